"""How the weights train in low precision: fp32 master weights beside bf16 ones (MasterWeights), full bf16,
the optimizer and LR scaling, and apply_gradients (unscale, clip, step) for every policy."""

from __future__ import annotations

import math

import torch

from laionkit.common import (
    LaionkitError,
)
from laionkit.trainer.config import TrainConfig


def make_optimizer(config: TrainConfig, params, lr: float, device: torch.device):
    if config.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise LaionkitError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay, fused=device.type == "cuda")


class MasterWeights:
    """bf16 weights for forward and backward, fp32 master copies for the optimizer, clipping, EMA,
    checkpoints and export: FSDP2's and DeepSpeed's policy, here for one device and DDP. Against
    autocast over fp32 weights it drops the per-step weight casts and the fp32 GroupNorms autocast
    inserts, which makes the eager step faster and smaller. Compiled, the step measured slower this way
    (inductor fuses bf16 GroupNorms, and the master round trip costs GPU time each step), so ``--compile``
    keeps autocast unless --bf16-weights is given. The numbers: docs/BENCHMARKS.md, train, "SD 1.x / 2.x"
    (and `git log -p docs/BENCHMARKS.md` for the sessions that measured it).

    With --grad-accum on one process, gradients leave the bf16 weights after every micro-batch and add
    up in fp32. Under DDP the micro-batches before the last run in ``no_sync``: their gradients exist on
    one rank only until DDP all-reduces the bf16 ``.grad`` sum at the sync micro-batch, so they stay in
    bf16 until then (see apply_gradients). DDP all-reduces in bf16, as FSDP2 reduce-scatters by default."""

    def __init__(self, accelerator, unet) -> None:
        trained = [(name, p) for name, p in unet.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in trained]
        self.weights = [p for _, p in trained]
        # Parameters (requires_grad) as optimizers and diffusers' EMAModel expect; gradients are set by hand.
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.weights]
        bf16_weights_without_autocast(accelerator, unet)

    @staticmethod
    def wanted(config: TrainConfig, accelerator) -> bool:
        """Only where nothing else owns precision: bf16 on one device or DDP (FSDP and DeepSpeed do it)."""
        chosen = (not config.compile) if config.bf16_weights is None else config.bf16_weights
        return chosen and not config.full_bf16 and _owns_precision(accelerator)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """The micro-batch's bf16 gradients into the fp32 master gradients: one foreach call over all
        parameters instead of one copy per parameter (an SD-1.5 UNet has 686)."""
        fresh, summed = ([], []), ([], [])
        for master, weight in zip(self.master, self.weights):
            if weight.grad is None:
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
                fresh[0].append(master.grad)
                fresh[1].append(weight.grad)
            else:
                summed[0].append(master.grad)
                summed[1].append(weight.grad)
            weight.grad = None
        if fresh[0]:
            torch._foreach_copy_(*fresh)
        if summed[0]:
            torch._foreach_add_(*summed)

    @torch.no_grad()
    def publish(self) -> None:
        """The updated master weights, rounded into the bf16 weights the next forward uses."""
        torch._foreach_copy_(self.weights, self.master)

    def state_dict(self) -> dict:
        return {"master": self.master}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.master, [t.to(self.master[0].device) for t in state["master"]])
        self.publish()


def bf16_weights_without_autocast(accelerator, unet) -> None:
    """The model's weights cast to bf16, and no autocast around its forward (``prepare`` must not add it):
    forward and backward run in the weights' own dtype (MasterWeights, --full-bf16)."""
    from accelerate.utils import AutocastKwargs

    accelerator.autocast_handler = AutocastKwargs(enabled=False)
    torch.nn.Module.to(unet, torch.bfloat16)  # not diffusers' .to, which warns to use from_pretrained


def _owns_precision(accelerator) -> bool:
    """bf16 on one device or DDP: laionkit chooses the precision policy (FSDP and DeepSpeed own theirs)."""
    from accelerate.utils import DistributedType

    return accelerator.mixed_precision == "bf16" and accelerator.distributed_type in (
        DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def full_bf16_policy(config: TrainConfig, accelerator, unet) -> bool:
    """--full-bf16 (kohya's --full_bf16): weights, gradients and AdamW state all in bf16, no fp32 master
    copies and no autocast: 8 bytes per trained parameter instead of 20 (a full-parameter Flux-12B fits one
    H200), and the fastest step (what the bench scripts' bare ceiling runs). Numerically weaker: an update
    under half a bf16 ulp of its weight is lost (|update| < ~0.2 % of |w|), so use it with learning rates
    that move weights by more than that, or for memory. Returns whether the policy applies; it is refused
    (one line) where laionkit does not own the precision: FSDP / DeepSpeed, or no bf16."""
    from accelerate.utils import DistributedType

    if not config.full_bf16:
        return False
    if not _owns_precision(accelerator):
        where = ("FSDP / DeepSpeed set their own precision (their mixed-precision config)"
                 if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
                 else f"mixed precision is {accelerator.mixed_precision!r}")
        raise LaionkitError(f"--full-bf16: {where}; it works with bf16 on one device or DDP")
    bf16_weights_without_autocast(accelerator, unet)
    return True


def apply_gradients(accelerator, unet, optimizer, master: MasterWeights | None, max_grad_norm: float):
    """After a micro-batch's backward: clip and step once per optimizer step (accelerate skips both on
    accumulating micro-steps). Returns the gradient norm of a sync step, else None.

    The master gradients take the bf16 gradients only where those are already what every rank agrees
    on: at the sync micro-batch (DDP has just all-reduced the accumulated ``.grad``), or on every
    micro-batch when there is one process. Moving them earlier under DDP would take each rank's
    ``no_sync`` gradients out of DDP's reach and let the ranks' weights drift apart."""
    if master is not None and (accelerator.sync_gradients or accelerator.num_processes == 1):
        master.accumulate_grads()
    grad_norm = None
    if accelerator.sync_gradients:
        params = master.master if master is not None else unet.parameters()
        grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None and accelerator.sync_gradients:
        master.publish()
    return grad_norm


def scaled_lr(config: TrainConfig, global_batch: int) -> float:
    """diffusers' --scale_lr rule: --lr is per sample and grows with the global batch (linearly or by sqrt)."""
    factor = {"none": 1.0, "linear": global_batch, "sqrt": math.sqrt(global_batch)}[config.scale_lr]
    return config.lr * factor


def rebase_lr(lr_scheduler, optimizer, lr: float) -> float | None:
    """After a resume: the checkpoint restored its own base rate, which --scale-lr computed for the global
    batch it was written with; an elastic resume changes that batch. Every group's rate is scaled to this
    run's ``lr`` (the schedule's position kept: a LambdaLR's rate is base x factor(step)). Returns the
    checkpoint's base rate where it differed, else None."""
    inner = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's AcceleratedScheduler wraps it
    old = inner.base_lrs[0]
    if math.isclose(old, lr, rel_tol=1e-9):
        return None
    factor = lr / old
    inner.base_lrs = [base * factor for base in inner.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]
    return old
