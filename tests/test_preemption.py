"""Preemption for real: SIGTERM as docker stop, Kubernetes and Slurm send it, to the launcher or to a whole
process group, with DataLoader workers running; the run must leave a complete checkpoint and resume
with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from fixtures import free_port, process_tree, signal_all, steps_done

TINY = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "2", "--log-every", "1", "--checkpoint-every", "1000", "--record-keys")
# PYTHONFAULTHANDLER: a run that hangs is sent SIGABRT, and every Python process in it prints its threads.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}




def torchrun(ranks: int, latents: Path, run: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m", "laionkit.cli", "train", str(latents), "--output", str(run), *TINY,
            *map(str, extra)]


def single(latents: Path, run: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "laionkit.cli", "train", str(latents), "--output", str(run), *TINY,
            *map(str, extra)]


def interrupt(command: list[str], run: Path, kill) -> tuple[int, str, int]:
    """Start ``command`` in its own session, wait for its first step, then ``kill(pid)``: the exit
    status, the output and the number of steps done when the signal was sent."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not steps_done(run):
            assert process.poll() is None, process.stdout.read()[-3000:]
            if time.monotonic() > deadline:  # hung: where every process of the run is, then fail
                tree = process_tree(process.pid)  # torchrun's ranks have sessions of their own
                signal_all(tree, signal.SIGABRT)
                time.sleep(5)
                signal_all(tree, signal.SIGKILL)
                pytest.fail(f"no step done in 240 s; the run's threads:\n{process.communicate()[0][-12000:]}")
            time.sleep(0.05)
        done = steps_done(run)
        kill(process.pid)
        out, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, out, done


def checkpoints(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").iterdir())


def launch_torchrun(latents: Path, run: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun(2, latents, run, *extra), capture_output=True, text=True, timeout=300, env=ENV)


def launch_single(latents: Path, run: Path, *extra) -> subprocess.CompletedProcess:
    """In this process: only the interrupted run needs a process of its own, to be signalled."""
    return run_cli(*single(latents, run, *extra)[3:], check=False)


def assert_resumes_like_uninterrupted(launch, latents: Path, run: Path, tmp_path: Path) -> int:
    [checkpoint] = checkpoints(run)
    stopped_at = int(checkpoint.name.split("-")[1])
    assert 0 < stopped_at < 1000 and (checkpoint / "trainer.json").is_file()
    assert not (run / "unet").exists()
    end = stopped_at + 2
    resumed = launch(latents, run, "--max-steps", end, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = tmp_path / "reference"
    whole = launch(latents, reference, "--max-steps", end)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, end + 1))
    for step in range(1, end + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step
    for keys in (reference / "seen").iterdir():
        assert (run / "seen" / keys.name).read_text() == keys.read_text()  # the same samples, step by step
    return stopped_at


def test_sigterm_to_torchrun_checkpoints_with_workers_and_resumes_exactly(latent_shards, tmp_path):
    """torchrun forwards SIGTERM to each rank's process group, DataLoader workers included: the workers
    must survive it and both ranks checkpoint at the same step. torchrun itself then exits 1 (it re-raises
    the signal as a SignalException), whatever its ranks returned: that is what a scheduler sees."""
    run = tmp_path / "run"
    code, out, _ = interrupt(torchrun(2, latent_shards, run, "--max-steps", 1000), run,
                          lambda pid: os.kill(pid, signal.SIGTERM))
    assert "killed by signal" not in out, out[-3000:]
    assert code == 1 and "SignalException" in out, out[-3000:]
    assert out.count("stopped by signal 15") == 2, out[-3000:]  # each rank's own exit, 128 + 15
    [checkpoint] = checkpoints(run)
    assert {p.name for p in checkpoint.glob("rank-*.json")} == {"rank-00000.json", "rank-00001.json"}
    assert_resumes_like_uninterrupted(launch_torchrun, latent_shards, run, tmp_path)


def test_sigterm_to_the_process_group_of_one_trainer_checkpoints_and_exits_143(latent_shards, tmp_path):
    """Ctrl-C, `docker stop` without an init and a Slurm step signal every process of the job, workers too."""
    run = tmp_path / "run"
    code, out, _ = interrupt(single(latent_shards, run, "--max-steps", 1000), run,
                          lambda pid: os.killpg(pid, signal.SIGTERM))
    assert code == 128 + signal.SIGTERM, out[-3000:]
    # its weights are only in the checkpoint: export says, in one line, how to get them out
    [checkpoint] = checkpoints(run)
    exported = run_cli("export", run, "--format", "pipeline", check=False)
    assert exported.returncode != 0 and "Traceback" not in exported.stderr, exported.stderr[-3000:]
    assert (f"stopped at step {int(checkpoint.name.split('-')[1])} before its end" in exported.stderr
            and "--resume latest --max-steps" in exported.stderr), exported.stderr[-3000:]
    stopped_at = assert_resumes_like_uninterrupted(launch_single, latent_shards, run, tmp_path)
    assert f"stopped by signal 15 at step {stopped_at}" in out


def test_ranks_agree_to_stop_within_steps_not_at_the_next_log_step(latent_shards, tmp_path):
    """The stop flag is all-reduced every step (read one step late, to spare a per-step GPU sync), so
    ranks that got the signal at different moments still checkpoint together, soon, at a step boundary."""
    run = tmp_path / "run"
    code, out, done = interrupt(torchrun(2, latent_shards, run, "--max-steps", 1000, "--log-every", 500), run,
                                lambda pid: os.killpg(pid, signal.SIGTERM))
    assert code == 1 and out.count("stopped by signal 15") == 2, out[-3000:]
    [checkpoint] = checkpoints(run)
    stopped_at = int(checkpoint.name.split("-")[1])
    # the signal lands during step done + 1 (+ 1 if torchrun forwards it late); its flag is reduced then
    # and read one step later
    assert done <= stopped_at <= done + 4, (done, stopped_at)
    assert {p.name for p in checkpoint.glob("rank-*.json")} == {"rank-00000.json", "rank-00001.json"}
    for rank in (0, 1):  # neither rank ran past the agreed step
        assert (run / "seen" / f"rank-0000{rank}.jsonl").read_text().count("\n") == stopped_at


def test_in_process_train_gives_the_signal_handlers_back(latent_shards, tmp_path):
    """Under `laionkit run` / `laionkit demo` the trainer runs in-process: after it, Ctrl-C is the caller's."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    result = run(TrainConfig(latents=latent_shards, output=tmp_path / "run", unet_config="tiny", max_steps=1,
                             batch_size=2, workers=0, log_with="none", quiet=True))
    assert result.step == 1 and (tmp_path / "run" / "unet").is_dir()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_sigterm_with_a_spot_nodes_30_s_grace_leaves_a_complete_resumable_checkpoint(latent_shards, tmp_path):
    """The Kubernetes train Job as a spot node runs it: its checkpoint flags (--checkpoint-minutes, the async
    writer), 2 ranks under torchrun, SIGTERM to torchrun (preStop -> tini -> torchrun), and SIGKILL to
    everything left 30 s later (GKE Spot and AKS Spot give at most that). The newest checkpoint is complete
    and --resume latest continues from it."""
    import re

    import yaml

    from laionkit.trainer.checkpoint import complete_checkpoints, verify_checkpoint

    manifest = Path(__file__).resolve().parents[1] / "pipelines" / "k8s" / "train-job.yaml"
    [container] = list(yaml.safe_load_all(manifest.read_text()))[1]["spec"]["template"]["spec"]["containers"]
    script = container["args"][2]
    writer = re.search(r"--checkpoint-writer (\S+)", script).group(1)
    minutes = float(re.search(r"--checkpoint-minutes (\S+)", script).group(1))
    assert writer in ("async", "auto") and 0 < minutes <= 30
    run, grace = tmp_path / "run", 30
    # minutes as seconds here: periodic checkpoints come during the test's steps too
    flags = ("--checkpoint-writer", writer, "--checkpoint-minutes", minutes / 60 / 60, "--resume", "latest")
    process = subprocess.Popen(torchrun(2, latent_shards, run, "--max-steps", 1000, *flags), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while steps_done(run) < 2:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no 2 steps in 120 s"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            signal_all(process_tree(process.pid), signal.SIGKILL)
            out, _ = process.communicate()
    finally:
        if process.poll() is None:
            signal_all(process_tree(process.pid), signal.SIGKILL)
            process.wait()
    stopped = [int(step) for step in re.findall(r"stopped by signal 15 at step (\d+)", out)]
    assert len(stopped) == 2 and len(set(stopped)) == 1, out[-3000:]
    newest = complete_checkpoints(run)[-1]
    assert newest.name == f"step-{stopped[0]:08d}" and verify_checkpoint(newest) is None
    resumed = run_cli(*single(latent_shards, run, "--max-steps", stopped[0] + 1, *flags, "--workers", 0)[3:])
    assert f"resumed from {newest} at step {stopped[0]}" in resumed.stdout, resumed.stdout[-3000:]
    assert sorted(losses(run)) == list(range(1, stopped[0] + 2))
