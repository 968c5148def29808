"""`laionkit pack` against a loopback server holding the real photos and the ways the web fails."""

from __future__ import annotations

import io
import os
import signal
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import run_cli
from PIL import Image

from laionkit.common import LaionkitError, Rank, read_json, split
from laionkit.common.imageserver import Response, folder_routes, serve
from laionkit.pack import PackConfig, failure_reason, plan_shards, size_bucket

TIMEOUT_S = 1
SHARD_SIZE = 4
PACK_OPTIONS = (
    "--processes", "1", "--threads", "4", "--timeout", str(TIMEOUT_S), "--shard-size", str(SHARD_SIZE),
    "--quiet",
)


def png_header(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height, with almost no pixel data: a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(1000))) + chunk(
        b"IEND", b"")


def failure_routes(photo: bytes) -> dict[str, tuple[Response, str]]:
    """Each way a download fails, with the reason pack must count it under."""
    return {
        "missing.jpg": (Response(b"not found", status=404, content_type="text/plain"), "http 404"),
        "error.jpg": (Response(b"oops", status=500, content_type="text/plain"), "http 500"),
        "truncated.jpg": (Response(photo[: len(photo) // 2]), "decode error"),
        "cut.jpg": (Response(photo[:1000], declared_length=len(photo)), "truncated transfer"),
        "empty.jpg": (Response(b""), "empty body"),
        "page.jpg": (Response(b"<html><body>moved</body></html>", content_type="text/html"), "decode error"),
        # Under OpenCV's own 2**30-pixel limit, so only pack's --max-image-area guard names it.
        "bomb-20k.png": (Response(png_header(20_000, 20_000), content_type="image/png"), "image too large"),
        "bomb-100k.png": (Response(png_header(100_000, 100_000), content_type="image/png"),
                          "image too large"),
        "noai.jpg": (Response(photo, headers=(("X-Robots-Tag", "noai"),)), "opt-out header"),
    }


@pytest.fixture(scope="module")
def site(realdata):
    """The server, and the input rows: a slow URL closes every full shard, so a run can be killed mid-way."""
    photos = folder_routes(realdata / "images")
    failures = failure_routes(photos["524_316.jpg"].body)
    slow = {f"slow-{i}.jpg": Response(photos["123_456.jpg"].body, delay_s=3 * TIMEOUT_S) for i in range(5)}
    routes = {**photos, **{name: response for name, (response, _) in failures.items()}, **slow}
    others = list(photos) + list(failures)
    paths = []
    for slow_path in slow:
        paths += [others.pop(0) for _ in range(SHARD_SIZE - 1)] + [slow_path]
    paths += others
    with serve(routes) as server:
        yield {
            "server": server, "paths": paths,
            "photos": {name: Image.open(io.BytesIO(response.body)).size for name, response in photos.items()},
            "reasons": {
                **{name: reason for name, (_, reason) in failures.items()}, **dict.fromkeys(slow, "timeout")
            },
        }


@pytest.fixture(scope="module")
def input_parquet(site, tmp_path_factory) -> Path:
    paths = site["paths"]
    rows = len(paths)
    table = pa.table({
        "URL": [site["server"].url(path) for path in paths],
        "TEXT": [f"a photo called {path}" for path in paths],
        "similarity": [0.25 + i / 100 for i in range(rows)],
        "punsafe": [0.01] * rows,
        "hash": [f"h{i}" for i in range(rows)],
        "key": list(range(rows)),  # a name img2dataset owns: carried as source_key
        "__index_level_0__": list(range(rows)),
    })
    path = tmp_path_factory.mktemp("input") / "kept.parquet"
    pq.write_table(table, path, row_group_size=5)  # row groups that straddle shards
    return path


@pytest.fixture(scope="module")
def packed(input_parquet, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("packed") / "shards"
    run_cli("pack", input_parquet, "--output", output, *PACK_OPTIONS)
    return output


def tar_members(folder: Path) -> dict[str, dict[str, bytes]]:
    """Every tar's members and bytes; tar headers (mtimes) are left out."""
    found = {}
    for path in sorted(folder.glob("*.tar")):
        with tarfile.open(path) as tar:
            found[path.name] = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
    return found


def statuses(folder: Path) -> dict[str, tuple[str, str | None]]:
    tables = [pq.read_table(path) for path in sorted(folder.glob("[0-9]*.parquet"))]
    rows = pa.concat_tables(tables).to_pylist()
    return {row["url"].rsplit("/", 1)[1]: (row["status"], row["error_message"]) for row in rows}


def test_every_good_photo_lands_once_and_decodes_with_plain_webdataset(packed, site):
    dataset = wds.WebDataset([str(path) for path in sorted(packed.glob("*.tar"))], shardshuffle=False)
    samples = list(dataset.decode("pil"))
    names = Counter(sample["json"]["url"].rsplit("/", 1)[1] for sample in samples)
    assert names == Counter(list(site["photos"]))
    for sample in samples:
        assert sample["jpg"].size == (512, 512)
        meta = sample["json"]
        assert sample["txt"] == meta["caption"] == f"a photo called {meta['url'].rsplit('/', 1)[1]}"
        index = site["paths"].index(meta["url"].rsplit("/", 1)[1])
        assert meta["similarity"] == pytest.approx(0.25 + index / 100)
        assert (meta["punsafe"], meta["hash"], meta["source_key"]) == (0.01, f"h{index}", index)
        assert "__index_level_0__" not in meta
        original_size = site["photos"][meta["url"].rsplit("/", 1)[1]]
        assert (meta["original_width"], meta["original_height"]) == original_size


def test_every_failure_is_counted_under_its_reason(packed, site):
    manifest = read_json(packed / "manifest.json")
    assert Counter(manifest["failures"]) == Counter(site["reasons"].values())
    assert (manifest["rows"], manifest["samples"]) == (len(site["paths"]), len(site["photos"]))
    assert manifest["complete"] and len(manifest["shards"]) == manifest["planned_shards"] == 6
    for name, (status, message) in statuses(packed).items():
        if name in site["photos"]:
            assert status == "success"
        else:
            assert status != "success" and failure_reason(message) == site["reasons"][name], (name, message)


def test_killed_run_resumes_to_the_same_result_without_redoing_finished_shards(
    packed, input_parquet, site, tmp_path
):
    output = tmp_path / "shards"
    command = [sys.executable, "-m", "laionkit.cli", "pack", str(input_parquet), "--output", str(output),
               *PACK_OPTIONS]
    process = subprocess.Popen(
        command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not (list(output.glob("*_stats.json")) and list(output.glob(".*.partial/*.tar"))):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)  # the run and its download workers, as kill -9 would leave it
    process.wait()
    process.stderr.close()

    finished = {path.name: path.read_bytes() for path in output.glob("*_stats.json")}
    assert 0 < len(finished) < 6
    done_shards = {name.removesuffix("_stats.json") for name in finished}
    assert {path.stem for path in output.glob("*.tar")} == done_shards  # no tar without its record
    urls_done = {path for shard in done_shards for path in shard_paths(output, shard)}
    hits_before = Counter(site["server"].hits)

    run_cli("pack", input_parquet, "--output", output, *PACK_OPTIONS)
    assert all((output / name).read_bytes() == record for name, record in finished.items())
    new_hits = site["server"].hits - hits_before
    assert not urls_done & set(new_hits)
    assert tar_members(output) == tar_members(packed)
    assert statuses(output) == statuses(packed)
    assert not list(output.glob(".*"))


def shard_paths(folder: Path, shard: str) -> list[str]:
    return [url.rsplit("/", 1)[1] for url in pq.read_table(folder / f"{shard}.parquet")["url"].to_pylist()]


def test_two_ranks_together_produce_exactly_what_one_rank_does(packed, input_parquet, tmp_path):
    output = tmp_path / "shards"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "laionkit.cli", "pack", str(input_parquet), "--output", str(output),
             *PACK_OPTIONS, "--rank", str(rank), "--world-size", "2"],
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()
    assert sorted(p.name for p in output.iterdir()) == sorted(p.name for p in packed.iterdir())
    assert tar_members(output) == tar_members(packed)
    assert statuses(output) == statuses(packed)
    one, two = read_json(packed / "manifest.json"), read_json(output / "manifest.json")
    for key in ("rows", "samples", "failures", "original_sizes", "planned_shards", "complete"):
        assert one[key] == two[key], key


def test_stats_summarises_the_shard_folder_without_writing(packed):
    (packed / "manifest.json").unlink()
    result = run_cli("stats", packed)
    assert not (packed / "manifest.json").exists()  # read-only: the summary is merged in memory
    expected = ("6 / 6 planned", "samples", "36.4%", "size on disk", "http 404", "image too large", "256-511")
    for text in expected:
        assert text in result.stdout, text


def test_optout_headers_are_ignored_only_when_asked(site, tmp_path):
    url = site["server"].url("noai.jpg")
    pq.write_table(pa.table({"url": [url], "caption": ["opted out"]}), tmp_path / "noai.parquet")
    run_cli("pack", tmp_path / "noai.parquet", "--output", tmp_path / "ignored", "--no-respect-optout",
            *PACK_OPTIONS)
    assert read_json(tmp_path / "ignored" / "manifest.json")["samples"] == 1


def test_resume_with_other_options_is_refused(packed, input_parquet):
    result = run_cli(
        "pack", input_parquet, "--output", packed, *PACK_OPTIONS, "--image-size", "256", check=False
    )
    assert result.returncode == 2
    assert "00000_stats.json was packed with other image_size (image_size=512; this run:" in result.stderr


def test_missing_url_column_names_the_file_and_the_columns(tmp_path):
    pq.write_table(pa.table({"link": ["http://127.0.0.1:9/a.jpg"], "TEXT": ["a"]}), tmp_path / "odd.parquet")
    result = run_cli("pack", tmp_path / "odd.parquet", "--output", tmp_path / "out", check=False)
    assert result.returncode == 2
    assert "odd.parquet: no url column (tried URL, url); available columns: link, TEXT" in result.stderr


@pytest.mark.parametrize("message, reason", [
    ("HTTP Error 404: Not Found", "http 404"),
    ("HTTP Error 503: Service Unavailable", "http 503"),
    ("<urlopen error timed out>", "timeout"),
    ("The read operation timed out", "timeout"),
    ("Use of image disallowed by X-Robots-Tag directive", "opt-out header"),
    ("image area too large", "image too large"),
    ("Image decoding error", "decode error"),
    ("IncompleteRead(1000 bytes read, 37526 more expected)", "truncated transfer"),
    ("<urlopen error [Errno 111] Connection refused>", "connection error"),
    ("hash mismatch", "hash mismatch"),
    ("something new", "other"),
])
def test_failure_reason(message, reason):
    assert failure_reason(message) == reason


@pytest.mark.parametrize(
    "size, bucket", [((100, 900), "0-127"), ((512, 512), "512-1023"), ((4000, 3000), ">=2048")]
)
def test_size_bucket(size, bucket):
    assert size_bucket(*size) == bucket


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_shards_are_split_into_disjoint_rank_slices_that_cover_the_input(input_parquet, tmp_path, world_size):
    second = tmp_path / "second.parquet"
    pq.write_table(pq.read_table(input_parquet).slice(0, 9), second)
    config = PackConfig(inputs=(), output=tmp_path, shard_size=SHARD_SIZE)
    tasks = plan_shards([input_parquet, second], config)
    assert [task.name for task in tasks] == [f"{i:05d}" for i in range(len(tasks))]
    rows = [(task.input, row) for task in tasks for row in range(task.start, task.stop)]
    assert len(rows) == len(set(rows)) == 22 + 9  # shards never span files and cover every row
    owned = [task.shard_id for rank in range(world_size) for task in split(tasks, Rank(rank, world_size))]
    assert sorted(owned) == list(range(len(tasks)))


def test_bad_options_are_refused():
    with pytest.raises(LaionkitError, match="--resize-mode 'squash'"):
        PackConfig(inputs=(), output=Path("x"), resize_mode="squash")
