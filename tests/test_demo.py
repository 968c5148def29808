"""`laionkit demo` (the README's main command) and `laionkit run` on the demo recipe, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import REPO, run_cli
from PIL import Image

from laionkit.demo import DEMO_DATA, MISSING_PATH, write_metadata

PHOTOS = len(json.loads((DEMO_DATA / "captions.json").read_text()))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, str]:
    """README.md's own commands (its ```bash blocks: `laionkit demo`), run as tests/test_docs.py runs every
    document's, in a fresh folder: the demo these tests check is the one a reader of the README gets (and
    test_docs leaves README.md to this fixture rather than run the demo twice)."""
    from test_docs import run_script, script_of

    folder = tmp_path_factory.mktemp("readme")
    result = run_script(script_of((REPO / "README.md").read_text()), folder, timeout=900)
    assert result.returncode == 0, f"README.md: a documented command failed\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    workdir = folder / "laionkit-demo"  # `laionkit demo`'s default --workdir
    assert (workdir / "run").is_dir(), result.stdout[-3000:]
    return workdir, result.stdout


def test_demo_runs_every_stage_for_real(demo):
    workdir, stdout = demo
    for stage in ("filter", "pack", "encode", "train"):
        assert f"[{stage}] laionkit {stage}" in stdout
    metadata = pq.read_table(workdir / "metadata.parquet").to_pandas()
    unsafe, watermarked = metadata.punsafe >= 0.5, metadata.pwatermark >= 0.8
    assert (unsafe & ~watermarked).any() and (watermarked & ~unsafe).any()  # each rule alone drops rows
    expected = metadata[~unsafe & ~watermarked & (metadata.TEXT.str.len() >= 10)
                        & (metadata.WIDTH >= 64) & (metadata.HEIGHT >= 64)]
    kept = pq.read_table(sorted((workdir / "filtered").glob("part-*.parquet"))).to_pandas()
    assert kept.URL.tolist() == expected.URL.tolist() and len(kept) == PHOTOS + 1
    assert [u for u in kept.URL if u.endswith("/" + MISSING_PATH)]  # the dead URL passes the filter...
    manifest = json.loads((workdir / "shards" / "manifest.json").read_text())
    assert manifest["samples"] == PHOTOS and manifest["failures"] == {"http 404": 1}  # ...and fails pack
    shards = [str(path) for path in sorted((workdir / "shards").glob("*.tar"))]
    assert sum(1 for _ in wds.WebDataset(shards, shardshuffle=False)) == PHOTOS
    latents = json.loads((workdir / "latents" / "manifest.json").read_text())
    assert latents["counts"]["samples_out"] == PHOTOS
    assert "http 404" in stdout and "== laionkit stats" in stdout


def test_demo_metadata_has_rows_that_each_safety_rule_alone_drops(tmp_path):
    """Otherwise the demo could not show a broken rule: its output would not change."""
    rows = write_metadata(tmp_path / "metadata.parquet", "http://127.0.0.1:9")
    metadata = pq.read_table(tmp_path / "metadata.parquet").to_pandas()
    unsafe, watermarked = metadata.punsafe >= 0.5, metadata.pwatermark >= 0.8
    assert len(metadata) == rows
    assert (unsafe & ~watermarked).sum() > 0 and (watermarked & ~unsafe).sum() > 0, metadata
    assert metadata.URL.str.endswith("/" + MISSING_PATH).sum() == 1


def test_demo_trains_and_exports_a_loadable_unet_with_plots(demo):
    from diffusers import UNet2DConditionModel

    workdir, stdout = demo
    losses = [json.loads(line)["loss"] for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses[-1] < losses[0] / 2  # the tiny UNet learns the 8 photos
    unet = UNet2DConditionModel.from_pretrained(workdir / "run" / "unet")
    assert unet.config.in_channels == 4
    for picture in ("samples.png", "training.png"):
        with Image.open(workdir / picture) as image:
            assert image.format == "PNG" and min(image.size) >= 64
    named = Path(workdir.name)  # the README's command names the default workdir, relative to where it runs
    assert f"{named / 'samples.png'}" in stdout and f"{named / 'training.png'}" in stdout


def test_the_demo_draws_each_photo_it_trained_on_from_its_caption(demo):
    """samples.png puts each photo trained on beside what the trained pipeline draws from its caption; the drawn
    images (WORKDIR/generated/KEY.png) are nearer in pixels to their own photo than to any other (each of the 8:
    the demo's CLIP tells their captions apart), at under half the mean distance to the others: a person
    looking at the grid sees the photos again."""
    import numpy as np

    workdir, _ = demo
    shards = [str(path) for path in sorted((workdir / "shards").glob("*.tar"))]
    trained = {sample["__key__"]: np.asarray(sample["jpg"].convert("RGB"), dtype=float) / 255
               for sample in wds.WebDataset(shards, shardshuffle=False).decode("pil")}
    assert len(trained) == PHOTOS
    own, others, nearest = [], [], 0
    for key in trained:
        with Image.open(workdir / "generated" / f"{key}.png") as image:
            drawn = np.asarray(image.convert("RGB"), dtype=float) / 255
        mse = {other: ((drawn - pixels) ** 2).mean() for other, pixels in trained.items()}
        nearest += min(mse, key=mse.get) == key
        own.append(mse.pop(key))
        others.append(np.mean(list(mse.values())))
    assert nearest == PHOTOS and np.mean(own) < 0.5 * np.mean(others), (nearest, own, others)
    with Image.open(workdir / "samples.png") as grid:
        assert grid.width >= 2 * 64 * 4 and grid.height >= 64 * 2  # 4 pairs a row, 2 rows


def test_the_sharpened_clip_tells_the_demo_captions_apart(tiny_models, tmp_path):
    """The tiny random-init CLIP gives the 8 captions states that differ by a tenth of their variance, which is
    why a denoiser needed 800 steps to tell them apart; made a bag of words (sharpen_text_encoder) it gives
    each caption states that differ from every other caption's by more than the random one's most distinct
    pair, down to its last padding position (which carries the whole caption), loaded by from_pretrained."""
    import shutil

    import torch
    from transformers import CLIPTextModel, CLIPTokenizer

    from laionkit.common.learnable_models import sharpen_text_encoder

    captions = list(json.loads((DEMO_DATA / "captions.json").read_text()).values())
    tokenizer = CLIPTokenizer.from_pretrained(tiny_models / "tokenizer")
    tokens = tokenizer(captions, padding="max_length", max_length=77, return_tensors="pt").input_ids

    def states(folder: Path) -> torch.Tensor:
        with torch.no_grad():
            return CLIPTextModel.from_pretrained(folder)(tokens).last_hidden_state

    def distances(found: torch.Tensor) -> torch.Tensor:
        apart = ((found[:, None] - found[None]) ** 2).mean((2, 3))
        return apart[~torch.eye(len(found), dtype=torch.bool)]

    random = states(tiny_models / "text_encoder")
    sharp = tmp_path / "text_encoder"
    shutil.copytree(tiny_models / "text_encoder", sharp)
    sharpen_text_encoder(sharp)
    found = states(sharp)
    assert distances(found).min() > 2 * distances(random).max(), (distances(found), distances(random))
    last = found[:, -1:]  # the 77th position: padding in every caption
    assert distances(last).min() > 2 * distances(random).max(), distances(last)


def test_run_skips_stages_already_complete(demo, monkeypatch):
    workdir, _ = demo
    monkeypatch.chdir(workdir.parent)  # where the README's `laionkit demo` ran: its stages record relative paths
    result = run_cli("run", REPO / "pipelines" / "demo.yaml", "--var", f"workdir={workdir.name}")
    assert result.stdout.count("complete with these options; skipped") == 4


def test_demo_until_pack_leaves_the_shards_alone_and_run_until_stops_there(tmp_path):
    """`demo --until pack` (docs/guides/curate.md's start): the shards, no models, latents or run; `run --until`
    stops after the named stage, and a stage the recipe lacks is one line."""
    workdir = tmp_path / "demo"
    result = run_cli("demo", "--workdir", workdir, "--until", "pack")
    assert "[pack] laionkit pack" in result.stdout and "[encode]" not in result.stdout
    manifest = json.loads((workdir / "shards" / "manifest.json").read_text())
    assert manifest["samples"] == PHOTOS
    assert not any((workdir / name).exists() for name in ("models", "latents", "run", "samples.png"))
    result = run_cli("run", REPO / "pipelines" / "demo.yaml", "--var", f"workdir={workdir}", "--until", "filter")
    assert result.stdout.count("complete with these options; skipped") == 1 and "[pack]" not in result.stdout
    for command in (("run", REPO / "pipelines" / "demo.yaml", "--var", f"workdir={workdir}"), ("demo",)):
        result = run_cli(*command, "--until", "score", check=False)
        assert result.returncode == 2 and "--until score: the" in result.stderr and "Traceback" not in result.stderr


def test_run_launches_a_stage_under_accelerate(demo, tmp_path):
    workdir, _ = demo
    recipe = _recipe(tmp_path, f"""
workdir: {tmp_path}
stages:
  train:
    input: {workdir / 'latents'}
    output: "{{workdir}}/run"
    launch: {{num_processes: 1, num_machines: 1, cpu: true, mixed_precision: "no", dynamo_backend: "no"}}
    unet_config: {workdir / 'models' / 'unet'}
    max_steps: 3
    batch_size: 4
    workers: 0
    log_with: none
    quiet: true
""")
    result = run_cli("run", recipe)
    assert "accelerate.commands.launch --num_processes 1" in result.stdout and "--cpu" in result.stdout
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [3]
    assert (tmp_path / "run" / "unet" / "config.json").is_file()


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("stages: {filter: {input: X, output: out, colour: red}}", "`colour` is not an option of `laionkit filter`"),
        ("stages: {bake: {input: X, output: out}}", "unknown stage `bake`"),
        ("stages: {filter: {input: missing.parquet, output: out}}", "input `missing.parquet` does not exist"),
        ("stages: {filter: {output: out}}", "needs `input` and `output`"),
        ("workdir: w\nstagez: {}", "a recipe is a mapping with a `stages:` mapping"),
        ("stages: {}\nextra: 1", "unknown top-level keys ['extra']"),
        ("stages: [", "not valid YAML"),
        ("stages: {filter: {input: X, output: out, quiet: maybe}}", "`quiet` is a switch"),
    ],
)
def test_recipe_errors_are_named_before_anything_runs(tmp_path, realdata, text, message):
    sample = realdata / "laion-sample" / "test_1000.parquet"
    recipe = _recipe(tmp_path, text.replace("input: X", f"input: {sample}"))
    result = run_cli("run", recipe, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.replace("\n", "")
    assert not (tmp_path / "out").exists() and not Path("out").exists()


def test_run_stops_at_the_first_failing_stage(tmp_path, realdata):
    recipe = _recipe(tmp_path, f"""
workdir: {tmp_path}
stages:
  filter: {{input: {realdata / 'laion-sample' / 'test_1000.parquet'}, output: "{{workdir}}/filtered", where: [nope > 1]}}
  pack: {{input: "{{workdir}}/filtered", output: "{{workdir}}/shards"}}
""")
    result = run_cli("run", recipe, check=False)
    assert result.returncode == 2
    assert "stage `filter` failed" in result.stderr and "nope" in result.stderr and "later stages not run" in result.stderr
    assert not (tmp_path / "shards").exists()


def test_the_curation_recipe_runs_a_stage_twice_in_order(tmp_path, realdata):
    """pipelines/curate.yaml: score and dedup are stages, and filter@scores is filter's second run, wired to
    dedup's keep list and score's folder, all validated before anything runs."""
    sample = realdata / "laion-sample" / "test_1000.parquet"
    variables = ["--var", f"workdir={tmp_path}", "--var", f"metadata={sample}", "--var", "aesthetic=aes.pth",
                 "--var", "watermark=wm.pt", "--var", "nsfw=nsfw.safetensors"]
    lines = run_cli("run", REPO / "pipelines" / "curate.yaml", *variables, "--dry-run").stdout.splitlines()
    w = tmp_path
    assert lines == [
        f"laionkit filter {sample} --output {w}/filtered --where 'WIDTH >= 512 AND HEIGHT >= 512' "
        "--where 'length(TEXT) >= 10'",
        f"laionkit pack {w}/filtered --output {w}/shards --image-size 512 --resize-mode center_crop "
        "--min-image-size 512 --shard-size 10000",
        f"laionkit score {w}/shards --output {w}/scored --score aesthetic=aesthetic-v2:aes.pth --watermark wm.pt "
        "--nsfw nsfw.safetensors",
        f"laionkit dedup {w}/scored --output {w}/dedup --layers exact,phash,semantic --keep-by aesthetic",
        f"laionkit filter {w}/dedup/keep.parquet --output {w}/kept --scores {w}/scored --where 'aesthetic >= 5' "
        "--where 'pwatermark < 0.5' --where 'punsafe < 0.1'",
        f"laionkit caption {w}/shards --output {w}/captioned --model Qwen/Qwen2-VL-2B-Instruct --name vlm "
        "--max-new-tokens 77",
        f"laionkit encode {w}/captioned --output {w}/latents --keep {w}/kept --captions alt,vlm --model sd15 "
        "--resolution 512",
        f"laionkit train {w}/latents --output {w}/run --unet sd15 --mixed-precision bf16 "
        "--caption-mix alt:0.2,vlm:0.8 --resume latest",
    ]
    typo = tmp_path / "typo.yaml"
    typo.write_text((REPO / "pipelines" / "curate.yaml").read_text().replace("    where: [\"aesthetic", "    wher: [\"aesthetic"))
    result = run_cli("run", typo, *variables, "--dry-run", check=False)
    assert result.returncode == 2 and result.stdout == ""
    message = result.stderr.replace("\n", "")
    assert f"{typo}: stages.filter@scores: `wher` is not an option of `laionkit filter`" in message


def test_a_second_run_of_a_stage_has_its_own_record(tmp_path, realdata):
    """filter then filter@strict: each run is recorded under its recipe name, so a rerun skips both."""
    recipe = _recipe(tmp_path, f"""
workdir: {tmp_path}
stages:
  filter: {{input: {realdata / 'laion-sample' / 'test_1000.parquet'}, output: "{{workdir}}/filtered", quiet: true}}
  filter@strict: {{input: "{{workdir}}/filtered", output: "{{workdir}}/strict", where: ["length(TEXT) >= 20"], quiet: true}}
""")
    first = run_cli("run", recipe).stdout
    assert "[filter] laionkit filter" in first and "[filter@strict] laionkit filter" in first
    assert (tmp_path / ".laionkit-run" / "filter@strict.json").is_file()
    assert run_cli("run", recipe).stdout.count("complete with these options; skipped") == 2
    bad = _recipe(tmp_path, "stages: {filter@a b: {input: x, output: y}}")
    assert "name `a b` after `@`" in run_cli("run", bad, check=False).stderr
