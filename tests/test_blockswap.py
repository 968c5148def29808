"""train --block-swap N (laionkit/trainer/blockswap.py): on CPU the swapper's "device" and "host" are both the CPU,
so weights still move between two storages: the same weights as the plain run, at most two swapped blocks off
the host at any moment of forward, backward and checkpointing's recompute, exact resume, one-line refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from fixtures import assert_lora_resumed_like, assert_same_exports

from laionkit.trainer.blockswap import BlockSwap

FAST = ("--batch-size", "2", "--lr", "1e-2", "--log-with", "none", "--quiet", "--workers", "0", "--log-every", "1",
        "--shuffle-buffer", "3", "--export", "none")


class Block(torch.nn.Module):
    """A residual MLP block with two outputs (as Flux's double-stream blocks return two streams)."""

    def __init__(self, width: int, checkpointed: bool) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.checkpointed = checkpointed

    def _plain(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x, skip):
        if self.checkpointed and torch.is_grad_enabled():
            x = torch.utils.checkpoint.checkpoint(self._plain, x, use_reentrant=False)
        else:
            x = self._plain(x)
        return x, skip + x.mean()


class Adapter(torch.nn.Module):
    """A trainable low-rank branch beside a frozen Linear, as a LoRA layer is."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.a = torch.nn.Linear(base.in_features, 2, bias=False)
        self.b = torch.nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


def make_model(lora: bool, checkpointed: bool, count: int = 6, width: int = 8) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(width, checkpointed) for _ in range(count))
    if lora:
        blocks.requires_grad_(False)
        for block in blocks:
            block.up = Adapter(block.up)
            torch.nn.init.normal_(block.up.b.weight)
    return blocks


def step(blocks, x) -> torch.Tensor:
    skip = torch.zeros(())
    for block in blocks:
        x, skip = block(x, skip)
    loss = (x ** 2).mean() + skip
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_swapped_blocks_compute_on_device_copies_at_most_two_at_a_time_with_the_plain_gradients(lora, checkpointed):
    plain, swapped = make_model(lora, checkpointed), make_model(lora, checkpointed)
    count, n = len(swapped), 4
    swap = BlockSwap(list(swapped), n, "cpu", "cpu", trained=not lora)
    swap.install()
    moving = {i: swap.params[i] for i in swap.swapped}
    # The host copies: where the weights are at rest (the swapper writes a full fine-tune's changes back there).
    host = {i: [p.data_ptr() for p in params] for i, params in moving.items()}

    def resident() -> set[int]:
        return {i for i, params in moving.items() if any(p.data_ptr() not in host[i] for p in params)}

    seen = []

    def probe(index: int, where: str):
        def check(*_):
            now = resident()
            assert index in now, f"block {index} computed its {where} on the host copies"
            assert all(p.data_ptr() not in host[index] for p in moving[index]), (index, where)
            seen.append((where, index, len(now)))
        return check

    for index in swap.swapped:  # on an inner layer: checkpointing's recompute calls those, not the block
        swapped[index].down.register_forward_hook(probe(index, "forward"))
        for param in swapped[index].parameters():  # fires inside the block's backward, as its gradient is made
            if param.requires_grad:
                param.register_hook(probe(index, "backward"))
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (plain, swapped)]
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        losses = [step(model, x) for model in (plain, swapped)]
        assert torch.equal(*losses)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():  # a forward without backward (validation) rests as a training step does
            for model in (plain, swapped):
                step_free = torch.zeros(())
                for block in model:
                    _, step_free = block(x, step_free)
    assert {where for where, _, _ in seen} == {"forward", "backward"}
    assert max(most for _, _, most in seen) <= 2, "more than the computing block and one prefetched"
    if checkpointed:  # the recomputed forward ran inside backward, between the block's backward hooks
        assert any(w == "forward" and s[0] == "backward" for (w, *_), s in zip(seen[1:], seen))
    for (name, want), have in zip(plain.named_parameters(), swapped.parameters()):
        assert torch.equal(want, have), name
    # at rest: a full fine-tune's weights all on the device (for the step, EMA, checkpoints); LoRA's on the host
    assert resident() == (set(swap.swapped) if not lora else resident() & {count - 1})


def flux_args(flow_latents, lora: bool) -> tuple:
    flow = flow_latents("flux")
    return (flow.latents, *FAST, "--unet", str(flow.model),
            *(("--lora-rank", "2", "--lora-targets", "to_q,to_k,to_v") if lora else ()))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_block_swap_trains_the_plain_runs_weights(flow_latents, tmp_path, monkeypatch, lora):
    """Flux's tiny transformer (one double- and two single-stream blocks): swapping 2 or all 3 blocks, with and
    without per-block activation checkpointing, gives the weights of the run without swap."""
    from safetensors.torch import load_file

    loads = []
    original = BlockSwap._load
    monkeypatch.setattr(BlockSwap, "_load", lambda self, index, ahead: loads.append(index) or original(
        self, index, ahead))
    latents, *args = flux_args(flow_latents, lora)
    weights = "lora/pytorch_lora_weights.safetensors" if lora else "transformer/diffusion_pytorch_model.safetensors"
    runs = {}
    for name, extra in {"plain": (), "swap2": ("--block-swap", "2"),
                        "swap3-checkpointed": ("--block-swap", "3", "--checkpointing", "blocks")}.items():
        runs[name] = tmp_path / name
        run_cli("train", latents, "--output", runs[name], *args, "--max-steps", "3", "--export", "auto",
                "--checkpoint-at-end" if lora else "--no-checkpoint-at-end", *extra)
        assert bool(loads) == bool(extra), name  # the swap ran (and only where asked)
        loads.clear()
    want = load_file(runs["plain"] / weights)
    for name in ("swap2", "swap3-checkpointed"):
        have = load_file(runs[name] / weights)
        assert want.keys() == have.keys()
        for key in want:
            assert torch.equal(want[key], have[key]), (name, key)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_block_swap_resumes_exactly_with_ema(flow_latents, tmp_path, lora):
    latents, *args = flux_args(flow_latents, lora=lora)
    args = (*args, "--block-swap", "2", "--checkpoint-every", "2", "--ema", "--ema-decay", "0.5",
            "--export", "auto", "--checkpointing", "blocks")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_cli("train", latents, "--output", whole, *args, "--max-steps", "4")
    run_cli("train", latents, "--output", resumed, *args, "--max-steps", "4",
            "--resume", whole / "checkpoints" / "step-00000002")
    if lora:
        assert_lora_resumed_like(whole, resumed, [3, 4])
    else:
        assert_same_exports(whole, resumed)


@pytest.mark.parametrize("flags, message", [
    (("--block-swap", "-1"), "--block-swap -1: must be >= 0"),
    (("--block-swap", "2", "--compile"), "--block-swap 2 with --compile"),
    (("--block-swap", "4"), "--block-swap 4: this flux FluxTransformer2DModel has 3"),
])
def test_block_swap_mistakes_are_one_line(flow_latents, tmp_path, flags, message):
    latents, *args = flux_args(flow_latents, lora=False)
    result = run_cli("train", latents, "--output", tmp_path / "run", *args, "--max-steps", "1", *flags, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_block_swap_is_refused_across_ranks(flow_latents):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from diffusers import FluxTransformer2DModel

    from laionkit.common import LaionkitError
    from laionkit.families import get_family
    from laionkit.trainer.blockswap import check_run

    model = FluxTransformer2DModel.from_pretrained(flow_latents("flux").model, subfolder="transformer")
    ranks = SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU)
    with pytest.raises(LaionkitError, match="--block-swap 1 moves weights between one GPU and its host"):
        check_run(SimpleNamespace(block_swap=1), get_family("flux"), model, ranks)
