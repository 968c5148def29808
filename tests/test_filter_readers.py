"""A filter folder is a dataset other tools read as is: polars.read_parquet(DIR) and
datasets.load_dataset(DIR) see the kept rows and nothing else; older folders (JSON sidecars) still summarise
and resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

from laionkit.filter import read_record, stats_paths
from laionkit.stats import filter_totals

SAMPLE = REPO / "laionkit" / "data" / "laion-sample.parquet"
RULES = ("--where", "punsafe < 0.5", "--where", "WIDTH >= 300", "--unit-rows", "250", "-q")


@pytest.fixture
def filtered(tmp_path: Path) -> Path:
    out = tmp_path / "filtered"
    for rank in (0, 1):
        run_cli("filter", SAMPLE, "--output", out, *RULES, "--rank", str(rank), "--world-size", "2")
    return out


def kept(folder: Path) -> pa.Table:
    parts = sorted(folder.glob("part-*.parquet"), key=lambda p: p.name.split("-")[2])
    return pa.concat_tables(pq.read_table(p) for p in parts)


def test_polars_and_datasets_read_the_folder_as_its_kept_rows(filtered: Path, tmp_path: Path):
    polars = pytest.importorskip("polars")
    datasets = pytest.importorskip("datasets")
    want = sorted(kept(filtered)["URL"].to_pylist())
    assert 0 < len(want) < 1000 and sum(read_record(p)["rows_out"] for p in stats_paths(filtered)) == len(want)
    assert sorted(polars.read_parquet(filtered)["URL"].to_list()) == want
    dataset = datasets.load_dataset(str(filtered), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(dataset["URL"]) == want and set(dataset.column_names) == set(pq.read_schema(SAMPLE).names)
    assert filter_totals(filtered)["rows_out"] == len(want)


def test_a_folder_with_the_older_json_sidecars_is_still_read_and_resumed(filtered: Path, tmp_path: Path):
    old = Path(shutil.copytree(filtered, tmp_path / "old"))
    sidecars = old / "_laionkit"
    (old / "_filter-plan.json").write_text(json.dumps(read_record_at(sidecars / "filter-plan.parquet")))
    for rank in (0, 1):
        record = read_record_at(sidecars / f"filter-stats-0000{rank}.parquet")
        (old / f"_stats-0000{rank}.json").write_text(json.dumps(record))
    shutil.rmtree(sidecars)
    assert filter_totals(old)["rows_out"] == filter_totals(filtered)["rows_out"]
    assert "4 of 4 done (complete)" in run_cli("stats", old).stdout
    for rank in (0, 1):  # a rerun resumes it (same plan) and rewrites its sidecars in the new place
        run_cli("filter", SAMPLE, "--output", old, *RULES, "--rank", str(rank), "--world-size", "2")
    assert not list(old.glob("_*.json")) and (old / "_laionkit" / "filter-plan.parquet").is_file()
    assert kept(old).equals(kept(filtered))


def read_record_at(path: Path) -> dict:
    from laionkit.common.storage import Location

    return read_record(Location.parse(path))
