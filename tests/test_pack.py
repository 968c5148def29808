"""`laionkit pack` against a loopback server holding the real photos and the ways the web fails."""

from __future__ import annotations

import base64
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
from laionkit.common.imageserver import Response, folder_routes, redirect, serve
from laionkit.pack import (
    DEFAULT_MAX_BYTES,
    Fetcher,
    PackConfig,
    check_tar_samples,
    failure_reason,
    input_files,
    plan_shards,
    size_bucket,
)

TIMEOUT_S = 1
SHARD_SIZE = 4
PACK_OPTIONS = (
    "--processes", "1", "--threads", "4", "--timeout", str(TIMEOUT_S), "--shard-size", str(SHARD_SIZE),
    "--quiet", "--allow-private-hosts",  # the test server is on 127.0.0.1
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


# --- hostile and unusual input (issue 13) ---------------------------------------------------------------

TRICKLE_S = 4 * TIMEOUT_S  # how long the trickling route takes to send its whole body


@pytest.fixture(scope="module")
def hostile(realdata):
    """A second server: two photos, redirects, a trickling body and huge bodies."""
    photos = folder_routes(realdata / "images")
    photo = photos["524_316.jpg"].body
    piece = len(photo) // 20 + 1
    routes = {
        "a.jpg": photos["123_456.jpg"], "b.jpg": photos["208_495.jpg"], "c.jpg": photos["321_421.jpg"],
        "to-b.jpg": redirect("/b.jpg"),
        "to-file.jpg": redirect("file:///etc/passwd"),
        "trickle.jpg": Response(photo, trickle_bytes=piece, trickle_s=TRICKLE_S / 20),
        "huge.jpg": Response(photo, padding=200 * 2**20),
        "huge-unsized.jpg": Response(photo, padding=200 * 2**20, send_length=False),
    }
    with serve(routes) as server:
        yield server


def pack_rows(folder: Path, columns: dict | pa.Table, *options: str, check: bool = True,
              private: bool = True):
    """Write ``columns`` as kept.parquet in ``folder`` and pack it into folder/shards."""
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns) if isinstance(columns, dict) else columns, folder / "kept.parquet")
    flags = PACK_OPTIONS if private else tuple(flag for flag in PACK_OPTIONS if flag != "--allow-private-hosts")
    return run_cli("pack", folder / "kept.parquet", "--output", folder / "shards", *flags, *options,
                   check=check)


def tar_samples(folder: Path) -> dict[str, dict]:
    """The json of every sample in the folder's tars, by url file name."""
    tars = [str(path) for path in sorted(folder.glob("*.tar"))]
    dataset = wds.WebDataset(tars, shardshuffle=False, empty_check=False)
    return {sample["json"]["url"].rsplit("/", 1)[1]: sample for sample in dataset.decode("pil")}


def test_time_decimal_and_binary_columns_are_carried_as_json_and_counts_match_the_tar(hostile, tmp_path):
    import datetime
    import decimal

    when = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc)
    table = pa.table({
        "url": [hostile.url(name) for name in ("a.jpg", "b.jpg", "c.jpg")],
        "caption": ["a", "b", "c"],
        "crawled": pa.array([when] * 3, pa.timestamp("us", tz="UTC")),
        "day": pa.array([when.date()] * 3, pa.date32()),
        "price": pa.array([decimal.Decimal("1.50")] * 3, pa.decimal128(5, 2)),
        "blob": pa.array([b"\x00\xffraw"] * 3, pa.binary()),
    })
    pack_rows(tmp_path, table)
    samples = tar_samples(tmp_path / "shards")
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    assert manifest["samples"] == len(samples) == 3
    meta = samples["a.jpg"]["json"]
    assert (meta["crawled"], meta["day"], meta["price"]) == ("2024-05-06T07:08:09+00:00", "2024-05-06", "1.50")
    assert base64.b64decode(meta["blob"]) == b"\x00\xffraw"
    record = read_json(tmp_path / "shards" / "00000_stats.json")
    assert record["converted_columns"] == {
        "crawled": "timestamp[us, tz=UTC]", "day": "date32[day]", "price": "decimal128(5, 2)", "blob": "binary",
    }


def test_a_record_is_refused_when_the_tar_holds_fewer_samples_than_counted(tmp_path):
    tar = tmp_path / "00000.tar"
    with wds.TarWriter(str(tar)) as sink:
        sink.write({"__key__": "000000000", "jpg": b"x", "txt": "a", "json": b"{}"})
    check_tar_samples(tar, 1)
    with pytest.raises(RuntimeError, match="counted 2 successes but the tar holds 1 samples"):
        check_tar_samples(tar, 2)


def test_invalid_utf8_caption_is_repaired_and_counted_not_the_shard_lost(hostile, tmp_path):
    captions = pa.array([b"fine", b"caf\xe9 au lait", b"ok"], pa.binary()).view(pa.string())
    result = pack_rows(tmp_path, pa.table({
        "url": [hostile.url(name) for name in ("a.jpg", "b.jpg", "c.jpg")], "caption": captions,
    }), check=False)
    assert result.returncode == 0, result.stderr
    samples = tar_samples(tmp_path / "shards")
    assert samples["b.jpg"]["txt"] == samples["b.jpg"]["json"]["caption"] == "caf\ufffd au lait"
    assert len(samples) == 3
    assert read_json(tmp_path / "shards" / "00000_stats.json")["invalid_utf8"] == {"caption": 1}
    assert read_json(tmp_path / "shards" / "manifest.json")["invalid_utf8"] == {"caption": 1}


def test_only_public_http_urls_are_fetched_by_default(hostile, tmp_path):
    png = base64.b64encode((Path(__file__).parents[1] / "laionkit/data/demo/original.png").read_bytes()).decode()
    urls = ["file:///etc/passwd", f"data:image/png;base64,{png}", "ftp://127.0.0.1/a.jpg", hostile.url("a.jpg"),
            f"http://localhost:{hostile.base_url.rsplit(':', 1)[1]}/a.jpg"]
    hits = Counter(hostile.hits)
    pack_rows(tmp_path, {"url": urls, "caption": ["x"] * len(urls)}, private=False)
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    assert manifest["samples"] == 0 and not tar_samples(tmp_path / "shards")
    assert manifest["failures"] == {"refused scheme": 3, "refused address": 2}
    assert hostile.hits == hits  # nothing reached the loopback server
    messages = set(manifest["error_messages"])
    assert "URL refused: scheme file: (only http and https are fetched)" in messages
    assert any(message.startswith("URL refused: 127.0.0.1 resolves to 127.0.0.1, a loopback address")
               for message in messages), messages


def test_redirects_are_followed_only_to_allowed_schemes(hostile, tmp_path):
    urls = [hostile.url("to-b.jpg"), hostile.url("to-file.jpg")]
    pack_rows(tmp_path, {"url": urls, "caption": ["x", "y"]})
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    assert (manifest["samples"], manifest["failures"]) == (1, {"refused scheme": 1})
    assert list(tar_samples(tmp_path / "shards")) == ["to-b.jpg"]


def test_every_redirect_hop_is_checked_against_private_addresses(hostile, monkeypatch):
    """The first hop's address is treated as public, the hop it redirects to as private."""
    import laionkit.pack.fetch as pack

    port = hostile.base_url.rsplit(":", 1)[1]
    monkeypatch.setattr(pack, "non_public_kind", lambda address: "private" if address == "::1" else None)
    fetch = Fetcher(max_bytes=DEFAULT_MAX_BYTES, allow_private_hosts=False)
    with serve({"hop.jpg": redirect(f"http://[::1]:{port}/a.jpg")}) as first:
        _, body, error = fetch((0, first.url("hop.jpg")), 5, None, None)
    assert body is None and error == "URL refused: ::1 resolves to ::1, a private address (--allow-private-hosts fetches it)"
    _, body, error = fetch((1, hostile.url("a.jpg")), 5, None, None)
    assert error is None and body.getvalue()[:2] == b"\xff\xd8"


def test_timeout_is_a_total_deadline_and_bodies_have_a_size_cap(hostile, tmp_path):
    urls = [hostile.url(name) for name in ("trickle.jpg", "huge.jpg", "huge-unsized.jpg", "a.jpg")]
    pack_rows(tmp_path, {"url": urls, "caption": ["x"] * 4}, "--max-bytes", "1000000")
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    assert manifest["failures"] == {"timeout": 1, "body too large": 2}
    assert manifest["samples"] == 1

    fetch = Fetcher(max_bytes=DEFAULT_MAX_BYTES, allow_private_hosts=True)
    start = time.monotonic()
    _, body, error = fetch((0, hostile.url("trickle.jpg")), TIMEOUT_S, None, None)
    assert body is None and "timed out" in error
    assert time.monotonic() - start < TIMEOUT_S + 1.5 < TRICKLE_S  # a read never outlasts the deadline


@pytest.mark.parametrize("flag", ["--output", "input"])
def test_url_paths_without_credentials_fail_in_one_line_and_write_nothing_locally(input_parquet, tmp_path, flag):
    """URLs are storage now (not a local ``./s3:`` folder, as before object storage was wired in)."""
    args = (["pack", str(input_parquet), "--output", "s3://bucket/shards"] if flag == "--output"
            else ["pack", "s3://bucket/kept.parquet", "--output", "shards"])
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    result = subprocess.run([sys.executable, "-m", "laionkit.cli", *args], cwd=tmp_path, capture_output=True,
                            text=True, env=env)
    assert result.returncode == 2, result.stderr
    assert "s3:// needs credentials" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


def test_a_url_that_lost_a_slash_is_refused(input_parquet, tmp_path):
    with pytest.raises(LaionkitError, match="lost a slash"):
        PackConfig(inputs=(input_parquet,), output=Path("s3://bucket/shards"))


def test_output_that_overlaps_the_input_is_refused(input_parquet, tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "kept.parquet").write_bytes(input_parquet.read_bytes())
    result = run_cli("pack", folder, "--output", folder, *PACK_OPTIONS, check=False)
    assert result.returncode == 2
    assert f"pack: --output {folder} is the input {folder}" in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["kept.parquet"]
    assert (folder / "kept.parquet").read_bytes() == input_parquet.read_bytes()


@pytest.mark.parametrize("output, message", [
    ("a-file", "is a file; give a folder"),
    ("a-file/shards", "cannot create the folder (Not a directory)"),
    ("/sys/laionkit-test-shards", "cannot create the folder (Operation not permitted)"),
])
def test_an_output_that_cannot_be_a_folder_is_one_line(input_parquet, tmp_path, output, message):
    (tmp_path / "a-file").write_text("not a folder")
    target = output if output.startswith("/") else tmp_path / output
    result = run_cli("pack", input_parquet, "--output", target, *PACK_OPTIONS, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--output {target}" in result.stderr and message in result.stderr


def test_a_damaged_record_marks_its_shard_not_done_and_is_redone(hostile, tmp_path):
    rows = {"url": [hostile.url(name) for name in ("a.jpg", "b.jpg", "c.jpg", "a.jpg", "b.jpg")],
            "caption": ["x"] * 5}
    pack_rows(tmp_path, rows)
    output = tmp_path / "shards"
    good = read_json(output / "00000_stats.json")
    (output / "00000_stats.json").write_text('{"count": 4, "succ')
    (output / "00001_stats.json").write_text("[]")
    stats = run_cli("stats", output)
    assert "00000_stats.json, 00001_stats.json" in stats.stdout.replace("\n", "")
    from laionkit.pack import merge_records

    assert merge_records(output)["complete"] is False  # stats is read-only: the records say it, not a rewrite

    hits = Counter(hostile.hits)
    result = pack_rows(tmp_path, rows)
    assert "00000_stats.json is unreadable or incomplete: shard 00000 is redone" in result.stderr
    assert "00001_stats.json is unreadable or incomplete: shard 00001 is redone" in result.stderr
    assert sum((hostile.hits - hits).values()) == 5
    record = read_json(output / "00000_stats.json")
    assert {key: record[key] for key in ("count", "successes", "input")} == {
        key: good[key] for key in ("count", "successes", "input")}
    manifest = read_json(output / "manifest.json")
    assert manifest["complete"] and manifest["samples"] == 5 and manifest["unreadable_records"] == []


def test_folders_yield_only_data_parquet_not_sidecars_or_temporaries(input_parquet, tmp_path):
    for name in ("part-00000-000000.parquet", "_stats-00000.parquet", ".part.parquet.partial.parquet"):
        (tmp_path / name).write_bytes(input_parquet.read_bytes())
    assert [path.name for path in input_files([tmp_path])] == ["part-00000-000000.parquet"]
