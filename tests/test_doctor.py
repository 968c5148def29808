"""`laionkit doctor` on a CPU machine: versions, a real gloo all-reduce, a real shard read."""

from __future__ import annotations

import json
import re

import pytest
import webdataset as wds
from conftest import run_cli

from laionkit.doctor import shard_read_throughput


def test_reports_versions_and_no_gpu():
    rows = {row["name"]: row for row in json.loads(run_cli("doctor", "--json").stdout)}
    assert rows["torch"]["verdict"] == "ok" and rows["torch"]["value"][0].isdigit()
    assert rows["webdataset"]["value"].startswith("0.2.")
    assert rows["GPUs"]["verdict"].startswith("missing")


def write_photo_shard(folder, realdata) -> tuple[int, int]:
    """One tar of the real photos with their names as captions; (samples, payload bytes) as doctor counts
    them: every member's bytes, not the key."""
    photos = sorted((realdata / "images").glob("*.jpg"))
    with wds.TarWriter(str(folder / "00000.tar")) as sink:
        for index, photo in enumerate(photos):
            sink.write({"__key__": f"{index:09d}", "jpg": photo.read_bytes(), "txt": photo.stem})
    return len(photos), sum(photo.stat().st_size + len(photo.stem.encode()) for photo in photos)


def test_shard_read_rates_are_the_bytes_and_samples_on_disk_over_one_time(tmp_path, realdata):
    samples, payload = write_photo_shard(tmp_path, realdata)
    mbps, per_second = shard_read_throughput(tmp_path)
    assert per_second > 0
    assert mbps * 1e6 / per_second == pytest.approx(payload / samples, rel=1e-9)  # both over the same seconds


def test_allreduce_and_shard_read(tmp_path, realdata):
    samples, payload = write_photo_shard(tmp_path, realdata)
    out = run_cli("doctor", "--json", "--allreduce", "--processes", "2", "--backend", "gloo",
                  "--megabytes", "4", "--shards", tmp_path, "--min-read", "1000000").stdout
    rows = {row["name"]: row for row in json.loads(out)}
    busbw = rows["all-reduce busbw (gloo, 2 proc, 4 MB)"]
    assert float(busbw["value"].split()[0]) > 0
    read = rows[f"shard read ({tmp_path})"]
    mbps, per_second = (float(word) for word in re.fullmatch(r"(\d+) MB/s, (\d+) samples/s", read["value"]).groups())
    size = payload / samples / 1e6  # MB per sample; the figures are rounded to whole numbers
    assert (per_second - 0.5) * size - 0.5 <= mbps <= (per_second + 0.5) * size + 0.5, read["value"]
    assert read["verdict"].startswith("slow: below 1e+06 MB/s"), read  # no disk reads a TB/s


def test_empty_shard_folder_is_a_clear_error(tmp_path):
    result = run_cli("doctor", "--shards", tmp_path, check=False)
    assert result.returncode == 2
    assert f"no .tar shards in {tmp_path}" in result.stderr.replace("\n", "")
