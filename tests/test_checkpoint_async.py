"""Sharded DCP checkpoints written in the background (laionkit/trainer/checkpoint_async.py), with real processes on
CPU: exact resume under each precision policy with 2 ranks, a synchronous checkpoint on SIGTERM, a write killed
with -9 before its done record never chosen, --checkpoint-minutes, and the accelerate layout of earlier
versions still resuming."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path, PosixPath

import pytest
import torch
from conftest import run_cli
from fixtures import accelerate_launch, finish, free_port, metrics

REPO = Path(__file__).resolve().parents[1]
TINY = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "0", "--log-every", "1")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}



def torchrun(*args, script: Path | None = None) -> list[str]:
    target = [str(script)] if script else ["-m", "laionkit.cli"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), *target, *map(str, args)]


def launched(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=ENV, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def assert_same_losses(reference: Path, resumed: Path, steps: list[int]) -> None:
    """Bitwise: the resumed run's losses are the uninterrupted run's, step by step."""
    expected, got = metrics(reference), metrics(resumed)
    assert sorted(got) == steps, sorted(got)
    for step in steps:
        assert got[step]["loss"] == expected[step]["loss"], step


def assert_dcp(checkpoint: Path, ranks: int) -> dict:
    record = json.loads((checkpoint / "trainer.json").read_text())
    assert record["format"] == "dcp"
    assert (checkpoint / "state" / ".metadata").is_file()
    assert {f"rank-{r:05d}.json" for r in range(ranks)} <= set(record["files"])
    assert not (checkpoint / "model.safetensors").exists()
    return record


def test_async_checkpoints_resume_exactly_and_the_accelerate_layout_still_resumes(latent_shards, tmp_path):
    """One process, bf16 weights with fp32 master weights and an EMA: a run writing DCP checkpoints in the
    background resumes from its step-2 checkpoint to the same losses and export, bit for bit; a checkpoint in
    accelerate's layout (what earlier versions wrote) resumes under the DCP writer to the same numbers too."""
    from diffusers import UNet2DConditionModel

    args = (*TINY, "--mixed-precision", "bf16", "--ema", "--ema-decay", "0.5", "--checkpoint-every", "2",
            "--max-steps", "4", "--keep-checkpoints", "5")
    whole = tmp_path / "whole"
    run_cli("train", latent_shards, "--output", whole, *args, "--checkpoint-writer", "async")
    record = assert_dcp(whole / "checkpoints" / "step-00000002", 1)
    assert record["host"]["ema"]["optimization_step"] == 2
    resumed = tmp_path / "resumed"
    run_cli("train", latent_shards, "--output", resumed, *args, "--checkpoint-writer", "async",
            "--resume", whole / "checkpoints" / "step-00000002")
    assert_same_losses(whole, resumed, [3, 4])
    for folder in ("unet", "unet_ema"):
        a = UNet2DConditionModel.from_pretrained(whole / folder).state_dict()
        b = UNet2DConditionModel.from_pretrained(resumed / folder).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), folder

    old = tmp_path / "old"  # the layout of earlier versions, resumed by a run that writes DCP checkpoints
    run_cli("train", latent_shards, "--output", old, *args, "--checkpoint-writer", "accelerate", "--max-steps", "2")
    assert (old / "checkpoints" / "step-00000002" / "model.safetensors").is_file()
    run_cli("train", latent_shards, "--output", old, *args, "--checkpoint-writer", "async", "--resume", "latest")
    assert_same_losses(whole, old, [1, 2, 3, 4])
    assert_dcp(old / "checkpoints" / "step-00000004", 1)


# Each policy: (launcher, extra flags). The LoRA run trains adapters over the tiny SD models with dropout
# (seeded per step) and records the base in adapter.safetensors; FSDP2 runs through train/fsdp.yaml on CPU.
POLICIES = {
    "ddp-fp32-master": ("torchrun", ("--mixed-precision", "bf16", "--bf16-weights", "--ema", "--ema-decay", "0.5",
                                     "--grad-accum", "2")),
    "full-bf16": ("torchrun", ("--mixed-precision", "bf16", "--full-bf16")),
    "lora": ("torchrun", ("--mixed-precision", "bf16", "--lora-rank", "4", "--lora-dropout", "0.1", "--lr", "1e-2")),
    "fsdp2": ("fsdp.yaml", ()),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_two_ranks_with_async_checkpoints_resume_bitwise_like_the_uninterrupted_run(policy, latent_shards,
                                                                                    tiny_models, tmp_path):
    """2 real ranks (gloo) writing sharded checkpoints in the background at steps 2 and 4; a run resumed from
    step 2 logs the uninterrupted run's losses at steps 3 and 4, bit for bit. Each rank wrote its own part
    (its rank record, its generators, its share of the tensors)."""
    launcher, extra = POLICIES[policy]
    model = ("--unet", tiny_models) if policy == "lora" else ("--unet-config", "tiny")
    args = (*model, "--batch-size", "2", "--log-with", "none", "--quiet", "--workers", "0", "--log-every", "1",
            "--max-steps", "4", "--checkpoint-every", "2", "--checkpoint-writer", "async", *extra)

    def launch(run: Path, *more) -> subprocess.CompletedProcess:
        if launcher == "torchrun":
            return launched(torchrun("train", latent_shards, "--output", run, *args, *more))
        return finish(accelerate_launch(launcher, "bf16", latent_shards, run, *args, *more))

    whole = tmp_path / "whole"
    launch(whole)
    checkpoint = whole / "checkpoints" / "step-00000002"
    record = assert_dcp(checkpoint, 2)
    assert any(name.startswith("state/__1_") for name in record["files"]), "rank 1 wrote no tensors"
    if policy == "lora":
        assert "adapter.safetensors" in record["files"]
    resumed = tmp_path / "resumed"
    result = launch(resumed, "--resume", checkpoint)
    assert "resumed from" in result.stdout
    assert_same_losses(whole, resumed, [3, 4])


def test_sigterm_writes_a_complete_checkpoint_at_once_and_the_clock_checkpoints_between(latent_shards, tmp_path):
    """2 ranks with --checkpoint-minutes (a clock so short that a checkpoint is due at every step: saves back
    to back in the background, each waiting for the one before) and no step-based checkpoint: checkpoints
    appear, every rank agreeing on their steps; SIGTERM to torchrun then leaves a complete checkpoint of the
    step it stopped at, written before the exit (143)."""
    from test_preemption import interrupt, steps_done

    from laionkit.trainer.checkpoint import complete_checkpoints, verify_checkpoint

    run = tmp_path / "run"
    command = torchrun("train", latent_shards, "--output", run, *TINY, "--max-steps", "1000", "--checkpoint-every",
                       "1000", "--checkpoint-minutes", "0.0001", "--checkpoint-writer", "async", "--record-keys")

    def term_after_a_few_steps(pid: int) -> None:
        deadline = time.monotonic() + 240
        while steps_done(run) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGTERM)

    code, out, _ = interrupt(command, run, term_after_a_few_steps)
    assert code in (143, -15, 1), out[-3000:]  # torchrun reports its ranks' 143 as its own failure
    found = complete_checkpoints(run)
    assert len(found) >= 2, (found, out[-3000:])  # the clock's, then the stop's
    stopped = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines())
    assert found[-1].name == f"step-{stopped:08d}", out[-3000:]
    for folder in found:
        assert verify_checkpoint(folder) is None
        assert_dcp(folder, 2)
    assert not list((run / "checkpoints").glob(".*partial")), "a save was left unfinished at exit"


SLOW_DONE_RECORD = """
import sys, time
from laionkit.trainer import checkpoint_async
finish = checkpoint_async.CheckpointWriter._finish
def stalls(self, job, *args):  # step 4's files are all written; its done record never comes
    if job.step == 4:
        (job.final.parent / "writing-4").write_text("")
        time.sleep(600)
    return finish(self, job, *args)
checkpoint_async.CheckpointWriter._finish = stalls
from laionkit.cli import main
sys.argv = ["laionkit", *sys.argv[1:]]
main()
"""


def test_a_background_write_killed_before_its_done_record_is_never_resumed_from(latent_shards, tmp_path):
    """kill -9 while step 4's checkpoint is written in the background (every file there, trainer.json not):
    the folder keeps its temporary name, --resume latest takes step 2 and reproduces the uninterrupted run."""
    args = (*TINY, "--max-steps", "6", "--checkpoint-every", "2", "--checkpoint-writer", "async")
    reference = tmp_path / "reference"
    run_cli("train", latent_shards, "--output", reference, *args)
    script = tmp_path / "slow.py"
    script.write_text(SLOW_DONE_RECORD)
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(script), "train", str(latent_shards), "--output", str(run),
                                *args], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "writing-4").exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    partial = run / "checkpoints" / ".step-00000004.partial"
    assert (partial / "state" / ".metadata").is_file() and not (partial / "trainer.json").exists()
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000002"]
    result = run_cli("train", latent_shards, "--output", run, *args, "--resume", "latest")
    assert "step-00000002 at step 2" in result.stdout
    assert_same_losses(reference, run, [1, 2, 3, 4, 5, 6])


def test_a_bucket_run_folder_gets_async_checkpoints_with_done_records_and_resumes_from_them(
        s3, latent_shards, tmp_path, monkeypatch):
    """--output s3://...: each background save uploads every rank's files, then trainer.json and the done
    record; --resume latest downloads the newest and continues to the losses of an uninterrupted run."""
    from laionkit.common.storage import Location
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    monkeypatch.setenv("LAIONKIT_STAGING", str(tmp_path / "staging"))
    options = dict(unet_config="tiny", batch_size=2, lr=1e-3, log_with="none", quiet=True, workers=0, log_every=1,
                   checkpoint_every=2, keep_checkpoints=1, checkpoint_writer="async")
    local, run = tmp_path / "local", s3.url("runs", "tiny")
    train(TrainConfig(latents=latent_shards, output=local, max_steps=6, **options))
    assert train(TrainConfig(latents=latent_shards, output=run, max_steps=4, **options)).step == 4
    checkpoints = Location.parse(run) / "checkpoints"
    assert [p.name for p in checkpoints.list("step-*", complete_only=False)] == ["step-00000004"]
    assert [p.name for p in checkpoints.list("step-*")] == ["step-00000004"]  # done record there
    assert (checkpoints / "step-00000004" / "state" / ".metadata").exists()
    assert train(TrainConfig(latents=latent_shards, output=run, max_steps=6, resume="latest", **options)).step == 6
    losses = [json.loads(line)["loss"] for line in (Location.parse(run) / "metrics.jsonl").read_bytes().decode()
              .splitlines()]
    assert losses == [record["loss"] for _, record in sorted(metrics(local).items())]


def test_a_failed_background_write_stops_the_run_in_one_line_keeping_the_last_good_checkpoint(
        latent_shards, tmp_path, monkeypatch):
    """A write error in the background thread (here: the storage raises at step 4's save) is no silently
    missing checkpoint: the run stops at its next step with one line naming the step and the error, the
    temporary folder is not taken for a checkpoint, and step 2 stays the one --resume latest takes."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if "step-00000004" in str(self.path):
            raise OSError(28, "No space left on device")
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", failing)
    run = tmp_path / "run"
    result = run_cli("train", latent_shards, "--output", run, *TINY, "--max-steps", "8", "--checkpoint-every", "2",
                     "--checkpoint-writer", "async", check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if "step-00000004 was not written" in line]
    assert "No space left on device" in line and "last good one stays" in line and "step-00000002" in line
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000002"]
    assert max(metrics(run)) <= 6  # stopped at the step after the failed save, not at the end


def test_ranks_whose_weights_drift_stop_naming_the_rank_under_the_async_writer(latent_shards, tmp_path):
    """The ranks' weight fingerprints are compared in the background, on the staged copy: a drifting rank
    stops the run with train's one line, and no checkpoint of that step is written."""
    from test_train import DRIFT

    script = tmp_path / "drift.py"
    script.write_text(DRIFT)
    run = tmp_path / "run"
    result = subprocess.run(torchrun("train", latent_shards, "--output", run, *TINY, "--max-steps", "4",
                                     "--checkpoint-every", "2", "--checkpoint-writer", "async", script=script),
                            capture_output=True, text=True, timeout=400, env=ENV, cwd=REPO)
    assert result.returncode != 0
    assert "step 2: the weights of rank(s) 1 differ from rank 0's" in result.stderr, result.stderr[-3000:]
    assert not list((run / "checkpoints").glob("step-*"))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/laionkit-pwned",))


class _GetsCode:
    """getattr (the global torch 2.7's metadata calls for its enum members) on an allowed class: a method that
    would write files (PosixPath.write_text), called by a later pickle opcode."""

    def __reduce__(self):
        return (getattr, (PosixPath, "write_text"))


def test_dcp_metadata_is_read_as_data_and_a_pickle_that_calls_code_is_refused(tmp_path):
    """DCP's .metadata is a pickle: laionkit's reader builds DCP's metadata classes (sizes, dtypes, chunks) and
    refuses any other global (getattr only for the members of DCP's own enums), in one line, before anything is
    called."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from laionkit.common import LaionkitError
    from laionkit.trainer.checkpoint_async import _reader

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": torch.tensor(7.0)}
    dcp.save(state, checkpoint_id=str(tmp_path / "state"), no_dist=True)
    loaded = {"model": {"w": torch.empty(3, 4), "b": torch.empty(4, dtype=torch.bfloat16)}, "step": torch.tensor(0.0)}
    dcp.load(loaded, storage_reader=_reader(tmp_path / "state"), no_dist=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"].item() == 7.0

    (tmp_path / "state" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(LaionkitError, match=r"not plain checkpoint metadata, refused to load it .*(posix|os)\.system"):
        _reader(tmp_path / "state").read_metadata()
    assert not Path("/tmp/laionkit-pwned").exists()
    (tmp_path / "state" / ".metadata").write_bytes(pickle.dumps(_GetsCode()))
    with pytest.raises(LaionkitError, match=r"refused to load it .*getattr\(<class 'pathlib.*PosixPath'>, 'write_text'\)"):
        _reader(tmp_path / "state").read_metadata()


def test_auto_writer_is_async_and_accelerate_under_deepspeed():
    """--checkpoint-writer auto (the cluster recipes' choice): DCP in the background, except under DeepSpeed,
    whose partitioned state only accelerate's layout saves; async / sync there are refused in one line. (A
    DeepSpeed run needs GPUs: on CPU accelerate runs its config as plain processes, so this is the choice alone.)"""
    from laionkit.common import LaionkitError
    from laionkit.trainer.checkpoint_async import writer_kind

    assert [writer_kind(choice, False) for choice in ("auto", "async", "sync", "accelerate")] == [
        "async", "async", "sync", "accelerate"]
    assert writer_kind("auto", True) == writer_kind("accelerate", True) == "accelerate"
    for choice in ("async", "sync"):
        with pytest.raises(LaionkitError, match=f"--checkpoint-writer {choice}: DeepSpeed saves its own"):
            writer_kind(choice, True)
