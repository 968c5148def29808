"""`laionkit stats DIR` on filter folders: merged across ranks, each unit counted once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from laionkit.stats import filter_totals

SAMPLE = Path(__file__).resolve().parents[1] / "laionkit" / "data" / "laion-sample.parquet"


@pytest.fixture
def two_rank_run(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    for rank in (0, 1):
        run_cli(
            "filter",
            SAMPLE,
            "--preset",
            "laion-safe",
            "--where",
            "similarity >= 0.3",
            "--unit-rows",
            "250",
            "--output",
            out,
            "--rank",
            rank,
            "--world-size",
            2,
            "-q",
        )
    return out


def test_totals_merge_ranks_and_match_the_data(two_rank_run: Path):
    frame = pq.read_table(SAMPLE).to_pandas()
    totals = filter_totals(two_rank_run)
    kept = frame[(frame.punsafe < 0.5) & (frame.pwatermark < 0.8) & (frame.similarity >= 0.3)]
    assert (totals["units_done"], totals["units_total"]) == (4, 4)
    assert (totals["rows_in"], totals["rows_out"]) == (len(frame), len(kept))
    assert totals["rules"]["punsafe < 0.5"] == {
        "dropped": int((frame.punsafe >= 0.5).sum()),
        "nulls": int(frame.punsafe.isna().sum()),
    }
    assert len(totals["ranks"]) == 2


def test_stale_or_duplicate_stats_are_not_counted_twice(two_rank_run: Path):
    before = filter_totals(two_rank_run)
    # A rank file of the same plan from an earlier world size repeats units; one of another plan is stale.
    stats = json.loads((two_rank_run / "_stats-00000.json").read_text())
    (two_rank_run / "_stats-00002.json").write_text(json.dumps({**stats, "rank": 2, "world_size": 3}))
    (two_rank_run / "_stats-00003.json").write_text(json.dumps({**stats, "plan_id": "0123456789abcdef"}))
    after = filter_totals(two_rank_run)
    assert (after["rows_in"], after["rows_out"], after["rules"]) == (
        before["rows_in"],
        before["rows_out"],
        before["rules"],
    )


def test_cli_summary_says_what_is_missing(two_rank_run: Path, tmp_path: Path):
    result = run_cli("stats", two_rank_run)
    totals = filter_totals(two_rank_run)
    assert f"{totals['rows_out']:,}" in result.stdout and "punsafe < 0.5" in result.stdout
    assert "4 of 4 done (complete)" in result.stdout
    half = tmp_path / "half"
    shutil.copytree(two_rank_run, half)
    for path in half.glob("_stats-00001.json"):
        path.unlink()
    assert "2 of 4 done (INCOMPLETE" in run_cli("stats", half).stdout


def test_a_folder_without_stage_records_is_a_clear_error(tmp_path: Path):
    result = run_cli("stats", tmp_path, check=False)
    assert result.returncode == 2 and "nothing laionkit stats knows" in result.stderr
