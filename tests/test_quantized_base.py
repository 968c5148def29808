"""train --lora-rank on a quantized frozen base (--base-dtype fp8 / int8 / nf4) and with float8 base matmuls (--fp8):
the base's block linears stored as the quantizer makes them, loaded block by block, trained, resumed exactly,
and exported at the trained strength for the bf16 base diffusers and ComfyUI load."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from conftest import run_cli
from fixtures import assert_lora_resumed_like, metrics
from safetensors.torch import load_file
from test_lora_export import ALPHA, RANK, base_denoiser, loaded, output

from laionkit.families import get_family
from laionkit.trainer import quantized_base
from laionkit.trainer.quantized_base import FrozenLinear

QUANTIZED = ("fp8", "int8", "nf4")
FAST = ("--batch-size", "4", "--lr", "1e-2", "--log-with", "none", "--quiet", "--workers", "0", "--log-every", "1",
        "--shuffle-buffer", "3", "--mixed-precision", "bf16")


def lora_run(flux, output_dir, *flags, steps=4, resume=None):
    args = ("train", flux.latents, "--output", output_dir, "--transformer", flux.model, "--lora-rank", str(RANK),
            "--lora-alpha", str(ALPHA), *FAST, "--checkpoint-every", "2", "--max-steps", str(steps), *flags)
    run_cli(*args, *(("--resume", resume) if resume else ()))
    return output_dir


@pytest.fixture(scope="module")
def bf16_run(flow_latents, tmp_path_factory):
    """The same LoRA run on the plain bf16 base: the losses the quantized and float8 runs are compared with."""
    return lora_run(flow_latents("flux"), tmp_path_factory.mktemp("bf16") / "run")


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_base_trains_resumes_exactly_and_exports_at_the_trained_strength(fmt, flow_latents, bf16_run,
                                                                                    tmp_path):
    flux = flow_latents("flux")
    whole = lora_run(flux, tmp_path / "whole", "--base-dtype", fmt)
    plain, quantized = metrics(bf16_run), metrics(whole)
    # the base was quantized (the first step's loss moved) and trains as the bf16 base does, within its error
    assert quantized[1]["loss"] != plain[1]["loss"]
    for step in (1, 4):
        assert quantized[step]["loss"] == pytest.approx(plain[step]["loss"], rel=0.15), step
    resumed = lora_run(flux, tmp_path / "resumed", "--base-dtype", fmt,
                       resume=whole / "checkpoints" / "step-00000002")
    assert_lora_resumed_like(whole, resumed, [3, 4])

    # the export is the trained adapters (fp32 masters of the last checkpoint's bf16 ones) for the bf16 base:
    # diffusers' loader on the tiny pipeline gives that base merged at alpha / rank
    adapters = load_file(whole / "checkpoints" / "step-00000004" / "adapter.safetensors")
    exported = load_file(whole / "lora" / "pytorch_lora_weights.safetensors")
    names = sorted({key.split(".lora_A.")[0] for key in adapters if ".lora_A." in key})
    assert len(exported) == len(adapters)
    want = base_denoiser("flux", flux.model)
    modules = dict(want.named_modules())
    with torch.no_grad():
        for name in names:
            down, up = (exported[f"transformer.{name}.lora.{part}.weight"] for part in ("down", "up"))
            for part, value in zip("AB", (down, up)):
                torch.testing.assert_close(value.bfloat16(), adapters[f"{name}.lora_{part}.default.weight"])
            modules[name].weight += ALPHA / RANK * up @ down
    base = output("flux", base_denoiser("flux", flux.model))
    assert (output("flux", want) - base).abs().max() > 1e-3, "the adapters did not train"
    torch.testing.assert_close(output("flux", loaded("flux", flux.model, whole / "lora")), output("flux", want),
                               rtol=1e-4, atol=1e-5)
    kohya = load_file(whole / "lora" / "lora_kohya.safetensors")
    assert {value.item() for key, value in kohya.items() if key.endswith(".alpha")} >= {ALPHA}


def test_resume_refuses_another_base_dtype(flow_latents, tmp_path):
    flux = flow_latents("flux")
    run = lora_run(flux, tmp_path / "run", "--base-dtype", "int8", steps=2)
    result = run_cli("train", flux.latents, "--output", tmp_path / "again", "--transformer", flux.model,
                     "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), *FAST, "--max-steps", "4",
                     "--base-dtype", "nf4", "--resume", run / "checkpoints" / "step-00000002", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "base_dtype" in result.stderr and "--base-dtype" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_cli("train", flux.latents, "--output", tmp_path / "full", "--transformer", flux.model, *FAST,
                     "--max-steps", "1", "--base-dtype", "nf4", check=False)
    assert result.returncode == 2 and "--base-dtype nf4" in result.stderr and "--lora-rank" in result.stderr


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fp8_lora_trains_near_the_bf16_run(recipe, fmt, flow_latents, bf16_run, tmp_path):
    """--fp8 --lora-rank: the base's block matmuls in float8 (on the bf16 base, or straight from the stored
    float8 weights); the losses stay within float8's noise of the bf16 run's."""
    flux = flow_latents("flux")
    run = lora_run(flux, tmp_path / "run", "--fp8", "--fp8-recipe", recipe, "--base-dtype", fmt)
    plain, fp8 = metrics(bf16_run), metrics(run)
    assert fp8[1]["loss"] != plain[1]["loss"]
    for step in (1, 2, 3, 4):
        assert fp8[step]["loss"] == pytest.approx(plain[step]["loss"], rel=0.1), step
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("compute", ["bf16", "tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", ("bf16", *QUANTIZED))
def test_frozen_linear_backward_is_the_input_gradient_of_its_dequantized_weight(fmt, compute):
    """FrozenMatmul against nn.Linear with the dequantized weight: the same output and input gradient (float8
    compute: within float8's error), no weight gradient."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    frozen = FrozenLinear.of(layer, fmt, compute)
    reference = torch.nn.Linear(64, 48)
    with torch.no_grad():
        reference.weight.copy_(quantized_base.dequantize(fmt, frozen.weight, frozen.scale, torch.float32))
        reference.bias.copy_(layer.bias)
    x = torch.randn(2, 16, 64, requires_grad=True)
    want = reference(x)
    (grad_want,) = torch.autograd.grad(want.square().sum(), x)
    got = frozen(x)
    (grad_got,) = torch.autograd.grad(got.square().sum(), x)
    tolerance = dict(rtol=0, atol=1e-5) if compute == "bf16" else dict(rtol=0.1, atol=0.1)
    torch.testing.assert_close(got, want, **tolerance)
    assert (grad_got - grad_want).norm() <= (1e-5 if compute == "bf16" else 0.08) * grad_want.norm()
    assert frozen.weight.grad is None and not frozen.weight.requires_grad


def test_quantized_weights_hold_the_quantizer_error_and_survive_a_dtype_cast():
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    error = {}
    for fmt in QUANTIZED:
        codes, scale = quantized_base.quantize(weight, fmt)
        back = quantized_base.dequantize(fmt, codes, scale, torch.float32)
        error[fmt] = float((back - weight).norm() / weight.norm())
        layer = FrozenLinear(codes, scale, None, 128, fmt)
        torch.nn.Module.to(layer, torch.bfloat16)  # what lora.attach and MasterWeights do to the whole model
        assert torch.equal(layer.weight, codes) and torch.equal(layer.scale, scale)
    assert error["int8"] < 0.01 and error["fp8"] < 0.04 and error["nf4"] < 0.12
    assert error["int8"] < error["fp8"] < error["nf4"]


def test_loading_quantizes_block_by_block_without_the_whole_bf16_state(flow_latents, tmp_path):
    """quantized_base.load of a Flux transformer (widened so its blocks outweigh the rest) equals quantizing the
    from_pretrained model's block linears, and the shards' bytes held at once (read_safetensors' buffers,
    traced) stay near one tensor's, far below the bf16 state's."""
    import diffusers

    spec = get_family("flux")
    config = diffusers.FluxTransformer2DModel.load_config(flow_latents("flux").model, subfolder="transformer")
    config.update(num_layers=2, num_single_layers=4, attention_head_dim=32, num_attention_heads=8)
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel.from_config(config).to(torch.bfloat16)
    folder = tmp_path / "model"
    model.save_pretrained(folder / "transformer", max_shard_size="200KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()  # shards
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    for fmt in QUANTIZED:
        tracemalloc.start()
        got = quantized_base.load(diffusers.FluxTransformer2DModel, str(folder), "transformer", spec.block_classes,
                                  fmt, torch.device("cpu"))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < largest + state // 8, (peak, largest, state)
        layers = {name: module for name, module in got.named_modules() if isinstance(module, FrozenLinear)}
        assert layers and all(name.startswith(("transformer_blocks.", "single_transformer_blocks."))
                              for name in layers)
        plain = dict(model.named_modules())
        for name, layer in layers.items():
            codes, scale = quantized_base.quantize(plain[name].weight, fmt)
            assert torch.equal(layer.weight, codes) and torch.equal(layer.scale, scale), name
            assert layer.bias is None or torch.equal(layer.bias, plain[name].bias.float())
        assert isinstance(got.x_embedder, torch.nn.Linear) and not isinstance(got.x_embedder, FrozenLinear)
        torch.testing.assert_close(got.x_embedder.weight, model.x_embedder.weight.float())


def test_a_random_base_is_drawn_straight_into_its_quantized_form(flow_latents, tmp_path):
    """--lora-random-base --base-dtype (the benchmark's FLUX.2 [dev] 32B, whose bf16 weights would not fit): the
    blocks' linears are drawn one at a time straight into FrozenLinear, and under the same seed they are
    from_config's weights quantized (so the benchmark's loss compares with its bf16 base's); it trains."""
    import diffusers

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet

    flux = flow_latents("flux")
    config = TrainConfig(latents=flux.latents, output=tmp_path / "run", unet_config="tiny", max_steps=2, lora_rank=4,
                         lora_random_base=True, base_dtype="nf4", export="none")
    data = open_latents(flux.latents)
    torch.manual_seed(0)
    model = build_unet(config, data)
    torch.manual_seed(0)
    plain = build_unet(TrainConfig(latents=flux.latents, output=tmp_path / "run", unet_config="tiny", max_steps=2),
                       data)
    assert isinstance(plain, diffusers.FluxTransformer2DModel)
    frozen = {name: module for name, module in model.named_modules() if isinstance(module, FrozenLinear)}
    assert frozen and {module.fmt for module in frozen.values()} == {"nf4"}
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    modules = dict(plain.named_modules())
    for name, layer in frozen.items():
        codes, scale = quantized_base.quantize(modules[name].weight, "nf4")
        assert torch.equal(layer.weight, codes) and torch.equal(layer.scale, scale), name
    state = plain.state_dict()
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items()
               if key.removesuffix(".weight") not in frozen and key.removesuffix(".scale") not in frozen)
    run_cli("train", flux.latents, "--output", tmp_path / "run", "--transformer-config", "tiny", "--lora-rank", "4",
            "--lora-random-base", "--base-dtype", "nf4", "--export", "none", *FAST, "--max-steps", "2")
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in metrics(tmp_path / "run").values())


def cpu_peak_bytes(fn):
    """``fn()`` and the most bytes torch's CPU allocator held at once while it ran, above what it held before
    (the profiler's memory events: tracemalloc does not see torch's allocations)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    held = peak = 0
    events = sorted(prof.profiler.kineto_results.events(), key=lambda event: event.start_ns())
    for event in events:
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
            held += event.nbytes()
            peak = max(peak, held)
    return result, peak


def test_a_random_base_is_never_held_in_full_precision_while_it_is_drawn():
    """--lora-random-base --base-dtype nf4 on FLUX.2 [dev]'s blocks (its MLP ratio and layout, narrower and
    3 blocks deep): the bytes held at once while drawing stay within the built model's plus one block's bf16
    weights: each drawn fp32 layer is freed once quantized, and quantizing it needs no multiple of its size."""
    import diffusers

    from laionkit.families.flux2_dev import TRANSFORMER_CONFIG

    spec = get_family("flux2-dev")
    config = dict(TRANSFORMER_CONFIG, num_layers=1, num_single_layers=2, num_attention_heads=8,
                  joint_attention_dim=1024)
    cls = diffusers.Flux2Transformer2DModel
    model, peak = cpu_peak_bytes(lambda: quantized_base.random_init(cls, config, spec.block_classes, "nf4",
                                                                    torch.device("cpu")))
    built = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with torch.device("meta"):
        plain = cls.from_config(config)
    block = max(sum(2 * p.numel() for p in module.parameters()) for module in plain.modules()
                if type(module).__name__ in spec.block_classes)
    assert sum(isinstance(module, FrozenLinear) for module in model.modules()) > 10
    assert peak <= built + block, (peak, built, block)


@pytest.mark.parametrize("compute", ["bf16", "tensorwise"])
@pytest.mark.parametrize("fmt", ("bf16", *QUANTIZED))
def test_compiled_frozen_linears_save_no_dequantized_weight_for_the_backward(fmt, compute):
    """Under torch.compile (AOTAutograd's min-cut partitioner, as Inductor runs it) the tensors two FrozenLinears'
    forward saves for the backward hold no weight-sized tensor besides the stored codes: a dequantized bf16 copy
    (or NF4's unpacked codes) saved per layer made an int8 base use more memory than the bf16 one."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved = []

    def backward_compiler(graph, inputs):
        saved.extend(node.meta["val"] for node in graph.graph.find_nodes(op="placeholder")
                     if isinstance(node.meta.get("val"), torch.Tensor))
        return make_boxed_func(graph)

    backend = aot_autograd(fw_compiler=lambda graph, inputs: make_boxed_func(graph), bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    layers = [FrozenLinear.of(torch.nn.Linear(128, 128), fmt, compute) for _ in range(2)]
    module = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1]).bfloat16()
    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        out = torch.compile(module, backend=backend, fullgraph=True)(torch.randn(2, 32, 128, requires_grad=True))
    out.float().sum().backward()
    codes = layers[0].weight  # saved as it is or as a view (fp8's float8 view of its bytes): no copy
    weight_sized = [(tuple(t.shape), t.dtype) for t in saved if t.numel() >= 128 * 128 and not
                    (t.shape == codes.shape and t.element_size() == codes.element_size())]
    assert saved and not weight_sized, weight_sized
