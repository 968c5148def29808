"""Quantile rules (--top) and the COYO-700M / DataComp presets, on the real LAION sample's rows laid out
with each dataset's column names."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

SAMPLE = REPO / "laionkit" / "data" / "laion-sample.parquet"  # real URLs, captions, sizes and scores


def parts(folder: Path) -> pa.Table:
    found = sorted(folder.glob("part-*.parquet"), key=lambda p: p.name.split("-")[2])
    return pa.concat_tables(pq.read_table(p) for p in found)


def all_stats(folder: Path) -> list[dict]:
    from laionkit.filter import read_record, stats_paths

    return [read_record(path) for path in stats_paths(folder)]


@pytest.fixture
def two_files(tmp_path: Path) -> Path:
    """The sample split into two files (row groups of 50), and as DataComp names its columns: the real
    sizes as original_width/height, the real CLIP similarity as clip_l14_similarity_score, with ties
    (rounded to 2 decimals), NaN and nulls."""
    table = pq.read_table(SAMPLE)
    score = np.round(table["similarity"].to_numpy(), 2)
    score[::53] = np.nan
    folder = tmp_path / "datacomp"
    folder.mkdir()
    columns = {"url": table["URL"], "text": table["TEXT"], "original_width": table["WIDTH"],
               "original_height": table["HEIGHT"],
               "clip_l14_similarity_score": pa.array(score, mask=np.arange(len(score)) % 71 == 0),
               "clip_b32_similarity_score": table["similarity"]}
    whole = pa.table(columns)
    pq.write_table(whole.slice(0, 600), folder / "part_0.parquet", row_group_size=50)
    pq.write_table(whole.slice(600), folder / "part_1.parquet", row_group_size=50)
    return folder


def expected_top(folder: Path, column: str, fraction: str) -> list[str]:
    """Rank by value (descending), then input order; keep floor(fraction x rows with a value)."""
    table = pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("*.parquet")))
    values = table[column].to_pylist()
    pool = [(-v, i) for i, v in enumerate(values) if v is not None and v == v]
    keep = sorted(pool)[: int(Fraction(fraction) * len(pool))]
    return [table["url"][i].as_py() for _, i in sorted(keep, key=lambda x: x[1])]


def test_top_fraction_is_exact_and_two_ranks_keep_what_one_does(two_files: Path, tmp_path: Path):
    want = expected_top(two_files, "clip_l14_similarity_score", "0.3")
    one, two = tmp_path / "one", tmp_path / "two"
    top = ("--top", "0.3:clip_l14_similarity_score", "--unit-rows", "100", "--quiet")
    run_cli("filter", two_files, "--output", one, *top)
    for rank in (0, 1):  # two ranks, each reading every input's column for the same threshold
        run_cli("filter", two_files, "--output", two, *top, "--rank", str(rank), "--world-size", "2")
    assert parts(one)["url"].to_pylist() == want
    assert parts(two)["url"].to_pylist() == want
    values = pq.read_table(two_files / "part_0.parquet")["clip_l14_similarity_score"].to_pylist()
    assert len(set(values)) < len(values)  # ties at the threshold are real here
    stats = all_stats(two)
    [record] = stats[0]["top"]
    assert record["kept"] == len(want) and record["pool_rows"] == 1000 - len(range(0, 1000, 53)) - len(
        [i for i in range(0, 1000, 71) if i % 53])
    assert sum(s["rules"]["top(0.3:clip_l14_similarity_score)"]["dropped"] for s in stats) + \
        sum(s["rules"]["top(0.3:clip_l14_similarity_score)"]["nulls"] for s in stats) == 1000 - len(want)


def test_datacomp_presets_on_datacomp_columns(two_files: Path, tmp_path: Path):
    out = tmp_path / "dc"
    run_cli("filter", two_files, "--output", out, "--preset", "datacomp-basic", "--preset", "datacomp-clip-b32-30",
            "--quiet")
    table = pa.concat_tables(pq.read_table(p) for p in sorted(two_files.glob("*.parquet")))
    top = set(expected_top(two_files, "clip_b32_similarity_score", "0.3"))
    want = [row["url"] for row in table.to_pylist()
            if row["url"] in top and len(row["text"]) > 5 and len(row["text"].split()) > 2
            and min(row["original_width"], row["original_height"]) >= 200
            and max(row["original_width"], row["original_height"]) < 3 * min(row["original_width"], row["original_height"])]
    assert parts(out)["url"].to_pylist() == want and 0 < len(want) < 300


def test_coyo_columns_work_with_sd1_and_coyo_safe(tmp_path: Path):
    table = pq.read_table(SAMPLE)
    rng = np.random.default_rng(0)
    coyo = pa.table({"url": table["URL"], "text": table["TEXT"], "width": table["WIDTH"], "height": table["HEIGHT"],
                     "clip_similarity_vitb32": table["similarity"],
                     "aesthetic_score_laion_v2": table["AESTHETIC_SCORE"], "watermark_score": table["pwatermark"],
                     "nsfw_score_opennsfw2": table["punsafe"],
                     "nsfw_score_gantman": pa.array(rng.beta(0.5, 4, len(table)).astype(np.float32))})
    path = tmp_path / "coyo.parquet"
    pq.write_table(coyo, path)
    run_cli("filter", path, "--output", tmp_path / "out", "--preset", "sd1", "--preset", "coyo-safe", "--quiet")
    rows = coyo.to_pylist()
    want = [r["url"] for r in rows if r["watermark_score"] < 0.5 and r["aesthetic_score_laion_v2"] >= 5
            and r["width"] >= 512 and r["height"] >= 512 and r["nsfw_score_opennsfw2"] < 0.5
            and r["nsfw_score_gantman"] < 0.5]
    assert parts(tmp_path / "out")["url"].to_pylist() == want and want
    assert pq.read_schema(next((tmp_path / "out").glob("part-*.parquet"))).names == coyo.column_names
    refused = run_cli("filter", path, "--output", tmp_path / "sd2", "--preset", "sd2", check=False)
    assert refused.returncode == 2 and "punsafe" in refused.stderr and "nsfw_score_opennsfw2" in refused.stderr


@pytest.mark.parametrize("text", ["0:clip", "1.5:clip", "x:clip", "0.3", "0.3:"])
def test_a_bad_top_is_one_line(two_files: Path, tmp_path: Path, text: str):
    result = run_cli("filter", two_files, "--output", tmp_path / "o", "--top", text, check=False)
    assert result.returncode == 2 and "FRACTION:COLUMN" in result.stderr and "Traceback" not in result.stderr


def test_top_needs_a_number_column_that_exists(two_files: Path, tmp_path: Path):
    result = run_cli("filter", two_files, "--output", tmp_path / "o", "--top", "0.3:nope", check=False)
    assert result.returncode == 2 and "no such column" in result.stderr and "clip_l14_similarity_score" in result.stderr
    result = run_cli("filter", two_files, "--output", tmp_path / "o", "--top", "0.3:text", check=False)
    assert result.returncode == 2 and "number column" in result.stderr
    json.dumps(result.stderr)
