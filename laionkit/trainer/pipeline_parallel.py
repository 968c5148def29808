"""Pipeline parallelism (`train --pipeline-stages N`) on torch.distributed.pipelining, as torchtitan runs it.

The family's blocks (FamilySpec.blocks) are cut into N contiguous stages (2N under interleaved-1f1b, two per
rank) balanced by each block's measured forward + backward time, the embedders on the first stage and the
final layers on the last (the family's cut, FamilySpec.pipeline_cut). Rank r runs stage r % N of pipeline
replica r // N; the replicas split the data as data-parallel ranks do, and average their stages' gradients.

Why a pipelined run's loss is the single-process run's: every rank of a replica reads the same batches (the
replica is its data rank) and seeds its generator alike, so each rank draws each sample's latent, noise, sigma
and caption dropout exactly as one process draws them (objective.flow_batch, same order); the first stage
takes the noisy latents, the last compares its output with the target. The step's --grad-accum batches are its
micro-batches, and the schedule scales the summed gradients by 1 / micro-batches as accelerate's accumulation
does. The gradient norm is taken over all stages (an all-reduce of the stages' squared norms) before clipping.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laionkit.common import LaionkitError
from laionkit.families import flow
from laionkit.trainer.model import count_flops
from laionkit.trainer.objective import flow_batch

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def data_ranks(config, accelerator) -> tuple[int, int]:
    """(this rank's data rank, the number of data ranks): every rank of one pipeline replica reads the same
    stream and draws the same noise; without pipeline stages, the rank and the world."""
    stages = config.pipeline_stages
    return accelerator.process_index // stages, accelerator.num_processes // stages


def balance(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """``costs`` cut into ``parts`` non-empty contiguous runs [start, end) whose largest sum is the least
    (the slowest stage sets the pipeline's pace); on ties, the earlier cut."""
    count = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best = [[math.inf] * (count + 1) for _ in range(parts + 1)]
    cut = [[0] * (count + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for part in range(1, parts + 1):
        for end in range(part, count + 1):
            for start in range(part - 1, end):
                worst = max(best[part - 1][start], prefix[end] - prefix[start])
                if worst < best[part][end]:
                    best[part][end], cut[part][end] = worst, start
    bounds, end = [], count
    for part in range(parts, 0, -1):
        bounds.append((cut[part][end], end))
        end = cut[part][end]
    return bounds[::-1]


def _keep(captured: dict, index: int, _module, args, kwargs) -> None:
    captured.setdefault(index, (args, kwargs))


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    return value


def _forward_backward(block, args, kwargs) -> None:
    args = tuple(_detached(value) for value in args)
    kwargs = {key: _detached(value) for key, value in kwargs.items()}
    out = block(*args, **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad).backward()


def block_costs(denoiser, data, device, shape, objective) -> list[float]:
    """Seconds of one forward + backward of each block (FamilySpec.blocks) on the inputs it takes in a
    one-sample step of the denoiser (count_flops's, at the first bucket's shape), each timed after a warm-up:
    measured, because blocks of one model differ (Flux's double- and single-stream blocks)."""
    blocks = data.family.blocks(denoiser)
    captured: dict = {}
    hooks = [block.register_forward_pre_hook(partial(_keep, captured, index), with_kwargs=True)
             for index, block in enumerate(blocks)]
    try:
        count_flops(denoiser, data, device, shape, objective)
    finally:
        for hook in hooks:
            hook.remove()
    costs = []
    for index, block in enumerate(blocks):
        args, kwargs = captured[index]
        _forward_backward(block, args, kwargs)  # warm-up: the first call's allocations and kernels
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        _forward_backward(block, args, kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        costs.append(time.perf_counter() - began)
    denoiser.zero_grad(set_to_none=True)
    return costs


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules (``stages``: one, two under interleaved-1f1b)
    with their numbers, the block runs of every stage, the process groups (its replica's pipeline and, with
    several replicas, its stage's replicas), and the busy / wall seconds of the steps since the last record
    (the bubble share). The schedule is made at the first step."""

    config: Any
    stages: nn.ModuleList
    numbers: list[int]
    bounds: list[tuple[int, int]]
    group: Any
    replicas: Any
    last_rank: int  # the global rank of this replica's last stage (its losses)
    first: bool  # this rank holds the first stage: it counts the replica's samples
    schedule: Any = None
    busy: float = 0.0
    wall: float = 0.0
    _trained: list = field(default_factory=list)

    def step(self, trainer, micro: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
        """One optimizer step over the micro-batches ``micro`` ((moments, conditioning) each): the draws of
        each (flow_batch, in order), the schedule's forward and backward, the replicas' gradients averaged,
        clipped by the norm over all stages, the optimizer step. Returns the step's mean loss on every rank."""
        t, cut = trainer, trainer.data.family.cut()
        args, kwargs, targets = [], [], []
        for moments, cond in micro:
            noisy, timestep, cond, latents, noise, sigmas = flow_batch(
                moments, cond, t.empty, t.config, t.data, t.generator, t.objective)
            first, every = cut.inputs(noisy, timestep, t.data.family.conditioning(cond))
            args.append(first)
            kwargs.append(every)
            targets.append(_target(cut.layout(latents), cut.layout(noise), sigmas))
        if self.schedule is None:
            self.schedule = self._schedule(t.device, len(micro), t.objective.weighting)
            self._trained = [p for p in self.stages.parameters() if p.requires_grad]
        losses: list = []
        began = time.perf_counter()
        with t.accelerator.autocast():
            self.schedule.step(arg_mbs=args, kwarg_mbs=kwargs, target_mbs=targets, losses=losses,
                               return_outputs=False)
        self.wall += time.perf_counter() - began
        self._average_replicas()
        t.grad_norm = self._clip(t.config.max_grad_norm)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        loss = sum(loss.detach().float() for loss in losses) / len(micro) if losses else torch.zeros(())
        loss = loss.to(t.device)
        dist.broadcast(loss, self.last_rank, group=self.group)
        return loss

    def _schedule(self, device, microbatches: int, weighting: str):
        from torch.distributed import pipelining

        stages = [pipelining.PipelineStage(module, number, len(self.bounds), device, group=self.group)
                  for number, module in zip(self.numbers, self.stages)]
        for stage in stages:  # busy time: the chunks' compute; the rest of the step waits on neighbours
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name), device))
        kind = getattr(pipelining, SCHEDULES[self.config.pipeline_schedule])
        loss = partial(_loss, weighting=weighting)
        if self.config.pipeline_schedule == "interleaved-1f1b":
            return kind(stages, n_microbatches=microbatches, loss_fn=loss)
        return kind(stages[0], n_microbatches=microbatches, loss_fn=loss)

    def _timed(self, method, device):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            result = method(*args, **kwargs)
            if device.type == "cuda":  # the kernels' time, not their launch
                torch.cuda.synchronize(device)
            self.busy += time.perf_counter() - began
            return result
        return timed

    def _average_replicas(self) -> None:
        if self.replicas is None:
            return
        size = dist.get_world_size(self.replicas)
        for param in self._trained:
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.replicas)
                param.grad.div_(size)

    @property
    def device(self) -> torch.device:
        return next(self.stages.parameters()).device

    def _clip(self, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model: the stages' squared norms summed over the pipeline."""
        grads = [p.grad for p in self._trained if p.grad is not None]
        squared = torch.nn.utils.get_total_norm(grads).float() ** 2 if grads else torch.zeros((), device=self.device)
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self._trained, max_norm or math.inf, total)
        return total

    def record(self, accelerator) -> dict:
        """``pipeline_bubble``: the share of the steps' pipeline time the ranks spent waiting on their
        neighbours rather than computing, averaged over the ranks, since the last record."""
        idle = torch.tensor(1.0 - self.busy / self.wall if self.wall else 0.0, device=accelerator.device)
        self.busy = self.wall = 0.0
        return {"pipeline_bubble": accelerator.reduce(idle, "mean").item()}

    def local_state(self, denoiser) -> dict:
        """The denoiser's tensors this rank's stages hold, by the denoiser's names, on the host."""
        held = {id(tensor) for tensor in self.stages.state_dict(keep_vars=True).values()}
        return {name: tensor.detach().cpu() for name, tensor in denoiser.state_dict(keep_vars=True).items()
                if id(tensor) in held}

    def state(self, trainer) -> dict:
        """This rank's part of a checkpoint: its stages' trained weights (by the denoiser's names) and its
        optimizer's state."""
        trained = {id(p) for p in self.stages.parameters() if p.requires_grad}
        weights = {name: p.detach().cpu() for name, p in trainer.unet.named_parameters() if id(p) in trained}
        return {"weights": weights, "optimizer": trainer.optimizer.state_dict(), "stages": self.bounds}

    def load(self, trainer, folder, ranks: int) -> None:
        """A pipeline checkpoint's part of this rank (``state``), and accelerate's LR schedule and RNG states;
        one line where it was written by another layout of ranks or stages, or for other weights."""
        from laionkit.trainer.checkpoint import load_checkpoint_state, load_tensors

        accelerator = trainer.accelerator
        path = folder / f"pipeline-rank-{accelerator.process_index:05d}.pt"
        if ranks != accelerator.num_processes or not path.is_file():
            raise LaionkitError(f"--resume {folder}: written by {ranks} ranks"
                                f"{'' if path.is_file() else ' without pipeline stages'}; a pipeline run resumes "
                                f"on the same ranks and --pipeline-stages ({accelerator.num_processes} ranks now)")
        load_checkpoint_state(accelerator, folder, {})
        saved = load_tensors(path)
        trained = {id(p) for p in self.stages.parameters() if p.requires_grad}
        named = {name: p for name, p in trainer.unet.named_parameters() if id(p) in trained}
        if [tuple(b) for b in saved["stages"]] != self.bounds or saved["weights"].keys() != named.keys():
            raise LaionkitError(f"--resume {folder}: its stages hold other blocks or weights than this run's "
                                "(another model, --lora-rank or --pipeline-schedule?)")
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(saved["weights"][name])
        trainer.optimizer.load_state_dict(saved["optimizer"])

    def gather(self, accelerator, denoiser) -> None:
        """Rank 0's denoiser takes every stage's weights (before the export, which writes rank 0's): the
        stages merge into the ordinary denoiser."""
        parts = [None] * accelerator.num_processes if accelerator.is_main_process else None
        mine = self.local_state(denoiser) if data_ranks(self.config, accelerator)[0] == 0 else {}
        dist.gather_object(mine, parts, dst=0)
        if accelerator.is_main_process:
            merged = {name: tensor for part in parts for name, tensor in part.items()}
            missing = set(denoiser.state_dict()) - set(merged)
            if missing:
                raise RuntimeError(f"pipeline stages hold no {sorted(missing)[:3]}: the cut missed them")
            denoiser.load_state_dict(merged)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient goes back contiguous."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _Sent(nn.Module):
    """A stage as the schedule runs it: what travels between stages (the activations forward, their
    gradients back) contiguous, as send / recv take them; a family's blocks hand on views (Flux's
    single-stream blocks split one tensor into the image and text streams)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        args = tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                     for a in args)
        out = self.stage(*args, **kwargs)
        return tuple(o.contiguous() for o in out) if isinstance(out, tuple) else out.contiguous()


def _target(latents, noise, sigmas) -> torch.Tensor:
    """What the last stage's loss compares with, as one tensor [B, 2K + 1] (the schedule takes a tensor):
    x0 and noise in the output's layout, flattened, and sigma."""
    return torch.cat([latents.flatten(1), noise.flatten(1), sigmas[:, None].to(latents.dtype)], dim=1)


def _loss(output, target, weighting: str):
    """flow.loss of the last stage's output, from _target's tensor."""
    size = (target.shape[1] - 1) // 2
    latents, noise = target[:, :size].view_as(output), target[:, size:2 * size].view_as(output)
    return flow.loss(output, latents, noise, target[:, -1], weighting)


def _run_costs(config, measure) -> list[float]:
    """The block costs of this run: measured once and kept in RUN/pipeline.json, which a resume reads back (a
    second measurement would differ a little, and so might the stages its checkpoint holds)."""
    import json

    path = config.output / "pipeline.json"
    if config.resume is not None and path.is_file():
        return json.loads(path.read_text())["block_seconds"]
    costs = measure()
    path.write_text(json.dumps({"block_seconds": costs}))
    return costs


def place(denoiser, config, data, schedule, objective, accelerator) -> Pipeline:
    """Cut ``denoiser`` into stages, balanced by block_costs (measured on rank 0, shared), and move this
    rank's stages onto its device; the process groups of the pipelines and their replicas. One line for what
    cannot be cut: another objective than flow matching, several buckets (the stages' shapes are fixed at the
    first step), fewer blocks than stages, ranks not a multiple of the stages."""
    from accelerate.utils import DistributedType, broadcast_object_list

    stages, world, rank = config.pipeline_stages, accelerator.num_processes, accelerator.process_index
    family = data.family
    cut = family.cut()
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise LaionkitError(f"--pipeline-stages under a {accelerator.distributed_type.value} launch: sharding inside "
                            "a stage is not built; launch with train/pipeline.yaml or torchrun")
    if world % stages:
        raise LaionkitError(f"--pipeline-stages {stages}: the launch started {world} ranks, not a multiple of "
                            f"{stages} (each pipeline replica takes {stages})")
    if objective.kind != "flow":
        raise LaionkitError(f"--pipeline-stages: {family.name} trains with the {objective.kind} objective; "
                            "pipeline parallelism is built for flow matching")
    if len(schedule.buckets) > 1:
        raise LaionkitError(f"--pipeline-stages: the latents have {len(schedule.buckets)} buckets; a pipeline's "
                            "stages take one latent shape (encode one resolution)")
    blocks = family.blocks(denoiser)
    total = stages * (2 if config.pipeline_schedule == "interleaved-1f1b" else 1)
    if len(blocks) < total:
        raise LaionkitError(f"--pipeline-stages {stages} --pipeline-schedule {config.pipeline_schedule}: "
                            f"{total} stages, but the denoiser has {len(blocks)} blocks")
    costs = [None]
    if accelerator.is_main_process:
        costs = [_run_costs(config, lambda: block_costs(denoiser, data, next(denoiser.parameters()).device,
                                                        schedule.shapes()[schedule.buckets[0]], objective))]
    costs = broadcast_object_list(costs)[0] if world > 1 else costs[0]
    bounds = balance(costs, total)
    replica, position = divmod(rank, stages)
    group, replicas = None, None
    for first in range(0, world, stages):  # every rank makes every group, in the same order
        made = dist.new_group(list(range(first, first + stages)))
        group = made if first == replica * stages else group
    if world > stages:
        for stage in range(stages):
            made = dist.new_group(list(range(stage, world, stages)))
            replicas = made if stage == position else replicas
    numbers = [number for number in range(total) if number % stages == position]
    modules = nn.ModuleList(_Sent(cut.stage(denoiser, blocks[bounds[n][0]:bounds[n][1]], n == 0, n == total - 1))
                            for n in numbers)
    modules.to(accelerator.device)
    accelerator.print(f"pipeline: {total} stages over {stages} ranks x {world // stages} replicas, blocks "
                      + " | ".join(f"{a}-{b - 1} ({sum(costs[a:b]) * 1e3:.1f} ms)" for a, b in bounds)
                      + " (measured forward + backward, one sample)")
    return Pipeline(config=config, stages=modules, numbers=numbers, bounds=bounds, group=group,
                    replicas=replicas, last_rank=replica * stages + stages - 1, first=position == 0)
