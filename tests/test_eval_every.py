"""`train --eval-every`: FID, KID and CLIP score of the run's weights during training, with the random-init
scorers of `laionkit models tiny-eval` (the real weights layouts) against the real photos of
../shared/realdata/images. A record equals `laionkit eval` of the pipeline exported at that step; it is the same
under 2 ranks (the export gathered, rank 0 scoring); scoring leaves the training itself untouched, checkpoint
for checkpoint, and a resume truncates eval records as any other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from fixtures import accelerate_launch, finish

COUNT = 4
STEPS = 2
SCORES = ("fid", "kid", "kid_std", "clip_score")


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scorers")
    run_cli("models", "tiny-eval", "--output", folder)
    return folder


def eval_flags(scorers: Path, realdata: Path) -> list:
    return ["--eval-reference", realdata / "images", "--eval-count", COUNT, "--eval-steps", STEPS,
            "--eval-inception", scorers / "inception.pth", "--eval-clip-model", scorers / "tiny-clip.json",
            "--eval-clip-pretrained", scorers / "tiny-clip.safetensors"]


def train_args(latents: Path, run: Path, *extra) -> list:
    return ["train", latents, "--output", run, "--unet-config", "tiny", "--max-steps", 4, "--batch-size", 2,
            "--lr", "1e-3", "--workers", 0, "--log-with", "none", "--log-every", 3, "--checkpoint-every", 2, "--ema",
            "--quiet", *extra]


def records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, latent_shards, scorers, realdata) -> Path:
    run = tmp_path_factory.mktemp("eval-every") / "run"
    run_cli(*train_args(latent_shards, run, "--eval-every", 2, *eval_flags(scorers, realdata)))
    return run


def test_scores_go_into_the_records_and_equal_laionkit_eval_of_the_export(scored_run, scorers, realdata,
                                                                         latent_shards, tmp_path):
    found = records(scored_run)
    assert sorted(found) == [2, 3, 4]  # eval steps are logged even off --log-every
    assert "fid" not in found[3]
    for step in (2, 4):
        record = found[step]
        assert record["eval_count"] == COUNT and record["eval_seconds"] > 0
        assert all(isinstance(record[key], float) for key in SCORES), record
    assert found[2]["fid"] != found[4]["fid"]  # the weights changed, so did the images
    assert not list(scored_run.glob(".eval-step-*"))  # each evaluation's folder removed after it
    assert (scored_run / "eval.png").stat().st_size > 1000

    # `laionkit eval` of the run's final export scores what the step-4 evaluation scored, to the bit
    run_cli("eval", scored_run / "pipeline", "--reference", realdata / "images", "--val-latents", latent_shards,
            "--count", COUNT, "--steps", STEPS, "--output", tmp_path / "eval", "--inception", scorers / "inception.pth",
            "--clip-model", scorers / "tiny-clip.json", "--clip-pretrained", scorers / "tiny-clip.safetensors",
            "--quiet")
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {key: found[4][key] for key in SCORES} == {key: evaluated[key] for key in SCORES}


def test_scoring_changes_no_checkpoint(scored_run, latent_shards, tmp_path):
    """The same run without --eval-every writes the same checkpoints, byte for byte (their trainer.json
    apart from the --eval-* flags it records), and the same export. With --ema this failed: the evaluation's
    export copied the EMA into the training weights themselves (CPU tensors shared with the export's model)."""
    plain = tmp_path / "plain"
    run_cli(*train_args(latent_shards, plain))
    for step in (2, 4):
        ours, theirs = (run / "checkpoints" / f"step-{step:08d}" for run in (scored_run, plain))
        names = sorted(p.name for p in ours.iterdir())
        assert names == sorted(p.name for p in theirs.iterdir())
        for name in names:
            if name == "trainer.json":
                config, other = (json.loads((folder / name).read_text())["config"] for folder in (ours, theirs))
                assert {k: v for k, v in config.items() if not k.startswith(("eval_", "output"))} == \
                       {k: v for k, v in other.items() if not k.startswith(("eval_", "output"))}
            else:
                assert (ours / name).read_bytes() == (theirs / name).read_bytes(), (step, name)
    assert (scored_run / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == \
           (plain / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    plain_records, scored = records(plain), records(scored_run)
    assert plain_records[4]["loss"] == scored[4]["loss"]


def test_a_resume_truncates_and_redoes_the_eval_records(scored_run, latent_shards, scorers, realdata, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(scored_run, run)
    for name in ("unet", "unet_ema", "pipeline"):
        shutil.rmtree(run / name)
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # as if killed after step 4's record, before its checkpoint
    run_cli(*train_args(latent_shards, run, "--eval-every", 2, *eval_flags(scorers, realdata), "--resume", "latest"))
    again, before = records(run), records(scored_run)
    assert sorted(again) == [2, 3, 4]  # step 3 and 4 truncated and redone once, step 2 kept
    for step in (2, 4):
        assert {k: again[step][k] for k in SCORES} == {k: before[step][k] for k in SCORES}


def test_two_fsdp_ranks_score_as_one_process_does(latent_shards, scorers, realdata, tmp_path):
    """Under FSDP (2 gloo ranks, accelerate launch) the export gathers the shards on every rank and rank 0
    scores; the record equals `laionkit eval` of the run's export, as one process's does."""
    run = tmp_path / "run"
    result = finish(accelerate_launch("fsdp.yaml", "no", latent_shards, run, "--unet-config", "tiny",
                                      "--max-steps", 2, "--batch-size", 2, "--lr", "1e-3", "--checkpoint-every", 2,
                                      "--eval-every", 2, *eval_flags(scorers, realdata)))
    assert "FSDP2 on CPU ranks (gloo)" in result.stdout
    found = records(run)
    run_cli("eval", run / "pipeline", "--reference", realdata / "images", "--val-latents", latent_shards,
            "--count", COUNT, "--steps", STEPS, "--output", tmp_path / "eval", "--inception", scorers / "inception.pth",
            "--clip-model", scorers / "tiny-clip.json", "--clip-pretrained", scorers / "tiny-clip.safetensors",
            "--quiet")
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {key: found[2][key] for key in SCORES} == {key: evaluated[key] for key in SCORES}


def test_eval_flags_are_checked_before_training(latent_shards, scorers, realdata, tmp_path):
    def error(*args) -> str:
        result = run_cli("train", latent_shards, "--output", tmp_path / "bad", "--unet-config", "tiny",
                         "--max-steps", 1, "--workers", 0, "--log-with", "none", *args, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, result.stderr
        return lines[0]

    flags = eval_flags(scorers, realdata)
    assert "--eval-every needs --eval-reference" in error("--eval-every", 1)
    assert "give --eval-every N" in error("--eval-count", 8)
    missing = tmp_path / "missing"
    assert f"--eval-reference {missing}: no such folder" in error("--eval-every", 1, "--eval-reference", missing)
    assert f"--eval-prompts {missing}: no such file" in error("--eval-every", 1, *flags, "--eval-prompts", missing)
    assert "--eval-count 1: must be >= 2" in error("--eval-every", 1, *flags[:2], "--eval-count", 1)
    assert "--eval-resolution 36: a multiple of 8" in error("--eval-every", 1, *flags, "--eval-resolution", 36)
    # found at setup, before the first step: a reference without images, a wrong weights file
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"--eval-reference {empty}: 0 readable images" in error("--eval-every", 1, *flags[2:],
                                                                   "--eval-reference", empty)
    weights = scorers / "tiny-clip.safetensors"
    at = flags.index("--eval-inception") + 1
    line = error("--eval-every", 1, *flags[:at], weights, *flags[at + 1:])
    assert "--eval-inception" in line and str(weights) in line
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_failure_while_scoring_is_recorded_and_the_run_goes_on(latent_shards, scorers, realdata, tmp_path,
                                                                 monkeypatch):
    """Out of memory while generating (raised here in its place): a warning and `eval_error` in the record,
    and the run still checkpoints and exports."""
    import laionkit.evaluate

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(laionkit.evaluate, "generate", out_of_memory)
    run = tmp_path / "run"
    result = run_cli(*train_args(latent_shards, run, "--eval-every", 2, *eval_flags(scorers, realdata)))
    assert "warning: --eval-every, step 2: no scores (RuntimeError: CUDA out of memory." in result.stdout
    found = records(run)
    assert found[4]["eval_error"].startswith("RuntimeError: CUDA out of memory") and "fid" not in found[4]
    assert (run / "checkpoints" / "step-00000004").is_dir() and (run / "pipeline" / "model_index.json").is_file()
    assert not list(run.glob(".eval-step-*"))


def test_a_lora_run_scores_its_adapters_merged_into_the_base(latent_shards, tiny_models, scorers, realdata,
                                                             tmp_path):
    """A LoRA run exports no pipeline by default; its evaluation scores the base with the adapters merged, as
    `laionkit export RUN --format pipeline` then `laionkit eval` score it."""
    run = tmp_path / "run"
    run_cli("train", latent_shards, "--output", run, "--unet", tiny_models, "--lora-rank", 2, "--max-steps", 2,
            "--batch-size", 2, "--lr", "1e-2", "--workers", 0, "--log-with", "none", "--checkpoint-every", 2,
            "--quiet", "--eval-every", 2, *eval_flags(scorers, realdata))
    assert not (run / "pipeline").exists()
    run_cli("export", run, "--format", "pipeline")
    run_cli("eval", run / "pipeline", "--reference", realdata / "images", "--val-latents", latent_shards,
            "--count", COUNT, "--steps", STEPS, "--output", tmp_path / "eval", "--inception", scorers / "inception.pth",
            "--clip-model", scorers / "tiny-clip.json", "--clip-pretrained", scorers / "tiny-clip.safetensors",
            "--quiet")
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {key: records(run)[2][key] for key in SCORES} == {key: evaluated[key] for key in SCORES}
