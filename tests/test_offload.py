"""Offload with real ranks on CPU (gloo): FSDP2's CPUOffloadPolicy (--cpu-offload) under `accelerate launch
--config_file train/fsdp.yaml`, on 2 ranks and on a world of 1 (how one GPU runs it), against the plain FSDP2
run; and the one-line refusals of what does not compose.

On CPU ranks the "host" and the "device" are the same memory, so what these tests check is FSDP2's offload
path itself (the shards kept as host tensors, gradients copied to them, the optimizer stepping them,
checkpoints and exports read from them), not the PCIe traffic a GPU run pays (docs/CLUSTER.md,
"Offload: when each pays")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli
from fixtures import accelerate_launch, finish, metrics

from laionkit.common import LaionkitError

REPO = Path(__file__).resolve().parents[1]
SD3 = ("--transformer-config", "tiny", "--lr", "1e-3", "--max-grad-norm", "0.05", "--grad-accum", "2")


def transformer(run: Path) -> dict[str, torch.Tensor]:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(run / "transformer").state_dict()


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

    want, got = metrics(plain), metrics(offloaded)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert got[step]["grad_norm"] > 0.05  # the clipping bites
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-7), (step, key)
    reference = transformer(plain)
    exported = transformer(offloaded)
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == torch.float32
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_one_process_fsdp2_cpu_offload_is_how_one_gpu_runs_it(latent_shards, tmp_path):
    """`--num_processes 1`: FSDP2 over a world of 1 with the shards on the host (one GPU's launch), the UNet
    in fp32, checkpointed and exported."""
    from diffusers import UNet2DConditionModel

    run = tmp_path / "run"
    command = accelerate_launch("fsdp.yaml", "no", latent_shards, run, "--unet-config", "tiny", "--max-steps", 2,
                                "--checkpoint-every", 2, "--cpu-offload")
    command[command.index("--num_processes") + 1] = "1"
    result = finish(command)
    assert "FSDP2 CPU offload" in result.stdout
    assert sorted(metrics(run)) == [1, 2]
    assert (run / "checkpoints" / "step-00000002" / "pytorch_model_fsdp_0" / "__0_0.distcp").is_file()
    assert UNet2DConditionModel.from_pretrained(run / "unet").config.in_channels == 4


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
