"""FSDP2 with 2 real CPU ranks (gloo), launched as on GPUs: `accelerate launch --config_file train/fsdp.yaml
--num_processes 2 -m laionkit.cli train ...`. accelerate alone would run these ranks as DDP (laionkit/trainer/fsdp.py
says where and why); train honors the FSDP config on CPU, so what runs here is accelerate's own FSDP2 path:
fully_shard per wrap unit, sharded distributed checkpoints, gathered exports.

Each launch costs seconds of imports on 2 cores, so the tests share the work: SD3 (one FSDP unit per
transformer block) is killed with -9 and resumed; the UNet is checked against DDP step by step; LoRA
trains adapters over a sharded frozen base, for SD and for Qwen-Image (whose 20B needs it)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from fixtures import accelerate_launch, assert_lora_resumed_like, finish, kill_tree, metrics
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def assert_sharded(checkpoint: Path) -> set[str]:
    """The model of an FSDP checkpoint: one distributed-checkpoint file per rank (no whole-model file);
    returns the names it holds."""
    from torch.distributed.checkpoint import FileSystemReader

    shards = checkpoint / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "model.safetensors").exists()
    return {name.removeprefix("model.") for name in FileSystemReader(str(shards)).read_metadata().state_dict_metadata}


def logged(run: Path) -> dict[int, dict]:
    """metrics.jsonl of a running run, by step ({} before its first record; a line being written is skipped)."""
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    return {r["step"]: r for r in map(json.loads, (line for line in lines if line.endswith("}")))}


def test_sd3_under_fsdp_resumes_after_kill9_exactly_and_exports_the_whole_transformer(flow_latents, tmp_path):
    """fsdp.yaml as shipped (bf16 mixed precision, its UNet block names): one unit per JointTransformerBlock.
    Killed with -9 (launcher and ranks) two steps past its checkpoint at step 3, it resumes from it (with
    --checkpointing blocks: activation checkpointing inside each FSDP unit) and logs the losses the run
    logged before the kill, a validation loss and grid, then exports the whole transformer."""
    from diffusers import SD3Transformer2DModel

    sd3 = flow_latents("sd3")
    args = ("--transformer-config", "tiny", "--lr", "1e-3", "--checkpoint-every", "3")
    run = tmp_path / "run"
    process = subprocess.Popen(accelerate_launch("fsdp.yaml", "bf16", sd3.latents, run, *args, "--max-steps",
                                                 1000),
                               env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while max(logged(run), default=0) < 5:  # step 6 (the next checkpoint) is a step away
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        kill_tree(process.pid)  # the launcher and both ranks, as kill -9 of the job
        process.wait()
    uninterrupted = logged(run)
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000003"]
    names = assert_sharded(run / "checkpoints" / "step-00000003")

    end = max(uninterrupted) + 1
    # resumed with activation checkpointing inside each FSDP unit (it changes no number), and at the end a
    # validation loss and a validation grid, which run the sharded transformer on every rank
    result = finish(accelerate_launch("fsdp.yaml", "bf16", sd3.latents, run, *args, "--max-steps", end,
                                      "--resume", "latest", "--checkpointing", "blocks", "--val-latents",
                                      sd3.latents, "--val-every", end, "--val-samples", 3, "--validate-every", end,
                                      "--validation-count", 2, "--validation-steps", 2))
    assert "FSDP2 on CPU ranks (gloo)" in result.stdout and "resumed from" in result.stdout
    assert "wrapping each JointTransformerBlock" in result.stdout
    assert "activation checkpointing: 2 of 2 JointTransformerBlock blocks" in result.stdout
    got = metrics(run)
    assert sorted(got) == list(range(1, end + 1))
    for step in uninterrupted:  # 4 and 5 trained again from the checkpoint
        assert got[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-5, abs=1e-7), step
    assert got[end]["val_samples"] == 3 and math.isfinite(got[end]["val_loss"])
    assert (run / "samples" / f"step-{end:06d}.png").is_file()
    exported = SD3Transformer2DModel.from_pretrained(run / "transformer").state_dict()
    assert set(exported) == names  # whole tensors of every sharded parameter
    assert {t.dtype for t in exported.values()} == {torch.float32}  # FSDP2's fp32 parameters, not bf16


def test_the_unet_under_fsdp_trains_as_under_ddp(latent_shards, tmp_path):
    """FSDP keeps one sharded copy of the weights, so the ranks cannot drift apart; what can go wrong is the
    sharding itself (gradients reduce-scattered, the clipping norm taken over all shards, accumulation
    without sync). In fp32, FSDP and DDP of the same 2 ranks must log the same losses and gradient norms
    and export the same UNet, with --grad-accum 2 and a clipping norm that bites."""
    from diffusers import UNet2DConditionModel

    args = ("--unet-config", "tiny", "--lr", "1e-3", "--max-steps", "3", "--checkpoint-every", "3",
            "--grad-accum", "2", "--max-grad-norm", "0.05")
    runs = {kind: tmp_path / kind for kind in ("fsdp", "ddp")}
    result = finish(accelerate_launch("fsdp.yaml", "no", latent_shards, runs["fsdp"], *args))
    assert "FSDP2 on CPU ranks (gloo)" in result.stdout
    assert_sharded(runs["fsdp"] / "checkpoints" / "step-00000003")
    finish(accelerate_launch("ddp.yaml", "no", latent_shards, runs["ddp"], *args))
    records = [json.loads(p.read_text()) for p in sorted((runs["ddp"] / "checkpoints" / "step-00000003").glob("rank-*"))]
    assert len(records) == 2 and records[0]["fingerprint"] == records[1]["fingerprint"]  # DDP's ranks agree

    fsdp, ddp = metrics(runs["fsdp"]), metrics(runs["ddp"])
    assert sorted(fsdp) == sorted(ddp) == [1, 2, 3]
    for step in (1, 2, 3):
        assert fsdp[step]["grad_norm"] > 0.05  # clipped
        for key in ("loss", "grad_norm"):
            assert fsdp[step][key] == pytest.approx(ddp[step][key], rel=1e-4), (step, key)
    weights = {kind: UNet2DConditionModel.from_pretrained(run / "unet").state_dict() for kind, run in runs.items()}
    for name, tensor in weights["ddp"].items():  # Adam's first steps amplify rounding where gradients are ~0
        torch.testing.assert_close(weights["fsdp"][name], tensor, rtol=0, atol=1e-4, msg=name)


def test_lora_under_fsdp_trains_adapters_over_a_sharded_frozen_base(latent_shards, tiny_models, tmp_path):
    """--lora-rank with fsdp.yaml (bf16): checkpoints hold the adapters only, in the sharded model checkpoint
    and in adapter.safetensors; a resume from one reproduces the run (LoRA dropout included), and the export
    holds whole adapter tensors that diffusers' load_lora_weights puts into the pipeline."""
    from diffusers import StableDiffusionPipeline

    args = ("--unet", tiny_models, "--lora-rank", "4", "--lora-dropout", "0.1", "--lr", "1e-2", "--max-steps", "4",
            "--checkpoint-every", "2")
    whole = tmp_path / "whole"
    result = finish(accelerate_launch("fsdp.yaml", "bf16", latent_shards, whole, *args))
    assert "FSDP2 on CPU ranks (gloo)" in result.stdout
    checkpoint = whole / "checkpoints" / "step-00000002"
    adapters = load_file(checkpoint / "adapter.safetensors")
    assert adapters and all("lora_" in name for name in adapters)
    assert {t.dtype for t in adapters.values()} == {torch.float32}  # trained in fp32 over the bf16 base
    assert assert_sharded(checkpoint) == set(adapters)  # the frozen base is not checkpointed

    resumed = tmp_path / "resumed"
    finish(accelerate_launch("fsdp.yaml", "bf16", latent_shards, resumed, *args, "--resume", checkpoint))
    assert_lora_resumed_like(whole, resumed, [3, 4])  # LoRA dropout included
    assert not (whole / "unet").exists()

    pipe = StableDiffusionPipeline.from_pretrained(tiny_models, safety_checker=None)
    pipe.load_lora_weights(whole / "lora")
    trained = load_file(whole / "checkpoints" / "step-00000004" / "adapter.safetensors")
    loaded = {re.sub(r"\.default(_\d+)?\.", ".", name): p.detach() for name, p in pipe.unet.named_parameters()
              if "lora_" in name}
    assert loaded.keys() == {re.sub(r"\.default\.", ".", name) for name in trained}
    for name, value in trained.items():  # whole tensors (not one rank's shard), the trained values
        torch.testing.assert_close(loaded[re.sub(r"\.default\.", ".", name)].float(), value, rtol=0, atol=0)


def test_full_bf16_is_refused_under_fsdp_in_one_line(latent_shards, tmp_path):
    """FSDP2 owns the precision (fsdp.yaml's mixed-precision policy keeps fp32 sharded weights): --full-bf16
    there is one clear line on each rank (exit 2), not a traceback and not a silently different policy."""
    command = accelerate_launch("fsdp.yaml", "bf16", latent_shards, tmp_path / "run", "--unet-config", "tiny",
                                "--max-steps", "1", "--full-bf16")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert result.returncode != 0
    assert "error: --full-bf16: FSDP / DeepSpeed set their own precision" in result.stderr
    # the launcher reports its failed children with its own traceback; no frame of laionkit's is in it
    assert str(REPO / "laionkit") not in result.stderr and "site-packages/laionkit" not in result.stderr


def test_qwen_image_lora_under_fsdp_shards_each_block_and_exports_what_its_pipeline_loads(flow_latents, tmp_path):
    """The way Qwen-Image (20B: no full-parameter run fits one GPU) trains on several: LoRA over a frozen base
    sharded one unit per QwenImageTransformerBlock (fsdp.yaml as shipped, bf16). The checkpoint holds the
    adapters only, sharded; the export holds the whole trained adapter tensors, which QwenImagePipeline's
    load_lora_weights puts into the transformer."""
    from diffusers import QwenImagePipeline

    qwen = flow_latents("qwen-image")
    run = tmp_path / "run"
    result = finish(accelerate_launch("fsdp.yaml", "bf16", qwen.latents, run, "--transformer", qwen.model,
                                      "--lora-rank", "4", "--lr", "1e-2", "--max-steps", "2", "--checkpoint-every", "2"))
    assert "FSDP2 on CPU ranks (gloo)" in result.stdout and "wrapping each QwenImageTransformerBlock" in result.stdout
    trained = load_file(run / "checkpoints" / "step-00000002" / "adapter.safetensors")
    assert trained and assert_sharded(run / "checkpoints" / "step-00000002") == set(trained)
    pipe = QwenImagePipeline.from_pretrained(qwen.model)
    pipe.load_lora_weights(run / "lora")
    loaded = {re.sub(r"\.default(_\d+)?\.", ".", name): p.detach() for name, p in pipe.transformer.named_parameters()
              if "lora_" in name}
    assert loaded.keys() == {re.sub(r"\.default\.", ".", name) for name in trained}
    for name, value in trained.items():  # whole tensors (not one rank's shard), the trained values
        torch.testing.assert_close(loaded[re.sub(r"\.default\.", ".", name)].float(), value, rtol=0, atol=0)
