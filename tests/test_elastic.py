"""Elastic resume for real: torchrun (gloo, CPU) with 2 ranks, stopped, resumed on 3 ranks with another
batch size and workers, stopped (--max-steps or a real SIGTERM), resumed on 1 rank: the keys trained in
the interrupted epoch are one epoch of an uninterrupted run, none twice; with aspect-ratio buckets and
--grad-accum 2 too. --add-shards takes shards appended to the folder from the next epoch on."""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import run_cli
from fixtures import free_port, process_tree, signal_all, steps_done

TINY = ("--unet-config", "tiny", "--lr", "1e-3", "--log-with", "none", "--quiet", "--log-every", "1",
        "--checkpoint-every", "1000", "--record-keys", "--shuffle-buffer", "3")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def widen(latents: Path, copies: range, output: Path) -> Path:
    """The encoded samples of ``latents`` ``copies`` times over, each copy's shards and keys renamed
    (``c<copy>_``): more samples than consumers, from the same 8 photos."""
    output.mkdir(exist_ok=True)
    for copy in copies:
        for shard in sorted(latents.glob("*.tar")):
            with tarfile.open(shard) as source, tarfile.open(output / f"c{copy}_{shard.name}", "w") as tar:
                for member in source.getmembers():
                    data = source.extractfile(member).read()
                    member.name = f"c{copy}_{member.name}"
                    tar.addfile(member, io.BytesIO(data))
    for name in ["manifest.json", *(p.name for p in latents.glob("empty_*.npy"))]:
        shutil.copy(latents / name, output / name)
    return output


def keys_of(latents: Path) -> set[str]:
    return {name.split(".")[0] for shard in latents.glob("*.tar") for name in tarfile.open(shard).getnames()}


def trained(run: Path, steps: range | None = None) -> list[tuple[str, int]]:
    """(key, epoch) of every sample every rank trained (RUN/seen/rank-N.jsonl), in ``steps`` if given."""
    found = []
    for path in sorted((run / "seen").glob("rank-*.jsonl")):
        for record in map(json.loads, filter(None, path.read_text().splitlines())):
            assert len(record["epochs"]) == len(record["keys"])
            if steps is None or record["step"] in steps:
                found += zip(record["keys"], record["epochs"])
    return found




def torchrun(ranks: int, latents: Path, run: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m", "laionkit.cli", "train", str(latents), "--output", str(run), *TINY,
            *map(str, extra)]


def finish(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=ENV)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result


def sigterm_after(command: list[str], run: Path, steps: int) -> str:
    """Start ``command`` in its own session, SIGTERM its process group once rank 0 has done ``steps``
    steps in all; the output."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while steps_done(run) < steps:
            assert process.poll() is None, process.stdout.read()[-3000:]
            if time.monotonic() > deadline:
                signal_all(process_tree(process.pid), signal.SIGKILL)
                pytest.fail("no step done in 300 s")
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGTERM)
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            signal_all(process_tree(process.pid), signal.SIGKILL)
            process.wait()
    assert out.count("stopped by signal 15") == 3, out[-3000:]
    return out


def last_checkpoint(run: Path) -> Path:
    return sorted((run / "checkpoints").iterdir())[-1]


def data_record(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "rank-00000.json").read_text())["data"]


@pytest.mark.parametrize("case", ["sigterm", "buckets-grad-accum", "sigterm-async-writer"])
def test_two_then_three_then_one_ranks_train_the_interrupted_epoch_once(case, latent_shards, bucket_latents,
                                                                         tmp_path):
    bucketed = case == "buckets-grad-accum"
    latents = widen(bucket_latents if bucketed else latent_shards, range(4), tmp_path / "latents")  # 32 samples
    accum = ("--grad-accum", "2") if bucketed else ()
    # the sharded DCP checkpoints of --checkpoint-writer async (checkpoint_async) resume elastically too
    accum += ("--checkpoint-writer", "async") if case.endswith("async-writer") else ()
    run = tmp_path / "run"
    # 2 ranks x 2 workers, batch 2: stopped by --max-steps
    finish(torchrun(2, latents, run, "--workers", 2, "--batch-size", 2, "--max-steps", 2, *accum))
    first = len(trained(run))
    # 3 ranks x 1 worker, batch 1: stopped by SIGTERM (or --max-steps)
    if bucketed:
        out = finish(torchrun(3, latents, run, "--workers", 1, "--batch-size", 1, "--max-steps", 3, *accum,
                              "--resume", "latest")).stdout
    else:
        out = sigterm_after(torchrun(3, latents, run, "--workers", 1, "--batch-size", 1, "--max-steps", 1000,
                                     "--resume", "latest"), run, 3)
    assert "elastic resume at step 2" in out and "world_size 2 -> 3" in out and "batch_size 2 -> 1" in out, out[-3000:]
    stopped = int(last_checkpoint(run).name.split("-")[1])
    assert len(trained(run)) > first and stopped > 2
    # 1 rank, batch 3 (no workers; with buckets 2 workers, batch 2): to the end of the epoch and beyond
    single = ("--workers", 2, "--batch-size", 2) if bucketed else ("--workers", 0, "--batch-size", 3)
    result = run_cli("train", latents, "--output", run, *TINY, *single, *accum, "--max-steps", stopped + 12,
                     "--resume", "latest")
    assert f"elastic resume at step {stopped}" in result.stdout, result.stdout[-3000:]
    history = data_record(last_checkpoint(run))["history"]
    assert [(h["step"], h["world_size"]) for h in history] == [(0, 2), (2, 3), (stopped, 1)]

    epochs = collections.defaultdict(collections.Counter)
    for key, epoch in trained(run):
        epochs[epoch][key] += 1
    assert set(epochs[0].values()) == {1}, [key for key, n in epochs[0].items() if n > 1]  # none twice
    for steps in (range(1, 3), range(3, stopped + 1), range(stopped + 1, stopped + 13)):  # each layout trained some
        assert any(epoch == 0 for _, epoch in trained(run, steps)), steps
    assert all(n == 1 for n in epochs[1].values())  # begun under the last layout: none twice either
    reference = tmp_path / "reference"  # one uninterrupted epoch
    run_cli("train", latents, "--output", reference, *TINY, "--workers", 0, "--batch-size", 2, "--max-steps", 20)
    whole = collections.Counter(key for key, epoch in trained(reference) if epoch == 0)
    assert set(whole.values()) == {1} and set(whole) == keys_of(latents)
    assert set(epochs[0]) == set(whole)


def test_add_shards_joins_from_the_next_epoch_and_is_refused_without_the_flag(latent_shards, tmp_path):
    latents = widen(latent_shards, range(2), tmp_path / "latents")  # 16 samples
    old = keys_of(latents)
    run = tmp_path / "run"
    args = ("train", latents, "--output", run, *TINY, "--workers", 0, "--batch-size", 2)
    run_cli(*args, "--max-steps", 3)
    widen(latent_shards, range(2, 4), latents)  # 16 more, appended
    refused = run_cli(*args, "--max-steps", 4, "--resume", "latest", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "was written with other shards" in line and "--add-shards" in line, line
    result = run_cli(*args, "--max-steps", 3 + 5 + 16, "--resume", "latest", "--add-shards")
    assert "4 new shard(s) (16 samples) take part from epoch 1 on" in result.stdout, result.stdout[-2000:]
    epochs = collections.defaultdict(collections.Counter)
    for key, epoch in trained(run):
        epochs[epoch][key] += 1
    assert set(epochs[0]) == old and set(epochs[0].values()) == {1}
    assert set(epochs[1]) == keys_of(latents) and set(epochs[1].values()) == {1}
    record = data_record(last_checkpoint(run))
    assert record["progress"]["from_epoch"] == [0] * 4 + [1] * 4
    assert record["history"][-1]["added_shards"] == [f"c{c}_{n:05d}.tar" for c in (2, 3) for n in (0, 1)]


def test_onto_fewer_ranks_the_dropped_ranks_records_and_the_scaled_lr_follow_the_checkpoint(latent_shards, tmp_path):
    """2 ranks run a step past their checkpoint, then 1 rank resumes: rank 1's record of that step was kept
    (its samples recorded twice in the epoch), and --scale-lr sqrt kept the 2-rank rate (lr x sqrt 2)."""
    run = tmp_path / "run"
    lr = ("--lr", "2e-3", "--scale-lr", "sqrt", "--batch-size", 1)
    finish(torchrun(2, latent_shards, run, "--workers", 0, *lr, "--max-steps", 3, "--checkpoint-every", 2,
                    "--no-checkpoint-at-end"))
    first = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert first[3] == pytest.approx(2e-3 * 2 ** 0.5)
    result = run_cli("train", latent_shards, "--output", run, *TINY, "--workers", 0, *lr, "--max-steps", 6,
                     "--resume", "latest")
    assert "elastic resume at step 2" in result.stdout, result.stdout[-3000:]
    assert "--scale-lr sqrt: the learning rate is 2.00e-03 at global batch 1, the checkpoint's 2.83e-03" \
        in result.stdout, result.stdout[-3000:]
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == list(range(1, 7))
    assert all(records[step]["lr"] == pytest.approx(2e-3) for step in range(3, 7))
    dropped = [json.loads(line)["step"] for line in (run / "seen" / "rank-00001.jsonl").read_text().splitlines()]
    assert dropped == [1, 2]
    epoch0 = collections.Counter(key for key, epoch in trained(run) if epoch == 0)
    assert set(epoch0.values()) == {1} and set(epoch0) == keys_of(latent_shards)
