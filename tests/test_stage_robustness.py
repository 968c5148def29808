"""score, caption, encode, dedup and eval on what a user may hand them by mistake: a FIFO named like a shard or a
scores parquet (refused in one line, never waited on), an output that cannot be written (one line, before any
work), and two processes into one output (the second refused)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, run_cli_process
from fixtures import write_image_shards
from test_dedup_layers import planted


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vlm") / "tiny-vlm"
    run_cli("models", "tiny-vlm", "--output", folder)
    return folder


def stage_args(stage: str, inputs: Path, output: Path, models: dict) -> list:
    """The stage's command line on ``inputs``, with tiny real models, so that it gets as far as reading them."""
    if stage == "score":
        return ["score", inputs, "--output", output, "--clip-model", models["score"]["config"], "--clip-pretrained",
                models["score"]["weights"], "--workers", "0", "--batch-size", "3", "-q"]
    if stage == "caption":
        return ["caption", inputs, "--model", models["caption"], "--output", output, "--max-new-tokens", "4",
                "--batch-size", "3", "--workers", "0", "-q"]
    if stage == "encode":
        return ["encode", inputs, "--model", models["encode"], "--output", output, "--resolution", "64",
                "--batch-size", "4", "--workers", "0", "-q"]
    return ["dedup", inputs, "--output", output, "--layers", "exact,phash", "-q"]


@pytest.fixture
def models(request, score_models) -> dict:
    found = {"score": score_models}
    if "caption" in request.node.name:
        found["caption"] = request.getfixturevalue("tiny_vlm")
    if "encode" in request.node.name:
        found["encode"] = request.getfixturevalue("tiny_models")
    return found


@pytest.mark.parametrize("stage", ["score", "caption", "encode", "dedup"])
def test_a_fifo_named_like_an_input_is_refused_in_one_line_not_waited_on(stage, models, realdata, tmp_path):
    """Opening a FIFO to read waits for a writer: each stage hung until killed. A subprocess with a timeout, so
    that a regression fails instead of hanging the suite."""
    inputs = tmp_path / "in"
    if stage == "dedup":
        write_image_shards(realdata / "images", tmp_path / "shards")
        run_cli(*stage_args("score", tmp_path / "shards", inputs, models))
        fifo = inputs / "scores" / "00001.parquet"
    else:
        write_image_shards(realdata / "images", inputs)
        fifo = inputs / "00001.tar"
    fifo.unlink()
    os.mkfifo(fifo)
    result = run_cli_process(*stage_args(stage, inputs, tmp_path / "out", models), check=False, timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert errors == [f"error: {fifo}: a FIFO, not a regular file; refused (reading it could wait for ever)"]


HOLD = """import sys, time
from laionkit.common.runlock import LocalLock
LocalLock(sys.argv[1], sys.argv[2], 0).acquire()
print("held", flush=True)
time.sleep(600)
"""



def stage_inputs(stage: str, realdata: Path, tmp_path: Path) -> Path:
    """dedup's input (a planted score folder) or score's / caption's (shards of the real photos)."""
    if stage == "dedup":
        return planted().write(tmp_path / "in")
    write_image_shards(realdata / "images", tmp_path / "in")
    return tmp_path / "in"

@pytest.mark.parametrize("stage", ["caption", "dedup"])
def test_a_second_process_of_one_rank_into_an_output_is_refused_while_the_first_runs(stage, models, realdata,
                                                                                       tmp_path):
    """Two processes of one rank wrote the same files: dedup's removed the other's scratch (FileNotFoundError),
    caption's renamed the other's unfinished tar into place. The second is refused, naming the first."""
    inputs = stage_inputs(stage, realdata, tmp_path)
    output = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(output), stage], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        result = run_cli(*stage_args(stage, inputs, output, models), check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"--output {output} is in use by another {stage} as rank 0 (pid {holder.pid} " in result.stderr
    finally:
        holder.kill()
        holder.wait()
    run_cli(*stage_args(stage, inputs, output, models))  # the lock goes with its process, kill -9 included
    assert not [path.name for path in output.glob(".*.partial")]


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scorers")
    run_cli("models", "tiny-eval", "--output", folder)
    return folder


def eval_args(pipeline: Path, reference: Path, output: Path, scorers: Path, tmp_path: Path) -> list:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a mat\na dog in the park\n")
    return ["eval", pipeline, "--reference", reference, "--prompts", prompts, "--count", "2", "--steps", "1",
            "--resolution", "32", "--output", output, "--inception", scorers / "inception.pth", "--clip-model",
            scorers / "tiny-clip.json", "--clip-pretrained", scorers / "tiny-clip.safetensors", "--kid-subsets", "2",
            "--kid-subset-size", "2", "--quiet"]


@pytest.mark.parametrize("stage", ["score", "caption", "dedup", "eval"])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(stage, models, realdata, tmp_path, request):
    """An --output under a regular file (what a read-only folder is to root, who may write anywhere else): a
    NotADirectoryError traceback in score; eval found it only after generating every image."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    output = blocker / "out"
    if stage == "eval":
        args = eval_args(request.getfixturevalue("tiny_models"), realdata / "images", output,
                         request.getfixturevalue("scorers"), tmp_path)
    elif stage == "dedup":
        args = stage_args(stage, planted().write(tmp_path / "in"), output, models)
    else:
        write_image_shards(realdata / "images", tmp_path / "in")
        args = stage_args(stage, tmp_path / "in", output, models)
    result = run_cli(*args, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1 and str(output) in errors[0] and "Not a directory" in errors[0], result.stderr
    if stage == "eval":
        assert "nothing was generated" in errors[0]


FULL_DISK = """import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
from laionkit.cli import main
sys.argv = ["laionkit", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("stage", ["score", "caption", "dedup"])
def test_a_disk_that_takes_no_more_is_one_line_naming_the_file(stage, models, realdata, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) in the stage's process: its writes past 3000 bytes fail as on a full disk
    (root cannot be kept from writing by permissions, and a small mount needs privileges CI may not have)."""
    inputs = stage_inputs(stage, realdata, tmp_path)
    output = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", FULL_DISK, *map(str, stage_args(stage, inputs, output, models))],
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1 and f"cannot write {output}{os.sep}" in errors[0] and "File too large" in errors[0]


def test_eval_counts_unreadable_reference_files_as_skips_and_refuses_another_familys_pipeline(
        tiny_models, scorers, realdata, tmp_path):
    """A decompression bomb (a traceback after generating), a FIFO named like a photo (a hang), a file that is
    no image: counted skips, found before anything is generated. And a model_index.json that names a family
    whose components the folder lacks loaded in diffusers and failed once it generated."""
    from PIL import Image

    reference = tmp_path / "reference"
    shutil.copytree(realdata / "images", reference)
    Image.new("1", (14_000, 14_000)).save(reference / "bomb.png")  # over twice Pillow's pixel limit
    os.mkfifo(reference / "waiting.jpg")
    (reference / "notes.jpg").write_text("not an image")
    run_cli(*eval_args(tiny_models, reference, tmp_path / "out", scorers, tmp_path))
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert (result["reference_images"], result["reference_skipped"]) == (8, 3)
    few = tmp_path / "few"
    few.mkdir()
    for name in ("bomb.png", "notes.jpg", "original.png"):
        shutil.copy(reference / name, few / name)
    failed = run_cli(*eval_args(tiny_models, few, tmp_path / "few-out", scorers, tmp_path), check=False)
    assert failed.returncode == 2 and f"--reference {few}: 1 readable images (2 skipped)" in failed.stderr
    assert not (tmp_path / "few-out" / "eval.json").exists()

    other = tmp_path / "sdxl-named"
    shutil.copytree(tiny_models, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    failed = run_cli(*eval_args(other, reference, tmp_path / "sdxl-out", scorers, tmp_path), check=False)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert (f"PIPELINE {other}: model_index.json names StableDiffusionXLPipeline (sdxl), but the folder has no "
            "tokenizer_2, text_encoder_2 folder") in " ".join(failed.stderr.split())


def test_eval_downloads_each_inception_url_into_its_own_file(scorers, tmp_path, monkeypatch):
    """Two URLs ending in one file name: the second was given the first one's cached weights."""
    import functools
    import http.server
    import threading

    import torch

    from laionkit.evaluate.inception import resolve_weights

    for folder, seed in (("a", 1), ("b", 2)):
        (tmp_path / "site" / folder).mkdir(parents=True)
        torch.save({"w": torch.full((2,), float(seed))}, tmp_path / "site" / folder / "inception.pth")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        first, second = (resolve_weights(f"{base}/{folder}/inception.pth") for folder in ("a", "b"))
    finally:
        server.shutdown()
    assert first != second
    assert [torch.load(path)["w"][0].item() for path in (first, second)] == [1.0, 2.0]
