"""Several captions per sample end to end: `encode --captions alt,vlm` stores each caption's text states (the
states `encode` gives that caption alone), `train --caption-mix` picks one per sample and epoch from (seed,
epoch, id), exactly across kill -9 + resume, and a 0/1 mix trains byte for byte as a single-caption encode
of that caption does (laionkit/common/caption_mix.py)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import run_cli
from fixtures import add_captions, metrics, vlm_caption

from laionkit.common import LaionkitError
from laionkit.common.caption_mix import CaptionMix, parse_mix, parse_names, uniform

FAST = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet", "--workers",
        "0", "--log-every", "1", "--shuffle-buffer", "3", "--record-keys")


@pytest.fixture(scope="module")
def captioned(tmp_path_factory, image_shards, tiny_models) -> dict[str, Path]:
    """Captioned image shards encoded three ways with the tiny SD models: both captions, vlm alone, alt alone."""
    root = tmp_path_factory.mktemp("captioned")
    shards = add_captions(image_shards, root / "images")
    found = {"images": shards}
    for name, captions in (("two", "alt,vlm"), ("vlm", "vlm"), ("alt", "alt")):
        found[name] = root / name
        run_cli("encode", shards, "--output", found[name], "--model", tiny_models, "--resolution", "64",
                "--batch-size", "4", "--workers", "0", "--quiet", "--captions", captions)
    return found


def members(latents: Path) -> dict[str, bytes]:
    found = {}
    for tar in sorted(latents.glob("*.tar")):
        with tarfile.open(tar) as archive:
            found.update({member.name: archive.extractfile(member).read() for member in archive.getmembers()})
    return found


def seen(run: Path) -> dict[int, dict]:
    return {record["step"]: record for record in
            map(json.loads, (run / "seen" / "rank-00000.jsonl").read_text().splitlines())}


# --- the policy: pure functions ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ("alt:0.2,foo", "NAME:WEIGHT"), ("alt:-1", "NAME:WEIGHT"), ("alt:0,vlm:0", "at least one weight"),
    ("alt:1,alt:2", "named twice"), ("clip:0", "clip:TEMPERATURE"), ("a.b:1", "caption name"),
    ("ids_x:1", "caption name"),
])
def test_bad_caption_mix_specs_are_one_line(spec, message):
    with pytest.raises(LaionkitError, match=message):
        parse_mix(spec)


def test_picks_follow_the_weights_and_depend_only_on_seed_epoch_and_id():
    captions = {"alt": {"score": 0.1}, "vlm": {"score": 0.3}}
    order = ("alt", "vlm")
    assert {parse_mix("alt:0,vlm:1").pick(0, e, i, captions, order) for e in range(3) for i in range(50)} == {"vlm"}
    assert {parse_mix("alt:1,vlm:0").pick(0, e, i, captions, order) for e in range(3) for i in range(50)} == {"alt"}
    half = parse_mix("alt:0.5,vlm:0.5")
    picks = [half.pick(7, 1, i, captions, order) for i in range(2000)]
    assert picks == [half.pick(7, 1, i, captions, order) for i in range(2000)]  # no state
    assert 900 < picks.count("vlm") < 1100
    assert picks != [half.pick(8, 1, i, captions, order) for i in range(2000)]  # the seed counts
    # a caption the sample lacks is not drawn; the weights renormalise over those it has
    assert {half.pick(0, 0, i, {"alt": {}}, order) for i in range(50)} == {"alt"}
    assert {parse_mix("vlm:1").pick(0, 0, i, {"alt": {}}, order) for i in range(20)} == {"alt"}  # its first
    # clip: softmax(score / T), Sana's sampler: a low temperature takes the best-scored caption
    sharp = parse_mix("clip:0.001")
    assert {sharp.pick(0, 0, i, captions, order) for i in range(100)} == {"vlm"}
    soft = parse_mix("clip:0.1")
    share = sum(soft.pick(0, 0, i, captions, order) == "vlm" for i in range(4000)) / 4000
    assert share == pytest.approx(1 / (1 + math.exp(-2)), abs=0.03)
    assert parse_mix("clip") == CaptionMix("clip:1", temperature=1.0)
    assert parse_mix("vlm:0.80, alt:0.2").spec == "alt:0.2,vlm:0.8"  # what a resume compares
    assert 0 <= uniform(0, 0, 0) < 1
    assert parse_names("alt") is None and parse_names("alt,vlm") == ("alt", "vlm")


# --- encode ----------------------------------------------------------------------------------------------

def test_encode_with_two_captions_stores_each_as_encoding_it_alone_gives(captioned, latent_shards):
    two, vlm, alt = (members(captioned[name]) for name in ("two", "vlm", "alt"))
    default = members(latent_shards)  # the same images and alt-texts, encoded without --captions
    keys = sorted({name.split(".")[0] for name in two})
    assert len(keys) == 8
    for key in keys:
        assert two[f"{key}.text.npy"] == default[f"{key}.text.npy"] == alt[f"{key}.text.npy"]
        assert two[f"{key}.vlm.text.npy"] == vlm[f"{key}.text.npy"] != two[f"{key}.text.npy"]
        assert two[f"{key}.moments.npy"] == default[f"{key}.moments.npy"]
        record = json.loads(two[f"{key}.json"])
        assert record["caption_name"] == "alt" and set(record["captions"]) == {"alt", "vlm"}
        assert record["captions"]["vlm"]["text"] == vlm_caption(record["captions"]["alt"]["text"])
        assert record["captions"]["vlm"]["score"] == 0.3
        assert json.loads(vlm[f"{key}.json"])["caption"] == record["captions"]["vlm"]["text"]
    # --captions alt alone is encode as it always was: the same shards, byte for byte, and settings
    for tar in sorted(captioned["alt"].glob("*.tar")):
        record = json.loads((captioned["alt"] / tar.name.replace(".tar", ".stats.json")).read_text())
        assert "captions" not in record["settings"] and "caption_skips" not in record
    manifest = json.loads((captioned["two"] / "manifest.json").read_text())
    assert manifest["captions"] == ["alt", "vlm"]
    assert manifest["caption_counts"]["vlm"] == {"stored": 8, "missing": 0, "truncated": 1, "scored": 8}


def test_a_missing_caption_is_a_recorded_skip_of_that_caption_or_of_the_sample(tmp_path, image_shards, tiny_models):
    shards = add_captions(image_shards, tmp_path / "images", lacking={"000010001"})
    base = ("--model", tiny_models, "--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet")
    run_cli("encode", shards, "--output", tmp_path / "two", "--captions", "alt,vlm", *base)
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["counts"]["samples_out"] == 8 and manifest["skips"] == {}
    assert manifest["caption_counts"]["vlm"]["stored"] == 7 and manifest["caption_counts"]["vlm"]["missing"] == 1
    record = json.loads((tmp_path / "two" / "00001.stats.json").read_text())
    assert record["caption_skips"] == [{"key": "000010001", "caption": "vlm", "reason": "missing"}]
    found = members(tmp_path / "two")
    assert "000010001.vlm.text.npy" not in found and "000010001.text.npy" in found
    assert "captions" in run_cli("stats", tmp_path / "two").stdout  # `laionkit stats` shows the counts per name
    # vlm alone: the sample without it has no caption left and is skipped, counted with its reason
    run_cli("encode", shards, "--output", tmp_path / "vlm", "--captions", "vlm", *base)
    manifest = json.loads((tmp_path / "vlm" / "manifest.json").read_text())
    assert manifest["counts"]["samples_out"] == 7 and manifest["skips"] == {"no_caption": 1}
    record = json.loads((tmp_path / "vlm" / "00001.stats.json").read_text())
    assert [(skip["key"], skip["reason"]) for skip in record["skips"]] == [("000010001", "no_caption")]


# --- train -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mix, single", [("alt:0,vlm:1", "vlm"), ("alt:1,vlm:0", "alt")])
def test_a_zero_one_mix_trains_byte_for_byte_as_the_single_caption_encode(captioned, tmp_path, mix, single):
    mixed, alone = tmp_path / "mixed", tmp_path / "alone"
    args = (*FAST, "--max-steps", "4", "--caption-dropout", "0.3", "--export", "none")
    run_cli("train", captioned["two"], "--output", mixed, *args, "--caption-mix", mix)
    run_cli("train", captioned[single], "--output", alone, *args)
    assert {name for record in seen(mixed).values() for name in record["captions"]} == {single}
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert (mixed / weights).read_bytes() == (alone / weights).read_bytes()
    assert [r["loss"] for r in metrics(mixed).values()] == [r["loss"] for r in metrics(alone).values()]


def test_without_a_mix_a_sample_trains_on_its_first_caption(captioned, tmp_path):
    """A several-caption folder without --caption-mix trains as the single-caption encode of its first caption
    (the other captions' members are not even read)."""
    args = (*FAST, "--max-steps", "3", "--export", "none")
    run_cli("train", captioned["two"], "--output", tmp_path / "two", *args)
    run_cli("train", captioned["alt"], "--output", tmp_path / "alt", *args)
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert (tmp_path / "two" / weights).read_bytes() == (tmp_path / "alt" / weights).read_bytes()
    assert all("captions" not in record for record in seen(tmp_path / "two").values())


def _train(latents: Path, run: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "laionkit.cli", "train", str(latents), "--output", str(run), *FAST,
            "--checkpoint-every", "3", "--caption-dropout", "0.2", *map(str, extra)]


def test_a_half_mix_is_deterministic_and_survives_kill9_and_resume_exactly(captioned, tmp_path):
    args = ("--max-steps", "8", "--caption-mix", "alt:0.5,vlm:0.5")
    reference = tmp_path / "reference"
    run_cli(*_train(captioned["two"], reference, *args)[3:])
    picked = [name for record in seen(reference).values() for name in record["captions"]]
    assert set(picked) == {"alt", "vlm"}  # 16 picks over 2 epochs: both captions train

    run = tmp_path / "run"
    process = subprocess.Popen(_train(captioned["two"], run, *args), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step-00000003").is_dir() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    process.kill()
    assert process.wait() == -9, "the run ended before the kill"
    assert not (run / "unet").exists(), "killed too late: the run already finished"
    run_cli(*_train(captioned["two"], run, *args, "--resume", "latest")[3:])
    assert [r["loss"] for r in metrics(run).values()] == [r["loss"] for r in metrics(reference).values()]
    assert seen(run) == seen(reference)  # the same samples with the same captions, step by step
    assert json.loads((run / "checkpoints" / "step-00000008" / "trainer.json").read_text())["config"][
        "caption_mix"] == "alt:0.5,vlm:0.5"

    # another policy on resume: refused in one line, unless asked for (a curriculum), then recorded
    longer = ("--max-steps", "10", "--caption-mix", "alt:0,vlm:1", "--resume", "latest")
    result = run_cli(*_train(captioned["two"], run, *longer)[3:], check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "was written with --caption-mix alt:0.5,vlm:0.5, this run has alt:0,vlm:1" in result.stderr
    assert "--allow-caption-mix-change" in result.stderr
    run_cli(*_train(captioned["two"], run, *longer, "--allow-caption-mix-change")[3:])
    assert {name for step, record in seen(run).items() if step > 8 for name in record["captions"]} == {"vlm"}


def test_a_caption_the_latents_do_not_store_is_one_line_naming_it_and_the_manifest(captioned, tmp_path):
    result = run_cli("train", captioned["two"], "--output", tmp_path / "run", *FAST, "--max-steps", "2",
                     "--caption-mix", "alt:0.2,foo:0.8", check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "caption 'foo' is not stored in" in line and str(captioned["two"] / "manifest.json") in line, line
    assert "its captions: alt, vlm" in line
    # clip needs scores: the vlm-only folder has them, a folder encoded without --captions has none
    result = run_cli("train", captioned["alt"], "--output", tmp_path / "clip", *FAST, "--max-steps", "2",
                     "--caption-mix", "clip", check=False)
    assert "no caption in" in result.stderr and "has a CLIP score" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("family, text", [("sdxl", "stored"), ("pixart", "stored"), ("flux", "online")])
def test_every_family_stores_each_caption_as_its_own_encode_does(tmp_path, image_shards, family, text):
    """The family spec decides a caption's members (SDXL's pooled vector, PixArt's trimmed states and mask,
    Flux's token ids for online text): each named caption's are those an encode of it alone stores."""
    from laionkit.families import get_family

    model = get_family(family).write_tiny(tmp_path / "model", 0)
    shards = add_captions(image_shards, tmp_path / "images")
    base = ("--model", model, "--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet", "--text", text)
    run_cli("encode", shards, "--output", tmp_path / "two", "--captions", "alt,vlm", *base)
    run_cli("encode", shards, "--output", tmp_path / "vlm", "--captions", "vlm", *base)
    two, vlm = members(tmp_path / "two"), members(tmp_path / "vlm")
    plain = {name.split(".", 1)[1] for name in vlm if not name.endswith(("moments.npy", ".json"))}
    if family == "flux":
        assert plain and all(name.startswith("ids_") for name in plain), plain
    else:
        assert plain == {"sdxl": {"text.npy", "pooled.npy"}, "pixart": {"text.npy", "mask.npy"}}[family]
    for name, data in vlm.items():
        key, member = name.split(".", 1)
        if member not in plain:
            continue
        assert two[f"{key}.vlm.{member}"] == data, name
        if member == "text.npy" or member.startswith("ids_"):
            assert two[f"{key}.{member}"] != data, name  # the alt-text's: another caption


def test_an_elastic_resume_gives_every_sample_of_an_epoch_the_caption_of_the_uninterrupted_run(captioned, tmp_path):
    """Another --batch-size on resume splits the rest of the epoch anew; the picks follow (seed, epoch, id)."""
    mix = ("--caption-mix", "alt:0.5,vlm:0.5", "--checkpoint-every", "3")
    reference, run = tmp_path / "reference", tmp_path / "run"
    run_cli("train", captioned["two"], "--output", reference, *FAST, "--max-steps", "8", *mix)
    run_cli("train", captioned["two"], "--output", run, *FAST, "--max-steps", "3", *mix)
    run_cli("train", captioned["two"], "--output", run, *FAST, "--max-steps", "13", "--batch-size", "1", *mix,
            "--resume", "latest")

    def picks(folder: Path) -> set[tuple]:
        return {(epoch, key, caption) for record in seen(folder).values()
                for key, epoch, caption in zip(record["keys"], record["epochs"], record["captions"])}

    assert len(picks(reference)) == 16 and picks(run) == picks(reference)


def test_a_sample_whose_image_fails_on_the_device_drops_its_captions_with_it(captioned, tiny_models):
    """encode's device decode (nvjpeg; torchvision's decoder on the CPU here) skips an undecodable JPEG after
    the workers batched it: every caption's rows and caption skips of that sample go with it."""
    import numpy as np
    import torch

    from laionkit.common.jpeg import joined, unjoin
    from laionkit.common.models import load_tokenizer
    from laionkit.encode import ShardBatches, _gpu_batch

    batches = ShardBatches([captioned["images"] / "00000.tar"], load_tokenizer(str(tiny_models), "tokenizer"), 64,
                           None, 4, gpu_decode=True, captions=("alt", "vlm"))
    batch = next(item for item in batches.shard_batches(captioned["images"] / "00000.tar") if isinstance(item, dict))
    assert batch["gpu_rows"], "no JPEG went to the device decode"
    row = batch["gpu_rows"][0]
    broken = batch["keys"][row]
    files = [file.numpy() for file in unjoin(batch["jpegs"], batch["jpeg_sizes"])]
    files[0] = np.frombuffer(b"\xff\xd8\xff" + b"\0" * 64, dtype=np.uint8)  # the first device JPEG, broken
    batch["jpegs"], batch["jpeg_sizes"] = joined(files), [file.size for file in files]
    batch["caption_skips"] = [{"key": broken, "caption": "vlm", "reason": "missing"}]
    texts = {name: list(found) for name, found in batch["caption_texts"].items()}
    out = _gpu_batch(batch, torch.device("cpu"), torch.float32)
    assert [skip["key"] for skip in out["skips"]] == [broken] and broken not in out["keys"]
    kept = [index for index in range(len(texts["alt"])) if index != row]
    assert out["caption_texts"] == {name: [found[i] for i in kept] for name, found in texts.items()}
    assert all(len(ids) == len(out["keys"]) == len(out["present"]) for ids in out["caption_ids"].values())
    assert out["caption_skips"] == []


# --- CLIP scores per caption: score --captions -> encode --caption-scores -> train --caption-mix clip ------

LACKING = "000010001"  # a sample without a vlm caption


def far_captions(image_shards: Path, score_models: dict) -> dict[str, str]:
    """Per image, the vlm caption (of 512 seeded word strings) whose similarity under score's tiny random CLIP is
    farthest from its alt-text's, above or below: one of its two captions then scores clearly higher."""
    import io
    import random

    import torch
    import webdataset as wds
    from PIL import Image

    from laionkit.evaluate.clipscore import load_clip

    clip, preprocess, tokenizer = load_clip(str(score_models["config"]), str(score_models["weights"]))
    rng = random.Random(0)
    words = "red blue tram bridge dusk dog beach leaves city skyline coffee flower garden mountain lake film".split()
    candidates = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 9))) for _ in range(512)]
    chosen = {}
    with torch.no_grad():
        texts = torch.nn.functional.normalize(clip.encode_text(tokenizer(candidates)).float(), dim=-1)
        for tar in sorted(image_shards.glob("*.tar")):
            for sample in wds.WebDataset(str(tar), shardshuffle=False):
                image = Image.open(io.BytesIO(next(sample[e] for e in ("jpg", "png", "webp") if e in sample)))
                embedding = torch.nn.functional.normalize(clip.encode_image(preprocess(image)[None]).float(), dim=-1)
                alt = torch.nn.functional.normalize(clip.encode_text(tokenizer([sample["txt"].decode()])).float(), -1)
                gaps = ((embedding @ texts.T)[0] - (embedding * alt).sum()).abs()
                chosen[sample["__key__"]] = candidates[int(gaps.argmax())]
    return chosen


@pytest.fixture(scope="module")
def clip_scored(tmp_path_factory, image_shards, tiny_models, score_models) -> dict[str, Path]:
    """Captioned shards (far_captions' vlm, one sample lacking it; json caption_scores as add_captions writes
    them) scored with score's tiny CLIP for alt and vlm, then encoded with --caption-scores."""
    root = tmp_path_factory.mktemp("clip-scored")
    shards = add_captions(image_shards, root / "images", lacking={LACKING}, vlm=far_captions(image_shards, score_models))
    run_cli("score", shards, "--output", root / "scored", "--clip-model", score_models["config"], "--clip-pretrained",
            score_models["weights"], "--captions", "alt,vlm", "--workers", "0", "--batch-size", "3", "--quiet")
    run_cli("encode", shards, "--output", root / "latents", "--model", tiny_models, "--resolution", "64",
            "--batch-size", "4", "--workers", "0", "--quiet", "--captions", "alt,vlm", "--caption-scores",
            root / "scored")
    return {"images": shards, "scored": root / "scored", "latents": root / "latents"}


def score_rows(scored: Path) -> dict[str, dict]:
    import pyarrow.parquet as pq

    return {row["key"]: row for row in pq.read_table(scored / "scores").to_pylist()}


def test_score_captions_are_open_clips_cosine_of_each_caption(clip_scored, score_models):
    import io

    import torch
    import webdataset as wds
    from PIL import Image

    from laionkit.evaluate.clipscore import load_clip

    clip, preprocess, tokenizer = load_clip(str(score_models["config"]), str(score_models["weights"]))
    rows = score_rows(clip_scored["scored"])
    samples = [sample for tar in sorted(clip_scored["images"].glob("*.tar"))
               for sample in wds.WebDataset(str(tar), shardshuffle=False)]
    assert sorted(rows) == sorted(sample["__key__"] for sample in samples)
    for sample in samples:
        meta = json.loads(sample["json"])
        image = Image.open(io.BytesIO(next(sample[e] for e in ("jpg", "png", "webp") if e in sample)))
        texts = {"alt": sample["txt"].decode(), "vlm": meta.get("captions", {}).get("vlm")}
        with torch.no_grad():
            image_embedding = torch.nn.functional.normalize(clip.encode_image(preprocess(image)[None]).float(), dim=-1)
            for name, text in texts.items():
                row = rows[sample["__key__"]][f"similarity_{name}"]
                if not (text or "").strip():  # an empty alt-text, the sample lacking vlm: null
                    assert row is None, (sample["__key__"], name)
                    continue
                text_embedding = torch.nn.functional.normalize(clip.encode_text(tokenizer([text])).float(), dim=-1)
                assert row == pytest.approx(float((image_embedding * text_embedding).sum()), abs=1e-5)
        assert rows[sample["__key__"]]["similarity_alt"] == rows[sample["__key__"]]["similarity"]
    record = json.loads((clip_scored["scored"] / "records" / "00001.json").read_text())
    assert record["settings"]["captions"] == ["alt", "vlm"]
    assert record["captions"] == {"alt": {"scored": 4, "missing": 0}, "vlm": {"scored": 3, "missing": 1}}
    stats = json.loads((clip_scored["scored"] / "stats.json").read_text())
    assert stats["caption_counts"] == {"alt": {"scored": 7, "missing": 1}, "vlm": {"scored": 7, "missing": 1}}


def test_encode_caption_scores_stores_score_columns_as_each_captions_score(clip_scored, tiny_models):
    rows = score_rows(clip_scored["scored"])
    found = members(clip_scored["latents"])
    for key, row in rows.items():
        captions = json.loads(found[f"{key}.json"])["captions"]
        for name in ("alt", "vlm"):
            value = row[f"similarity_{name}"]
            if value is None:  # no score (an empty alt-text, the sample lacking vlm); json caption_scores ignored
                assert "score" not in captions.get(name, {}), (key, name)
            else:  # the join wins over json caption_scores (0.3 for every vlm)
                assert captions[name]["score"] == value != 0.3
    manifest = json.loads((clip_scored["latents"] / "manifest.json").read_text())
    assert manifest["caption_counts"]["alt"]["scored"] == 7 and manifest["caption_counts"]["vlm"]["scored"] == 7
    assert manifest["caption_scores"]["columns"] == ["similarity_alt", "similarity_vlm"]  # its settings
    again = run_cli("encode", clip_scored["images"], "--output", clip_scored["latents"], "--model", tiny_models,
                    "--resolution", "64", "--batch-size", "4", "--workers", "0", "--captions", "alt,vlm",
                    "--caption-scores", clip_scored["scored"] / "scores")  # its scores/ folder names the same join
    assert "0 of 2 shards to do" in " ".join(again.stderr.split())  # a rerun resumes: the same settings


def test_clip_mix_at_a_low_temperature_trains_on_the_clearly_better_scored_caption(clip_scored, tmp_path):
    rows = score_rows(clip_scored["scored"])
    both = {key: row for key, row in rows.items() if None not in (row["similarity_alt"], row["similarity_vlm"])}
    assert len(both) == 6 and min(abs(r["similarity_alt"] - r["similarity_vlm"]) for r in both.values()) > 0.05
    best = {key: max(("alt", "vlm"), key=lambda name: row[f"similarity_{name}"] if row[f"similarity_{name}"]
                     is not None else -math.inf) for key, row in rows.items()}
    run = tmp_path / "run"
    run_cli("train", clip_scored["latents"], "--output", run, *FAST, "--max-steps", "8", "--export", "none",
            "--caption-mix", "clip:0.01")
    picks = [(key, name) for record in seen(run).values() for key, name in zip(record["keys"], record["captions"])]
    assert len(picks) == 16 and {name for _, name in picks} == {"alt", "vlm"}  # the scores choose, not a name
    assert sum(name == best[key] for key, name in picks) >= 15, picks  # near-always: p(other) < exp(-5) each
    trainer = json.loads(sorted((run / "checkpoints").glob("step-*"))[-1].joinpath("trainer.json").read_text())
    assert trainer["config"]["caption_mix"] == "clip:0.01"


def test_missing_scores_are_one_line_naming_the_file_and_column(clip_scored, tiny_models, tmp_path, score_models):
    base = ("--model", tiny_models, "--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet",
            "--captions", "alt,vlm")
    result = run_cli("encode", clip_scored["images"], "--output", tmp_path / "a", *base, "--caption-scores",
                     tmp_path / "nowhere", check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--caption-scores" in result.stderr and "nowhere" in result.stderr.strip().splitlines()[-1]
    # scored without --captions: no similarity_vlm column
    run_cli("score", clip_scored["images"] / "00000.tar", "--output", tmp_path / "plain", "--clip-model",
            score_models["config"], "--clip-pretrained", score_models["weights"], "--workers", "0", "--quiet")
    result = run_cli("encode", clip_scored["images"] / "00000.tar", "--output", tmp_path / "b", *base,
                     "--caption-scores", tmp_path / "plain", check=False)
    line = " ".join(result.stderr.split())
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'plain' / 'scores' / '00000.parquet'}: no column 'similarity_alt'" in line, line
    # a shard the score folder lacks
    (tmp_path / "half" / "scores").mkdir(parents=True)
    shutil.copy(clip_scored["scored"] / "scores" / "00000.parquet", tmp_path / "half" / "scores")
    result = run_cli("encode", clip_scored["images"], "--output", tmp_path / "c", *base, "--caption-scores",
                     tmp_path / "half", check=False)
    assert f"no {tmp_path / 'half' / 'scores' / '00001.parquet'} (shard 00001" in " ".join(result.stderr.split())
    result = run_cli("encode", clip_scored["images"], "--output", tmp_path / "e", *base, "--caption-key", "txt",
                     "--caption-scores", clip_scored["scored"], check=False)  # alt scored under another caption key
    assert "alt was scored with --caption-key None, this encode takes it with --caption-key txt" in \
        " ".join(result.stderr.split())
    result = run_cli("encode", clip_scored["images"], "--output", tmp_path / "d", "--model", tiny_models,
                     "--caption-scores", clip_scored["scored"], check=False)
    assert "give --captions too" in " ".join(result.stderr.split())
