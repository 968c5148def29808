"""Offload with real ranks on CPU (gloo): FSDP2's CPUOffloadPolicy (--cpu-offload) under `accelerate launch
--config_file train/fsdp.yaml`, on 2 ranks and on a world of 1 (how one GPU runs it), against the plain FSDP2
run; DeepSpeed ZeRO-3 with its parameters and optimizer offloaded (train/deepspeed-zero3-offload.yaml), against
DDP, and ZeRO-3 on SD3 in bf16 (train/deepspeed-zero3.yaml): DeepSpeed's own CPU ranks (laionkit/trainer/zero.py);
and the one-line refusals of what does not compose.

On CPU ranks the "host" and the "device" are the same memory, so what these tests check is FSDP2's offload
path itself (the shards kept as host tensors, gradients copied to them, the optimizer stepping them,
checkpoints and exports read from them), not the PCIe traffic a GPU run pays (docs/CLUSTER.md,
"Offload: when each pays")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from fixtures import accelerate_launch, finish, metrics
from safetensors.torch import load_file

from laionkit.common import LaionkitError

REPO = Path(__file__).resolve().parents[1]
UNET = ("--unet-config", "tiny", "--lr", "1e-3", "--grad-accum", "2", "--max-grad-norm", "0.05")
SD3 = ("--transformer-config", "tiny", "--lr", "1e-3", "--max-grad-norm", "0.05", "--grad-accum", "2")


def transformer(run: Path) -> dict[str, torch.Tensor]:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(run / "transformer").state_dict()


def one_process(command: list[str]) -> list[str]:
    command[command.index("--num_processes") + 1] = "1"
    return command


def same_steps(want: dict, got: dict, **tolerance) -> None:
    """Steps 1-4 of two runs log the same losses and (clipped: above the 0.05 limit) gradient norms."""
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert want[step]["grad_norm"] > 0.05  # the clipping bites
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], **tolerance), (step, key)


def test_fsdp2_cpu_offload_trains_resumes_and_exports_as_the_plain_fsdp2_run(flow_latents, tmp_path):
    """SD3 (one wrap unit per JointTransformerBlock) in bf16 mixed precision on 2 ranks, accumulating and
    clipped: the offloaded run, stopped at its step-2 checkpoint and resumed, logs the losses and gradient
    norms of the plain FSDP2 run and exports its weights (whole fp32 tensors gathered from host shards)."""
    sd3 = flow_latents("sd3")
    plain, offloaded = tmp_path / "plain", tmp_path / "offload"
    finish(accelerate_launch("fsdp.yaml", "bf16", sd3.latents, plain, *SD3, "--max-steps", 4))
    first = finish(accelerate_launch("fsdp.yaml", "bf16", sd3.latents, offloaded, *SD3, "--max-steps", 2,
                                     "--checkpoint-every", 2, "--cpu-offload", "--export", "none"))
    assert "FSDP2 on CPU ranks (gloo)" in first.stdout and "FSDP2 CPU offload" in first.stdout
    resumed = finish(accelerate_launch("fsdp.yaml", "bf16", sd3.latents, offloaded, *SD3, "--max-steps", 4,
                                       "--cpu-offload", "--resume", "latest"))
    assert "resumed from" in resumed.stdout

    same_steps(metrics(plain), metrics(offloaded), rel=1e-5, abs=1e-7)
    reference = transformer(plain)
    exported = transformer(offloaded)
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == torch.float32
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_one_gpu_launch_of_lora_under_fsdp2_cpu_offload_trains_the_plain_runs_adapters(latent_shards, tiny_models,
                                                                                        tmp_path):
    """`--num_processes 1` (how one GPU runs it: FSDP2 over a world of 1) with --lora-rank in bf16: the frozen
    base and the fp32 adapters on the host; the checkpoint's adapters are the plain FSDP2 run's, checkpointed
    in FSDP2's sharded layout, and the export is RUN/lora."""
    args = ("--unet", tiny_models, "--lora-rank", "4", "--lr", "1e-2", "--max-steps", "2", "--checkpoint-every", "2")
    plain, offloaded = tmp_path / "plain", tmp_path / "offload"
    finish(one_process(accelerate_launch("fsdp.yaml", "bf16", latent_shards, plain, *args)))
    result = finish(one_process(accelerate_launch("fsdp.yaml", "bf16", latent_shards, offloaded, *args,
                                                  "--cpu-offload")))
    assert "FSDP2 on CPU ranks (gloo)" in result.stdout and "FSDP2 CPU offload" in result.stdout
    checkpoint = offloaded / "checkpoints" / "step-00000002"
    assert (checkpoint / "pytorch_model_fsdp_0" / "__0_0.distcp").is_file()
    want, got = (load_file(run / "checkpoints" / "step-00000002" / "adapter.safetensors") for run in (plain, offloaded))
    assert want and set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (offloaded / "lora").is_dir() and not (offloaded / "unet").exists()


def test_cpu_offload_outside_an_fsdp_launch_is_one_line(latent_shards, tmp_path):
    """One plain process (no launcher) has no FSDP to offload with: exit 2 naming the launch that does."""
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps",
                     "1", "--workers", "0", "--log-with", "none", "--quiet", "--cpu-offload", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--cpu-offload runs under FSDP2" in result.stderr and "--num_processes" in result.stderr
    assert "Traceback" not in result.stderr


def test_cpu_offload_with_ema_is_refused_before_anything_runs(tmp_path):
    from laionkit.trainer.config import TrainConfig

    with pytest.raises(LaionkitError, match="--cpu-offload with --ema"):
        TrainConfig(latents=tmp_path, output=tmp_path / "run", unet_config="tiny", max_steps=1, cpu_offload=True,
                    ema=True)


def test_zero3_offload_trains_resumes_and_exports_as_ddp(latent_shards, tmp_path):
    """train/deepspeed-zero3-offload.yaml on 2 ranks in fp32, accumulating and clipped: DeepSpeed's
    partitioned checkpoint at step 2, resumed, logs DDP's losses and gradient norms on the same ranks, and the
    export (the fp32 master weights gathered from the host partitions) is DDP's UNet."""
    from diffusers import UNet2DConditionModel

    ddp, zero3 = tmp_path / "ddp", tmp_path / "zero3"
    finish(accelerate_launch("ddp.yaml", "no", latent_shards, ddp, *UNET, "--max-steps", 4))
    finish(accelerate_launch("deepspeed-zero3-offload.yaml", "no", latent_shards, zero3, *UNET, "--max-steps", 2,
                             "--checkpoint-every", 2, "--export", "none"))
    partitions = zero3 / "checkpoints" / "step-00000002" / "pytorch_model"
    assert sorted(p.name for p in partitions.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resumed = finish(accelerate_launch("deepspeed-zero3-offload.yaml", "no", latent_shards, zero3, *UNET,
                                       "--max-steps", 4, "--resume", "latest"))
    assert "resumed from" in resumed.stdout

    same_steps(metrics(ddp), metrics(zero3), rel=1e-4)
    reference = UNet2DConditionModel.from_pretrained(ddp / "unet").state_dict()
    exported = UNet2DConditionModel.from_pretrained(zero3 / "unet").state_dict()
    assert set(exported) == set(reference)
    for name, tensor in reference.items():  # Adam's first steps amplify rounding where gradients are ~0
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-4, msg=name)


def test_zero3_runs_the_sd3_transformer_in_bf16_and_exports_its_fp32_weights(flow_latents, tmp_path):
    """train/deepspeed-zero3.yaml on 2 ranks in bf16: the family's forward under ZeRO-3's gather hooks, in
    training with activation checkpointing per block (the backward's recompute gathers again) and in the
    validation loss (eval mode, between steps), and an export of whole fp32 tensors that from_pretrained loads."""
    from diffusers import SD3Transformer2DModel

    sd3 = flow_latents("sd3")
    run = tmp_path / "run"
    finish(accelerate_launch("deepspeed-zero3.yaml", "bf16", sd3.latents, run, *SD3, "--max-steps", 2,
                             "--checkpointing", "blocks", "--val-latents", sd3.latents, "--val-every", 2,
                             "--val-samples", 2))
    got = metrics(run)
    assert sorted(got) == [1, 2] and got[2]["val_loss"] > 0
    exported = SD3Transformer2DModel.from_pretrained(run / "transformer").state_dict()
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert all(t.numel() > 0 for t in exported.values())  # gathered, not ZeRO-3's empty placeholders


def test_ema_under_zero3_is_one_line(latent_shards, tmp_path):
    """--ema needs whole weights between steps: one line (exit 2) naming what to use instead, on a one-process
    ZeRO-3 launch (what one GPU runs)."""
    command = one_process(accelerate_launch("deepspeed-zero3-offload.yaml", "no", latent_shards, tmp_path / "run",
                                            "--unet-config", "tiny", "--max-steps", 1, "--ema"))
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert result.returncode != 0
    assert "error: --ema under DeepSpeed ZeRO-3" in result.stderr, result.stderr[-2000:]
    # the launcher reports its failed child with its own traceback; no frame of laionkit's is in it
    assert str(REPO / "laionkit") not in result.stderr and "site-packages/laionkit" not in result.stderr


def test_cpu_offload_under_a_deepspeed_launch_names_zero3_offload(latent_shards, tmp_path, monkeypatch):
    """A DeepSpeed launch offloads through its config: --cpu-offload there is one line naming it (checked
    before the Accelerator is built, so in process with the launch's environment)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps",
                     "1", "--workers", "0", "--log-with", "none", "--quiet", "--cpu-offload", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "train/deepspeed-zero3-offload.yaml" in result.stderr and "Traceback" not in result.stderr


def test_a_deepspeed_launch_without_deepspeed_installed_is_one_line(latent_shards, tmp_path, monkeypatch):
    """Without DeepSpeed a deepspeed-*.yaml launch is one line naming the package (sys.modules' None entry is
    how an uninstalled module looks to the import system)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps",
                     "1", "--workers", "0", "--log-with", "none", "--quiet", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs DeepSpeed: pip install deepspeed" in result.stderr and "Traceback" not in result.stderr
