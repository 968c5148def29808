"""`laionkit train --fp8`: the denoiser blocks' linear layers train in float8 through torchao (on CPU here:
torch._scaled_mm runs there too, slowly); checkpoints, exact resume and the export are a bf16 run's."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from conftest import run_cli
from fixtures import metrics

from laionkit.common import LaionkitError

pytest.importorskip("torchao.float8")


def test_fp8_converts_only_the_blocks_linear_layers():
    from diffusers import SD3Transformer2DModel
    from torchao.float8.float8_linear import Float8Linear

    from laionkit.families.sd3 import TINY_TRANSFORMER_CONFIG
    from laionkit.trainer import fp8

    model = SD3Transformer2DModel.from_config(TINY_TRANSFORMER_CONFIG)
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    converted = fp8.convert(model, ("JointTransformerBlock",))
    assert converted and set(converted) < linears
    assert all(name.startswith("transformer_blocks.") for name in converted)
    now = dict(model.named_modules())
    assert all(isinstance(now[name], Float8Linear) for name in converted)
    assert not isinstance(now["proj_out"], Float8Linear)  # the output projection stays high precision
    with pytest.raises(LaionkitError, match="no linear layer of the Nothing blocks"):
        fp8.convert(SD3Transformer2DModel.from_config(TINY_TRANSFORMER_CONFIG), ("Nothing",))


def test_fp8_layers_run_plain_when_the_token_rows_are_not_a_multiple_of_16():
    """The float8 weight-gradient GEMM needs batch x tokens to be a multiple of 16 (CUDA's _scaled_mm; SD3's
    333 text tokens at batch 8 failed on an H200). Such calls run as the plain linear; others in float8."""
    from diffusers import SD3Transformer2DModel

    from laionkit.families.sd3 import TINY_TRANSFORMER_CONFIG
    from laionkit.trainer import fp8

    torch.manual_seed(0)
    model = SD3Transformer2DModel.from_config(TINY_TRANSFORMER_CONFIG).to(torch.bfloat16)
    layer = model.get_submodule(fp8.convert(model, ("JointTransformerBlock",))[0])
    for rows, plain in ((10, True), (16, False)):  # x batch 2: 20 rows (not a multiple of 16), 32 rows
        x = torch.randn(2, rows, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
        out = layer(x)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(out, expected) is plain, rows
        assert torch.allclose(out.float(), expected.float(), rtol=0.2, atol=0.2)  # float8 rounding, not garbage
        out.float().square().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all() and layer.weight.grad is not None
        layer.weight.grad = None


def test_fp8_trains_resumes_exactly_and_exports_a_plain_transformer(flow_latents, tmp_path):
    from diffusers import SD3Transformer2DModel

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    sd3 = flow_latents("sd3")
    base = TrainConfig(latents=sd3.latents, output=tmp_path / "bf16", unet_config="tiny", max_steps=4, batch_size=4,
                       lr=1e-3, log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3,
                       checkpoint_every=2)
    run(replace(base, max_steps=1))  # the bf16 step 1: the same batch, noise and initial weights
    config = replace(base, output=tmp_path / "fp8", fp8=True)
    run(config)
    plain, fp8_losses = metrics(base.output), metrics(config.output)
    # float8 matmuls change the numbers a little, not the run: same data, same noise, a close loss
    assert fp8_losses[1]["loss"] != plain[1]["loss"]
    assert fp8_losses[1]["loss"] == pytest.approx(plain[1]["loss"], rel=0.05)
    # kill after the step-2 checkpoint, resume: the same losses as the uninterrupted fp8 run
    stopped = tmp_path / "stopped"
    shutil.copytree(config.output, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step-00000004")
    shutil.rmtree(stopped / "transformer")
    run(replace(config, output=stopped, resume="latest"))
    resumed = metrics(stopped)
    for step in range(1, 5):
        assert resumed[step]["loss"] == pytest.approx(fp8_losses[step]["loss"], rel=1e-5, abs=1e-7), step
    # the export is a plain diffusers transformer with a bf16 run's keys
    exported = SD3Transformer2DModel.from_pretrained(stopped / "transformer")
    reference = SD3Transformer2DModel.from_pretrained(base.output / "transformer")
    assert exported.state_dict().keys() == reference.state_dict().keys()
    assert not any("Float8" in type(module).__name__ for module in exported.modules())


def test_fp8_refusals(flow_latents, tmp_path):
    sd3 = flow_latents("sd3")  # --fp8 --lora-rank trains (tests/test_quantized_base.py)
    result = run_cli("train", sd3.latents, "--output", tmp_path / "run", "--transformer-config", "tiny",
                     "--max-steps", "1", "--fp8", "--fp8-recipe", "blockwise", "--log-with", "none", check=False)
    assert result.returncode == 2 and "--fp8-recipe 'blockwise'" in result.stderr
    assert "Traceback" not in result.stderr
