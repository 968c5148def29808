"""`laionkit doctor` on a CPU machine: versions, a real gloo all-reduce, a real shard read."""

from __future__ import annotations

import json

import webdataset as wds
from conftest import run_cli


def test_reports_versions_and_no_gpu():
    rows = {row["name"]: row for row in json.loads(run_cli("doctor", "--json").stdout)}
    assert rows["torch"]["verdict"] == "ok" and rows["torch"]["value"][0].isdigit()
    assert rows["webdataset"]["value"].startswith("0.2.")
    assert rows["GPUs"]["verdict"].startswith("missing")


def test_allreduce_and_shard_read(tmp_path, realdata):
    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        for index, photo in enumerate(sorted((realdata / "images").glob("*.jpg"))):
            sink.write({"__key__": f"{index:09d}", "jpg": photo.read_bytes(), "txt": photo.stem})
    out = run_cli("doctor", "--json", "--allreduce", "--processes", "2", "--backend", "gloo",
                  "--megabytes", "4", "--shards", tmp_path).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    busbw = rows["all-reduce busbw (gloo, 2 proc, 4 MB)"]
    assert float(busbw["value"].split()[0]) > 0
    read = next(row for name, row in rows.items() if name.startswith("shard read"))
    assert read["value"].endswith("samples/s") and float(read["value"].split()[0]) >= 0


def test_empty_shard_folder_is_a_clear_error(tmp_path):
    result = run_cli("doctor", "--shards", tmp_path, check=False)
    assert result.returncode == 2
    assert f"no .tar shards in {tmp_path}" in result.stderr.replace("\n", "")
