"""Issue 17's end-to-end test: the demo chain (filter -> pack -> encode -> train, `laionkit demo`'s recipe
with tiny models and the photos on a loopback image server) with its input and every stage output in a
bucket of a real S3 API server (moto, through s3fs), two rank processes per stage, and at each stage a
kill -9 of rank 0 at the worst moment, then a rerun that must give what the killed run was writing.

Each stage's bucket output equal to the same stage on local disk is tests/test_s3_stages.py; here the
stages feed each other from the bucket. Sizes are the smallest that still give each rank several units:
the test is about the storage contract, not the numbers. Train's latents stream from the bucket and its
run folder is there too (staged locally, laionkit/trainer/runfolder.py): each rank's checkpoint files uploaded.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_cli
from fixtures import free_port, killed, with_hook
from test_s3_stages import read_parts, tar_members, upload

from laionkit.common.imageserver import folder_routes, serve
from laionkit.common.storage import Location
from laionkit.demo import DEMO_DATA, MISSING_PATH, write_metadata
from laionkit.filter import read_record, stats_paths

PHOTOS = len(json.loads((DEMO_DATA / "captions.json").read_text()))
FILTER = ("--preset", "laion-safe", "--where", "length(TEXT) >= 10", "--where", "WIDTH >= 64 AND HEIGHT >= 64",
          "--unit-rows", "1", "--threads", "1", "-q")
PACK = ("--image-size", "64", "--processes", "1", "--threads", "4", "--timeout", "5", "--shard-size", "2",
        "--allow-private-hosts", "-q")
ENCODE = ("--resolution", "64", "--batch-size", "8", "--workers", "0", "-q")
TRAIN = ("--batch-size", "2", "--lr", "1e-3", "--max-steps", "4", "--checkpoint-every", "2", "--log-every", "1",
         "--workers", "0", "--shuffle-buffer", "4", "--log-with", "none", "--record-keys", "--resume", "latest",
         "-q")


def kill_before_record(s3, tmp_path: Path, name: str) -> dict[str, str]:
    """An environment in which the process SIGKILLs its process group when the object ``name`` is about to
    get its done record: its data objects are in the bucket by then, the record never is."""
    return with_hook(s3.env, tmp_path, f"""
        import os, signal
        from laionkit.common import storage
        mark_done = storage.mark_done
        def die_before_record(location, record=None):
            if location.name == {name!r}:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            mark_done(location, record)
        storage.mark_done = storage.writes.mark_done = die_before_record  # callers and atomic_write
    """)


def unrecorded(folder: Location, pattern: str) -> list[Location]:
    """Objects a killed run left without a done record: there, but no reader counts them."""
    complete = {p.name for p in folder.list(pattern)}
    return [p for p in folder.list(pattern, complete_only=False) if p.name not in complete]


def assert_all_recorded(folder: Location, pattern: str, names: list[str]) -> None:
    """Exactly ``names`` match ``pattern``, each with its done record: no duplicates, no holes, no leftovers."""
    assert [p.name for p in folder.list(pattern, complete_only=False)] == names
    assert [p.name for p in folder.list(pattern)] == names


def tar_of(location: Location) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(location.read_bytes())) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers()}


def train_ranks(latents: str, run: str, env: dict[str, str], *extra: str) -> int:
    """Two `laionkit train` rank processes (RANK/WORLD_SIZE as torchrun sets them, gloo on CPU) under one
    shell in a new process group, so a kill -9 of the group takes both, as a node failure would."""
    command = [sys.executable, "-m", "laionkit.cli", "train", latents, "--output", str(run), *TRAIN, *extra]
    script = ('RANK=0 LOCAL_RANK=0 "$@" & a=$!; RANK=1 LOCAL_RANK=1 "$@" & b=$!; '
              'wait $a; x=$?; wait $b; y=$?; exit $((x | y))')
    result = subprocess.run(["sh", "-c", script, "sh", *command], capture_output=True, text=True, timeout=300,
                            start_new_session=True, env={**env, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    if result.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(result.stdout[-3000:] + result.stderr[-3000:])
    return result.returncode



@pytest.fixture(scope="module")
def photos():
    with serve(folder_routes(DEMO_DATA)) as server:
        yield server


def test_demo_chain_in_the_bucket_with_two_ranks_and_kill_9_at_every_stage(s3, photos, tiny_models, tmp_path):
    # The demo's metadata (real photos, synthetic scores, a dead URL), in row groups of 2 so that filter
    # has 7 units (3-4 per rank); it goes into the bucket as other tools would put it there.
    # 2 ranks on few cores: no thread oversubscription; what killed runs stage stays in tmp_path
    env = {**s3.env, "OMP_NUM_THREADS": "1", "LAIONKIT_STAGING": str(tmp_path / "staging")}
    metadata = tmp_path / "metadata.parquet"
    write_metadata(metadata, photos.base_url)
    table = pq.read_table(metadata)
    pq.write_table(table, metadata, row_group_size=2)
    upload(s3, metadata, "laion", "metadata.parquet")

    # -- filter: rank 0 killed before its third part is recorded, rerun; rank 1 ---------------------
    filtered = s3.url("filtered")
    argv = ["filter", s3.url("laion"), "--output", filtered, *FILTER, "--world-size", "2"]
    killed([*argv, "--rank", "0"], kill_before_record(s3, tmp_path, "part-00000-000004.parquet"))
    folder = Location.parse(filtered)
    [left] = unrecorded(folder, "part-*.parquet")
    assert left.name == "part-00000-000004.parquet"
    half_written = pq.read_table(io.BytesIO(left.read_bytes()))
    before = {p.name: p.done_record.read_bytes() for p in folder.list("part-*.parquet")}
    assert sorted(before) == ["part-00000-000000.parquet", "part-00000-000002.parquet"]
    assert not (folder / "_laionkit").list("filter-stats-*")  # the rank's stats come last
    run_cli(*argv, "--rank", "0", env=env)
    run_cli(*argv, "--rank", "1", env=env)

    parts = [f"part-0000{unit % 2}-00000{unit}.parquet" for unit in range(7)]
    assert_all_recorded(folder, "part-*.parquet", sorted(parts))
    assert {p.name: p.done_record.read_bytes() for p in folder.list("part-*.parquet") if p.name in before} == before
    assert pq.read_table(io.BytesIO((folder / left.name).read_bytes())).equals(half_written)
    frame = table.to_pandas()
    expected = frame[(frame.punsafe < 0.5) & (frame.pwatermark < 0.8) & (frame.TEXT.str.len() >= 10)
                     & (frame.WIDTH >= 64) & (frame.HEIGHT >= 64)]
    kept = read_parts(filtered).to_pandas()
    assert kept.URL.tolist() == expected.URL.tolist() and len(kept) == PHOTOS + 1  # + the dead URL
    stats = [read_record(path) for path in stats_paths(folder)]  # listed anew: this process cached the folder
    assert [s["rank"] for s in stats] == [0, 1] and sum(s["rows_out"] for s in stats) == PHOTOS + 1

    # -- pack: 9 rows -> 5 shards of 2; rank 0 (shards 0, 2, 4) killed between the objects of shard 2:
    # its tar and parquet recorded, its stats (which make the shard done) not
    shards = s3.url("shards")
    argv = ["pack", filtered, "--output", shards, *PACK, "--world-size", "2"]
    killed([*argv, "--rank", "0"], kill_before_record(s3, tmp_path, "00002_stats.json"))
    folder = Location.parse(shards)
    assert [p.name for p in unrecorded(folder, "*_stats.json")] == ["00002_stats.json"]
    assert [p.name for p in folder.list("*_stats.json")] == ["00000_stats.json"]
    half_written = tar_of(folder / "00002.tar")
    first = (folder / "00000.tar").done_record.read_bytes()
    run_cli(*argv, "--rank", "1", env=env)  # the other rank first: the order of ranks does not matter
    run_cli(*argv, "--rank", "0", env=env)

    names = [f"{shard:05d}" for shard in range(5)]
    assert_all_recorded(folder, "*.tar", [f"{n}.tar" for n in names])
    assert_all_recorded(folder, "*_stats.json", [f"{n}_stats.json" for n in names])
    assert (folder / "00000.tar").done_record.read_bytes() == first  # not redone
    assert tar_of(folder / "00002.tar") == half_written  # redone: the same shard as the killed run's
    manifest = (folder / "manifest.json").read_json()
    assert manifest["complete"] and manifest["samples"] == PHOTOS and manifest["failures"] == {"http 404": 1}
    members = [m for tar in tar_members(shards).values() for m in tar if m.endswith(".txt")]
    assert len(members) == len(set(members)) == PHOTOS  # each photo once
    assert not [m for tar in tar_members(shards).values() for m in tar if MISSING_PATH in m]

    # -- encode: rank 0 (shards 0, 2, 4) killed before latent 00002.tar is recorded ------------------
    latents = s3.url("latents")
    argv = ["encode", shards, "--model", tiny_models, "--output", latents, *ENCODE, "--world-size", "2"]
    killed([*argv, "--rank", "0"], kill_before_record(s3, tmp_path, "00002.tar"))
    folder = Location.parse(latents)
    assert [p.name for p in unrecorded(folder, "*.tar")] == ["00002.tar"]
    half_written = tar_of(folder / "00002.tar")
    first = (folder / "00000.stats.json").done_record.read_bytes()
    from laionkit.encode import EncodeConfig
    from laionkit.encode import run as encode

    for rank in (0, 1):  # in this process (torch is loaded already): the two ranks never talk anyway
        encode(EncodeConfig(shards=(shards,), output=latents, model=str(tiny_models), resolution=64, batch_size=8,
                            workers=0, quiet=True, rank=rank, world_size=2))

    assert_all_recorded(folder, "*.tar", [f"{n}.tar" for n in names])
    assert (folder / "00000.stats.json").done_record.read_bytes() == first
    assert tar_of(folder / "00002.tar") == half_written
    manifest = (folder / "manifest.json").read_json()
    assert manifest["complete"] and manifest["counts"]["samples_out"] == PHOTOS
    keys = [m.split(".")[0] for tar in tar_members(latents).values() for m in tar if m.endswith(".json")]
    assert len(keys) == len(set(keys)) == PHOTOS

    # -- train: two ranks stream the bucket's latents (one through --cache-dir); both killed by kill -9
    # as rank 0 starts the step-4 checkpoint (steps 1-4 logged in staging, checkpoint 2 in the bucket); the
    # rerun downloads checkpoint 2 and must give steps 3-4 the same samples and losses.
    run = s3.url("run")
    killing = with_hook(s3.env, tmp_path, """
        import os, signal
        import laionkit.trainer.loop as train
        save = train.save_checkpoint
        def die_at_step_4(accelerator, output, step, *args, **kwargs):
            if step == 4 and accelerator.is_main_process:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return save(accelerator, output, step, *args, **kwargs)
        train.save_checkpoint = die_at_step_4
    """)
    unet = ("--unet-config", str(tiny_models / "unet"))
    cache = ("--cache-dir", str(tmp_path / "cache"), "--cache-size", str(2**20))
    assert train_ranks(latents, run, killing, *unet, *cache) == -signal.SIGKILL
    folder = Location.parse(run)
    assert [p.name for p in (folder / "checkpoints").list("step-*", complete_only=False)] == ["step-00000002"]
    both = {p.name for p in (folder / "checkpoints" / "step-00000002").list(complete_only=False)}
    assert {"rank-00000.json", "rank-00001.json", "trainer.json"} <= both  # each rank's files are there
    assert not (folder / "unet").exists()
    [staged] = (tmp_path / "staging").glob("laionkit-run-run-*")  # the killed run's working copy
    logged = (staged / "metrics.jsonl").read_text().splitlines()
    seen = {rank: (staged / "seen" / f"rank-0000{rank}.jsonl").read_text().splitlines() for rank in (0, 1)}
    assert [json.loads(line)["step"] for line in logged] == [1, 2, 3, 4]
    uploaded = (folder / "metrics.jsonl").read_bytes().decode().splitlines()
    assert uploaded == logged[:2]  # with checkpoint 2

    assert train_ranks(latents, run, env, *unet) == 0  # streamed, no cache
    text = lambda location: location.read_bytes().decode().splitlines()  # noqa: E731
    assert text(folder / "metrics.jsonl")[:2] == logged[:2]
    resumed = [json.loads(line) for line in text(folder / "metrics.jsonl")]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # no step twice, none missing
    assert [r["loss"] for r in resumed[2:]] == pytest.approx([json.loads(line)["loss"] for line in logged[2:]],
                                                             rel=1e-5, abs=1e-7)
    for rank in (0, 1):
        assert text(folder / "seen" / f"rank-0000{rank}.jsonl") == seen[rank]
    steps = [json.loads(line)["keys"] for rank in (0, 1) for line in seen[rank][:2]]  # the first epoch
    assert sorted(key for step in steps for key in step) == sorted(keys)  # every sample once per epoch
    assert [p.name for p in (folder / "checkpoints").list("step-*", complete_only=False)] == \
        ["step-00000002", "step-00000004"]  # --keep-checkpoints 3, both with their done records
    assert (folder / "unet").is_complete() and (folder / "unet" / "config.json").exists()
