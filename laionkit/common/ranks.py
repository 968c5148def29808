"""Which slice of the work this process owns: rank discovery and deterministic splitting.

Every stage splits an ordered list of work units (parquet row groups, tar shards) the same way, so
any number of processes started by torchrun, accelerate, Slurm or by hand cover the input exactly
once with no coordinator. Invariant: for every world size W, the union over r < W of
``split(units, Rank(r, W))`` is ``units``, and the slices are pairwise disjoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from laionkit.common.errors import LaionkitError

T = TypeVar("T")

# Checked in order; the first pair present wins. torchrun and accelerate both export RANK/WORLD_SIZE.
ENV_SOURCES = (
    ("torch", "RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
)


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


def resolve_rank(
    rank: int | None = None, world_size: int | None = None, environ: Mapping[str, str] | None = None
) -> Rank:
    """Flags beat the environment; a half-given pair of flags is refused rather than guessed."""
    if (rank is None) != (world_size is None):
        raise LaionkitError("give both --rank and --world-size, or neither")
    if rank is not None and world_size is not None:
        return Rank(rank, world_size, "flags")
    env = os.environ if environ is None else environ
    for source, rank_var, world_var in ENV_SOURCES:
        if rank_var in env and world_var in env:
            return Rank(_parse_int(env[rank_var], rank_var), _parse_int(env[world_var], world_var), source)
    return Rank()


def split(units: Sequence[T], rank: Rank) -> list[T]:
    """Round-robin: unit i belongs to rank i % world_size, which balances sizes sorted by input order."""
    return list(units[rank.rank :: rank.world_size])
