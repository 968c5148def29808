"""`--checkpointing auto`: checkpoint the fewest blocks that let the run's batch fit in GPU memory.

Activation checkpointing trades compute (about a third more per checkpointed block) for activation memory,
so the fastest configuration that fits checkpoints as few blocks as it can. Which number fits depends on
the GPU, the batch, the largest bucket, the precision policy and compile, so it is measured, not guessed:
after the model, its precision policy and optimizer are built, every rank runs forward and backward of one
batch of the largest bucket's shape (the run's own loss function, a throwaway generator, no optimizer
step, no gradient sync) under a few candidate intervals, and takes the first that fits. A candidate fits
when its peak memory plus the optimizer state that its first step will allocate (AdamW's two moments and
the fp32 master gradients: counted from the trained parameters, since no step has run yet) stays under
``MEMORY_SHARE`` of the device's memory on every rank. Checkpointing does not change losses or gradients
(non-reentrant checkpoint restores the RNG), so the choice changes speed and memory only: the run's data,
noise and weights are the same whatever it picks, and a resume may pick again.

Order of the trials: none; if that does not fit, every block; between the two, the interval that a line
through the two peaks (memory falls by about the same amount per checkpointed block) says fits, then
denser ones until one does. If every block checkpointed does not fit either, the run stops with a one-line
error that says by how much. The choice and every trial are written to RUN/checkpointing.json.

One GPU or DDP only: under FSDP / DeepSpeed the memory of a step depends on sharding and offload that
this trial does not model, so auto is refused there. Without CUDA there is no device memory to measure and
auto means none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from laionkit.common import LaionkitError
from laionkit.trainer.latent_stream import SIZE_FIELDS
from laionkit.trainer.wrappers import unwrap

MEMORY_SHARE = 0.92  # of the device's memory: headroom for the allocator's fragmentation and NCCL buffers
INTERVALS = (0, 8, 4, 3, 2, 1)  # candidate --checkpointing every-N intervals; 0 none, 1 every block


def interval_name(interval: int) -> str:
    return {0: "none", 1: "blocks"}.get(interval, f"every-{interval}")


def checked_count(blocks: int, interval: int) -> int:
    """Blocks that ``every-interval`` checkpoints out of ``blocks`` (the N-th, 2N-th, ...)."""
    return 0 if interval == 0 else blocks // interval


@dataclass
class Trial:
    interval: int
    peak: float | None  # bytes at the peak of forward + backward (max over ranks); None: out of memory

    def record(self, extra: float, budget: float) -> dict:
        fits = self.peak is not None and self.peak + extra <= budget
        return {"checkpointing": interval_name(self.interval), "fits": fits,
                "out_of_memory": self.peak is None,
                "peak_gib": None if self.peak is None else round(self.peak / 2**30, 3)}


def choose_interval(measure: Callable[[int], float | None], blocks: int, extra: float,
                    budget: float) -> tuple[int, list[Trial]]:
    """The candidate interval (``INTERVALS``, fewest checkpointed blocks first) with the fewest
    checkpointed blocks whose measured peak + ``extra`` fits ``budget``, and the trials it ran.
    ``measure(interval)`` is one forward + backward's peak in bytes, or None when it ran out of memory.
    Raises LaionkitError when not even every block checkpointed fits."""
    candidates = sorted({i for i in INTERVALS if i <= blocks}, key=lambda i: checked_count(blocks, i))
    trials: dict[int, Trial] = {}

    def fits(interval: int) -> bool:
        if interval not in trials:
            trials[interval] = Trial(interval, measure(interval))
        peak = trials[interval].peak
        return peak is not None and peak + extra <= budget

    def done(interval: int) -> tuple[int, list[Trial]]:
        return interval, list(trials.values())

    if fits(0):
        return done(0)
    if not fits(1):
        peak = trials[1].peak
        need = "more than the device has" if peak is None else f"{(peak + extra) / 2**30:.1f} GiB"
        raise LaionkitError(
            f"--checkpointing auto: the batch does not fit even with every block checkpointed ({need}, "
            f"of {budget / 2**30:.1f} GiB usable): lower --batch-size, or add --full-bf16, --lora-rank, "
            "or shard with FSDP (train/fsdp.yaml)")
    none, every = trials[0].peak, trials[1].peak
    between = candidates[1:-1]
    start = 0
    if none is not None and blocks and none > every:  # a line through the two: memory per checkpointed block
        per_block = (none - every) / blocks
        needed = math.ceil((none + extra - budget) / per_block)
        start = next((n for n, i in enumerate(between) if checked_count(blocks, i) >= needed), len(between))
    for interval in between[start:]:
        if fits(interval):
            return done(interval)
    return done(1)


def optimizer_state_bytes(trainer) -> float:
    """Bytes the first optimizer step allocates: AdamW's two moments per trained parameter not yet in the
    optimizer's state (8-bit AdamW: one byte each), and the fp32 master gradients (MasterWeights)."""
    t = trainer
    moments = 2 if t.config.optimizer == "adamw8bit" else None
    total = 0.0
    for p in t.trained:
        if t.optimizer.state.get(p):  # resumed state is loaded after this: a fresh optimizer has none
            continue
        total += p.numel() * (moments if moments is not None else 2 * p.element_size())
        if t.master is not None and p.grad is None:
            total += p.numel() * p.element_size()
    return total


def dummy_batch(trainer, shape: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
    """``--batch-size`` samples of moments ``shape`` and the empty caption's conditioning, as a batch of
    stored text gives them to the loss (random values: the step's memory does not depend on them)."""
    t, batch = trainer, trainer.config.batch_size
    channels, height, width = shape
    generator = torch.Generator(t.device).manual_seed(0)
    moments = torch.randn(batch, channels, height, width, device=t.device, generator=generator)
    if not t.data.deterministic:  # a deterministic VAE's moments are the latent alone
        moments[:, channels // 2:] = -30.0  # a sharp posterior: log-variance -30
    cond = {key: value.expand(batch, *value.shape).contiguous() for key, value in t.empty.items()}
    cond.update({name: torch.tensor([[height * 8, width * 8]] * batch, device=t.device) for name in SIZE_FIELDS})
    return moments, cond


def measure_peak(trainer, shape: tuple[int, ...], interval: int) -> float | None:
    """Peak bytes of one forward + backward at ``interval`` (max over ranks), None where a rank ran out
    of memory. No gradient sync, no optimizer step; the gradients are dropped after."""
    from laionkit.trainer.objective import diffusion_loss, flow_loss, guidance_input

    t = trainer
    t.data.family.checkpoint_blocks(unwrap(t.accelerator, t.unet), interval)
    moments, cond = dummy_batch(t, shape)
    cond = guidance_input(t.objective, cond, moments.shape[0], t.device)
    generator = torch.Generator(t.device).manual_seed(0)  # the run's own generator is left untouched
    torch.cuda.synchronize(t.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(t.device)
    peak = torch.zeros((), device=t.device)
    try:
        with t.accelerator.no_sync(t.unet):
            if t.noise_scheduler is None:
                loss = flow_loss(t.model, moments, cond, t.empty, t.config, t.data, generator, t.objective)
            else:
                loss = diffusion_loss(t.model, moments, cond, t.empty, t.noise_scheduler, t.config, t.data, generator)
            t.accelerator.backward(loss)
        torch.cuda.synchronize(t.device)
        peak.fill_(torch.cuda.max_memory_allocated(t.device))
    except torch.cuda.OutOfMemoryError:
        peak.fill_(-1.0)
    loss = None
    t.unet.zero_grad(set_to_none=True)
    t.optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    low, high = t.accelerator.reduce(peak.clone(), "min"), t.accelerator.reduce(peak, "max")
    return None if low.item() < 0 else float(high.item())


def device_memory(config, device: torch.device) -> int:
    """Bytes this process may use on its GPU: the device's memory, or --gpu-memory-gib where that is less."""
    total = torch.cuda.get_device_properties(device).total_memory
    return min(total, int(config.gpu_memory_gib * 2**30)) if config.gpu_memory_gib else total


def cap_gpu_memory(config, accelerator) -> None:
    """--gpu-memory-gib: PyTorch's allocator on this rank's GPU stops at G GiB and raises out of memory past
    it, so a larger GPU answers what trains on a smaller one (what runs outside the allocator, the CUDA
    context, is not counted). Without CUDA there is nothing to cap: a line says it is ignored, so a plan
    or recipe written for a GPU still runs on a CPU smoke test. A cap above the GPU's memory is refused."""
    gib = config.gpu_memory_gib
    if gib is None:
        return
    if accelerator.device.type != "cuda":
        accelerator.print(f"--gpu-memory-gib {gib:g}: no CUDA device, nothing to cap (ignored)")
        return
    total = torch.cuda.get_device_properties(accelerator.device).total_memory
    if gib * 2**30 > total:
        raise LaionkitError(f"--gpu-memory-gib {gib:g}: this GPU has {total / 2**30:.1f} GiB; give less, or leave "
                            "the flag out to use all of it")
    index = accelerator.device.index  # one process on one GPU: Accelerate's device is "cuda", without one
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total,
                                               torch.cuda.current_device() if index is None else index)
    accelerator.print(f"--gpu-memory-gib {gib:g}: {gib * 2**30 / total:.3f} of this GPU's {total / 2**30:.1f} GiB")


def auto_checkpointing(trainer) -> dict:
    """Choose and apply --checkpointing auto's interval on ``trainer``'s denoiser; the record written to
    RUN/checkpointing.json (main process)."""
    from accelerate.utils import DistributedType

    t = trainer
    if t.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise LaionkitError("--checkpointing auto measures one GPU or DDP; under FSDP / DeepSpeed give "
                            "--checkpointing blocks, every-N or none")
    blocks = len(t.data.family.blocks(unwrap(t.accelerator, t.unet)))
    shapes = t.schedule.shapes()
    shape = max(shapes.values(), key=lambda s: math.prod(s))  # the largest bucket: the step's worst memory
    if t.device.type != "cuda":
        record = {"chosen": "none", "reason": "no CUDA device to measure", "trials": []}
    else:
        if t.config.compile:  # each trial's forward is traced again (the blocks' forward changed): allow it
            dynamo = torch._dynamo.config
            dynamo.recompile_limit *= len(INTERVALS) + 1
            dynamo.accumulated_recompile_limit *= len(INTERVALS) + 1
        total = device_memory(t.config, t.device)
        budget, extra = MEMORY_SHARE * total, optimizer_state_bytes(t)
        interval, trials = choose_interval(lambda i: measure_peak(t, shape, i), blocks, extra, budget)
        t.data.family.checkpoint_blocks(unwrap(t.accelerator, t.unet), interval)
        torch.cuda.reset_peak_memory_stats(t.device)
        record = {"chosen": interval_name(interval), "blocks": blocks,
                  "checkpointed": checked_count(blocks, interval), "batch_size": t.config.batch_size,
                  "shape": list(shape), "budget_gib": round(budget / 2**30, 3),
                  "optimizer_state_gib": round(extra / 2**30, 3),
                  "trials": [trial.record(extra, budget) for trial in trials]}
    t.accelerator.print(f"--checkpointing auto: {record['chosen']} "
                        f"({json.dumps(record['trials'])})" if record["trials"] else
                        f"--checkpointing auto: none ({record['reason']})")
    if t.accelerator.is_main_process:
        path = t.config.output / "checkpointing.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
    return record
