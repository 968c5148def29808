"""The run folder is one run's: a lock (local) or lease (bucket) against a second train, resume rules that
never replace a run silently, the last step always checkpointed, train config files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import run_cli
from fixtures import metrics

TINY = ("--unet-config", "tiny", "--batch-size", "4", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "0", "--log-every", "1")


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laionkit.cli", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(condition, process: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while not condition():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)


def _logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_a_second_train_into_a_running_folder_is_refused_naming_the_holder(latent_shards, tmp_path):
    """Two real processes: while one trains, a second into its --output (resume or overwrite) is refused in
    one line naming the first's pid, and touches nothing; kill -9 of the first frees the folder."""
    run = tmp_path / "run"
    base = ["train", latent_shards, "--output", run, *TINY, "--checkpoint-every", "100000"]
    first = _start([*base, "--max-steps", "100000"])
    try:
        _wait_for(lambda: _logged(run) >= 2, first)
        for extra in (("--resume", "latest"), ("--overwrite",)):
            second = run_cli(*base, "--max-steps", "2", *extra, check=False)
            assert second.returncode == 2, second.stderr[-2000:]
            assert f"is in use by another train (pid {first.pid} on host" in second.stderr
            assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1
        logged = _logged(run)
        _wait_for(lambda: _logged(run) > logged, first)  # the first run trains on, its records whole
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, len(steps) + 1))
    finally:
        first.kill()
        first.wait()
    # the kernel released the lock of the killed run; it died before its first checkpoint: a preemptible
    # job's --resume latest starts over
    run_cli(*base, "--max-steps", "2", "--resume", "latest")
    assert sorted(metrics(run)) == [1, 2] and (run / "unet" / "config.json").is_file()


def test_resume_latest_never_replaces_a_run_it_cannot_continue(latent_shards, tmp_path):
    run = tmp_path / "run"
    base = ("train", latent_shards, "--output", run, *TINY, "--checkpoint-every", "2")
    run_cli(*base, "--max-steps", "3")
    # the last step is checkpointed though 3 is not a multiple of --checkpoint-every
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    exported = (run / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    finished = (run / "metrics.jsonl").read_text()

    # --max-steps below the newest checkpoint: refused, not an export of step 3 as if it were step 2
    fewer = run_cli(*base, "--max-steps", "2", "--resume", "latest", check=False)
    assert fewer.returncode == 2 and "step-00000003 is at step 3, past this run's 2 steps" in fewer.stderr, \
        fewer.stderr[-2000:]

    # the checkpoints gone: --resume latest refuses to start over on the finished run
    shutil.rmtree(run / "checkpoints")
    refused = run_cli(*base, "--max-steps", "3", "--resume", "latest", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "holds a run (its export unet) but no complete checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (run / "metrics.jsonl").read_text() == finished
    assert (run / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == exported

    # --resume latest --overwrite: starts over where there is nothing to resume ...
    run_cli(*base, "--max-steps", "1", "--resume", "latest", "--overwrite")
    assert sorted(metrics(run)) == [1] and [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]
    # ... and resumes where there is
    resumed = run_cli(*base, "--max-steps", "2", "--resume", "latest", "--overwrite")
    assert "resumed from" in resumed.stdout and sorted(metrics(run)) == [1, 2]
    # an explicit checkpoint with --overwrite contradicts itself
    both = run_cli(*base, "--max-steps", "2", "--resume", run / "checkpoints" / "step-00000002", "--overwrite",
                   check=False)
    assert both.returncode == 2 and "--overwrite goes with --resume latest only" in both.stderr

    # a new folder: --resume latest (as a cluster job always passes it) starts fresh
    new = tmp_path / "new"
    run_cli("train", latent_shards, "--output", new, *TINY, "--max-steps", "1", "--resume", "latest")
    assert sorted(metrics(new)) == [1]
