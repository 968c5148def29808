"""A sample is its (shard, key) across stages: plain webdatasets restart their key numbering in every shard, so
filter --scores, pack --keep, encode --keep and dedup --keep match by both, and dedup's keep.parquet names each
row's input folder where two score folders hold the same (shard, key). Real photos in real tars, scored and
deduplicated by the real stages (issue 57)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import run_cli
from fixtures import CAPTIONS, _pack_sample
from test_caption import tiny_vlm  # noqa: F401 (a fixture)
from test_encode_faithful import one_line_error
from test_score import score_args

PHOTOS = sorted(CAPTIONS)
# Two shards whose keys both run 0000-0003; shard 00001's key 0001 is shard 00000's key 0001's photo again,
# the exact duplicate dedup removes (its key and shard each name a kept sample, never both).
RESTARTING = {"00000": PHOTOS[0:4], "00001": [PHOTOS[4], PHOTOS[1], PHOTOS[5], PHOTOS[6]]}
REMOVED = ("00001", "0001")
# A second dataset numbered the same way: its 00000/0001 is the first one's 00000/0000 photo (which stays: the
# smaller key), while the first one's 00000/0001 stays too.
OTHER = {"00000": [PHOTOS[7], PHOTOS[0]]}


def write_plain_shards(folder: Path, shards: dict[str, list[str]], realdata: Path) -> Path:
    """A plain webdataset (no records): each tar's keys restart at 0000."""
    folder.mkdir(parents=True)
    for stem, names in shards.items():
        with wds.TarWriter(str(folder / f"{stem}.tar")) as sink:
            for index, name in enumerate(names):
                data = (realdata / "images" / name).read_bytes()
                sink.write(_pack_sample(f"{index:04d}", name, data, name.rsplit(".", 1)[1], index, CAPTIONS[name]))
    return folder


def samples_of(folder: Path) -> set[tuple[str, str]]:
    """(shard, key) of every sample in the folder's tars (a member's name up to its first dot is its key)."""
    return {(tar.name.split(".")[0], member.split(".")[0]) for tar in folder.glob("*.tar")
            for member in tarfile.open(tar).getnames()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory, realdata, score_models) -> dict[str, Path]:
    """The restarting shards, their scores, and dedup's exact layer over them."""
    root = tmp_path_factory.mktemp("identity")
    shards = write_plain_shards(root / "shards", RESTARTING, realdata)
    run_cli(*score_args(shards, root / "scored", score_models, realdata))
    run_cli("dedup", root / "scored", "--output", root / "dedup", "--layers", "exact", "-q")
    return {"shards": shards, "scored": root / "scored", "dedup": root / "dedup"}


def all_samples() -> set[tuple[str, str]]:
    return {(stem, f"{i:04d}") for stem, names in RESTARTING.items() for i in range(len(names))}


def test_dedup_keep_lists_the_kept_samples_by_shard_and_key(chain):
    keep = pq.read_table(chain["dedup"] / "keep.parquet").to_pylist()
    assert {(row["shard"], row["key"]) for row in keep} == all_samples() - {REMOVED}
    assert {row["input"] for row in keep} == {str(chain["scored"])}


def test_pack_keep_leaves_out_the_removed_duplicate_whose_key_another_shard_keeps(chain, tmp_path):
    run_cli("pack", chain["shards"], "--keep", chain["dedup"] / "keep.parquet", "--output", tmp_path / "subset", "-q")
    assert samples_of(tmp_path / "subset") == all_samples() - {REMOVED}
    manifest = json.loads((tmp_path / "subset" / "manifest.json").read_text())
    assert manifest["samples"] == 7


def test_encode_keep_leaves_out_the_removed_duplicate(chain, tmp_path, tiny_models):
    run_cli("encode", chain["shards"], "--keep", chain["dedup"] / "keep.parquet", "--model", tiny_models,
            "--output", tmp_path / "lat", "--resolution", "64", "--batch-size", "4", "--workers", "0", "-q")
    assert {(stem.removesuffix(".tar"), key) for stem, key in samples_of(tmp_path / "lat")} == all_samples() - {REMOVED}
    manifest = json.loads((tmp_path / "lat" / "manifest.json").read_text())
    assert manifest["counts"]["samples_out"] == 7 and manifest["counts"]["not_kept"] == 1


def test_filter_scores_joins_each_kept_row_to_its_own_scores(chain, tmp_path):
    run_cli("filter", chain["dedup"] / "keep.parquet", "--scores", chain["scored"], "--output", tmp_path / "kept",
            "-q")
    rows = pq.read_table(tmp_path / "kept").to_pylist()
    scores = {(row["shard"], row["key"]): row for row in pq.read_table(chain["scored"] / "scores").to_pylist()}
    assert len(rows) == 7
    for row in rows:
        assert row["sha256"] == scores[row["shard"], row["key"]]["sha256"]
        assert row["aes"] == scores[row["shard"], row["key"]]["aes"]


def test_filter_scores_refuses_a_join_by_keys_that_repeat_across_shards(chain, tmp_path):
    """Inputs without a shard column, joined to every score parquet: a key names a row of each shard."""
    pq.write_table(pa.table({"key": ["0001", "0002"]}), tmp_path / "keys.parquet")
    result = run_cli("filter", tmp_path / "keys.parquet", "--scores", chain["scored"], "--output", tmp_path / "out",
                     "-q", check=False)
    one_line_error(result, "--scores: key '0000' is in more than one score row", "00000.parquet", "00001.parquet")


def test_keep_lists_of_numbers_or_of_repeated_keys_are_refused_in_one_line(chain, tmp_path, tiny_models):
    pq.write_table(pa.table({"key": [0, 1, 2]}), tmp_path / "numbers.parquet")
    pq.write_table(pa.table({"key": ["0000", "0001", "0000"]}), tmp_path / "repeated.parquet")
    numbers = "column 'key' is int64, but sample keys are strings"
    result = run_cli("pack", chain["shards"], "--keep", tmp_path / "numbers.parquet", "--output", tmp_path / "p",
                     "-q", check=False)
    one_line_error(result, "numbers.parquet", numbers)
    result = run_cli("encode", chain["shards"], "--keep", tmp_path / "numbers.parquet", "--model", tiny_models,
                     "--output", tmp_path / "lat", "--resolution", "64", "-q", check=False)
    one_line_error(result, "numbers.parquet", numbers)
    result = run_cli("dedup", chain["scored"], "--keep", tmp_path / "numbers.parquet", "--output", tmp_path / "d",
                     "--layers", "exact", "-q", check=False)
    one_line_error(result, "numbers.parquet", numbers)
    result = run_cli("pack", chain["shards"], "--keep", tmp_path / "repeated.parquet", "--output", tmp_path / "r",
                     "-q", check=False)
    one_line_error(result, "repeated.parquet", "key '0000' is listed twice", "no 'shard' column")
    # the numbers written as strings match nothing either: said as such, not as "0 of 8 kept" or bad shards
    pq.write_table(pa.table({"key": ["0", "1"], "shard": ["00000", "00000"]}), tmp_path / "unpadded.parquet")
    none = "unpadded.parquet: none of the 8 samples of the input shards is in the list"
    result = run_cli("pack", chain["shards"], "--keep", tmp_path / "unpadded.parquet", "--output", tmp_path / "u",
                     "-q", check=False)
    one_line_error(result, none)
    result = run_cli("encode", chain["shards"], "--keep", tmp_path / "unpadded.parquet", "--model", tiny_models,
                     "--output", tmp_path / "lat", "--resolution", "64", "--workers", "0", "-q", check=False)
    one_line_error(result, none)


def test_truncated_keep_parquets_are_one_line_errors(chain, tmp_path, tiny_models):
    whole = (chain["dedup"] / "keep.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    for stage, extra in (("pack", ()), ("encode", ("--model", tiny_models, "--resolution", "64")),
                         ("dedup", ("--layers", "exact"))):
        inputs = chain["scored"] if stage == "dedup" else chain["shards"]
        result = run_cli(stage, inputs, "--keep", tmp_path / "cut.parquet", "--output", tmp_path / stage, *extra,
                         "-q", check=False)
        one_line_error(result, "cut.parquet: not a readable parquet file")


def test_dedup_of_two_score_folders_with_the_same_shards_and_keys_names_each_rows_input(chain, tmp_path, realdata,
                                                                                          score_models):
    """The other folder's 00000/0001 is a duplicate of the first's 00000/0000 and goes; the first's 00000/0001
    stays: keep.parquet tells them apart by input, and a list whose inputs share shard names is refused where
    (shard, key) alone would name a sample of each."""
    other = write_plain_shards(tmp_path / "other", OTHER, realdata)
    run_cli(*score_args(other, tmp_path / "other-scored", score_models, realdata))
    run_cli("dedup", chain["scored"], tmp_path / "other-scored", "--output", tmp_path / "dedup", "--layers", "exact",
            "-q")
    keep = {(row["input"], row["shard"], row["key"]) for row in pq.read_table(tmp_path / "dedup" / "keep.parquet")
            .to_pylist()}
    first = {(str(chain["scored"]), shard, key) for shard, key in all_samples() - {REMOVED}}
    assert keep == first | {(str(tmp_path / "other-scored"), "00000", "0000")}
    result = run_cli("pack", other, "--keep", tmp_path / "dedup" / "keep.parquet", "--output", tmp_path / "subset",
                     "-q", check=False)
    one_line_error(result, "several inputs whose shard names coincide", "shard 00000 of", "other-scored")


# --- a half-finished upstream output is refused, naming what it lacks (--allow-incomplete to insist) -----------

FOUR = {f"{i:05d}": PHOTOS[2 * i: 2 * i + 2] for i in range(4)}  # 4 shards of 2 photos: rank 0 of 2 owns 0 and 2


@pytest.fixture(scope="module")
def half(tmp_path_factory, realdata, score_models, tiny_vlm) -> dict[str, Path]:  # noqa: F811
    """Four shards scored, captioned and kept (pack --keep) by rank 0 of 2 only: shards 00001 and 00003 lack."""
    root = tmp_path_factory.mktemp("half")
    shards = write_plain_shards(root / "shards", FOUR, realdata)
    rank0 = ("--rank", "0", "--world-size", "2")
    run_cli(*score_args(shards, root / "scored", score_models, realdata, "--captions", "alt", *rank0))
    run_cli("caption", shards, "--model", tiny_vlm, "--output", root / "captioned", "--max-new-tokens", "4",
            "--batch-size", "2", "--workers", "0", "-q", *rank0)
    run_cli("pack", shards, "--keep", root / "scored" / "scores", "--output", root / "kept", "-q", *rank0,
            "--allow-incomplete")
    return {"shards": shards, "scored": root / "scored", "captioned": root / "captioned", "kept": root / "kept"}


def test_dedup_filter_pack_and_encode_refuse_a_score_run_of_rank_0_of_2(half, tmp_path, tiny_models):
    assert json.loads((half["scored"] / "stats.json").read_text())["complete"] is False
    missing = "is incomplete: 2 of 4 shards not scored (00001, 00003)"
    result = run_cli("dedup", half["scored"], "--output", tmp_path / "dedup", "--layers", "exact", "-q", check=False)
    one_line_error(result, "input", str(half["scored"]), missing, "--allow-incomplete")
    result = run_cli("filter", half["scored"] / "scores", "--scores", half["scored"], "--output", tmp_path / "f", "-q",
                     check=False)
    one_line_error(result, "--scores", missing)
    result = run_cli("pack", half["shards"], "--keep", half["scored"] / "scores", "--output", tmp_path / "p", "-q",
                     check=False)
    one_line_error(result, "--keep", missing)
    encode = ("--model", tiny_models, "--resolution", "64", "--batch-size", "4", "--workers", "0", "-q")
    result = run_cli("encode", half["shards"], "--keep", half["scored"], "--output", tmp_path / "e", *encode,
                     check=False)
    one_line_error(result, "--keep", missing)
    result = run_cli("encode", half["shards"], "--captions", "alt,vlm", "--caption-scores", half["scored"], "--output",
                     tmp_path / "c", *encode, check=False)
    one_line_error(result, "--caption-scores", missing)
    # insisting takes what is there, and says so
    result = run_cli("dedup", half["scored"], "--output", tmp_path / "dedup", "--layers", "exact",
                     "--allow-incomplete", "-q")
    assert "used as it is (--allow-incomplete)" in result.stderr
    assert pq.read_table(tmp_path / "dedup" / "keep.parquet").num_rows == 4


def test_encode_refuses_a_caption_or_pack_run_of_rank_0_of_2(half, tmp_path, tiny_models):
    encode = ("--model", tiny_models, "--resolution", "64", "--batch-size", "4", "--workers", "0", "-q")
    result = run_cli("encode", half["captioned"], "--output", tmp_path / "a", *encode, check=False)
    one_line_error(result, "input", "is incomplete: 2 of 4 shards not captioned (00001.tar, 00003.tar)")
    assert not (tmp_path / "a").exists()
    result = run_cli("encode", half["kept"], "--output", tmp_path / "b", *encode, check=False)
    one_line_error(result, "input", "is incomplete: 2 of 4 planned shards have no done record")
    run_cli("encode", half["captioned"], "--output", tmp_path / "c", *encode, "--allow-incomplete")
    assert sorted(p.name for p in (tmp_path / "c").glob("*.tar")) == ["00000.tar", "00002.tar"]


def test_score_and_caption_refuse_a_caption_or_pack_run_of_rank_0_of_2(half, tmp_path, score_models, realdata,
                                                                      tiny_vlm):  # noqa: F811
    result = run_cli(*score_args(half["captioned"], tmp_path / "s", score_models, realdata), check=False)
    one_line_error(result, "input", "is incomplete: 2 of 4 shards not captioned (00001.tar, 00003.tar)")
    assert not (tmp_path / "s").exists()
    caption = ("--model", tiny_vlm, "--max-new-tokens", "4", "--batch-size", "2", "--workers", "0", "-q")
    result = run_cli("caption", half["kept"], "--output", tmp_path / "c", *caption, check=False)
    one_line_error(result, "input", "is incomplete: 2 of 4 planned shards have no done record")
    run_cli("caption", half["kept"], "--output", tmp_path / "c", *caption, "--allow-incomplete")
    assert sorted(p.name for p in (tmp_path / "c").glob("*.tar")) == ["00000.tar", "00002.tar"]


def test_pack_keep_refuses_a_filter_run_of_rank_0_of_2(half, tmp_path):
    run_cli("filter", half["scored"] / "scores", "--where", "width > 0", "--unit-rows", "1", "--output",
            tmp_path / "filtered", "--rank", "0", "--world-size", "2", "-q")
    result = run_cli("pack", half["shards"], "--keep", tmp_path / "filtered", "--output", tmp_path / "p", "-q",
                     check=False)
    one_line_error(result, "--keep", "is incomplete:", "units not filtered")


def test_a_truncated_caption_scores_parquet_is_a_one_line_error(chain, tmp_path, tiny_models):
    (tmp_path / "cut" / "scores").mkdir(parents=True)
    for path in sorted((chain["scored"] / "scores").glob("*.parquet")):
        whole = path.read_bytes()
        (tmp_path / "cut" / "scores" / path.name).write_bytes(whole[: len(whole) // 2])
    result = run_cli("encode", chain["shards"], "--captions", "alt,vlm", "--caption-scores", tmp_path / "cut",
                     "--model", tiny_models, "--output", tmp_path / "lat", "--resolution", "64", "-q", check=False)
    one_line_error(result, "--caption-scores", "00000.parquet: not a readable parquet file")
