"""`laionkit stats DIR` on filter folders: merged across ranks, each unit counted once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from laionkit.common.storage import Location
from laionkit.filter import SIDECAR_KEY, read_record
from laionkit.stats import filter_totals


def rewrite_record(source: Path, target: Path, record: dict) -> None:
    """A copy of a sidecar (same columns, no row group) holding another record in its footer."""
    schema = pq.read_schema(source)
    with pq.ParquetWriter(target, schema.with_metadata({**(schema.metadata or {}),
                                                         SIDECAR_KEY.encode(): json.dumps(record).encode()})):
        pass

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
    sidecars = two_rank_run / "_laionkit"
    stats = read_record(Location.parse(sidecars / "filter-stats-00000.parquet"))
    rewrite_record(sidecars / "filter-stats-00000.parquet", sidecars / "filter-stats-00002.parquet",
                   {**stats, "rank": 2, "world_size": 3})
    rewrite_record(sidecars / "filter-stats-00000.parquet", sidecars / "filter-stats-00003.parquet",
                   {**stats, "plan_id": "0123456789abcdef"})
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
    for path in half.glob("_laionkit/filter-stats-00001.parquet"):
        path.unlink()
    assert "2 of 4 done (INCOMPLETE" in run_cli("stats", half).stdout


def test_a_folder_without_stage_records_is_a_clear_error(tmp_path: Path):
    result = run_cli("stats", tmp_path, check=False)
    assert result.returncode == 2 and "nothing laionkit stats knows" in result.stderr


def test_corrupt_rank_stats_is_a_one_line_error(two_rank_run: Path):
    (two_rank_run / "_laionkit" / "filter-stats-00001.parquet").write_bytes(b'{"plan_id": ')
    result = run_cli("stats", two_rank_run, check=False)
    assert result.returncode == 2 and "filter-stats-00001.parquet: unreadable" in result.stderr
    assert "Traceback" not in result.stderr


def snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def img2dataset_record(count: int, successes: int) -> dict:
    return {"count": count, "successes": successes, "failed_to_download": count - successes,
            "failed_to_resize": 0, "duration": 1.5, "start_time": 0, "end_time": 1.5,
            "status_dict": {"success": successes, "HTTP Error 404: Not Found": count - successes}}


def test_plain_img2dataset_and_webdataset_folders_are_summarised_read_only(image_shards: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    shutil.copytree(image_shards, plain)
    for path in plain.iterdir():
        if path.suffix != ".tar":
            path.unlink()
    tars = run_cli("stats", plain)
    assert "8" in tars.stdout.split("all")[1]  # 8 real photos over the tars
    for index, (count, successes) in enumerate([(10, 4), (10, 4)]):
        (plain / f"{index:05d}_stats.json").write_text(json.dumps(img2dataset_record(count, successes)))
    before = snapshot(plain)
    plain.chmod(0o555)
    try:
        result = run_cli("stats", plain)
    finally:
        plain.chmod(0o755)
    assert snapshot(plain) == before  # root may write anyway: nothing was written
    assert "40.0%" in result.stdout and "HTTP Error 404" in result.stdout and "Traceback" not in result.stderr


def test_pack_folder_summary_writes_nothing(tmp_path: Path):
    folder = tmp_path / "packed"
    folder.mkdir()
    record = {**img2dataset_record(10, 7), "shard": 0, "tar": "00000.tar", "tar_bytes": 100, "parquet_bytes": 10,
              "failures": {"http 404": 3}, "original_sizes": {"256-511": 7}, "planned_shards": 1,
              "input": {"file": "in.parquet", "rows": [0, 10]}, "options": {}, "versions": {}}
    (folder / "00000_stats.json").write_text(json.dumps(record))
    before = snapshot(folder)
    result = run_cli("stats", folder)
    assert snapshot(folder) == before and "70.0%" in result.stdout and "http 404" in result.stdout


def test_dedup_folders_say_what_each_layer_removed_and_what_was_kept(tmp_path: Path):
    """Before: "nothing laionkit stats knows how to summarise" for dedup's output folder."""
    from test_dedup_layers import FAST, planted

    scores = planted().write(tmp_path / "scored")
    run_cli("dedup", scores, "--output", tmp_path / "dedup", *FAST)
    said = " ".join(run_cli("stats", tmp_path / "dedup").stdout.split())
    for line in ("rows in │ 64", "removed by exact │ 2", "removed by phash │ 4", "removed by semantic │ 3",
                 "kept │ 55 of 64 (85.9%)", "semantic clusters │ 2"):
        assert line in said, said


def test_run_folders_say_their_steps_loss_checkpoints_and_exports(tmp_path: Path):
    """Before: refused. A finished run (tests/data/resume-run), then one killed before it exported anything."""
    run = Path(__file__).parent / "data" / "resume-run"
    said = " ".join(run_cli("stats", run).stdout.split())
    assert "steps │ 2 of 2" in said and "loss │ 1.0842 at step 2 (first 1.1898" in said, said
    assert "checkpoints │ step-00000002" in said and "exported │ lora/" in said
    killed = Path(shutil.copytree(run, tmp_path / "killed"))
    shutil.rmtree(killed / "lora")
    with open(killed / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 3, "lo')  # a line cut by the kill
    said = " ".join(run_cli("stats", killed).stdout.split())
    assert "steps │ 2 of 2" in said and "exported │ nothing yet" in said, said
