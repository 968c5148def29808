"""Rank discovery and the deterministic split every stage shares."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from laionkit.common import LaionkitError, Rank, available_cpus, resolve_rank, split


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, Rank(0, 1, "default")),
        ({"RANK": "3", "WORLD_SIZE": "8"}, Rank(3, 8, "torch")),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}, Rank(1, 4, "slurm")),
        ({"RANK": "2", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, Rank(2, 4, "torch")),
        ({"RANK": "1"}, Rank(0, 1, "default")),  # half a pair is not a pair
    ],
)
def test_rank_from_environment(environ, expected):
    assert resolve_rank(environ=environ) == expected


def test_flags_beat_environment():
    assert resolve_rank(1, 2, environ={"RANK": "5", "WORLD_SIZE": "8"}) == Rank(1, 2, "flags")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 1, "world_size": None}, "both --rank and --world-size"),
        ({"rank": 2, "world_size": 2}, "outside world size"),
        ({"rank": 0, "world_size": 0}, "world size must be >= 1"),
        ({"environ": {"RANK": "x", "WORLD_SIZE": "2"}}, "RANK='x' is not an integer"),
    ],
)
def test_bad_ranks_are_clear_errors(kwargs, match):
    with pytest.raises(LaionkitError, match=match):
        resolve_rank(**kwargs)


@pytest.mark.parametrize("n_units", [0, 1, 5, 17])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_split_covers_every_unit_exactly_once(n_units, world_size):
    units = list(range(n_units))
    parts = [split(units, Rank(r, world_size)) for r in range(world_size)]
    assert sorted(u for part in parts for u in part) == units
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == [split(units, Rank(r, world_size)) for r in range(world_size)]  # deterministic


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_available_cpus_follows_the_affinity_slurm_and_taskset_set():
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
           "from laionkit.common import available_cpus; print(available_cpus())"
    confined = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert confined.stdout.strip() == "1"
    assert available_cpus() == len(os.sched_getaffinity(0))
