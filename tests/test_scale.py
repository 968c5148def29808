"""Scale features through the family layer (FamilySpec.block_classes): activation checkpointing per block
(--checkpointing blocks|every-N|none), regional --compile (each transformer block compiled on its own),
and a real kill -9 + resume of a flow family through the CLI. Tiny models on CPU; the Flux runs reproduce
the session's flux_run (tests/fixtures.py), trained once."""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import pytest
import torch
from conftest import run_cli
from fixtures import FLUX_RUN, assert_kill9_resumes_like, compile_on_cpu, metrics, train_flags

from laionkit.common import LaionkitError
from laionkit.families import flow as flow_math
from laionkit.families import get_family


def tiny_denoiser(name: str, **overrides):
    import diffusers

    spec = get_family(name)
    config = {**spec.configs["tiny"], **overrides}
    if name == "sd":
        config.setdefault("cross_attention_dim", 32)
    torch.manual_seed(0)
    return spec, getattr(diffusers, spec.denoiser_class).from_config(config)


def loss_fn(name: str, spec, model):
    """A training loss of the family's denoiser on fixed inputs (the flow loss, or noise MSE for SD)."""
    generator = torch.Generator().manual_seed(0)
    if name == "sd":
        noisy = torch.randn(2, 4, 16, 16, generator=generator)
        states = torch.randn(2, 7, model.config.cross_attention_dim, generator=generator)
        target = torch.randn(2, 4, 16, 16, generator=generator)
        return lambda: torch.nn.functional.mse_loss(
            spec.predict(model, noisy, torch.tensor([10, 500]), {"states": states}), target)
    cond = {"states": torch.randn(2, 7, model.config.joint_attention_dim, generator=generator),
            "pooled": torch.randn(2, model.config.pooled_projection_dim, generator=generator)}
    if name == "flux":
        cond["guidance"] = torch.full((2,), 3.5)
    x0, noise = torch.randn(2, 2, 16, 8, 8, generator=generator)
    sigmas = torch.tensor([0.2, 0.7])
    noisy = flow_math.interpolate(x0, noise, sigmas)
    return lambda: flow_math.loss(spec.predict(model, noisy, sigmas * spec.objective.timestep_scale, cond),
                                  x0, noise, sigmas)


def loss_and_grads(model, loss):
    model.zero_grad()
    saved = [0]

    def pack(tensor):
        saved[0] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        value = loss()
    value.backward()
    return value.item(), [p.grad.clone() for p in model.parameters()], saved[0]


@pytest.mark.parametrize("name", ("sd", "sd3", "flux"))
def test_checkpointing_recomputes_the_chosen_blocks_and_changes_no_gradient(name):
    """--checkpointing blocks / every-2 on the family's blocks: the same loss and gradients as without,
    fewer tensors saved for backward, and exactly the chosen blocks run their forward twice (once more in
    backward); a no-grad forward (validation) runs each block once. For sd3 / flux, diffusers' own
    enable_gradient_checkpointing gives the same loss and gradients as well."""
    spec, model = tiny_denoiser(name)
    loss = loss_fn(name, spec, model)
    blocks = spec.blocks(model)
    calls = [0] * len(blocks)
    for index, block in enumerate(blocks):  # a child's hook fires in the forward and in the recompute
        child = next(m for m in block.modules() if m is not block and not list(m.children()))
        child.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    plain_loss, plain, plain_saved = loss_and_grads(model, loss)
    assert calls == [1] * len(blocks)
    saved = {}
    for every in (2, 1):  # every-2 first: checkpointing every block afterwards wraps the rest
        calls[:] = [0] * len(blocks)
        chosen = spec.checkpoint_blocks(model, every)
        assert chosen == [b for i, b in enumerate(blocks, 1) if i % every == 0]
        got_loss, got, saved[every] = loss_and_grads(model, loss)
        expected = [2 if i % every == 0 else 1 for i in range(1, len(blocks) + 1)]
        assert calls == expected, every
        assert got_loss == plain_loss
        for a, b in zip(plain, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert saved[1] < saved[2] < plain_saved
    calls[:] = [0] * len(blocks)
    with torch.no_grad():
        loss()
    assert calls == [1] * len(blocks)
    assert model.state_dict().keys() == tiny_denoiser(name)[1].state_dict().keys()
    clone = copy.deepcopy(model)  # EMA-style copies recompute their own blocks, not the original's
    for block in spec.blocks(clone):
        assert block.forward.__self__ is block and block._plain_forward.__self__ is block
    if name != "sd":  # diffusers' own per-block checkpointing (what --gradient-checkpointing called before
        # --checkpointing) recomputes each block too: same loss, same gradients
        _, theirs = tiny_denoiser(name)
        theirs.enable_gradient_checkpointing()
        their_loss, their_grads, _ = loss_and_grads(theirs, loss_fn(name, spec, theirs))
        assert their_loss == plain_loss
        for a, b in zip(plain, their_grads):
            torch.testing.assert_close(b, a)


def test_checkpointing_flag_values_and_the_deprecated_alias(tmp_path):
    from laionkit.trainer.config import TrainConfig

    def interval(**flags):
        return TrainConfig(latents=tmp_path, output=tmp_path / "run", unet_config="tiny", max_steps=1,
                           **flags).checkpoint_interval()

    assert interval() == 0 and interval(checkpointing="none") == 0
    assert interval(checkpointing="blocks") == 1 and interval(checkpointing="every-3") == 3
    assert interval(gradient_checkpointing=True) == 1
    assert interval(gradient_checkpointing=True, checkpointing="blocks") == 1
    for bad in ("every-0", "every-", "every-x", "3", "all"):
        with pytest.raises(LaionkitError, match="blocks \\(every block\\), every-N"):
            interval(checkpointing=bad)
    with pytest.raises(LaionkitError, match="deprecated.*give only --checkpointing"):
        interval(gradient_checkpointing=True, checkpointing="every-2")


def _graphs(name: str, backend: str, checkpoint: bool, **depth) -> tuple[int, float]:
    """Dynamo graphs compiled for one training step of a regionally compiled tiny transformer, and its loss."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec, model = tiny_denoiser(name, **depth)
    if checkpoint:
        spec.checkpoint_blocks(model, 1)
    spec.compile_blocks(model, dynamic=False, backend=backend)
    value, grads, _ = loss_and_grads(model, loss_fn(name, spec, model))
    return counters["stats"]["unique_graphs"], value, grads


def test_regional_compile_graphs_do_not_grow_with_depth():
    """Flux with 1 double + 2 single blocks and with 3 + 5: the same graphs (one per block kind and input
    layout), with and without checkpointing inside them."""
    for checkpoint in (False, True):
        shallow = _graphs("flux", "eager", checkpoint, num_layers=1, num_single_layers=2)[0]
        deep = _graphs("flux", "eager", checkpoint, num_layers=3, num_single_layers=5)[0]
        assert 0 < shallow == deep <= 3, checkpoint
    assert get_family("sd3").regional_compile and get_family("flux").regional_compile
    assert not get_family("sd").regional_compile


def test_sdxl_compiles_per_block_within_the_recompile_allowance_and_matches_eager():
    """SDXL's --compile is per block (its whole-UNet compile ran past 320 s on an H200): every ResnetBlock2D
    / BasicTransformerBlock compiles, the shapes that differ between blocks of one class (channels, sizes)
    stay within the allowance train sets (one graph per block at most), and loss and gradients equal eager."""
    from torch._dynamo.utils import counters

    spec, model = tiny_denoiser("sdxl")
    assert spec.regional_compile
    generator = torch.Generator().manual_seed(0)
    noisy, target = torch.randn(2, 2, 4, 16, 16, generator=generator)
    cond = {"states": torch.randn(2, 7, model.config.cross_attention_dim, generator=generator),
            "pooled": torch.randn(2, model.config.projection_class_embeddings_input_dim
                                  - 6 * model.config.addition_time_embed_dim, generator=generator),
            "time_ids": torch.tensor([[64.0, 48, 0, 8, 64, 64], [32, 32, 0, 0, 64, 64]])}
    loss = lambda unet: lambda: torch.nn.functional.mse_loss(  # noqa: E731
        spec.predict(unet, noisy, torch.tensor([10, 500]), cond), target)
    want_loss, want, _ = loss_and_grads(model, loss(model))
    torch._dynamo.reset()
    counters.clear()
    blocks = spec.blocks(model)
    with torch._dynamo.config.patch(recompile_limit=len(blocks), fail_on_recompile_limit_hit=True):
        spec.compile_blocks(model, dynamic=False, backend="aot_eager")
        got_loss, got, _ = loss_and_grads(model, loss(model))
    assert 2 <= counters["stats"]["unique_graphs"] <= len(blocks)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_regional_compile_with_checkpointing_matches_eager():
    """SD3 blocks compiled through AOTAutograd (what inductor gets; inductor itself is too slow to compile on
    this CPU for a unit test) with checkpointing inside: the eager loss and gradients within tolerance."""
    spec, model = tiny_denoiser("sd3")
    want_loss, want, _ = loss_and_grads(model, loss_fn("sd3", spec, model))
    graphs, got_loss, got = _graphs("sd3", "aot_eager", True)
    assert graphs >= 1
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def without_validation(flux_run, **changes):
    """flux_run's training (the same batches and losses) without EMA, validation images or validation loss."""
    from laionkit.trainer.config import TrainConfig

    defaults = {f.name: f.default for f in fields(TrainConfig)}
    off = {name: defaults[name] for name in ("ema", "validate_every", "val_latents", "val_every", "val_samples")}
    return replace(flux_run, **{**off, **changes})



def test_train_compile_per_block_with_checkpointing_matches_eager(flux_run, tmp_path, monkeypatch):
    """`train --compile --checkpointing blocks` on Flux compiles each transformer block (never the whole
    model) and trains to the eager run's (flux_run's) losses. The backend is AOTAutograd without inductor's
    codegen (inductor takes minutes per graph on this shared CPU)."""
    from laionkit.trainer.loop import run

    calls = compile_on_cpu(monkeypatch, "aot_eager")
    torch._dynamo.reset()
    # flux_run's first 2 steps (EMA and validation change no training loss)
    run(without_validation(flux_run, output=tmp_path / "compiled", max_steps=2, compile=True, checkpointing="blocks"))
    compiled = [type(getattr(target, "__self__", target)).__name__ for target, _ in calls]
    assert compiled == ["FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxSingleTransformerBlock"]
    want, got = metrics(flux_run.output), metrics(tmp_path / "compiled")
    for step in (1, 2):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), step


def test_flux_train_kill9_resume_matches_an_uninterrupted_run(flux_run, tmp_path):
    """`laionkit train` on Flux (flux_run's flags: from scratch, dynamic shift, EMA, validation images and
    loss) killed with SIGKILL right after its step-3 checkpoint landed, rerun with --resume latest: every
    step's loss, the validation losses and the exported transformer/ and transformer_ema/ equal the
    uninterrupted flux_run's. The killed run checkpoints every other block (--checkpointing every-2), which
    changes no number."""
    run = tmp_path / "run"
    args = ["train", str(flux_run.latents), "--output", str(run), "--val-latents", str(flux_run.val_latents),
            *train_flags(**FLUX_RUN), "--checkpointing", "every-2"]
    assert_kill9_resumes_like(flux_run.output, args, run, kill_at=3, steps=6)


def test_unet_compiles_whole_with_checkpointed_blocks():
    """SD 1.x/2.x keep whole-model --compile: the UNet with every block checkpointed traces as one graph (no
    graph break at the checkpointed blocks) and gives the eager loss and gradients."""
    from torch._dynamo.utils import counters

    spec, model = tiny_denoiser("sd")
    want_loss, want, _ = loss_and_grads(model, loss_fn("sd", spec, model))
    torch._dynamo.reset()
    counters.clear()
    spec.checkpoint_blocks(model, 1)
    compiled = torch.compile(model, dynamic=False, backend="aot_eager")
    got_loss, got, _ = loss_and_grads(model, loss_fn("sd", spec, compiled))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_cli_checkpointing_flags(flux_run, tmp_path, capsys, monkeypatch):
    """A wrong --checkpointing is one line and exit 2; --gradient-checkpointing still trains, as blocks (to
    flux_run's step-1 loss), and says it is deprecated; --help shows the flags with examples."""
    from laionkit.trainer.loop import run

    bad = run_cli("train", flux_run.latents, "--output", tmp_path / "bad", "--transformer-config", "tiny",
                  "--max-steps", "1", "--checkpointing", "every-0", check=False)
    assert bad.returncode == 2 and "--checkpointing 'every-0'" in bad.stderr and "Traceback" not in bad.stderr
    run(without_validation(flux_run, output=tmp_path / "old", max_steps=1, gradient_checkpointing=True))
    said = capsys.readouterr().out
    assert "--gradient-checkpointing is deprecated" in said
    assert "activation checkpointing: 3 of 3 FluxTransformerBlock/FluxSingleTransformerBlock blocks" in said
    loss = metrics(tmp_path / "old")[1]["loss"]
    assert loss > 0 and loss == pytest.approx(metrics(flux_run.output)[1]["loss"], rel=1e-6)
    monkeypatch.setenv("COLUMNS", "200")
    help_text = run_cli("train", "--help").stdout
    assert "--checkpointing" in help_text and "--compile --checkpointing blocks" in help_text


@pytest.mark.parametrize("name", ["sd", "sd3", "flux", "pixart", "sana"])
def test_flops_are_counted_on_a_weightless_copy_and_equal_the_real_count(name, latent_shards, flow_latents,
                                                                          monkeypatch):
    """train's model FLOPs (MFU's numerator) come from a meta-tensor copy of the denoiser, so counting them
    allocates nothing (a real one-sample fp32 step of Flux-12B at 1024 px, before the precision policy,
    ran an H200 out of memory); the count equals the real step's, LoRA adapters included, and leaves the
    model without gradients."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import _weightless, build_unet, count_flops, flops_per_sample
    from laionkit.trainer.objective import resolve_objective

    latents = latent_shards if name == "sd" else flow_latents(name).latents
    data = open_latents(latents)
    config = TrainConfig(latents=latents, output=latents.parent / "unused", unet_config="tiny", max_steps=1)
    model = build_unet(config, data)
    objective = resolve_objective(config, data.family)
    if objective.guidance is not None and not getattr(model.config, "guidance_embeds", False):
        objective = None  # as train: no guidance embedding to feed
    shape = data.bucket_shapes[0]
    # attention as matmuls, counted as on meta tensors and as the flop counter counts a GPU's SDPA kernels
    # (its CPU kernel is not counted at all)
    math = lambda: torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)  # noqa: E731
    with math():
        real = count_flops(model, data, torch.device("cpu"), shape, objective)
    model.zero_grad(set_to_none=True)
    copy_ = _weightless(model)
    assert all(p.is_meta for p in copy_.parameters()) and not any(p.is_meta for p in model.parameters())
    assert count_flops(copy_, data, torch.device("meta"), shape, objective) == real > 0
    assert flops_per_sample(model, data, torch.device("cpu"), shape, objective) == real  # the meta count, no fallback
    assert all(p.grad is None for p in model.parameters())
    if name == "flux":  # LoRA: frozen base, adapters trained; the copy keeps requires_grad as it is
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k"]))
        with math():
            lora_real = count_flops(model, data, torch.device("cpu"), shape, objective)
        assert count_flops(_weightless(model), data, torch.device("meta"), shape, objective) == lora_real < real
        # the same model counted again in this process is not recounted; once adapters changed it, it is
        assert flops_per_sample(model, data, torch.device("cpu"), shape, objective) == lora_real
        from laionkit.trainer import model as model_module

        recounted = []
        monkeypatch.setattr(model_module, "count_flops", lambda *args: recounted.append(args) or count_flops(*args))
        assert flops_per_sample(model, data, torch.device("cpu"), shape, objective) == lora_real
        assert not recounted
        model.requires_grad_(True)  # the base trains again: its weight gradients count
        assert flops_per_sample(model, data, torch.device("cpu"), shape, objective) > lora_real
        assert len(recounted) == 1


def test_flops_of_grouped_convolutions_count_each_group_once():
    """A depthwise convolution's backward costs twice its forward (input and weight gradients), as a dense
    one's does; torch's own formula counted its weight gradient C times over. Sana-1600M's Mix-FFN has one
    per block: one 1024 px sample (32x32 latent, 300 text tokens) counts 3x its forward, near 6 x parameters
    x tokens, where the uncorrected count was 55 TFLOP and train's MFU came out above 1 on an H200."""
    import diffusers

    from laionkit.families.sana import TRANSFORMER_CONFIG_1600M
    from laionkit.trainer.model import flop_counter

    for groups in (1, 4, 64):
        conv = torch.nn.Conv2d(64, 64, 3, padding=1, groups=groups, bias=False)
        image = torch.randn(2, 64, 16, 16, requires_grad=True)
        counter = flop_counter()
        with counter:
            conv(image).sum().backward()
        counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
        forward = 2 * 2 * 16 * 16 * 64 * (64 // groups) * 9  # 2 FLOPs per multiply-add, per output value
        assert counts == {"aten.convolution": forward, "aten.convolution_backward": 2 * forward}, groups

    with torch.device("meta"):
        sana = diffusers.SanaTransformer2DModel(**TRANSFORMER_CONFIG_1600M)
    latent = torch.zeros(1, 32, 32, 32, device="meta")
    text = torch.zeros(1, 300, TRANSFORMER_CONFIG_1600M["caption_channels"], device="meta")
    counter = flop_counter()
    with counter:
        sana(latent, encoder_hidden_states=text, timestep=torch.tensor([500.0], device="meta"),
             encoder_attention_mask=torch.ones(1, 300, dtype=torch.bool, device="meta"),
             return_dict=False)[0].sum().backward()
    parameters = sum(p.numel() for p in sana.parameters())
    assert 0.8 < counter.get_total_flops() / (6 * parameters * 32 * 32) < 1.0  # 8.9 TFLOP (cross-attention: 300 rows)


def test_checkpointing_moves_between_intervals_and_back_to_none():
    """--checkpointing auto tries several intervals on one model: each checkpoint_blocks call leaves exactly
    its blocks checkpointed (the others run plainly again), and every=0 restores the class's own forward."""
    spec, model = tiny_denoiser("flux")
    loss = loss_fn("flux", spec, model)
    blocks = spec.blocks(model)
    plain_loss, plain, plain_saved = loss_and_grads(model, loss)
    for every in (1, 3, 2, 0):
        chosen = spec.checkpoint_blocks(model, every)
        assert chosen == [b for i, b in enumerate(blocks, 1) if every and i % every == 0]
        assert [("_plain_forward" in vars(b)) for b in blocks] == [b in chosen for b in blocks]
        got_loss, got, saved = loss_and_grads(model, loss)
        assert got_loss == plain_loss and (saved < plain_saved) == bool(chosen)
        for a, b in zip(plain, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert all("forward" not in vars(b) for b in blocks)  # the class's forward, as before any checkpointing
