"""User text (model names, paths, SQL rules) comes back from the real CLI exactly as typed: rich markup,
emoji codes and highlighting never apply to it."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import run_cli

# `[red]` would vanish as a style tag, `:x:` would become an emoji, `[/x]` would raise MarkupError.
ODD = "[red]a:x:b[/x]"
ENV = {**os.environ, "COLUMNS": "400", "HF_HUB_OFFLINE": "1"}  # wide enough that rich wraps nothing


def assert_clean_error(result, *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def test_a_mistyped_model_name_is_one_readable_error(image_shards: Path, tmp_path: Path):
    result = run_cli("encode", image_shards, "--model", "sd51", "--output", tmp_path / "out", check=False, env=ENV)
    assert_clean_error(result, "error: model source 'sd51' for vae is not a preset", "hub id owner/name[/subfolder]")


def test_a_path_with_markup_and_emoji_codes_is_printed_as_typed(tmp_path: Path):
    missing = tmp_path / ODD
    assert_clean_error(run_cli("stats", missing, check=False, env=ENV), f"error: not a folder: {missing}")


def test_filter_summary_and_stats_print_paths_and_rules_verbatim(realdata: Path, tmp_path: Path):
    source = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(realdata / "laion-sample" / "test_1000.parquet").slice(0, 200), source)
    out = tmp_path / ODD
    rule = "TEXT NOT LIKE '%[/x]%:x:%'"
    filtered = run_cli("filter", source, "--output", out, "--where", rule, env=ENV)
    assert f"-> {out}" in filtered.stderr, filtered.stderr
    stats = run_cli("stats", out, env=ENV)
    assert str(out) in "".join(stats.stdout.split()), stats.stdout  # the title, wrapped to the table width
    assert rule in stats.stdout, stats.stdout


def test_pack_prints_its_output_path_as_typed(tmp_path: Path):
    """Rank 1 of 2 owns none of the one shard, so nothing is downloaded; the plan line still names the output."""
    source = tmp_path / "one.parquet"
    pq.write_table(pa.table({"URL": ["http://127.0.0.1:9/a.jpg"], "TEXT": ["a"]}), source)
    out = tmp_path / ODD
    packed = run_cli("pack", source, "--output", out, "--rank", "1", "--world-size", "2", env=ENV)
    assert f"0 mine, 0 to do -> {out}" in packed.stderr, packed.stderr
