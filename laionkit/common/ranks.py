"""Which slice of the work this process owns: rank discovery and deterministic splitting.

Every stage splits an ordered list of work units (parquet row groups, tar shards) the same way, so
any number of processes started by torchrun, accelerate, Slurm or by hand cover the input exactly
once with no coordinator. Invariant: for every world size W, the union over r < W of
``split(units, Rank(r, W))`` is ``units``, and the slices are pairwise disjoint.

Where the rank comes from, first match wins: --rank/--world-size; RANK/WORLD_SIZE (torchrun,
accelerate); a Slurm array task's SLURM_ARRAY_TASK_* (see _slurm_array_rank); SLURM_PROCID/SLURM_NTASKS
(srun tasks); else rank 0 of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from laionkit.common.errors import LaionkitError

T = TypeVar("T")

def available_cpus() -> int:
    """CPUs this process may run on (its affinity: what Slurm's --cpus-per-task or taskset allow), not the
    machine's count, so per-rank thread pools do not oversubscribe a shared node."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world_size: int = 1
    source: str = "default"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaionkitError(f"world size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise LaionkitError(
                f"rank {self.rank} is outside world size {self.world_size} (from {self.source})"
            )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _parse_int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LaionkitError(f"environment variable {name}={value!r} is not an integer") from None


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env:
        if default is None:
            raise LaionkitError(f"environment variable {name} is not set (a Slurm array task sets it)")
        return default
    return _parse_int(env[name], name)


def _slurm_array_rank(env: Mapping[str, str], world_size: int | None) -> Rank:
    """A Slurm array task's rank. Array tasks are separate jobs, so the array variables, not
    SLURM_PROCID/SLURM_NTASKS (0/1 in every task), say which slice is whose.

    Whole array (no flags): rank = (ID - MIN) / STEP of COUNT, so 0-31 and 100-130:10 both work.
    A task resubmitted alone (``--array=17``) has MIN = MAX = ID and COUNT = 1, which says nothing about
    the original array; it must be given the original ``--world-size N``, and then the task id *is* the
    rank. A one-task array without it is refused, not run as rank 0 of 1 (the whole input).
    Several srun tasks inside one array task (``--ntasks``) split that task's slice further:
    rank = array_rank * SLURM_NTASKS + SLURM_PROCID, world = arrays * SLURM_NTASKS.
    """
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    ntasks = _env_int(env, "SLURM_NTASKS", 1)
    procid = _env_int(env, "SLURM_PROCID", 0)
    if world_size is not None:
        return Rank(task * ntasks + procid, world_size, f"slurm array task {task}, --world-size")
    count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    if count == 1:
        raise LaionkitError(
            f"Slurm array task {task} is the only task of its array (a resubmit like --array={task}): "
            "give --world-size N, the number of ranks of the original array, and the task id is the rank"
        )
    first = _env_int(env, "SLURM_ARRAY_TASK_MIN")
    last = _env_int(env, "SLURM_ARRAY_TASK_MAX")
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP", 1)
    if step < 1 or last != first + step * (count - 1) or (task - first) % step:
        raise LaionkitError(
            f"Slurm array {first}-{last} with step {step} and {count} tasks is not an evenly spaced range: "
            "give --world-size N of the original array, and the task id is the rank"
        )
    array_rank = (task - first) // step
    return Rank(array_rank * ntasks + procid, count * ntasks, f"slurm array task {task}")


def resolve_rank(
    rank: int | None = None, world_size: int | None = None, environ: Mapping[str, str] | None = None
) -> Rank:
    """Flags beat the environment; a half-given pair of flags is refused rather than guessed, except
    ``--world-size`` alone in a Slurm array task (a resubmitted task keeps its id as its rank)."""
    env = os.environ if environ is None else environ
    in_array = "SLURM_ARRAY_TASK_ID" in env
    if rank is not None and world_size is not None:
        return Rank(rank, world_size, "flags")
    if rank is not None or (world_size is not None and not in_array):
        raise LaionkitError(
            "give both --rank and --world-size, or neither (--world-size alone only in a Slurm array task)"
        )
    if "RANK" in env and "WORLD_SIZE" in env and world_size is None:
        return Rank(_parse_int(env["RANK"], "RANK"), _parse_int(env["WORLD_SIZE"], "WORLD_SIZE"), "torch")
    if in_array:
        return _slurm_array_rank(env, world_size)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return Rank(_env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_NTASKS"), "slurm")
    return Rank()


def split(units: Sequence[T], rank: Rank) -> list[T]:
    """Round-robin: unit i belongs to rank i % world_size, which balances sizes sorted by input order."""
    return list(units[rank.rank :: rank.world_size])


def stage_device(device: str | None, rank: Rank):
    """The torch device a GPU stage (encode, score, caption) runs on: ``--device`` when given, else this
    process's GPU (LOCAL_RANK from torchrun / accelerate, else the rank modulo the GPUs), else the CPU."""
    import torch

    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank.rank % torch.cuda.device_count())))
    return torch.device("cpu")


def check_local_gpus(env: Mapping[str, str] = os.environ) -> None:
    """A launch of more processes on this machine than it has GPUs (a process count written for another
    machine) stops in one line naming the flag, before every extra rank fails on a GPU that is not there
    (CUDA's 'invalid device ordinal'). CPU ranks (no GPU visible) are not counted: gloo runs any number."""
    import torch

    local = env.get("LOCAL_WORLD_SIZE")
    if local is None or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if _parse_int(local, "LOCAL_WORLD_SIZE") > gpus:
        raise LaionkitError(f"the launcher started {local} processes on this machine, which has {gpus} GPU(s): "
                            f"start one per GPU (accelerate launch --num_processes {gpus} on one machine, the GPUs "
                            f"of all machines on several; torchrun --nproc-per-node {gpus})")
