"""What a new user meets first on the train / export side (issue 60): the documented commands work as written,
and a run says where its model went."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
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


@pytest.mark.parametrize("family", ["sd", "pixart"])
def test_validation_prompts_are_encoded_as_encode_encoded_the_captions(latent_shards, flow_latents, family):
    """--validation-prompts go through the latents' own tokenizers and text encoders: a prompt equal to a stored
    caption gets that caption's stored tensors (PixArt: trimmed to its mask and zero-padded alike)."""
    import numpy as np

    from laionkit.trainer.evaluation import prompt_texts, validation_conditioning

    data = open_latents(latent_shards if family == "sd" else flow_latents(family).latents)
    captions, stored = validation_conditioning(data, 3)
    encoded = prompt_texts(data, captions, "cpu")
    assert sorted(encoded) == sorted(stored)
    for key, value in stored.items():
        np.testing.assert_allclose(encoded[key].numpy(), value.float().numpy(), atol=3e-3, rtol=1e-2, err_msg=key)


def test_validation_prompts_sample_the_grid_and_log_it_to_tensorboard(latent_shards, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, prompts = tmp_path / "run", tmp_path / "prompts.txt"
    prompts.write_text("a red cube on a table\n\na dog on the beach\n")
    run_cli("train", latent_shards, "--output", run, "--unet-config", "tiny", "--max-steps", "2", "--validate-every",
            "2", "--validation-steps", "2", "--validation-prompts", "a photo of a cat", "--validation-prompts", prompts,
            *QUICK[:4], "--quiet", "--workers", "0", "--log-with", "tensorboard")
    assert (run / "samples" / "prompts.txt").read_text().splitlines() == [
        "a photo of a cat", "a red cube on a table", "a dog on the beach"]
    assert (run / "samples" / "step-000002.png").is_file()
    logged = EventAccumulator(str(run / "logs" / "laionkit"), size_guidance={"images": 0}).Reload()  # the run's
    assert "validation" in logged.Tags()["images"]
    assert [image.step for image in logged.Images("validation")] == [2]


@pytest.mark.parametrize("args, message", [
    (("--validation-prompts", "a cat"), "--validation-prompts are the prompts of the images --validate-every N"),
    (("--validate-every", "1", "--validation-prompts", "MISSING"), "--validation-prompts MISSING: cannot read it"),
])
def test_validation_prompts_mistakes_are_one_line(latent_shards, tmp_path, args, message):
    missing = str(tmp_path / "missing.txt")
    args = [missing if arg == "MISSING" else arg for arg in args]
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "1",
                     *QUICK, *args, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert message.replace("MISSING", missing) in result.stderr, result.stderr[-2000:]


def test_validation_grid_is_logged_to_wandb(latent_shards, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from test_wandb import _records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run_cli("train", latent_shards, "--output", run, "--unet-config", "tiny", "--max-steps", "2", "--validate-every",
            "2", "--validation-steps", "2", "--validation-prompts", "a photo of a cat", *QUICK[:4], "--quiet",
            "--workers", "0", "--log-with", "wandb")
    [path] = (run / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    logged = {(record.history.step.num, item.key or item.nested_key[0])  # an image: validation/{_type, ...}
              for record in _records(path) if record.WhichOneof("record_type") == "history"
              for item in record.history.item}
    assert (2, "validation") in logged, sorted(logged)


def test_the_curation_recipes_train_stage_builds_a_run_of_one_epoch(tmp_path, realdata, monkeypatch):
    """pipelines/curate.yaml's train stage names no length: the command its dry run prints is a valid train
    (it failed at the last stage, after every other had run). Run here up to the trainer, which is stubbed."""
    import shlex

    from laionkit.trainer import loop
    from laionkit.trainer.config import TrainResult

    variables = ["--var", f"workdir={tmp_path}", "--var", f"metadata={realdata / 'laion-sample' / 'test_1000.parquet'}",
                 "--var", "aesthetic=aes.pth", "--var", "watermark=wm.pt", "--var", "nsfw=nsfw.safetensors"]
    lines = run_cli("run", REPO / "pipelines" / "curate.yaml", *variables, "--dry-run").stdout.splitlines()
    [train] = [shlex.split(line)[1:] for line in lines if line.startswith("laionkit train ")]
    built = []
    monkeypatch.setattr(loop, "run", lambda config: built.append(config) or TrainResult(1, None, None))
    result = run_cli(*train, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [(config.max_steps, config.epochs) for config in built] == [(None, None)]  # one epoch: plan_stages


def test_a_launch_of_more_processes_than_gpus_is_one_line(latent_shards, tmp_path, monkeypatch):
    """A process count written for a bigger machine (train/*.yaml said 8): each rank says so in one line, naming
    the flag, before any of them asks CUDA for a GPU that is not there."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "1",
                     *QUICK, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert ("the launcher started 8 processes on this machine, which has 2 GPU(s): start one per GPU (accelerate "
            "launch --num_processes 2") in result.stderr
