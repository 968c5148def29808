"""laionkit.common.storage against a real S3 API server (moto's server mode) through s3fs, and locally.

The ``s3`` fixture (a fresh bucket) comes from tests/s3server.py via conftest.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from laionkit.common import LaionkitError, storage
from laionkit.common.storage import Location, ReadCache, atomic_write, refuse_overlap, write_json

REPO = Path(__file__).resolve().parents[1]


def make_tar(samples: dict[str, dict[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def run_killed(server, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh process that has the bucket's credentials; it is expected to die by SIGKILL."""
    script = "import os, signal\nfrom laionkit.common import storage\nfrom laionkit.common.storage import *\n"
    env = {**server.env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_write_read_list_on_s3(s3):
    folder = Location.parse(s3.url("out"))
    write_json(folder / "a.json", {"n": 1})
    with atomic_write(folder / "00000.tar") as tmp:
        tmp.write_bytes(make_tar({"k0": {"txt": b"hello"}}))
    with atomic_write(folder / "shard", folder=True) as tmp:
        (tmp / "x.bin").write_bytes(b"x" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "y.bin").write_bytes(b"y" * 3)

    # What a stage sees: only complete outputs, no done records or dot-names, literal names.
    assert [loc.name for loc in folder.list()] == ["00000.tar", "a.json", "shard"]
    assert [loc.name for loc in folder.list("*.tar")] == ["00000.tar"]
    assert (folder / "a.json").read_json() == {"n": 1}
    assert (folder / "shard" / "sub" / "y.bin").read_bytes() == b"yyy"
    assert (folder / "00000.tar").size() == (folder / "00000.tar").fs.size(f"{s3.bucket}/out/00000.tar")
    record = (folder / "shard").done_record.read_json()
    assert record["sizes"] == {"x.bin": 10, "sub/y.bin": 3}
    # Seekable read: tarfile counts members by seeking over headers.
    with (folder / "00000.tar").open_read() as handle, tarfile.open(fileobj=handle, mode="r:") as tar:
        assert tar.getnames() == ["k0.txt"]


def test_killed_before_done_record_leaves_nothing_complete_and_rerun_overwrites(s3):
    url = s3.url("out", "00000.tar")
    result = run_killed(s3, f"""
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        storage.writes.mark_done = die   # atomic_write uploads the data object, then the process is killed
        with atomic_write({url!r}) as tmp:
            tmp.write_bytes(b"half" * 1000)
    """)
    assert result.returncode == -9, result.stderr
    target = Location.parse(url)
    assert target.exists() and target.size() == 4000  # the data object is there...
    assert not target.is_complete()  # ...but not complete,
    assert target.parent.list() == []  # and listings skip it.

    with atomic_write(url) as tmp:  # the rerun overwrites it and completes it
        tmp.write_bytes(b"whole")
    assert target.is_complete() and target.read_bytes() == b"whole"
    assert target.parent.list() == [target]


def test_rewrite_killed_midway_is_not_complete(s3):
    """A complete object being rewritten loses its done record first: a kill during the upload must
    not leave the old record vouching for new, half-written data."""
    url = s3.url("out", "manifest.json")
    write_json(url, {"version": 1})
    result = run_killed(s3, f"""
        loc = Location.parse({url!r})
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        loc.fs.put_file = die
        with atomic_write(loc) as tmp:
            tmp.write_text("{{}}")
    """)
    assert result.returncode == -9, result.stderr
    assert not Location.parse(url).is_complete()
    assert Location.parse(url).parent.list() == []


def test_folder_rewrite_drops_stale_objects(s3):
    folder = Location.parse(s3.url("ckpt"))
    with atomic_write(folder, folder=True) as tmp:
        (tmp / "old.bin").write_bytes(b"1")
    with atomic_write(folder, folder=True) as tmp:
        (tmp / "new.bin").write_bytes(b"2")
    assert [loc.name for loc in folder.list(complete_only=False)] == ["new.bin"]


def test_webdataset_streams_a_tar_from_s3(s3):
    """The read path train/encode use: an fsspec file object (with read-ahead) handed to webdataset."""
    import webdataset as wds

    samples = {f"{i:04d}": {"txt": f"caption {i}".encode(), "npy": os.urandom(3000)} for i in range(40)}
    url = s3.url("latents", "00000.tar")
    with atomic_write(url) as tmp:
        tmp.write_bytes(make_tar(samples))
    stream = Location.parse(url).open_read(block_size=4096, prefetch=3)
    files = wds.tariterators.tar_file_expander([{"url": url, "stream": stream}])
    got = {s["__key__"]: (s["txt"], s["npy"]) for s in wds.tariterators.group_by_keys(files)}
    assert got == {key: (m["txt"], m["npy"]) for key, m in samples.items()}


def test_cache_bounds_its_size_evicts_lru_and_refetches_rewritten_objects(s3, tmp_path):
    folder = Location.parse(s3.url("c"))
    for i in range(4):
        storage.write_bytes(folder / f"{i}.bin", bytes([i]) * 1000)
    cache = ReadCache(tmp_path / "cache", max_bytes=2500)
    for i in (0, 1):
        with cache.open(folder / f"{i}.bin") as handle:
            assert handle.read() == bytes([i]) * 1000
    os.utime(next((tmp_path / "cache").glob("*-1.bin")), (1, 1))  # 1 is now the least recently used
    with cache.open(folder / "0.bin"):  # a hit refreshes 0
        pass
    with cache.open(folder / "2.bin") as handle:
        assert handle.read() == b"\x02" * 1000
    names = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache").iterdir())
    assert names == ["0.bin", "2.bin"] and cache.used_bytes() <= 2500
    assert (cache.hits, cache.misses) == (1, 3)

    storage.write_bytes(folder / "0.bin", b"new")  # rewritten: a new ETag, so fetched again
    with cache.open(folder / "0.bin") as handle:
        assert handle.read() == b"new"
    with cache.open(folder / "3.bin") as handle:  # 4 entries never fit: still within the bound
        assert handle.read() == b"\x03" * 1000
    assert cache.used_bytes() <= 2500
    assert not list((tmp_path / "cache").glob(".*"))  # no temporaries left behind

    storage.write_bytes(folder / "big.bin", b"b" * 5000)  # larger than the cache: streamed, not cached
    with cache.open(folder / "big.bin") as handle:
        assert handle.read() == b"b" * 5000
    assert cache.used_bytes() <= 2500


def test_duckdb_reads_parquet_from_s3_without_httpfs(s3, tmp_path):
    import duckdb

    from laionkit.filter import lock_down

    sample = REPO / "laionkit" / "data" / "laion-sample.parquet"
    url = s3.url("meta", "part-0.parquet")
    storage.write_bytes(url, sample.read_bytes())
    connection = duckdb.connect()
    source = storage.register_with_duckdb(connection, Location.parse(url))
    lock_down(connection, [source], tmp_path)  # filter's sandbox: only the planned inputs are readable
    rows = connection.execute(f"select count(*) from read_parquet('{source}')").fetchone()[0]
    assert rows == duckdb.connect().execute(f"select count(*) from read_parquet('{sample}')").fetchone()[0]
    assert rows > 0


def test_overlap_of_urls_is_refused(s3):
    with pytest.raises(LaionkitError, match="lies inside the input s3://b/in"):
        refuse_overlap(["s3://b/in"], "s3://b/in/out", "pack")
    with pytest.raises(LaionkitError, match="contains the input"):
        refuse_overlap(["s3://b/data/in"], "s3://b/data", "pack")
    with pytest.raises(LaionkitError, match="is the input"):
        refuse_overlap(["s3://b/x/"], "s3://b/x", "encode")
    refuse_overlap(["s3://b/in"], "s3://b/input2", "pack")  # a prefix of the name is no overlap
    refuse_overlap(["s3://b/in"], "s3://c/in", "pack")  # another bucket
    refuse_overlap(["/data/in", "s3://b/in"], "gs://b/in", "pack")  # another store


def test_local_paths_unchanged(tmp_path):
    folder = Location.parse(str(tmp_path / "we[ir]d*"))  # glob characters stay literal
    assert folder.local and Location.parse(f"file://{tmp_path}").path == str(tmp_path)
    write_json(folder / "a.json", {"n": 1})
    with atomic_write(folder / "b.bin") as tmp:
        assert tmp.parent == Path(folder.path) and tmp.name.endswith(".partial")  # atomic_output's temp
        tmp.write_bytes(b"b")
    (Path(folder.path) / ".c.partial").write_bytes(b"leftover")
    assert sorted(os.listdir(folder.path)) == [".c.partial", "a.json", "b.bin"]  # no done records
    assert [loc.name for loc in folder.list()] == ["a.json", "b.bin"]
    assert json.loads(open(folder / "a.json").read()) == {"n": 1}  # a local Location is path-like
    with pytest.raises(LaionkitError, match="lies inside"):
        refuse_overlap([str(tmp_path)], str(tmp_path / "sub"), "pack")


def test_bad_urls_and_options_are_one_line_errors(s3, monkeypatch):
    cases = [
        (lambda: Location.parse("s3://"), "no bucket name"),
        (lambda: Location.parse("nosuchproto://x/y").exists(), "unknown storage protocol nosuchproto://"),
        (lambda: Location.parse("s3://no-such-bucket-zz/x").read_bytes(), "not found"),
        (lambda: Location.parse("s3://no-such-bucket-zz/x").list(), "bucket no-such-bucket-zz does not exist"),
        (lambda: Location.parse(s3.url("missing.json")).read_json(), "missing.json: not found"),
        (lambda: storage.write_bytes("https://example.com/x", b""), "read-only"),
        (lambda: storage.parse_storage_options("{bad"), "--storage-options is not valid JSON"),
        (lambda: storage.parse_storage_options("[1]"), "must be a JSON object"),
    ]
    for call, message in cases:
        with pytest.raises(LaionkitError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_missing_credentials_is_a_one_line_error(s3, monkeypatch, tmp_path):
    """Not s3fs's silent anonymous fallback, which a private bucket answers with a puzzling 403."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    storage.options._FILESYSTEMS.clear()
    with pytest.raises(LaionkitError, match="s3:// needs credentials: set AWS_ACCESS_KEY_ID") as caught:
        Location.parse(s3.url("x.json")).read_bytes()
    assert "\n" not in str(caught.value)


def test_storage_options_per_protocol(s3):
    options = storage.parse_storage_options(json.dumps({"s3": s3.storage_options, "hf": {"token": "t"}}))
    location = Location.parse(s3.url("o.bin"), options)
    assert location.options == s3.storage_options
    storage.write_bytes(location, b"ok")
    assert location.read_bytes() == b"ok"


def test_two_ranks_write_one_bucket_and_share_one_cache(s3, tmp_path):
    """Two real processes, as two ranks of a job: each writes its own shards and both rewrite the shared
    manifest, then each reads every shard through one cache folder smaller than the data."""
    code = textwrap.dedent(f"""
        import sys
        from laionkit.common import storage
        from laionkit.common.storage import Location, ReadCache
        rank = int(sys.argv[1])
        out = Location.parse({s3.url("out")!r})
        for shard in range(rank, 6, 2):
            storage.write_bytes(out / f"{{shard:05d}}.tar", bytes([shard]) * 4000)
        storage.write_json(out / "manifest.json", {{"shards": 6}}, shared=True)
        while len(out.list("*.tar")) < 6:
            pass
        cache = ReadCache({str(tmp_path / "cache")!r}, max_bytes=10000)
        for shard in out.list("*.tar"):
            with cache.open(shard) as handle:
                assert handle.read() == bytes([int(shard.name[:5])]) * 4000
    """)
    env = {**s3.env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(rank)], env=env, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    for rank in ranks:
        assert rank.wait(timeout=120) == 0, rank.stderr.read()
    out = Location.parse(s3.url("out"))
    assert [loc.name for loc in out.list()] == [*(f"{i:05d}.tar" for i in range(6)), "manifest.json"]
    assert out.join("manifest.json").read_json() == {"shards": 6}
    cache = tmp_path / "cache"
    assert sum(p.stat().st_size for p in cache.iterdir()) <= 10000
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]
