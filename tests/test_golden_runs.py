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
    lines = golden_runs.differences(json.loads(golden_runs.GOLDEN.read_text()), got)
    assert not lines, "the golden runs differ from tests/data/golden_runs.json:\n" + "\n".join(lines) + "\n" + REWRITE


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
