"""Rank discovery and the deterministic split every stage shares."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laionkit.common import LaionkitError, Rank, available_cpus, resolve_rank, split

REPO = Path(__file__).resolve().parents[1]


def slurm_array(spec: str, task: int, ntasks: int = 1, procid: int = 0) -> dict[str, str]:
    """The variables Slurm sets in an array task submitted with ``sbatch --array=SPEC`` (a range
    ``FIRST-LAST[:STEP]`` or one index), as sbatch(1) documents them; SLURM_PROCID/SLURM_NTASKS are
    those of the batch step (0/1) or of an srun task inside it."""
    first, _, rest = spec.partition("-")
    last, _, step = rest.partition(":") if rest else (first, "", "")
    first_i, last_i, step_i = int(first), int(last), int(step or 1)
    return {
        "SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": str(task),
        "SLURM_ARRAY_TASK_MIN": first, "SLURM_ARRAY_TASK_MAX": last, "SLURM_ARRAY_TASK_STEP": str(step_i),
        "SLURM_ARRAY_TASK_COUNT": str((last_i - first_i) // step_i + 1),
        "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
    }


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


@pytest.mark.parametrize(
    "case, environ, world_size_flag, expected",
    [
        ("whole array 0-31, task 0", slurm_array("0-31", 0), None, Rank(0, 32)),
        ("whole array 0-31, task 17", slurm_array("0-31", 17), None, Rank(17, 32)),
        ("whole array 0-31, task 31", slurm_array("0-31", 31), None, Rank(31, 32)),
        ("array 100-130:10, task 100", slurm_array("100-130:10", 100), None, Rank(0, 4)),
        ("array 100-130:10, task 120", slurm_array("100-130:10", 120), None, Rank(2, 4)),
        ("array 100-130:10, task 130", slurm_array("100-130:10", 130), None, Rank(3, 4)),
        ("resubmit --array=17 --world-size 32", slurm_array("17", 17), 32, Rank(17, 32)),
        ("resubmit --array=0 --world-size 32", slurm_array("0", 0), 32, Rank(0, 32)),
        ("whole array 0-31 given --world-size 32", slurm_array("0-31", 5), 32, Rank(5, 32)),
        ("array 0-3, srun task 1 of 2 in task 2", slurm_array("0-3", 2, ntasks=2, procid=1), None, Rank(5, 8)),
        ("resubmit --array=2, srun task 1 of 2", slurm_array("2", 2, ntasks=2, procid=1), 8, Rank(5, 8)),
        ("plain srun task 3 of 8", {"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, None, Rank(3, 8)),
    ],
)
def test_rank_from_the_variables_slurm_sets(case, environ, world_size_flag, expected):
    got = resolve_rank(world_size=world_size_flag, environ=environ)
    assert (got.rank, got.world_size) == (expected.rank, expected.world_size), case


@pytest.mark.parametrize("spec, ntasks", [("0-31", 1), ("100-130:10", 1), ("7-9", 3)])
def test_the_tasks_of_a_whole_array_cover_every_rank_once(spec, ntasks):
    first, _, rest = spec.partition("-")
    last, _, step = rest.partition(":")
    tasks = range(int(first), int(last) + 1, int(step or 1))
    ranks = [resolve_rank(environ=slurm_array(spec, task, ntasks, procid)) for task in tasks
             for procid in range(ntasks)]
    assert {r.world_size for r in ranks} == {len(tasks) * ntasks}
    assert sorted(r.rank for r in ranks) == list(range(len(tasks) * ntasks))


@pytest.mark.parametrize(
    "environ, world_size_flag, match",
    [
        # a resubmitted task without the original size would silently take the whole input as rank 0 of 1
        (slurm_array("17", 17), None, r"only task of its array .*--array=17.*give --world-size"),
        # --array=1,5,6 is not a range: Slurm's MIN/MAX/STEP/COUNT do not place task 5
        ({**slurm_array("1-6", 5), "SLURM_ARRAY_TASK_COUNT": "3"}, None, "not an evenly spaced range"),
        # task id as rank: an offset array resubmitted with --world-size needs --rank too
        (slurm_array("120", 120), 4, "rank 120 is outside world size 4"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, 32, "--world-size alone only in a Slurm array task"),
    ],
)
def test_slurm_array_mistakes_are_clear_errors(environ, world_size_flag, match):
    with pytest.raises(LaionkitError, match=match):
        resolve_rank(world_size=world_size_flag, environ=environ)


def test_filter_sbatch_whole_array_and_a_resubmitted_task_cover_the_input_once(realdata, tmp_path):
    """The shipped script, run by bash with the variables Slurm sets: array 0-2 where task 1 failed,
    then ``sbatch --array=1 ... --world-size 3``; the parts equal one process's, each unit once."""
    table = pq.read_table(realdata / "laion-sample" / "test_1000.parquet").select(["URL", "TEXT"])
    for name, value in (("WIDTH", 640), ("HEIGHT", 640), ("pwatermark", 0.1), ("AESTHETIC_SCORE", 6.0)):
        table = table.append_column(name, pa.array([value] * table.num_rows))
    source = tmp_path / "in" / "laion.parquet"
    source.parent.mkdir()
    pq.write_table(table, source, row_group_size=100)
    bin_dir = tmp_path / "bin"  # `laionkit` on PATH is this checkout's real CLI
    bin_dir.mkdir()
    (bin_dir / "laionkit").write_text(f'#!/bin/sh\nexec {sys.executable} -m laionkit.cli "$@"\n')
    (bin_dir / "laionkit").chmod(stat.S_IRWXU)

    def sbatch(environ, out, *extra):
        env = {**os.environ, **environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        result = subprocess.run(["bash", REPO / "pipelines/slurm/filter.sbatch", source, out, "--unit-rows",
                                 "100", *extra], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr

    out, reference = tmp_path / "out", tmp_path / "reference"
    sbatch({}, reference)
    sbatch(slurm_array("0-2", 0), out)
    sbatch(slurm_array("0-2", 2), out)
    sbatch(slurm_array("1", 1), out, "--world-size", "3")
    parts = lambda folder: sorted(p.name.split("-")[1:3] for p in folder.glob("part-*.parquet"))  # noqa: E731
    assert sorted(unit for _, unit in parts(out)) == sorted(unit for _, unit in parts(reference))
    assert len(parts(reference)) == 10
    assert len({rank for rank, _ in parts(out)}) == 3  # the resubmit wrote as rank 1, not as rank 0 of 1
    assert sum(pq.read_table(p).num_rows for p in out.glob("part-*.parquet")) == table.num_rows


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
