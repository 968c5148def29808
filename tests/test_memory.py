"""--checkpointing auto (laionkit/trainer/memory.py): the fewest checkpointed blocks that fit, from measured peaks."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from laionkit.common import LaionkitError
from laionkit.trainer.memory import INTERVALS, checked_count, choose_interval

GIB = 2**30


def linear_memory(blocks: int, fixed: float, per_block: float, oom_above: float = float("inf")):
    """Peaks as activation checkpointing gives them: each checkpointed block frees about the same memory.
    Returns measure(interval) and the list of intervals it was asked for."""
    asked = []

    def measure(interval):
        asked.append(interval)
        peak = fixed + per_block * (blocks - checked_count(blocks, interval))
        return None if peak > oom_above else peak

    return measure, asked


@pytest.mark.parametrize("blocks", (2, 16, 57))
@pytest.mark.parametrize("budget", (30, 60, 90, 110, 200))
def test_auto_picks_the_fewest_checkpointed_blocks_that_fit(blocks, budget):
    fixed, per_block, extra = 20 * GIB, 80 * GIB / blocks, 5 * GIB
    measure, asked = linear_memory(blocks, fixed, per_block)
    candidates = [i for i in INTERVALS if i <= blocks]
    fitting = [i for i in candidates if fixed + per_block * (blocks - checked_count(blocks, i)) + extra <= budget * GIB]
    if not fitting:
        with pytest.raises(LaionkitError, match="does not fit even with every block checkpointed.*--batch-size"):
            choose_interval(measure, blocks, extra, budget * GIB)
        return
    chosen, trials = choose_interval(measure, blocks, extra, budget * GIB)
    assert chosen == min(fitting, key=lambda i: checked_count(blocks, i))
    assert [t.interval for t in trials] == asked and len(asked) == len(set(asked))  # each measured once
    assert len(asked) <= 3  # none, blocks, and the interval the line through them names


def test_auto_walks_up_from_an_out_of_memory_none():
    """With no peak for 'none' (it ran out of memory) there is no line to follow: the candidates are tried
    from the fewest checkpointed blocks up, and the first that fits is taken."""
    measure, asked = linear_memory(16, 20 * GIB, 5 * GIB, oom_above=90 * GIB)
    chosen, trials = choose_interval(measure, 16, 0, 85 * GIB)
    assert chosen == 4 and asked == [0, 1, 8, 4]  # every-8: 20 + 5*14 = 90 > 85; every-4: 80 fits
    assert trials[0].peak is None and trials[0].record(0, 85 * GIB)["out_of_memory"]


def test_train_auto_on_cpu_records_none(tiny_models, latent_shards, tmp_path):
    """Without CUDA there is no device memory to measure: auto trains as none and says so in the run."""
    run = tmp_path / "run"
    result = run_cli("train", latent_shards, "--output", run, "--unet-config", "tiny", "--max-steps", 2,
                     "--batch-size", 2, "--workers", 0, "--checkpointing", "auto", "--log-with", "none", "--quiet")
    record = json.loads((run / "checkpointing.json").read_text())
    assert record["chosen"] == "none" and record["trials"] == []
    assert "--checkpointing auto: none (no CUDA device to measure)" in result.stdout
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 1
