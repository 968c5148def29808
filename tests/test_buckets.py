"""train on aspect-ratio buckets: encode --buckets on the real photos, single-shape batches, exact resume.

At 64 px the photos fall into three buckets of uneven size (48x80: 123x456 and 208x495; 56x72: the
portrait ones; 80x48: the landscape ones), so batches of 2 leave leftovers that cross epochs.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import run_cli
from fixtures import compile_on_cpu, free_port, kill_tree

from laionkit.trainer.latent_order import DataProgress
from laionkit.trainer.latent_stream import StreamLayout, latent_loader

TINY = ("--unet-config", "tiny", "--lr", "1e-3", "--log-with", "none", "--quiet")


def bucket_of_key(latents: Path) -> dict[str, str]:
    """Each sample's bucket ("WxH") as encode recorded it in the sample's json."""
    found = {}
    for shard in sorted(latents.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    found[member.name.split(".")[0]] = "x".join(map(str, json.load(tar.extractfile(member))["bucket"]))
    return found


def test_fixture_has_uneven_buckets(bucket_latents):
    sizes = collections.Counter(bucket_of_key(bucket_latents).values())
    assert len(sizes) >= 3 and len(set(sizes.values())) >= 2, sizes


def _keys(batches) -> list[list[str]]:
    return [batch["key"] for batch in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_single_bucket_leftovers_carry_over_and_resume_continues_exactly(bucket_latents, workers):
    """Per worker, a batch is emitted when its bucket's buffer, fed in stream order, reaches the batch
    size; leftovers cross epochs (each worker holds 4 samples in 3 buckets); a loader restarted after k
    batches, with their samples marked trained, continues with batch k, leftovers of earlier epochs included."""
    bucket = bucket_of_key(bucket_latents)
    shards = tuple(map(str, sorted(bucket_latents.glob("*.tar"))))
    layout = StreamLayout(shards, 0, 1, workers, 2, 7, 3, bucketed=True)
    batches = list(itertools.islice(latent_loader(layout), 24))
    for batch in batches:
        assert len(batch["key"]) == 2 and len({bucket[key] for key in batch["key"]}) == 1, batch["key"]
        assert batch["moments"].shape[0] == 2
    assert set(itertools.chain(*_keys(batches))) == set(bucket)

    # The same stream one sample at a time (batch size 1: no grouping, same random draws) is the order
    # the buckets are fed in; batch i comes from worker i mod K.
    single = _keys(itertools.islice(latent_loader(StreamLayout(shards, 0, 1, workers, 1, 7, 3, bucketed=True)), 96))
    streams = max(workers, 1)
    for worker in range(streams):
        buffers, expected = collections.defaultdict(list), []
        for (key,) in single[worker::streams]:
            buffers[bucket[key]].append(key)
            if len(buffers[bucket[key]]) == 2:
                expected.append(buffers.pop(bucket[key]))
        got = _keys(batches[worker::streams])
        assert got == expected[:len(got)], worker

    counts = [sum(1 for name in tarfile.open(shard).getnames() if name.endswith(".json")) for shard in shards]
    for done in (range(1, 20) if workers == 0 else (3, 10, 17)):
        progress = DataProgress.fresh(counts)  # what the first `done` batches trained
        for batch in batches[:done]:
            progress.mark(batch["epoch"], batch["id"])
        progress.settle()
        resumed = list(itertools.islice(latent_loader(layout, batches_done=done, progress=progress), 4))
        assert _keys(resumed) == _keys(batches[done:done + 4]), done
        assert all(a["moments"].equal(b["moments"]) for a, b in zip(resumed, batches[done:done + 4]))


def _torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "laionkit.cli", "train", *map(str, args)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _records(run: Path, name: str) -> dict[int, dict]:
    lines = (run / name).read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, filter(None, lines))}


def test_two_ranks_uneven_buckets_kill9_resume_exactly_and_count_samples_per_bucket(bucket_latents, tmp_path):
    """Two DDP ranks (torchrun, gloo, 2 workers each) train different buckets in the same step; every
    rank runs every step; kill -9 of the whole job tree and --resume latest reproduce the uninterrupted
    run's losses, keys and bucket counts step by step; the counts sum to the samples seen."""
    args = (*TINY, "--batch-size", "2", "--max-steps", "12", "--checkpoint-every", "3", "--log-every", "1",
            "--workers", "2", "--shuffle-buffer", "3", "--record-keys")
    reference = tmp_path / "reference"
    result = subprocess.run(_torchrun(bucket_latents, "--output", reference, *args), capture_output=True,
                            text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]

    run = tmp_path / "run"
    process = subprocess.Popen(_torchrun(bucket_latents, "--output", run, *args), env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step-00000006").is_dir() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    kill_tree(process.pid)
    process.wait()
    assert not (run / "unet").exists(), "killed too late: the run already finished"
    resumed = subprocess.run(_torchrun(bucket_latents, "--output", run, *args, "--resume", "latest"),
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "samples per bucket (all ranks)" in resumed.stdout

    expected, got = _records(reference, "metrics.jsonl"), _records(run, "metrics.jsonl")
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7), step
        assert got[step]["samples_per_bucket"] == expected[step]["samples_per_bucket"], step
        assert sum(got[step]["samples_per_bucket"].values()) == step * 2 * 2

    bucket = bucket_of_key(bucket_latents)
    keys = [_records(run, f"seen/rank-{rank:05d}.jsonl") for rank in (0, 1)]
    assert keys == [_records(reference, f"seen/rank-{rank:05d}.jsonl") for rank in (0, 1)]
    step_buckets = [[bucket.get(k) for k in keys[rank][step]["keys"]] for step in range(1, 13) for rank in (0, 1)]
    assert all(len(set(b)) == 1 for b in step_buckets), step_buckets
    assert any(keys[0][step]["keys"] and bucket[keys[0][step]["keys"][0]] != bucket[keys[1][step]["keys"][0]]
               for step in range(1, 13)), "the ranks never trained different buckets in one step"
    seen = collections.Counter(bucket[k] for rank in (0, 1) for step in range(1, 13) for k in keys[rank][step]["keys"])
    assert got[12]["samples_per_bucket"] == {size: seen[size] for size in got[12]["samples_per_bucket"]}


def test_compile_takes_one_graph_per_bucket_or_symbolic_shapes(bucket_latents, tmp_path, monkeypatch):
    """--compile (dynamic=False) on bucketed latents compiles each bucket shape instead of failing at
    (or silently falling back past) dynamo's recompile limit, here 1 graph per function: a second bucket
    shape would be refused. --compile-dynamic hands torch.compile dynamic=True and trains the same steps to
    the same losses. On CPU dynamo traces with its eager backend: inductor there did not finish in 7 min on
    the dev machine's 2 shared cores; dynamo's guards are the same."""
    import torch

    calls = compile_on_cpu(monkeypatch, "eager")
    args = (*TINY, "--batch-size", "2", "--max-steps", "6", "--log-every", "1", "--workers", "0", "--compile")
    runs = {"static": tmp_path / "static", "dynamic": tmp_path / "dynamic"}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        run_cli("train", bucket_latents, "--output", runs["static"], *args)
    torch._dynamo.reset()
    run_cli("train", bucket_latents, "--output", runs["dynamic"], *args, "--compile-dynamic")
    torch._dynamo.reset()
    assert [options["dynamic"] for _, options in calls] == [False, True]
    static, dynamic = _records(runs["static"], "metrics.jsonl"), _records(runs["dynamic"], "metrics.jsonl")
    assert sum(1 for n in static[6]["samples_per_bucket"].values() if n) >= 2, static[6]["samples_per_bucket"]
    for step in range(1, 7):  # the shapes' treatment changes no number
        assert dynamic[step]["loss"] == pytest.approx(static[step]["loss"], rel=1e-4, abs=1e-6), step
        assert dynamic[step]["samples_per_bucket"] == static[step]["samples_per_bucket"], step
    refused = run_cli("train", bucket_latents, "--output", tmp_path / "refused", *args[:-1], "--compile-dynamic",
                      check=False)
    assert refused.returncode == 2 and "--compile-dynamic" in refused.stderr and "Traceback" not in refused.stderr


def test_stages_switch_latent_folders_and_resume_exactly_on_either_side_of_the_switch(
        latent_shards, bucket_latents, tmp_path):
    """--stage: 4 steps on the square 64 px latents, then 4 on the bucketed ones; resuming from the
    checkpoint before the switch (step 3) and after it (step 6) reproduces the uninterrupted run."""
    from laionkit.common import LaionkitError
    from laionkit.trainer.config import TrainConfig

    with pytest.raises(LaionkitError, match="DIR:STEPS"):
        TrainConfig(latents=latent_shards, output=tmp_path / "x", unet_config="tiny", max_steps=1, stage=["no-steps"])
    args = (*TINY, "--batch-size", "2", "--max-steps", "4", "--stage", f"{bucket_latents}:4", "--checkpoint-every",
            "3", "--log-every", "1", "--workers", "2", "--shuffle-buffer", "3", "--record-keys")
    whole = tmp_path / "whole"
    assert "stage 2 of 2" in run_cli("train", latent_shards, "--output", whole, *args).stdout
    expected = _records(whole, "metrics.jsonl")
    assert set(expected[4]["samples_per_bucket"].values()) == {0, 8} and expected[4]["samples_per_bucket"]["64x64"] == 8
    assert expected[8]["samples_per_bucket"]["64x64"] == 8 and sum(expected[8]["samples_per_bucket"].values()) == 16
    for step in (3, 6):
        run = tmp_path / f"from-{step}"
        run_cli("train", latent_shards, "--output", run, *args, "--resume", whole / "checkpoints" / f"step-{step:08d}")
        got = _records(run, "metrics.jsonl")
        assert sorted(got) == list(range(step + 1, 9))
        for later in got:
            assert got[later]["loss"] == pytest.approx(expected[later]["loss"], rel=1e-5, abs=1e-7), (step, later)
            assert got[later]["samples_per_bucket"] == expected[later]["samples_per_bucket"], (step, later)
        assert _records(run, "seen/rank-00000.jsonl") == {
            k: v for k, v in _records(whole, "seen/rank-00000.jsonl").items() if k > step}
    other = run_cli("train", latent_shards, "--output", tmp_path / "other", *args, "--stage", f"{bucket_latents}:2",
                    "--resume", whole / "checkpoints" / "step-00000006", check=False)
    assert other.returncode == 2 and "other stages" in other.stderr, other.stderr[-2000:]
