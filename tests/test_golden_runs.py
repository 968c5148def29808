"""The trainer's numbers do not move: tiny deterministic runs (scripts/golden_runs.py: SD with checkpoints,
SDXL on buckets, Flux LoRA with online text, 2 DDP ranks) give, file by file, the digests recorded in
tests/data/golden_runs.json; and a run folder written by an earlier laionkit (tests/data/resume-run)
still resumes."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, run_cli
from fixtures import metrics

# scripts/golden_runs.py, loaded by path (scripts/ is not a package).
golden_runs = SimpleNamespace(**runpy.run_path(str(REPO / "scripts" / "golden_runs.py")))

REWRITE = ("golden digests are only to be rewritten with `python scripts/golden_runs.py --write`, in a commit "
           "that explains the change in numerics")


def test_golden_runs_write_the_recorded_files(tmp_path, realdata):
    if torch.__version__ < golden_runs.DIGESTS_FROM_TORCH:  # TorchVersion compares with a tuple
        pytest.skip(f"the golden digests hold from torch {'.'.join(map(str, golden_runs.DIGESTS_FROM_TORCH))}: "
                    f"torch {torch.__version__}'s CPU kernels give other float results")
    got = golden_runs.golden_runs(tmp_path, cli=lambda *args, env=None: run_cli(*args))
    lines, how = golden_runs.check(json.loads(golden_runs.GOLDEN.read_text()), got, golden_runs.host())
    assert not lines, (f"the golden runs differ from tests/data/golden_runs.json ({how}):\n" + "\n".join(lines)
                       + "\n" + REWRITE)


def test_a_run_folder_from_before_resumes(tmp_path, latent_shards, tiny_models):
    """tests/data/resume-run: `laionkit train LATENTS --output resume-run --unet TINY --lora-rank 2
    --max-steps 2 --checkpoint-every 2 --batch-size 2 --workers 0 --shuffle-buffer 3 --lr 1e-3 --log-every 1
    --log-with none --quiet` (latent_shards, tiny_models) written by laionkit before the trainer became a
    package; its step-2 checkpoint resumes and the run finishes."""
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "data" / "resume-run", run)
    result = run_cli("train", latent_shards, "--output", run, "--unet", tiny_models, "--lora-rank", "2",
                     "--max-steps", "4", "--checkpoint-every", "2", "--batch-size", "2", "--workers", "0",
                     "--shuffle-buffer", "3", "--lr", "1e-3", "--log-every", "1", "--log-with", "none",
                     "--resume", "latest")
    assert "resumed from" in result.stdout
    assert sorted(metrics(run)) == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step-00000004" / "adapter.safetensors").is_file()
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_golden_check_holds_hosts_to_their_digests_and_others_to_the_numbers():
    """check(): the host whose digests are recorded is held bit for bit; another host (other float bits from its
    CPU's kernels) is held to the recorded numbers within RTOL, and a trainer change that moves a loss by 1e-3 or
    a weights file's norm by 1e-2 fails there, naming the run, step and field."""
    import copy

    recorded = json.loads(golden_runs.GOLDEN.read_text())
    hosts = golden_runs.recorded_hosts(recorded)
    this, digests = next(iter(hosts.items()))
    same = {"digests": copy.deepcopy(digests), "numbers": copy.deepcopy(recorded["numbers"])}
    assert golden_runs.check(recorded, same, this) == ([], f"digests recorded for {this}")

    other = copy.deepcopy(same)
    first = next(iter(other["digests"]["sd"]))
    other["digests"]["sd"][first] = "0" * 64  # another CPU's bits
    assert golden_runs.check(recorded, other, this)[0] == [f"sd/{first}: differs (recorded "
                                                           f"{digests['sd'][first][:12]}, now {'0' * 12})"]
    step = other["numbers"]["sd"]["metrics"][1]
    step["loss"] *= 1 + 2e-6  # the size of the AVX2 / AVX-512 difference
    lines, how = golden_runs.check(recorded, other, "a host of another kind")
    assert lines == [] and how.startswith("numbers within")

    step["loss"] *= 1 + 1e-3
    weights = other["numbers"]["sdxl"]["weights"]
    name = sorted(weights)[0]
    weights[name] *= 1.01
    lines, _ = golden_runs.check(recorded, other, "a host of another kind")
    assert [line.split(":")[0] for line in lines] == [f"sd/metrics.jsonl step {step['step']} loss", f"sdxl/{name}"]
