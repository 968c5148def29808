"""laionkit filter --dedup: hash-partitioned to disk, exact with several ranks, exact after kill -9."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from laionkit.filter import PART_NAME, read_record, stats_paths

# 1350 rows in 3 files -> 14 units of >= 100 rows, 14 buckets of ~100 rows.
ARGS = ("--dedup", "URL", "--where", "WIDTH >= 200", "--unit-rows", "100", "--dedup-bucket-rows", "100", "-q")


@pytest.fixture
def inputs(realdata: Path, tmp_path: Path) -> Path:
    return write_inputs(realdata, tmp_path / "in")


def write_inputs(realdata: Path, folder: Path) -> Path:
    """Real LAION URLs repeated within and across three files, with null URLs and a rule on WIDTH."""
    urls = pq.read_table(realdata / "laion-sample" / "test_1000.parquet").column("URL")
    rng = np.random.default_rng(0)
    folder.mkdir()
    picks = {"a": rng.integers(0, 400, 450), "b": rng.integers(300, 700, 450), "c": rng.integers(0, 1000, 450)}
    for name, rows in picks.items():
        url = urls.take(pa.array(rows)).to_pylist()
        for i in range(0, len(url), 37):
            url[i] = None
        table = pa.table({"URL": url, "WIDTH": rng.integers(100, 600, len(rows)), "row": rows})
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=50)
    return folder


def expected(folder: Path) -> pa.Table:
    """The rule --dedup has always had: rows passing the rules, in file then row order, non-null value,
    the value's first such row kept."""
    table = pa.concat_tables(pq.read_table(path) for path in sorted(folder.glob("*.parquet")))
    seen, keep = set(), []
    for i, (url, width) in enumerate(zip(table.column("URL").to_pylist(), table.column("WIDTH").to_pylist())):
        if width >= 200 and url is not None and url not in seen:
            seen.add(url)
            keep.append(i)
    return table.take(pa.array(keep, pa.int64()))


def parts(out: Path) -> pa.Table:
    """Parts in unit order (whichever rank wrote them); only the names a stage reads."""
    found = sorted(out.glob("part-*.parquet"), key=lambda p: int(PART_NAME.match(p.name).group(2)))
    return pa.concat_tables(pq.read_table(p) for p in found)


def dedup_counts(out: Path) -> tuple[int, int]:
    stats = [read_record(p) for p in stats_paths(out)]
    return (sum(s["rules"]["dedup(URL)"]["dropped"] for s in stats), sum(s["rows_out"] for s in stats))


def launch(folder: Path, out: Path, rank: int, world: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "laionkit.cli", "filter", str(folder), "--output", str(out), *ARGS,
         "--rank", str(rank), "--world-size", str(world), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_dedup_keeps_each_values_first_passing_row_and_counts_the_rest(inputs: Path, tmp_path: Path):
    out = tmp_path / "out"
    run_cli("filter", inputs, "--output", out, *ARGS)
    want = expected(inputs)
    assert 0 < want.num_rows < 1350 // 2  # duplicates within and across files, nulls, rule drops
    assert parts(out).to_pylist() == want.to_pylist()
    passing = sum(1 for row in pa.concat_tables(pq.read_table(p) for p in sorted(inputs.glob("*.parquet"))).to_pylist()
                  if row["WIDTH"] >= 200 and row["URL"] is not None)
    assert dedup_counts(out) == (passing - want.num_rows, want.num_rows)
    assert not list(out.glob(".dedup-*"))  # scratch removed once every part exists


def test_two_concurrent_ranks_write_what_one_rank_writes(inputs: Path, tmp_path: Path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli("filter", inputs, "--output", one, *ARGS)
    ranks = [launch(inputs, two, rank, 2) for rank in (0, 1)]
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    assert parts(two).to_pylist() == parts(one).to_pylist() == expected(inputs).to_pylist()
    assert {p.name[5:10] for p in two.glob("part-*")} == {"00000", "00001"}  # both ranks wrote parts
    assert dedup_counts(two) == dedup_counts(one)


def test_a_rank_alone_waits_then_names_the_missing_ranks_and_keeps_its_work(inputs: Path, tmp_path: Path):
    out = tmp_path / "out"
    result = run_cli("filter", inputs, "--output", out, *ARGS, "--rank", "0", "--world-size", "3",
                     "--dedup-wait", "0.5", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ranks 1, 2 of 3" in result.stderr and "--dedup-wait" in result.stderr
    [scratch] = out.glob(".dedup-*")
    keys = sorted(p.name for p in scratch.glob("keys-*"))
    assert keys == [f"keys-{i:06d}" for i in range(0, 14, 3)]  # rank 0's units, partitioned, kept
    # Bounded memory: each unit's keys are split over the buckets, none holding more than a few of its rows.
    sizes = [pq.read_metadata(p).num_rows for p in scratch.glob("keys-*/bucket=*/*.parquet")]
    assert len({p.parent.name for p in scratch.glob("keys-*/bucket=*/*")}) == 14 and max(sizes) <= 30
    # The other ranks come later; rank 0 resumes from its phase-1 output: same result as one rank.
    ranks = [launch(inputs, out, rank, 3) for rank in (0, 1, 2)]
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    assert parts(out).to_pylist() == expected(inputs).to_pylist()


@pytest.mark.parametrize("marker", ["keys-*", "drop-*", "part-*"])
def test_kill_9_in_each_phase_then_rerun_gives_the_same_output(inputs: Path, tmp_path: Path, marker: str):
    out = tmp_path / "out"
    process = launch(inputs, out, 0, 1)
    deadline = time.monotonic() + 120
    while not (list(out.glob(f".dedup-*/{marker}")) + list(out.glob(marker))) and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)  # the phase has written at least one output, maybe more
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    run_cli("filter", inputs, "--output", out, *ARGS)
    assert parts(out).to_pylist() == expected(inputs).to_pylist()
    assert dedup_counts(out)[1] == expected(inputs).num_rows


def test_an_unreadable_unit_is_an_error_or_a_counted_skip_left_out_of_the_dedup(inputs: Path, tmp_path: Path):
    b = inputs / "b.parquet"
    pq.write_table(pq.read_table(b), b, row_group_size=50, compression="zstd")
    page = pq.read_metadata(b).row_group(4).column(0).data_page_offset + 40  # URL of rows 200-249
    data = bytearray(b.read_bytes())
    data[page : page + 200] = b"\xff" * 200
    b.write_bytes(bytes(data))
    result = run_cli("filter", inputs, "--output", tmp_path / "out", *ARGS, check=False)
    assert result.returncode == 2 and "b.parquet: cannot read row groups 4-5" in result.stderr
    assert "Traceback" not in result.stderr
    run_cli("filter", inputs, "--output", tmp_path / "out", *ARGS, "--skip-bad")
    [stats] = [read_record(p) for p in stats_paths(tmp_path / "out")]
    assert [(u["input"].endswith("b.parquet"), u["rows"]) for u in stats["bad_units"]] == [(True, 100)]
    readable = tmp_path / "readable"
    readable.mkdir()
    for path in sorted(inputs.glob("*.parquet")):
        table = pq.read_table(path) if path != b else pa.concat_tables(
            [pq.ParquetFile(b).read_row_groups([g]) for g in range(9) if g not in (4, 5)])
        pq.write_table(table, readable / path.name)
    assert parts(tmp_path / "out").to_pylist() == expected(readable).to_pylist()
