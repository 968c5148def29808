"""SDXL end to end on CPU: tiny SDXL models -> encode the real photos -> train -> kill -9 + resume -> export
-> diffusers' own StableDiffusionXLPipeline, with no laionkit, generates from the exported UNet."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import run_cli
from fixtures import accelerate_launch, finish
from fixtures import metrics as records_by_step

from laionkit.common import LaionkitError

TRAIN = ("--batch-size", "4", "--lr", "1e-3", "--log-with", "none", "--quiet", "--log-every", "1")


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory) -> Path:
    """`laionkit models tiny --family sdxl`, through the real CLI."""
    output = tmp_path_factory.mktemp("models") / "tiny-sdxl"
    run_cli("models", "tiny", "--family", "sdxl", "--output", output)
    return output


@pytest.fixture(scope="module")
def sdxl_latents(tmp_path_factory, image_shards, tiny_sdxl) -> Path:
    from laionkit.encode import EncodeConfig, run

    output = tmp_path_factory.mktemp("sdxl-latents")
    run(EncodeConfig(shards=(str(image_shards),), output=output, model=str(tiny_sdxl), resolution=64,
                     batch_size=4, workers=0, quiet=True))
    return output


def samples(folder: Path) -> list[dict]:
    """Plain webdataset, no laionkit: what a user's own loop reads."""
    found = []
    for shard in sorted(folder.glob("*.tar")):
        for sample in wds.WebDataset(str(shard), shardshuffle=False):
            found.append({"moments": np.load(io.BytesIO(sample["moments.npy"])),
                          "text": np.load(io.BytesIO(sample["text.npy"])),
                          "pooled": np.load(io.BytesIO(sample["pooled.npy"])),
                          "json": json.loads(sample["json"])})
    return found


def metrics(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_models_tiny_writes_the_family_asked_for(tmp_path, tiny_sdxl):
    index = json.loads((tiny_sdxl / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and "text_encoder_2" in index
    run_cli("models", "tiny", "--output", tmp_path / "sd")  # the default stays SD
    assert json.loads((tmp_path / "sd" / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    result = run_cli("models", "tiny", "--family", "sdxl2", "--output", tmp_path / "x", check=False)
    assert result.returncode == 2 and "unknown model family 'sdxl2'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x").exists()


def test_sdxl_encode_stores_what_the_pipeline_conditions_on(sdxl_latents, tiny_sdxl):
    from diffusers import StableDiffusionXLPipeline

    manifest = json.loads((sdxl_latents / "manifest.json").read_text())
    assert manifest["family"] == "sdxl" and manifest["complete"]
    assert manifest["vae"]["scaling_factor"] == pytest.approx(0.13025)
    assert manifest["text"]["stored"] == {"states": [77, 96], "pooled": [64]}
    assert {"text_encoder_2", "tokenizer_2"} <= set(manifest["models"])
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    found = samples(sdxl_latents)
    assert len(found) == 8
    captions = [s["json"]["caption"] for s in found] + [""]
    with torch.no_grad():
        states, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    stored_states = [s["text"] for s in found] + [np.load(sdxl_latents / "empty_caption.npy")]
    stored_pooled = [s["pooled"] for s in found] + [np.load(sdxl_latents / "empty_pooled.npy")]
    for row, (text, pool) in enumerate(zip(stored_states, stored_pooled)):
        assert text.dtype == pool.dtype == np.float16
        np.testing.assert_allclose(text, states[row].numpy(), atol=3e-3, rtol=1e-2, err_msg=captions[row])
        np.testing.assert_allclose(pool, pooled[row].numpy(), atol=3e-3, rtol=1e-2, err_msg=captions[row])
    for sample in found:  # time_ids' inputs, per sample
        record = sample["json"]
        assert record["target_size"] == [64, 64] and len(record["crop_top_left"]) == 2
        assert record["original_size"] == record["image_size"]


def test_sdxl_vae_runs_in_fp32_when_encode_runs_fp16(tmp_path, image_shards, tiny_sdxl, sdxl_latents):
    from laionkit.encode import EncodeConfig, run

    run(EncodeConfig(shards=(str(image_shards),), output=tmp_path, model=str(tiny_sdxl), resolution=64,
                     batch_size=4, workers=0, dtype="fp16", device="cpu", quiet=True))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["compute_dtype"] == "float16" and manifest["vae"]["compute_dtype"] == "float32"
    half, full = samples(tmp_path), samples(sdxl_latents)
    for got, want in zip(half, full):
        assert np.isfinite(got["moments"]).all()
        np.testing.assert_array_equal(got["moments"], want["moments"])  # the fp32 VAE's, bit for bit


def test_caption_dropout_drops_the_pooled_text_with_the_states(sdxl_latents, tiny_sdxl):
    """With dropout 1 the loss is the loss of the empty caption's states AND pooled vector."""
    from laionkit.common.models import load_unet
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import Unit, decode, read_unit
    from laionkit.trainer.objective import batch_conditioning, diffusion_loss, load_noise_scheduler

    data = open_latents(sdxl_latents)
    assert data.family.name == "sdxl" and set(data.empty) == {"states", "pooled"}
    rows = [decode(s) for s, _ in zip(read_unit(Unit(data.shards[0])), range(3))]
    batch = torch.utils.data.default_collate(rows)
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    empty = {key: value.float() for key, value in data.empty.items()}
    unet = load_unet(str(tiny_sdxl))
    config = TrainConfig(latents=sdxl_latents, output=Path("unused"), unet=str(tiny_sdxl), max_steps=1)
    scheduler = load_noise_scheduler(config)

    def loss(dropout, conditioning):
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            return diffusion_loss(unet, batch["moments"], conditioning, empty, scheduler,
                                  replace(config, caption_dropout=dropout), data, generator)

    all_empty = {**cond, **{key: value.expand_as(cond[key]) for key, value in empty.items()}}
    only_states = {**cond, "states": all_empty["states"]}
    assert loss(1.0, cond) == loss(0.0, all_empty)
    assert loss(1.0, cond) != loss(0.0, only_states)  # the pooled vector conditions the UNet too


def test_family_comes_from_the_manifest_and_mismatches_are_one_line(sdxl_latents, latent_shards, tiny_models,
                                                                     tiny_sdxl, tmp_path):
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet

    # An SD folder written before families existed: its manifest names none, it is SD.
    old = tmp_path / "old"
    old.mkdir()
    for path in latent_shards.iterdir():
        if path.suffix in (".tar", ".npy") or path.name == "manifest.json":
            shutil.copy(path, old / path.name)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("family", None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert open_latents(old).family.name == "sd"

    cases = [
        (latent_shards, ("--unet-config", "sdxl"), "--unet-config sdxl is a sdxl architecture; these latents are sd"),
        (latent_shards, ("--unet", tiny_sdxl), "pooled text; the sd latents have 4, 32 and no"),
        (sdxl_latents, ("--unet", tiny_models), "no pooled text; the sdxl latents have 4, 96 and 64"),
    ]
    for index, (latents, args, message) in enumerate(cases):
        result = run_cli("train", latents, "--output", tmp_path / f"run{index}", *TRAIN, "--max-steps", "1", *args,
                         check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr

    # The real SDXL base architecture, fitted to the data (built on the meta device: 2.6B parameters).
    data = open_latents(sdxl_latents)
    with torch.device("meta"):
        unet = build_unet(TrainConfig(latents=sdxl_latents, output=tmp_path, unet_config="sdxl", max_steps=1), data)
    assert unet.config.transformer_layers_per_block == [1, 2, 10] and unet.config.cross_attention_dim == 96
    assert unet.config.projection_class_embeddings_input_dim == 6 * 256 + 64
    with pytest.raises(LaionkitError, match="sd15 is a sd architecture; these latents are sdxl"):
        build_unet(TrainConfig(latents=sdxl_latents, output=tmp_path, unet_config="sd15", max_steps=1), data)


def _train(latents, run, tiny, *extra):
    return [sys.executable, "-m", "laionkit.cli", "train", str(latents), "--output", str(run), "--unet", str(tiny),
            *TRAIN, "--workers", "0", "--caption-dropout", "0.5", *map(str, extra)]


def test_train_kill9_resume_export_and_generate_without_laionkit(sdxl_latents, tiny_sdxl, tmp_path):
    args = ("--max-steps", "8", "--checkpoint-every", "2", "--shuffle-buffer", "3")
    reference = tmp_path / "reference"
    run_cli(*_train(sdxl_latents, reference, tiny_sdxl, *args, "--validate-every", "8",
                    "--validation-count", "2", "--validation-steps", "2")[3:])
    assert (reference / "samples" / "step-000008.png").stat().st_size > 0

    run = tmp_path / "run"
    process = subprocess.Popen(_train(sdxl_latents, run, tiny_sdxl, *args), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step-00000004").is_dir() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    process.kill()
    process.wait()
    assert not (run / "unet").exists(), "killed too late: the run already finished"
    run_cli(*_train(sdxl_latents, run, tiny_sdxl, *args, "--resume", "latest")[3:])
    expected, got = metrics(reference), metrics(run)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step

    script = textwrap.dedent(f"""
        import sys
        import torch
        from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
        unet = UNet2DConditionModel.from_pretrained({str(run / "unet")!r})
        pipe = StableDiffusionXLPipeline.from_pretrained({str(tiny_sdxl)!r}, unet=unet)
        image = pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2,
                     generator=torch.Generator().manual_seed(0)).images[0]
        image.save({str(tmp_path / "generated.png")!r})
        assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
        print(image.size, unet.config.addition_embed_type)
    """)
    env_free = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                                "HF_HUB_OFFLINE": "1"})
    assert env_free.returncode == 0, env_free.stderr[-3000:]
    assert "(64, 64) text_time" in env_free.stdout
    from PIL import Image

    assert Image.open(tmp_path / "generated.png").size == (64, 64)


def test_sdxl_under_fsdp_trains_as_under_ddp(sdxl_latents, tiny_sdxl, tmp_path):
    """SDXL's own conditioning (both encoders' states, the pooled embedding and time_ids through
    ``added_cond_kwargs``) on 2 real ranks: FSDP2 (train/fsdp.yaml's down / mid / up blocks as wrap units,
    sharded checkpoints) and DDP log the same losses and gradient norms in fp32 and export the same UNet."""
    from diffusers import UNet2DConditionModel

    args = ("--unet", tiny_sdxl, "--lr", "1e-3", "--max-steps", "3", "--checkpoint-every", "3",
            "--caption-dropout", "0.5")
    runs = {kind: tmp_path / kind for kind in ("fsdp", "ddp")}
    assert "FSDP2 on CPU ranks (gloo)" in finish(accelerate_launch(
        "fsdp.yaml", "no", sdxl_latents, runs["fsdp"], *args)).stdout
    assert sorted(p.name for p in (runs["fsdp"] / "checkpoints" / "step-00000003" / "pytorch_model_fsdp_0")
                  .glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    finish(accelerate_launch("ddp.yaml", "no", sdxl_latents, runs["ddp"], *args))
    fsdp, ddp = records_by_step(runs["fsdp"]), records_by_step(runs["ddp"])
    assert sorted(fsdp) == sorted(ddp) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert fsdp[step][key] == pytest.approx(ddp[step][key], rel=1e-4), (step, key)
    start = UNet2DConditionModel.from_pretrained(tiny_sdxl / "unet").state_dict()
    weights = {kind: UNet2DConditionModel.from_pretrained(run / "unet").state_dict() for kind, run in runs.items()}
    moved = {kind: torch.cat([(found[name] - start[name]).flatten() for name in start]) for kind, found in weights.items()}
    # Adam moves every weight by about lr per step, also where the true gradient is ~0 (a conv bias before
    # GroupNorm): there it follows rounding, and the two runs may differ by up to a step (1e-3) on a few biases.
    assert (moved["fsdp"] - moved["ddp"]).norm() < 0.01 * moved["ddp"].norm()
    assert (weights["ddp"]["add_embedding.linear_1.weight"] != start["add_embedding.linear_1.weight"]).any()
    for name, tensor in weights["ddp"].items():
        torch.testing.assert_close(weights["fsdp"][name], tensor, rtol=0, atol=1e-3, msg=name)
