"""laionkit filter on the real LAION sample (real URLs and captions, score columns added here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from laionkit.common import LaionkitError
from laionkit.filter import FilterConfig, InputFile, make_units, read_record, run, stats_paths

ROWS = 1000
RULES = ("--where", "punsafe < 0.5", "--where", "AESTHETIC_SCORE >= 4.5", "--where", "WIDTH / HEIGHT <= 2")


def laion_columns(rows: int, seed: int) -> dict[str, pa.Array]:
    rng = np.random.default_rng(seed)
    punsafe = rng.beta(0.35, 3.0, rows)
    punsafe[::97] = np.nan  # NaN must fail the rule, like null
    aesthetic = rng.normal(4.9, 0.75, rows).astype(np.float32)
    aesthetic[::101] = np.nan  # DuckDB orders NaN above all numbers: NaN >= 4.5 must still fail
    return {
        "WIDTH": pa.array(rng.integers(100, 1500, rows)),
        "HEIGHT": pa.array(rng.integers(100, 1500, rows)),
        "punsafe": pa.array(punsafe, mask=np.arange(rows) % 89 == 0),  # nulls too
        "pwatermark": pa.array(rng.beta(0.6, 2.2, rows).astype(np.float32)),
        "AESTHETIC_SCORE": pa.array(aesthetic),
    }


@pytest.fixture
def sample(realdata: Path, tmp_path: Path) -> Path:
    """The 1000 real rows plus LAION score columns, in 10 row groups of 100."""
    table = pq.read_table(realdata / "laion-sample" / "test_1000.parquet")
    for name, column in laion_columns(table.num_rows, 0).items():
        table = table.append_column(name, column)
    path = tmp_path / "in" / "laion_0000.parquet"
    path.parent.mkdir()
    pq.write_table(table, path, row_group_size=100)
    return path


def read_parts(folder: Path) -> pa.Table:
    """Every part in global unit order (the rank in the name does not matter)."""
    parts = sorted(folder.glob("part-*.parquet"), key=lambda p: p.name.split("-")[2])
    return pa.concat_tables(pq.read_table(p) for p in parts)


def stats_of(folder: Path) -> list[dict]:
    return [read_record(p) for p in stats_paths(folder)]


def test_rules_keep_the_right_rows_and_count_nulls_and_nans(sample: Path, tmp_path: Path):
    out = tmp_path / "out"
    run_cli("filter", sample, "--output", out, *RULES, "--unit-rows", "300", "--quiet")
    source = pq.read_table(sample).to_pandas()
    punsafe_ok = source.punsafe < 0.5  # NaN and None compare False in pandas
    expected = source[punsafe_ok & (source.AESTHETIC_SCORE >= 4.5) & (source.WIDTH / source.HEIGHT <= 2)]
    kept = read_parts(out).to_pandas()
    assert kept.URL.tolist() == expected.URL.tolist()
    assert read_parts(out).column_names == pq.read_schema(sample).names
    [stats] = stats_of(out)
    nulls = int(source.punsafe.isna().sum())
    assert nulls > 10
    assert stats["rules"]["punsafe < 0.5"] == {"nulls": nulls, "dropped": int((source.punsafe >= 0.5).sum())}
    assert stats["rules"]["AESTHETIC_SCORE >= 4.5"] == {
        "dropped": int((source.AESTHETIC_SCORE < 4.5).sum()),
        "nulls": int(source.AESTHETIC_SCORE.isna().sum()),
    }
    assert (stats["rows_in"], stats["rows_out"]) == (ROWS, len(expected))
    assert len(list(out.glob("part-*.parquet"))) == 4  # 300-row units over 100-row groups: 3+3+3+1


@pytest.mark.parametrize("world_size", [2, 3])
def test_union_of_ranks_equals_one_rank_row_for_row(sample: Path, tmp_path: Path, world_size: int):
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli("filter", sample, "--output", single, *RULES, "--unit-rows", "100", "-q")
    for rank in range(world_size):
        run_cli(
            "filter",
            sample,
            "--output",
            multi,
            *RULES,
            "--unit-rows",
            "100",
            "-q",
            "--rank",
            rank,
            "--world-size",
            world_size,
        )
    assert read_parts(multi).equals(read_parts(single))
    units = lambda folder: sorted(p.name.split("-")[2] for p in folder.glob("part-*.parquet"))  # noqa: E731
    assert units(multi) == units(single) and len(units(single)) == 10
    ranks = {p.name.split("-")[1] for p in multi.glob("part-*.parquet")}
    assert len(ranks) == world_size
    assert sum(s["rows_out"] for s in stats_of(multi)) == stats_of(single)[0]["rows_out"]


def test_units_in_parallel_give_the_same_parts_and_stats_as_one_at_a_time(sample: Path, tmp_path: Path):
    one, many = tmp_path / "one", tmp_path / "many"
    run_cli("filter", sample, "--output", one, *RULES, "--unit-rows", "100", "--threads", "1", "-q")
    run_cli("filter", sample, "--output", many, *RULES, "--unit-rows", "100", "--threads", "4", "-q")
    for path in sorted(one.glob("part-*.parquet")):
        assert pq.read_table(path).equals(pq.read_table(many / path.name)), path.name
    assert len(list(many.glob("part-*.parquet"))) == 10
    same = lambda stats: (stats["rows_in"], stats["rows_out"], stats["rules"])  # noqa: E731
    assert same(stats_of(many)[0]) == same(stats_of(one)[0])


def test_resume_after_interrupted_run_gives_the_same_output(sample: Path, tmp_path: Path):
    reference, out = tmp_path / "reference", tmp_path / "out"
    run_cli("filter", sample, "--output", reference, *RULES, "--unit-rows", "100", "-q")
    run_cli("filter", sample, "--output", out, *RULES, "--unit-rows", "100", "-q")
    # Simulate a kill -9: two units never finished, one left a half-written temporary behind.
    (out / "part-00000-000004.parquet").unlink()
    (out / "part-00000-000007.parquet").rename(out / ".part-00000-000007.parquet.partial")
    (out / "_laionkit" / "filter-stats-00000.parquet").unlink()
    before = {p: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    run_cli("filter", sample, "--output", out, *RULES, "--unit-rows", "100", "-q")
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in before.items())  # finished units not redone
    assert read_parts(out).equals(read_parts(reference))
    assert not list(out.glob(".*partial"))
    resumed, full = stats_of(out)[0], stats_of(reference)[0]
    assert (resumed["rows_in"], resumed["rows_out"], resumed["rules"]) == (
        full["rows_in"],
        full["rows_out"],
        full["rules"],
    )


def test_rerun_with_other_rules_is_refused_unless_overwrite(sample: Path, tmp_path: Path):
    out = tmp_path / "out"
    run_cli("filter", sample, "--output", out, "--where", "punsafe < 0.5", "-q")
    result = run_cli("filter", sample, "--output", out, "--where", "punsafe < 0.1", "-q", check=False)
    assert result.returncode == 2 and "other rules" in result.stderr and "--overwrite" in result.stderr
    run_cli("filter", sample, "--output", out, "--where", "punsafe < 0.1", "-q", "--overwrite")
    assert read_parts(out).column("punsafe").to_numpy().max() < 0.1


def test_a_run_that_failed_before_any_unit_is_retried_with_other_rules(sample: Path, tmp_path: Path):
    """Before: a rule that fails on the data (it binds, then cannot cast a caption) left its plan in the folder, and
    the corrected command was refused as "filtered with other rules". A plan no unit was filtered by is replaced."""
    out = tmp_path / "out"
    result = run_cli("filter", sample, "--output", out, "--where", "CAST(TEXT AS INTEGER) > 0", "-q", check=False)
    assert result.returncode == 2 and "Conversion Error" in result.stderr and not list(out.glob("part-*"))
    run_cli("filter", sample, "--output", out, "--where", "punsafe < 0.1", "-q")
    assert read_parts(out).column("punsafe").to_numpy().max() < 0.1
    assert stats_of(out)[0]["rows_in"] == ROWS


def test_missing_column_names_the_available_columns_before_writing(sample: Path, tmp_path: Path):
    out = tmp_path / "out"
    result = run_cli("filter", sample, "--output", out, "--where", "aesthetic_v3 > 5", check=False)
    assert result.returncode == 2
    assert "aesthetic_v3" in result.stderr and "available columns" in result.stderr
    assert "URL, TEXT" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "where, message",
    [
        ("WIDTH + 1", "not a true/false test"),
        ("punsafe < ", "syntax error"),
        ("1); DROP TABLE x; SELECT (1", "syntax error"),  # one expression, never several statements
    ],
)
def test_bad_expressions_are_refused(sample: Path, tmp_path: Path, where: str, message: str):
    with pytest.raises(LaionkitError, match=message):
        run(FilterConfig(inputs=(str(sample),), output=str(tmp_path / "out"), where=(where,), quiet=True))


def test_presets_work_on_every_release_spelling_and_with_rename(realdata: Path, tmp_path: Path):
    base = pq.read_table(realdata / "laion-sample" / "test_1000.parquet").select(["URL", "TEXT"])
    columns = laion_columns(ROWS, 1)
    upper = base
    for name in ("WIDTH", "HEIGHT", "pwatermark", "AESTHETIC_SCORE"):
        upper = upper.append_column(name, columns[name])
    lower = upper.rename_columns(["url", "caption", "width", "height", "pwatermark", "aesthetic"])
    odd = upper.rename_columns(["URL", "TEXT", "W", "H", "watermark", "AESTHETIC_SCORE"])
    for name, table in {"upper": upper, "lower": lower, "odd": odd}.items():
        pq.write_table(table, tmp_path / f"{name}.parquet")
    outputs = {}
    for name in ("upper", "lower"):
        run_cli(
            "filter",
            tmp_path / f"{name}.parquet",
            "--preset",
            "sd1",
            "--where",
            "length(caption) >= 10",
            "--output",
            tmp_path / f"out-{name}",
            "-q",
        )
        outputs[name] = read_parts(tmp_path / f"out-{name}")
    run_cli(
        "filter",
        tmp_path / "odd.parquet",
        "--preset",
        "sd1",
        "--where",
        "length(caption) >= 10",
        "--rename",
        "W=WIDTH",
        "--rename",
        "H=HEIGHT",
        "--rename",
        "watermark=pwatermark",
        "--output",
        tmp_path / "out-odd",
        "-q",
    )
    outputs["odd"] = read_parts(tmp_path / "out-odd")
    frame = upper.to_pandas()
    expected = frame[
        (frame.pwatermark < 0.5)
        & (frame.AESTHETIC_SCORE >= 5)
        & (frame.WIDTH >= 512)
        & (frame.HEIGHT >= 512)
        & (frame.TEXT.str.len() >= 10)
    ]
    assert 0 < len(expected) < ROWS
    for name, kept in outputs.items():
        assert kept.column(0).to_pylist() == expected.URL.tolist(), name
    assert outputs["odd"].column_names == upper.column_names  # --rename renames the output too


def test_dedup_keeps_first_occurrence_globally(realdata: Path, tmp_path: Path):
    table = pq.read_table(realdata / "laion-sample" / "test_1000.parquet").select(["URL", "TEXT"])
    first, second = tmp_path / "in" / "a.parquet", tmp_path / "in" / "b.parquet"
    first.parent.mkdir()
    pq.write_table(table, first, row_group_size=100)
    pq.write_table(pa.concat_tables([table.slice(500, 300), table.slice(0, 50)]), second, row_group_size=100)
    out = tmp_path / "out"
    run_cli("filter", first.parent, "--dedup", "URL", "--unit-rows", "100", "--output", out, "-q")
    kept = read_parts(out).column("URL").to_pylist()
    urls = table.column("URL").to_pylist()
    assert kept == list(dict.fromkeys(urls))  # the sample's own duplicates, then all of b.parquet dropped
    [stats] = stats_of(out)
    assert stats["rules"]["dedup(URL)"]["dropped"] == 1350 - len(kept)
    # Resume: the first occurrences in finished units are remembered.
    (out / "part-00000-000012.parquet").unlink()
    (out / "part-00000-000005.parquet").unlink()
    run_cli("filter", first.parent, "--dedup", "URL", "--unit-rows", "100", "--output", out, "-q")
    assert read_parts(out).column("URL").to_pylist() == kept


def test_bad_inputs_are_named_or_skipped_and_counted(sample: Path, tmp_path: Path):
    corrupt = sample.parent / "laion_0001.parquet"
    data = sample.read_bytes()
    corrupt.write_bytes(data[: len(data) // 2])  # truncated: no footer
    text = sample.parent / "notes.parquet"
    text.write_text("url,caption\nhttp://x,y\n")
    result = run_cli("filter", sample.parent, "--output", tmp_path / "out", "-q", check=False)
    assert (
        result.returncode == 2 and "laion_0001.parquet" in result.stderr and "Traceback" not in result.stderr
    )
    assert not (tmp_path / "out").exists()
    run_cli("filter", sample.parent, "--output", tmp_path / "out", "-q", "--skip-bad", *RULES)
    [stats] = stats_of(tmp_path / "out")
    assert sorted(Path(b["path"]).name for b in stats["bad_inputs"]) == [
        "laion_0001.parquet",
        "notes.parquet",
    ]
    assert stats["rows_in"] == ROWS
    summary = run_cli("stats", tmp_path / "out")
    assert "skipped input" in summary.stdout and "notes.parquet" in summary.stdout


def test_corrupt_row_group_is_an_error_or_a_counted_skip(sample: Path, tmp_path: Path):
    pq.write_table(pq.read_table(sample), sample, row_group_size=100, compression="zstd")
    meta = pq.read_metadata(sample)
    column = meta.row_group(3).column(1)  # TEXT of row group 3
    data = bytearray(sample.read_bytes())
    start = column.data_page_offset + 40
    data[start : start + 200] = b"\xff" * 200
    sample.write_bytes(bytes(data))
    result = run_cli("filter", sample, "--output", tmp_path / "out", "--unit-rows", "100", "-q", check=False)
    assert (
        result.returncode == 2 and "laion_0000.parquet" in result.stderr and "row groups 3-3" in result.stderr
    )
    run_cli("filter", sample, "--output", tmp_path / "out", "--unit-rows", "100", "-q", "--skip-bad")
    [stats] = stats_of(tmp_path / "out")
    assert [(b["unit"], b["rows"]) for b in stats["bad_units"]] == [(3, 100)]
    assert stats["rows_in"] == ROWS - 100


def test_zero_row_inputs_and_odd_captions_pass_through(tmp_path: Path):
    odd = [b"\xff\xfe not utf-8 \x00 nul", "emoji \U0001f999 RTL \u202e txt \n\ttabs".encode(), b"", None]
    table = pa.table(
        {
            "URL": ["http://a", "http://b", "http://c", "http://d"],
            "TEXT": pa.array(odd, pa.binary()).view(pa.string()),  # a string column, bytes not UTF-8
            "raw": pa.array(odd, pa.binary()),
            "alt": ["e\u0301 combining", "\ud7ff edge", "zero\u200bwidth", None],
            "punsafe": [0.1, 0.2, 0.3, 0.4],
        }
    )
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(table, folder / "a.parquet")
    pq.write_table(table.schema.empty_table(), folder / "b.parquet")
    out = tmp_path / "out"
    run_cli(
        "filter",
        folder,
        "--where",
        "punsafe < 0.5",
        "--where",
        "length(alt) > 0 OR alt IS NULL",
        "--output",
        out,
        "-q",
    )
    kept = read_parts(out)
    assert kept.schema == table.schema
    assert kept.column("TEXT").cast(pa.binary()).to_pylist() == odd
    assert kept.drop_columns(["TEXT"]).equals(table.drop_columns(["TEXT"]))
    assert pq.read_table(out / "part-00000-000001.parquet").num_rows == 0
    assert stats_of(out)[0]["rows_in"] == 4


def test_embeddings_row_mismatch_is_a_clear_error(sample: Path, tmp_path: Path, realdata: Path):
    npy = tmp_path / "img_emb_0000.npy"
    np.save(npy, np.zeros((ROWS - 1, 768), np.float16))
    weights = realdata / "aesthetic" / "sa_0_4_vit_l_14_linear.pth"
    result = run_cli(
        "filter",
        sample,
        "--embeddings",
        npy,
        "--score",
        f"aes=aesthetic-v1:{weights}",
        "--output",
        tmp_path / "out",
        check=False,
    )
    assert result.returncode == 2 and "999 rows" in result.stderr and "laion_0000.parquet" in result.stderr


def test_score_columns_from_embeddings_matched_by_number(sample: Path, tmp_path: Path, realdata: Path):
    from laionkit.common.clip_scores import ScoreSpec, build_scorer, score_embeddings

    second = sample.parent / "laion_0001.parquet"
    pq.write_table(pq.read_table(sample).slice(0, 300), second, row_group_size=100)
    rng = np.random.default_rng(3)
    emb = tmp_path / "emb"
    emb.mkdir()
    arrays = {n: rng.standard_normal((rows, 768)).astype(np.float16) for n, rows in ((0, ROWS), (1, 300))}
    for n, array in arrays.items():
        np.save(emb / f"img_emb_{n:04d}.npy", array)
    weights = realdata / "aesthetic" / "sac+logos+ava1-l14-linearMSE.pth"
    expected = np.concatenate(
        [
            score_embeddings(build_scorer(ScoreSpec("aes", "aesthetic-v2", str(weights))), a)
            for a in arrays.values()
        ]
    )
    # A threshold no score sits next to, so float32-vs-double comparison details cannot matter.
    threshold = next(
        t
        for t in np.round(np.median(expected) + np.arange(100) / 1000, 3)
        if np.abs(expected - t).min() > 1e-4
    )
    out = tmp_path / "out"
    run_cli(
        "filter",
        sample.parent,
        "--embeddings",
        emb,
        "--score",
        f"aes=aesthetic-v2:{weights}",
        "--where",
        f"aes >= {threshold}",
        "--unit-rows",
        "200",
        "--output",
        out,
        "-q",
    )
    kept = read_parts(out)
    assert kept.schema.field("aes").type == pa.float32()
    passed = expected >= threshold
    assert 0 < passed.sum() < len(expected)
    np.testing.assert_allclose(kept.column("aes").to_numpy(), expected[passed], rtol=0, atol=1e-6)
    [stats] = stats_of(out)
    assert stats["rules"][f"aes >= {threshold}"]["dropped"] == int((~passed).sum())


@pytest.mark.parametrize(
    "rows, unit_rows, expected",
    [
        ((100, 100, 100), 1, [(0, 1), (1, 2), (2, 3)]),
        ((100, 100, 100), 150, [(0, 2), (2, 3)]),
        ((100, 100, 100), 10**6, [(0, 3)]),
        ((), 100, [(0, 0)]),
    ],
)
def test_units_merge_row_groups_up_to_unit_rows(rows, unit_rows, expected):
    files = [InputFile("a", sum(rows), rows, pa.schema([])), InputFile("b", 5, (5,), pa.schema([]))]
    units = make_units(files, unit_rows)
    assert [(u.start, u.stop) for u in units if u.file == 0] == expected
    assert [u.index for u in units] == list(range(len(units)))
    assert [u.offset for u in units if u.file == 0] == [sum(rows[:start]) for start, _ in expected]
    assert sum(u.rows for u in units if u.file == 0) == sum(rows)


def test_prompt_score_through_the_cli_with_a_random_init_clip(sample: Path, tmp_path: Path):
    from laionkit.common.clip_scores import ClipChoice, ScoreSpec, build_scorer, score_embeddings

    clip = ClipChoice("ViT-S-32", None)
    scorer = build_scorer(ScoreSpec("anime", "prompt", "an anime drawing|a manga page"), clip)
    npy = tmp_path / "img_emb_0000.npy"
    np.save(npy, np.random.default_rng(5).standard_normal((ROWS, scorer.dim)).astype(np.float16))
    out = tmp_path / "out"
    run_cli(
        "filter",
        sample,
        "--embeddings",
        npy,
        "--score",
        "anime=prompt:an anime drawing|a manga page",
        "--clip-model",
        "ViT-S-32",
        "--clip-pretrained",
        "none",
        "--output",
        out,
        "-q",
    )
    expected = score_embeddings(scorer, np.load(npy))
    np.testing.assert_allclose(read_parts(out).column("anime").to_numpy(), expected, rtol=0, atol=1e-5)
    result = run_cli(
        "filter",
        sample,
        "--embeddings",
        npy,
        "--score",
        "anime=prompt:anime",
        "--clip-model",
        "ViT-B-32",
        "--clip-pretrained",
        "none",
        "--output",
        tmp_path / "other",
        check=False,
    )
    assert (
        result.returncode == 2
        and f"shape ({ROWS}, {scorer.dim})" in result.stderr
        and "512-d" in result.stderr
    )


# ------------------------------------------------------------------------ issue 13: integrity, hostile input


def test_input_paths_are_literal_not_duckdb_globs(realdata: Path, tmp_path: Path):
    """g[1].parquet beside g1.parquet, star*.parquet beside star1.parquet: each file read once, as itself."""
    table = pq.read_table(realdata / "laion-sample" / "test_1000.parquet")
    folder = tmp_path / "in"
    folder.mkdir()
    slices = {"g1.parquet": (0, 50), "g[1].parquet": (50, 30), "star1.parquet": (100, 20), "star*.parquet": (200, 10)}
    for name, (start, rows) in slices.items():
        pq.write_table(table.slice(start, rows), folder / name)
    run_cli("filter", folder, "--output", tmp_path / "all", "-q")
    [stats] = stats_of(tmp_path / "all")
    expected = sorted(url for start, rows in slices.values() for url in table.column("URL")[start : start + rows].to_pylist())
    assert (stats["rows_in"], stats["rows_out"]) == (110, 110)
    assert sorted(read_parts(tmp_path / "all").column("URL").to_pylist()) == expected
    run_cli("filter", folder / "star*.parquet", "--output", tmp_path / "star", "-q")
    [stats] = stats_of(tmp_path / "star")
    assert (stats["rows_in"], stats["rows_out"]) == (10, 10)
    run_cli("filter", str(folder / "g*.parquet"), "--output", tmp_path / "pattern", "-q")  # a user glob
    assert stats_of(tmp_path / "pattern")[0]["rows_in"] == 80


def test_input_column_file_row_number_is_data_and_renames_may_not_collide(sample: Path, tmp_path: Path):
    table = pq.read_table(sample)
    table = table.append_column("file_row_number", pa.array(np.arange(table.num_rows) * 7 + 3))
    pq.write_table(table, sample, row_group_size=100)
    run_cli("filter", sample, "--output", tmp_path / "out", "--where", "punsafe < 0.5", "--unit-rows", "300", "-q")
    source = table.to_pandas()
    kept = read_parts(tmp_path / "out").to_pandas()
    assert kept.file_row_number.tolist() == source[source.punsafe < 0.5].file_row_number.tolist()
    assert len(kept) > 500
    result = run_cli("filter", sample, "--output", tmp_path / "clash", "--rename", "punsafe=url", "-q", check=False)
    assert result.returncode == 2 and "'url'" in result.stderr and "laion_0000.parquet" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "clash").exists()


def test_a_replaced_input_is_refused_on_rerun(sample: Path, tmp_path: Path):
    out = tmp_path / "out"
    run_cli("filter", sample, "--output", out, "--unit-rows", "300", "-q")
    (out / "part-00000-000003.parquet").unlink()  # an unfinished run
    table = pq.read_table(sample)
    replaced = table.set_column(table.schema.get_field_index("punsafe"), "punsafe", pa.array(np.zeros(table.num_rows)))
    pq.write_table(replaced, sample, row_group_size=100)  # same rows, same row groups: only the data differs
    result = run_cli("filter", sample, "--output", out, "--unit-rows", "300", "-q", check=False)
    assert result.returncode == 2 and "laion_0000.parquet changed" in result.stderr
    assert not (out / "part-00000-000003.parquet").exists()
    run_cli("filter", sample, "--output", out, "--unit-rows", "300", "-q", "--overwrite")
    assert stats_of(out)[0]["rows_out"] == ROWS


HOSTILE_RULES = [
    "length((SELECT string_agg(column0) FROM read_csv('/etc/passwd', header=false))) > 0",
    "(SELECT count(*) FROM read_text('/etc/passwd')) > 0",
    "(SELECT count(*) FROM glob('/root/*')) >= 0",
    "(SELECT count(*) FROM read_text('http://127.0.0.1:9/x')) > 0",
    "CAST((SELECT content FROM read_text('/etc/passwd')) AS INTEGER) > 0",
    "punsafe < 0.5 pwatermark",
    "punsafe < 0.5; SELECT 1",
    "punsafe < 0.5 AND COLUMNS(*) IS NOT NULL",
]


@pytest.mark.parametrize("rule", HOSTILE_RULES)
def test_hostile_rules_are_refused_before_anything_runs(sample: Path, tmp_path: Path, rule: str):
    result = run_cli("filter", sample, "--output", tmp_path / "out", "--where", rule, "-q", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "root:" not in result.stderr + result.stdout and "httpfs" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_duckdb_may_read_only_the_planned_inputs(sample: Path, tmp_path: Path):
    """The backstop behind rule parsing: the filter's connection reads the inputs and nothing else."""
    import duckdb

    from laionkit.filter import make_plan

    other = tmp_path / "other.parquet"
    pq.write_table(pq.read_table(sample).slice(0, 5), other)
    connection = duckdb.connect()
    make_plan(FilterConfig(inputs=(str(sample),), output=str(tmp_path / "out")), connection)
    assert connection.sql(f"SELECT count(*) FROM read_parquet('{sample}')").fetchall() == [(ROWS,)]
    for query in (f"SELECT * FROM read_parquet('{other}')", "SELECT * FROM read_csv('/etc/passwd')",
                  "SELECT * FROM read_text('http://127.0.0.1:9/x')", "INSTALL httpfs"):
        with pytest.raises(duckdb.Error, match="disabled|Permission"):
            connection.sql(query).fetchall()


def test_hostile_rule_through_a_recipe_var(sample: Path, tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"workdir: {tmp_path}\nstages:\n  filter:\n    input: {sample}\n"
                      f"    output: {tmp_path}/out\n    where: ['{{rule}}']\n    quiet: true\n")
    rule = "length((SELECT string_agg(content) FROM read_text('/etc/passwd'))) > 0"
    result = run_cli("run", recipe, "--var", f"rule={rule}", check=False)
    assert result.returncode != 0 and "root:" not in result.stderr + result.stdout
    assert "subquery is not allowed" in result.stderr + result.stdout


def test_skip_bad_catches_a_corrupt_data_page(sample: Path, tmp_path: Path):
    """Bytes flipped in the middle of row group 3's URL page: DuckDB's InvalidInputException (snappy)."""
    chunk = pq.read_metadata(sample).row_group(3).column(0)
    data = bytearray(sample.read_bytes())
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    sample.write_bytes(bytes(data))
    args = ("filter", sample, "--output", tmp_path / "out", "--unit-rows", "100", "-q", *RULES)
    result = run_cli(*args, check=False)
    assert result.returncode == 2 and "row groups 3-3" in result.stderr and "Traceback" not in result.stderr
    run_cli(*args, "--skip-bad")
    [stats] = stats_of(tmp_path / "out")
    assert [(b["unit"], b["rows"]) for b in stats["bad_units"]] == [(3, 100)]
    assert stats["rows_in"] == ROWS - 100 and read_parts(tmp_path / "out").num_rows == stats["rows_out"]


def test_output_folder_reads_as_a_dataset_and_resumes(sample: Path, tmp_path: Path):
    import pandas as pd
    import pyarrow.dataset as ds

    out = tmp_path / "out"
    run_cli("filter", sample, "--output", out, *RULES, "--unit-rows", "300", "-q")
    [stats] = stats_of(out)
    assert len(pd.read_parquet(out)) == ds.dataset(out).count_rows() == stats["rows_out"]
    (out / "part-00000-000001.parquet").unlink()
    run_cli("filter", sample, "--output", out, *RULES, "--unit-rows", "300", "-q")
    [again] = stats_of(out)
    assert again["rows_out"] == stats["rows_out"] and again["rows_filtered_now"] == 300
    assert len(pd.read_parquet(out)) == stats["rows_out"]


def test_output_mistakes_are_one_line_errors(sample: Path, tmp_path: Path):
    a_file = tmp_path / "taken.txt"
    a_file.write_text("not a folder")
    for output, expected in ((a_file, "is a file"), ("/proc/laionkit-out", "cannot write there"),
                             (sample.parent / "out", "lies inside the input")):
        result = run_cli("filter", sample.parent, "--output", output, "-q", check=False)
        assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr
    assert a_file.read_text() == "not a folder" and not (sample.parent / "out").exists()
    out = tmp_path / "out"
    run_cli("filter", sample, "--output", out, "-q")
    (out / "_laionkit" / "filter-plan.parquet").write_bytes(b"PAR1 truncated")
    result = run_cli("filter", sample, "--output", out, "-q", check=False)
    assert result.returncode == 2 and "filter-plan.parquet: unreadable" in result.stderr
    assert "Traceback" not in result.stderr
    (out / "_laionkit" / "filter-stats-00000.parquet").write_bytes(b"PAR1 truncated")
    (out / "_laionkit" / "filter-stats-copy.parquet").write_bytes(b"PAR1 truncated")
    (out / "_stats-copy.json").write_text("{ truncated")
    run_cli("filter", sample, "--output", out, "-q", "--overwrite")
    assert [s["rows_out"] for s in stats_of(out)] == [ROWS] and not (out / "_stats-copy.json").exists()
    assert not (out / "_laionkit" / "filter-stats-copy.parquet").exists()
