"""Every stage against a real S3 API server (moto's server mode, the ``s3`` fixture) through s3fs.

Each stage's output in the bucket must equal the same stage's output on local disk, a kill -9 at the
worst moment (data object uploaded, done record not yet) must leave nothing a reader counts, and a
rerun must finish to the same output with no duplicates. The kill -9 of pack and encode (and train) is
in tests/test_s3_chain.py, where the whole demo chain runs in the bucket with two ranks per stage.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

from laionkit.common.imageserver import folder_routes, serve
from laionkit.common.storage import Location
from laionkit.filter import read_record, stats_paths

SAMPLE = REPO / "laionkit" / "data" / "laion-sample.parquet"  # 1000 rows in 4 row groups
RULES = ("--where", "punsafe < 0.5", "--where", "WIDTH >= 300")


def upload(s3, local: Path, *key: str) -> str:
    """Put a file in the bucket as other tools would (no done record)."""
    url = s3.url(*key)
    location = Location.parse(url)
    location.fs.put_file(str(local), location.path)
    return url


def read_parts(folder: str | Path) -> pa.Table:
    """A filter folder's parts (local or bucket) in global unit order; the rank in the name does not matter."""
    parts = sorted(Location.parse(str(folder)).list("part-*.parquet"), key=lambda p: p.name.split("-")[2])
    tables = []
    for part in parts:
        with part.open_read() as handle:
            tables.append(pq.read_table(handle))
    return pa.concat_tables(tables)


def tar_members(folder: str | Path) -> dict[str, dict[str, bytes]]:
    """Every complete tar's members and bytes (tar headers, with their mtimes, left out)."""
    found = {}
    for path in Location.parse(str(folder)).list("*.tar"):
        with tarfile.open(fileobj=io.BytesIO(path.read_bytes())) as tar:
            found[path.name] = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
    return found


def killed_run(s3, tmp_path: Path, code: str, kill_when: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh process group that SIGKILLs itself when ``kill_when`` (an expression over
    the ``location`` about to get its done record) is first true: its data objects are in the bucket by
    then. The hook is a sitecustomize, so it is in every process of the run (pack's spawned workers too)."""
    hooks = tmp_path / "kill-hook"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, signal
        from laionkit.common import storage
        mark_done = storage.mark_done
        def die_before_record(location, record=None):
            if {kill_when}:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            mark_done(location, record)
        storage.mark_done = storage.writes.mark_done = die_before_record  # callers and atomic_write
    """))
    path = os.pathsep.join([str(hooks), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**s3.env, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300, start_new_session=True)


def test_filter_reads_and_writes_the_bucket_with_two_ranks_like_local_disk(s3, tmp_path):
    reference = tmp_path / "reference"
    run_cli("filter", SAMPLE, "--output", reference, *RULES, "--unit-rows", "1", "-q")
    upload(s3, SAMPLE, "laion", "laion_0000.parquet")
    output = s3.url("filtered")
    for rank in (0, 1):  # two real rank processes, no coordinator
        run_cli("filter", s3.url("laion"), "--output", output, *RULES, "--unit-rows", "1", "-q",
                "--rank", str(rank), "--world-size", "2", env=s3.env)

    assert read_parts(output).equals(read_parts(reference))
    folder = Location.parse(output)
    assert {p.name.split("-")[1] for p in folder.list("part-*.parquet")} == {"00000", "00001"}
    assert [p.name for p in (folder / "_laionkit").list()] == ["filter-plan.parquet", "filter-stats-00000.parquet",
                                                               "filter-stats-00001.parquet"]
    assert not list(Path.cwd().glob("s3:*")) and not (tmp_path / "s3:").exists()  # no local "s3:" folder
    kept = sum(read_record(folder / f"_laionkit/filter-stats-0000{rank}.parquet")["rows_out"] for rank in (0, 1))
    assert kept == read_parts(output).num_rows > 0  # the count reported is what is in the bucket

    summary = run_cli("stats", output, env=s3.env).stdout
    assert "units: 4 of 4 done (complete)" in summary and f"{kept:,}" in summary


def test_filter_killed_before_a_part_is_recorded_resumes_on_the_bucket_to_the_same_output(s3, tmp_path):
    reference = tmp_path / "reference"
    run_cli("filter", SAMPLE, "--output", reference, *RULES, "--unit-rows", "1", "-q")
    source = upload(s3, SAMPLE, "laion_0000.parquet")
    output = s3.url("filtered")
    run = f"""
        from laionkit.filter import FilterConfig, run
        run(FilterConfig(inputs=({source!r},), output={output!r}, where={RULES[1::2]!r}, unit_rows=1,
                         threads=1, quiet=True))
    """
    result = killed_run(s3, tmp_path, run, "location.name == 'part-00000-000002.parquet'")
    assert result.returncode == -9, result.stderr

    folder = Location.parse(output)
    half = folder / "part-00000-000002.parquet"
    assert half.exists() and not half.is_complete()  # uploaded, never recorded: a reader skips it
    assert [p.name for p in folder.list("part-*.parquet")] == ["part-00000-000000.parquet",
                                                               "part-00000-000001.parquet"]
    assert not (folder / "_laionkit").list("filter-stats-*")
    done_before = {p.name: p.done_record.read_bytes() for p in folder.list("part-*.parquet")}

    rerun = run_cli("filter", source, "--output", output, *RULES, "--unit-rows", "1", env=s3.env)
    assert "(2 already done)" in rerun.stdout + rerun.stderr
    assert {p.name: p.done_record.read_bytes() for p in folder.list("part-*.parquet")
            if p.name in done_before} == done_before  # finished units were not redone
    assert len(folder.list("part-*.parquet")) == 4  # no duplicates, no holes
    assert read_parts(output).equals(read_parts(reference))
    [stats] = [read_record(path) for path in stats_paths(folder)]  # listed anew: this process cached the folder
    assert stats["rows_out"] == read_parts(reference).num_rows


@pytest.fixture(scope="module")
def images(realdata):
    with serve(folder_routes(realdata / "images")) as server:
        yield server


PACK = ("--processes", "1", "--threads", "4", "--timeout", "5", "--shard-size", "3", "--image-size", "64",
        "--quiet", "--allow-private-hosts")  # the image server is on 127.0.0.1


def test_pack_reads_parquet_from_the_bucket_and_writes_shards_there_like_local_disk(s3, images, realdata,
                                                                                   tmp_path):
    names = sorted(p.name for p in (realdata / "images").iterdir())
    local = tmp_path / "urls.parquet"
    pq.write_table(pa.table({"URL": [images.url(n) for n in names], "TEXT": [f"photo {n}" for n in names]}), local)
    reference = tmp_path / "shards"
    run_cli("pack", local, "--output", reference, *PACK)
    source = upload(s3, local, "kept", "part-00000-000000.parquet")
    output = s3.url("shards")
    run_cli("pack", s3.url("kept"), "--output", output, *PACK, env=s3.env)

    assert tar_members(output) == tar_members(reference) and len(tar_members(reference)) == 3
    folder = Location.parse(output)
    manifest = (folder / "manifest.json").read_json()
    assert manifest["complete"] and manifest["samples"] == sum(
        len({m.split(".")[0] for m in members}) for members in tar_members(output).values())
    assert manifest["inputs"] == [source]
    for name in ("00000.tar", "00000.parquet", "00000_stats.json"):
        assert (folder / name).is_complete()
    summary = run_cli("stats", output, env=s3.env).stdout
    assert "3 / 3 planned" in summary


ENCODE = ("--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet")


def test_encode_streams_shards_from_the_bucket_and_writes_latents_there_with_two_ranks(
        s3, image_shards, tiny_models, latent_shards):
    for tar in sorted(image_shards.glob("*.tar")):
        upload(s3, tar, "shards", tar.name)
    output = s3.url("latents")
    for rank in (1, 0):
        run_cli("encode", s3.url("shards"), "--model", tiny_models, "--output", output, *ENCODE,
                "--rank", str(rank), "--world-size", "2", env=s3.env)

    assert tar_members(output) == tar_members(latent_shards) and len(tar_members(output)) == 2
    folder = Location.parse(output)
    manifest = (folder / "manifest.json").read_json()
    assert manifest["complete"] and manifest["counts"]["samples_out"] == 8
    assert (folder / "empty_caption.npy").read_bytes() == (latent_shards / "empty_caption.npy").read_bytes()
    summary = run_cli("stats", output, env=s3.env).stdout
    assert "8 of 8" in summary


def test_train_streams_latents_from_the_bucket_through_a_bounded_cache_with_the_same_losses(
        s3, latent_shards, tmp_path):
    from laionkit.common.storage import write_bytes

    for path in sorted(latent_shards.iterdir()):  # as encode leaves them in a bucket: each with its record
        if path.is_file():
            write_bytes(Location.parse(s3.url("latents", path.name)), path.read_bytes())
    args = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
            "--workers", "2", "--max-steps", "6", "--log-every", "1", "--checkpoint-every", "3")
    local, remote, cache = tmp_path / "local", tmp_path / "remote", tmp_path / "cache"
    run_cli("train", latent_shards, "--output", local, *args)
    biggest = max(p.stat().st_size for p in latent_shards.glob("*.tar"))
    # Credentials and endpoint only in --storage-options (none in the environment): they must reach every
    # read, in the DataLoader workers and the cache too.
    bare = {key: value for key, value in s3.env.items() if not key.startswith("AWS_")}
    run_cli("train", s3.url("latents"), "--output", remote, *args, "--cache-dir", cache,
            "--cache-size", str(biggest + 1),  # room for one shard: the second evicts the first
            "--storage-options", json.dumps(s3.storage_options),
            env={**bare, "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent",
                 "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})

    losses = lambda run: [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())  # noqa: E731
                          if "loss" in r]
    assert losses(remote) == losses(local) and len(losses(local)) == 6
    assert 0 < sum(p.stat().st_size for p in cache.iterdir() if not p.name.startswith(".")) <= biggest + 1



def test_filter_dedup_with_two_ranks_meets_in_the_bucket_and_resumes_after_kill_9(s3, realdata, tmp_path):
    """--dedup on a URL: the ranks' phase outputs are objects with done records in the bucket's scratch
    folder; a rank killed before one of its key folders is recorded reruns to the one-rank result."""
    from test_dedup import ARGS, expected, write_inputs

    folder = write_inputs(realdata, tmp_path / "in")  # 14 units of ~100 rows, 14 buckets
    for path in sorted(folder.glob("*.parquet")):
        upload(s3, path, "laion", path.name)
    output = s3.url("unique")
    argv = [s3.url("laion"), "--output", output, *ARGS, "--world-size", "2"]
    other = subprocess.Popen([sys.executable, "-m", "laionkit.cli", "filter", *argv, "--rank", "1",
                              "--dedup-wait", "120"], env=s3.env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    run = f"""
        import sys
        from laionkit.cli import main
        sys.argv = ["laionkit", "filter", *{argv!r}, "--rank", "0"]
        main()
    """
    result = killed_run(s3, tmp_path, run, "location.name == 'keys-000004'")  # one of rank 0's units (0, 2, 4, ...)
    assert result.returncode == -9, result.stderr
    [scratch] = Location.parse(output).glob(".dedup-*")
    assert (scratch / "keys-000004").exists() and not (scratch / "keys-000004").is_complete()
    assert (scratch / "keys-000000").is_complete()

    run_cli("filter", *argv, "--rank", "0", env=s3.env)
    _, err = other.communicate(timeout=300)
    assert other.returncode == 0, err
    assert read_parts(output).to_pylist() == expected(folder).to_pylist()
    assert not Location.parse(output).glob(".dedup-*")  # scratch removed once every part is recorded
    kept = sum(read_record(Location.parse(output) / f"_laionkit/filter-stats-0000{r}.parquet")["rows_out"]
               for r in (0, 1))
    assert kept == expected(folder).num_rows


def test_filter_scores_embeddings_read_by_row_range_from_the_bucket_like_local_disk(s3, realdata, tmp_path):
    rng = np.random.default_rng(5)
    npy = tmp_path / "img_emb_0000.npy"
    np.save(npy, rng.standard_normal((1000, 768)).astype(np.float16))
    weights = realdata / "aesthetic" / "sac+logos+ava1-l14-linearMSE.pth"
    args = ("--score", f"aes=aesthetic-v2:{weights}", "--where", "aes >= 5.3", "--unit-rows", "300", "-q")
    reference = tmp_path / "reference"
    run_cli("filter", SAMPLE, "--embeddings", npy, "--output", reference, *args)
    upload(s3, SAMPLE, "meta", "laion_0000.parquet")
    upload(s3, npy, "emb", npy.name)
    output = s3.url("scored")
    run_cli("filter", s3.url("meta"), "--embeddings", s3.url("emb"), "--output", output, *args, env=s3.env)

    assert read_parts(output).equals(read_parts(reference))
    assert 0 < read_parts(output).num_rows < 1000 and "aes" in read_parts(output).column_names


def test_train_run_folder_in_the_bucket_resumes_after_kill_9_mid_upload_with_the_same_losses(
        s3, latent_shards, tmp_path, monkeypatch):
    """--output s3://...: checkpoints go to the bucket with trainer.json and then the done record last; a
    kill -9 between them (checkpoint 2 recorded, 4 not) resumes from 2 on --resume latest (4 passed over) to
    the losses of an uninterrupted local run, and the exported unet/ in the bucket loads with diffusers."""
    from laionkit.common import LaionkitError
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    monkeypatch.setenv("LAIONKIT_STAGING", str(tmp_path / "staging"))
    args = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
            "--workers", "0", "--max-steps", "4", "--log-every", "1", "--checkpoint-every", "2",
            "--keep-checkpoints", "1")
    options = dict(unet_config="tiny", batch_size=2, lr=1e-3, log_with="none", quiet=True, workers=0, max_steps=4,
                   log_every=1, checkpoint_every=2, keep_checkpoints=1)  # the same, in this process (cheaper)
    local, run = tmp_path / "local", s3.url("runs", "tiny")
    train(TrainConfig(latents=latent_shards, output=local, **options))

    argv = ["train", str(latent_shards), "--output", run, *args, "--resume", "latest"]
    result = killed_run(s3, tmp_path, f"import runpy, sys; sys.argv = {['laionkit', *argv]!r}; "
                        "runpy.run_module('laionkit.cli', run_name='__main__')", "location.name == 'step-00000004'")
    assert result.returncode == -9, result.stderr[-3000:]
    checkpoints = Location.parse(run) / "checkpoints"
    assert [p.name for p in checkpoints.list("step-*")] == ["step-00000002"]
    assert [p.name for p in checkpoints.list("step-*", complete_only=False)] == ["step-00000002", "step-00000004"]
    assert (checkpoints / "step-00000004" / "trainer.json").exists()  # every object up, the record never
    assert not (Location.parse(run) / "unet").exists()

    with pytest.raises(LaionkitError, match=r"already holds a run \(checkpoints, metrics.jsonl\)"):
        train(TrainConfig(latents=latent_shards, output=run, **options))
    assert train(TrainConfig(latents=latent_shards, output=run, resume="latest", **options)).step == 4

    assert [p.name for p in checkpoints.list("step-*", complete_only=False)] == ["step-00000004"]
    records = lambda text: [json.loads(line) for line in text.splitlines()]  # noqa: E731
    resumed = records((Location.parse(run) / "metrics.jsonl").read_bytes().decode())
    uninterrupted = records((local / "metrics.jsonl").read_text())
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in uninterrupted], rel=1e-5, abs=1e-7)
    unet = Location.parse(run) / "unet"
    assert unet.is_complete()
    downloaded = tmp_path / "downloaded"
    unet.fs.get(unet.path + "/", str(downloaded), recursive=True)
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel.from_pretrained(downloaded)
    reference = UNet2DConditionModel.from_pretrained(local / "unet")
    for (name, weight), other in zip(model.state_dict().items(), reference.state_dict().values()):
        assert weight.allclose(other, rtol=1e-4, atol=1e-6), name


def test_train_bucket_run_folder_fresh_run_rules_and_resume_choice(s3):
    """Rank 0's decision for a URL --output, without training: a run there is refused, deleted with
    --overwrite; --resume picks the newest checkpoint with a done record, and an explicit one must have it."""
    from types import SimpleNamespace

    from laionkit.common import LaionkitError
    from laionkit.common.storage import mark_done, write_bytes
    from laionkit.trainer.runfolder import RUN_OUTPUTS, RunFolder

    run = Location.parse(s3.url("runs", "x"))
    folder = RunFolder(run, Path("unused"))
    decide = lambda **given: folder._decide(SimpleNamespace(**{"resume": None, "overwrite": False, **given}),  # noqa: E731
                                            RUN_OUTPUTS)
    assert decide() is None and decide(resume="latest") is None  # an empty folder: a fresh start
    for step in (2, 4, 6):
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        write_bytes(checkpoint / "trainer.json", b"{}")
        if step != 6:  # 6: every object up, its done record never written (killed mid-upload)
            mark_done(checkpoint)
    with pytest.raises(LaionkitError, match="already holds a run"):
        decide()
    assert decide(resume="latest") == "step-00000004"
    assert decide(resume=s3.url("runs", "x", "checkpoints", "step-00000002")) == "step-00000002"
    with pytest.raises(LaionkitError, match="no done record"):
        decide(resume=s3.url("runs", "x", "checkpoints", "step-00000006"))
    with pytest.raises(LaionkitError, match="a checkpoint of --output"):
        decide(resume=s3.url("elsewhere", "step-00000002"))
    assert decide(overwrite=True) is None
    assert run.list(complete_only=False) == []


def test_dedup_reads_scores_from_the_bucket_and_writes_there_like_local_disk_and_resumes_after_kill_9(s3, tmp_path):
    """dedup with SCORES_DIR and --output in the bucket: the score files are mirrored to --scratch, the steps run
    there, and keep.parquet, removed.parquet and stats.json (last) are uploaded with done records. Killed after
    the lists are uploaded but before stats.json's record, the output does not read as finished; the rerun gives
    the local run's files (stats.json naming the inputs by URL) and removes its work folder."""
    from test_dedup_layers import FAST, planted

    scores = planted().write(tmp_path / "scored")
    run_cli("dedup", scores, "--output", tmp_path / "local", *FAST, "--keep-by", "aesthetic")
    for path in sorted(p for p in scores.rglob("*") if p.is_file()):
        upload(s3, path, "scored", *path.relative_to(scores).parts)
    output, scratch = s3.url("dedup"), tmp_path / "scratch"
    argv = [s3.url("scored"), "--output", output, *FAST, "--keep-by", "aesthetic", "--scratch", str(scratch)]
    run = f"""
        import sys
        from laionkit.cli import main
        sys.argv = ["laionkit", "dedup", *{argv!r}]
        main()
    """
    result = killed_run(s3, tmp_path, run, "location.name == 'stats.json'")
    assert result.returncode == -9, result.stderr
    target = Location.parse(output)
    assert (target / "keep.parquet").is_complete() and not (target / "stats.json").is_complete()
    assert len(list((scratch / "inputs").rglob("*.npy"))) == 4  # the embeddings mirrored once

    run_cli("dedup", *argv, env=s3.env)
    assert (target / "removed.parquet").read_bytes() == (tmp_path / "local" / "removed.parquet").read_bytes()
    kept, local_kept = (pq.read_table(pa.BufferReader(path.read_bytes())).to_pydict()
                        for path in (target / "keep.parquet", Location.parse(tmp_path / "local" / "keep.parquet")))
    assert set(kept.pop("input")) == {s3.url("scored")} and set(local_kept.pop("input")) == {str(scores)}
    assert kept == local_kept  # the rows kept; each names its input as given (the URL)
    stats, local = (target / "stats.json").read_json(), json.loads((tmp_path / "local" / "stats.json").read_text())
    assert stats["inputs"] == [s3.url("scored", "scores", f"{stem:05d}.parquet") for stem in range(4)]
    where = ("inputs", "plan")  # the plan covers the inputs' paths and times
    assert {k: v for k, v in stats.items() if k not in where} == {k: v for k, v in local.items() if k not in where}
    assert not list((scratch / "work").iterdir())  # the work folder is removed once the output is whole
    rerun = run_cli("dedup", *argv, env=s3.env)  # finished: the same output, nothing redone
    assert rerun.returncode == 0 and (target / "stats.json").read_json() == stats


def test_dedup_mirror_reuses_unchanged_objects_and_fetches_changed_ones(s3, tmp_path):
    """A mirrored score file is reused while the object's size and time are the same (a rerun downloads nothing)
    and fetched again when the object changed; an interrupted download leaves only a dot-temporary."""
    import time

    from laionkit.dedup.remote import mirror

    (tmp_path / "a.parquet").write_bytes(b"first version")
    upload(s3, tmp_path / "a.parquet", "scored", "scores", "00000.parquet")
    local = mirror(s3.url("scored"), tmp_path / "scratch", embeddings=False)
    copy = local / "scores" / "00000.parquet"
    assert copy.read_bytes() == b"first version"
    stamp, inode = copy.stat().st_mtime_ns, copy.stat().st_ino
    assert mirror(s3.url("scored"), tmp_path / "scratch", embeddings=False) == local
    assert (copy.stat().st_mtime_ns, copy.stat().st_ino) == (stamp, inode)  # reused, not downloaded again
    time.sleep(1.1)  # S3 times are whole seconds
    (tmp_path / "a.parquet").write_bytes(b"second, longer version")
    upload(s3, tmp_path / "a.parquet", "scored", "scores", "00000.parquet")
    mirror(s3.url("scored"), tmp_path / "scratch", embeddings=False)
    assert copy.read_bytes() == b"second, longer version" and copy.stat().st_mtime_ns != stamp
    assert [p.name for p in copy.parent.iterdir()] == ["00000.parquet"]


def test_dedup_with_two_ranks_on_the_bucket_gives_the_one_rank_output(s3, tmp_path):
    """Two ranks on one node mirror the same score files into one --scratch at once (each download under its
    own temporary) and meet in its work folder; the bucket's output equals one rank's."""
    from test_dedup_layers import FAST, planted

    scores = planted().write(tmp_path / "scored")
    for path in sorted(p for p in scores.rglob("*") if p.is_file()):
        upload(s3, path, "scored", *path.relative_to(scores).parts)
    common = [s3.url("scored"), *FAST, "--keep-by", "aesthetic"]
    run_cli("dedup", *common, "--output", s3.url("one"), "--scratch", str(tmp_path / "one"), env=s3.env)
    ranks = [subprocess.Popen([sys.executable, "-m", "laionkit.cli", "dedup", *common, "--output", s3.url("two"),
                               "--scratch", str(tmp_path / "two"), "--rank", str(rank), "--world-size", "2"],
                              env=s3.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for rank in (0, 1)]
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
    one, two = Location.parse(s3.url("one")), Location.parse(s3.url("two"))
    for name in ("keep.parquet", "removed.parquet", "stats.json"):
        assert (two / name).is_complete() and (two / name).read_bytes() == (one / name).read_bytes(), name
