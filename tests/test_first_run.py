"""What a new user meets first on the train / export side (issue 60): the documented commands work as written,
and a run says where its model went."""

from __future__ import annotations

import math
import os
import subprocess
import sys

from conftest import REPO, run_cli
from fixtures import metrics

from laionkit.trainer.data import open_latents

QUICK = ("--batch-size", "4", "--lr", "1e-3", "--log-with", "none", "--quiet", "--workers", "0")


def test_train_without_a_length_trains_one_epoch_and_its_last_line_names_what_it_wrote(latent_shards, tmp_path):
    """README's stage command gives neither --max-steps nor --epochs: one epoch of the manifest's samples."""
    run = tmp_path / "run"
    result = run_cli("train", latent_shards, "--output", run, "--unet-config", "tiny", *QUICK)
    epoch = math.ceil(open_latents(latent_shards).samples / 4)
    assert max(metrics(run)) == epoch
    assert result.stdout.splitlines()[-1] == f"done at step {epoch}; wrote {run}/unet, {run}/pipeline"
    assert (run / "unet").is_dir() and (run / "pipeline" / "model_index.json").is_file()


def test_a_lora_runs_last_line_names_its_adapter_files(latent_shards, tiny_models, tmp_path):
    run = tmp_path / "lora"
    result = run_cli("train", latent_shards, "--output", run, "--unet", tiny_models, "--lora-rank", "2",
                     "--max-steps", "1", "--export", "pipeline,single-file", *QUICK)
    files = sorted(path.relative_to(run).as_posix() for path in (run / "lora").glob("*.safetensors"))
    singles = sorted(path.relative_to(run).as_posix() for path in (run / "single_file").iterdir())
    assert files and singles
    named = [str(run / name) for name in (*files, "pipeline", *singles)]
    assert result.stdout.splitlines()[-1] == f"done at step 1; wrote {', '.join(named)}"


def test_max_steps_and_epochs_together_are_one_line(latent_shards, tmp_path):
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "2",
                     "--epochs", "1", *QUICK, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "give one of --max-steps or --epochs, not both" in result.stderr


def test_without_realdata_the_tests_say_which_folder_and_what_goes_in_it(tmp_path):
    """A fresh clone without ../shared/realdata: one line naming the folder and where its files come from,
    instead of a pointer to a file that does not exist."""
    missing = tmp_path / "no-realdata"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
         "tests/test_families.py", "-k", "time_ids_crop"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "LAIONKIT_REALDATA": str(missing)}, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:]
    assert f"realdata: MISSING: real test data not found at {missing}" in result.stdout  # the header, once
    said = [line for line in result.stdout.splitlines() if line.startswith(f"real test data not found at {missing}")]
    assert said and "laion-sample/test_1000.parquet" in said[0] and "rom1504/img2dataset" in said[0]
    assert "DEVELOPERS.md" not in result.stdout and "Traceback" not in result.stdout
