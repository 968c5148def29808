"""train --lora-rank: adapters on a frozen tiny UNet, checkpointed alone, resumed exactly, loaded by diffusers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import run_cli
from fixtures import assert_lora_resumed_like, compile_on_cpu, free_port, metrics

FAST = ("--batch-size", "4", "--lr", "1e-2", "--log-with", "none", "--quiet", "--workers", "0")



# Runs with no laionkit import: what a user of the exported folder has.
LOAD_IN_DIFFUSERS = """
import sys, torch
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained(sys.argv[1], safety_checker=None)
def draw():
    return pipe("a dog running on the beach", num_inference_steps=2, height=64, width=64, output_type="np",
                generator=torch.Generator().manual_seed(0)).images
before = draw()
pipe.load_lora_weights(sys.argv[2])
after = draw()
assert not any(name.startswith("laionkit") for name in sys.modules)
print(float(abs(after - before).max()))
"""


def test_lora_checkpoints_adapters_only_resumes_exactly_and_exports_what_diffusers_loads(
        latent_shards, tiny_models, tmp_path):
    import torch
    from safetensors.torch import load_file

    args = (*FAST, "--unet", tiny_models, "--lora-rank", "4", "--mixed-precision", "bf16", "--ema",
            "--ema-decay", "0.5", "--checkpoint-every", "2", "--log-every", "1", "--lora-dropout", "0.1")
    whole = tmp_path / "whole"
    run_cli("train", latent_shards, "--output", whole, *args, "--max-steps", "4")
    checkpoint = whole / "checkpoints" / "step-00000002"
    assert not (checkpoint / "model.safetensors").exists()  # the frozen base is not checkpointed
    adapters = load_file(checkpoint / "adapter.safetensors")
    assert adapters and all("lora_" in name for name in adapters)
    # bf16 model, fp32 master copies and EMA of the adapters only, optimizer state for them only
    assert {t.dtype for t in adapters.values()} == {torch.bfloat16}
    master = torch.load(checkpoint / "master.pt", weights_only=True)["master"]
    assert sorted(tuple(t.shape) for t in master) == sorted(tuple(t.shape) for t in adapters.values())
    assert {t.dtype for t in master} == {torch.float32}
    assert len(torch.load(checkpoint / "ema.pt", weights_only=True)["shadow_params"]) == len(adapters)
    assert len(torch.load(checkpoint / "optimizer.bin", weights_only=True)["state"]) == len(adapters)

    resumed = tmp_path / "resumed"
    run_cli("train", latent_shards, "--output", resumed, *args, "--max-steps", "4", "--resume", checkpoint)
    exported = assert_lora_resumed_like(whole, resumed, [3, 4])
    assert all(k.startswith("unet.") for k in exported) and {t.dtype for t in exported.values()} == {torch.float32}
    assert any((t != t.bfloat16().float()).any() for t in exported.values()), "exported the bf16 rounding"
    assert (whole / "lora_ema" / "pytorch_lora_weights.safetensors").is_file()

    script = tmp_path / "load.py"
    script.write_text(LOAD_IN_DIFFUSERS)
    result = subprocess.run([sys.executable, str(script), str(tiny_models), str(whole / "lora")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split()[-1]) > 1e-4  # the adapters change the pipeline's output


def test_two_ddp_ranks_train_identical_adapters(latent_shards, tiny_models, tmp_path):
    """2 gloo ranks under torchrun, bf16 weights with fp32 master copies of the adapters and --grad-accum
    2: the rank fingerprints (of the adapters) agree at every checkpoint."""
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "laionkit.cli", "train", str(latent_shards), "--output", str(run), *FAST[:-2], "--batch-size", "2",
         "--workers", "0", "--unet", str(tiny_models), "--lora-rank", "4", "--mixed-precision", "bf16",
         "--bf16-weights", "--grad-accum", "2", "--max-steps", "4", "--log-every", "2", "--checkpoint-every", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for step in (2, 4):
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        records = [json.loads(p.read_text()) for p in sorted(checkpoint.glob("rank-*.json"))]
        assert len(records) == 2 and records[0]["fingerprint"] == records[1]["fingerprint"], step
    adapters = load_file(checkpoint / "adapter.safetensors")
    assert len(torch.load(checkpoint / "master.pt", weights_only=True)["master"]) == len(adapters)
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file() and not (run / "unet").exists()


def test_lora_mistakes_are_one_clear_line(latent_shards, tiny_models, tmp_path):
    """Refused in one line (exit 2), nothing trained: resumes with other LoRA settings, across full-model and
    adapter checkpoints, onto another base (adapters are deltas to the weights they trained on; the base is
    known by its weights files' sha256, so a byte-identical copy elsewhere resumes), unknown targets, and
    adapters on a from-scratch base (random, never saved: the adapters alone would be useless)."""
    import shutil

    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    base = ("train", latent_shards, "--output", run, *FAST, "--unet", tiny_models, "--checkpoint-every", "1")
    run_cli(*base, "--lora-rank", "2", "--max-steps", "1")
    full = tmp_path / "full"
    run_cli("train", latent_shards, "--output", full, *FAST, "--unet", tiny_models, "--max-steps", "1",
            "--checkpoint-every", "1")
    same, other = tmp_path / "same-base", tmp_path / "other-base"
    shutil.copytree(tiny_models, same)
    shutil.copytree(tiny_models, other)
    weights = other / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01  # a fine-tune of the same architecture: same names, shapes, size
    save_file(tensors, weights)
    on = lambda model: (*base[:base.index("--unet") + 1], model, *base[base.index("--unet") + 2:])  # noqa: E731
    cases = [
        ((*on(other), "--lora-rank", "2", "--max-steps", "2", "--resume", "latest"),
         f"its adapters were trained on the base {tiny_models} (diffusion_pytorch_model.safetensors sha256 "),
        (("train", latent_shards, "--output", tmp_path / "scratch", *FAST, "--unet-config", "tiny", "--lora-rank", "2",
          "--max-steps", "1"), "--lora-rank with --unet-config / --transformer-config tiny: adapters train on a "
                               "pretrained base"),
        ((*base, "--lora-rank", "4", "--max-steps", "2", "--resume", "latest"), "was trained with other lora_alpha, lora_rank"),
        ((*base, "--max-steps", "2", "--resume", "latest"), "holds LoRA adapters only"),
        (("train", latent_shards, "--output", full, *FAST, "--unet", tiny_models, "--max-steps", "2",
          "--lora-rank", "2", "--resume", "latest"), "holds no adapter.safetensors"),
        ((*base[:3], tmp_path / "new", *base[4:], "--lora-rank", "2", "--lora-targets", "nope", "--max-steps", "1"),
         "--lora-targets nope: Target modules"),
    ]
    for args, message in cases:
        result = run_cli(*args, check=False)
        assert result.returncode == 2 and message in result.stderr, (message, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
    assert sorted(metrics(run)) == [1]  # nothing trained on the refused resumes
    assert not (tmp_path / "scratch").exists()
    run_cli("train", latent_shards, "--output", tmp_path / "scratch", *FAST, "--unet-config", "tiny", "--lora-rank",
            "2", "--max-steps", "1", "--lora-random-base")  # the opt-in, for throughput measurements
    assert (tmp_path / "scratch" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    run_cli(*on(same), "--lora-rank", "2", "--max-steps", "2", "--resume", "latest")  # the same weights elsewhere
    assert sorted(metrics(run)) == [1, 2]


@pytest.mark.parametrize("options, message", [
    ({"lora_rank": 0}, "--lora-rank 0: must be >= 1"),
    ({"lora_rank": 2, "lora_dropout": 1.0}, "--lora-dropout 1.0: must be in [0, 1)"),
])
def test_lora_flag_mistakes_are_refused_before_anything_loads(tmp_path, options, message):
    from laionkit.common import LaionkitError
    from laionkit.trainer.config import TrainConfig

    with pytest.raises(LaionkitError) as error:
        TrainConfig(latents=tmp_path, output=tmp_path / "run", unet_config="tiny", max_steps=1, **options)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("family", ["sd", "sd3", "sana", "z-image", "qwen-image", "flux2", "flux2-dev"])
def test_lora_with_compile_trains_as_eager(family, latent_shards, tiny_models, flow_latents, tmp_path, monkeypatch):
    """--lora-rank with --compile: dynamo and AOT autograd trace PEFT's LoRA layers, inside the whole
    compiled UNet (SD) and inside each compiled transformer block (the transformer families: regional; Z-Image's
    list of captions and Qwen-Image's img_shapes included), and the run logs eager's losses and checkpoints and
    exports the adapters alone. On CPU the backend is aot_eager (forward and
    backward graphs as inductor gets them, run without codegen): inductor there takes minutes on 2 cores."""
    import torch
    from safetensors.torch import load_file

    compiled = compile_on_cpu(monkeypatch, "aot_eager")
    if family == "sd":
        latents, model = latent_shards, tiny_models
    else:
        flow = flow_latents(family)
        latents, model = flow.latents, flow.model
    args = (*FAST, "--unet", model, "--lora-rank", "4", "--max-steps", "3", "--log-every", "1",
            "--checkpoint-every", "3", "--shuffle-buffer", "3")
    eager = tmp_path / "eager"
    run_cli("train", latents, "--output", eager, *args)
    assert not compiled
    torch._dynamo.reset()
    run = tmp_path / "compiled"
    run_cli("train", latents, "--output", run, *args, "--compile")
    torch._dynamo.reset()
    assert len(compiled) == 1 if family == "sd" else len(compiled) > 1  # whole UNet / one call per block
    expected, got = metrics(eager), metrics(run)
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-4, abs=1e-6), step
    adapters = load_file(run / "checkpoints" / "step-00000003" / "adapter.safetensors")
    assert adapters and all("lora_" in name for name in adapters)
    exported = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
    reference = load_file(eager / "lora" / "pytorch_lora_weights.safetensors")
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-3, atol=1e-5, msg=name)
