"""train's failures that are the user's data or disk, not a bug: one line naming the file or flag, exit 2.

A latent shard damaged after train opened it, read by DataLoader workers or without; a --cache-dir that
cannot be written; a disk that fills up at a checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import run_cli

from laionkit.common import LaionkitError
from laionkit.trainer.latent_stream import StreamLayout, end_workers, latent_loader

TINY = ("--unet-config", "tiny", "--lr", "1e-3", "--log-with", "none", "--quiet", "--batch-size", "2")


def _zero_member(shard: Path, suffix: str, index: int = 2) -> str:
    """Overwrite the data of the ``index``-th member named *suffix with zeros (its tar header stays whole, so
    train's open, which counts samples by header, passes); returns the sample's key."""
    with tarfile.open(shard) as tar:
        member = [m for m in tar.getmembers() if m.name.endswith(suffix)][index]
    data = bytearray(shard.read_bytes())
    data[member.offset_data:member.offset_data + member.size] = bytes(member.size)
    shard.write_bytes(bytes(data))
    return member.name.split(".")[0]


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "Caught" not in stderr and "0x" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_member_that_fails_to_decode_is_one_line_naming_shard_sample_and_member(latent_shards, tmp_path, workers):
    """A text tensor damaged in place: with workers the trainer printed the worker's whole traceback."""
    latents = tmp_path / "latents"
    shutil.copytree(latent_shards, latents)
    key = _zero_member(latents / "00001.tar", ".text.npy")
    result = run_cli("train", latents, "--output", tmp_path / "run", *TINY, "--max-steps", "6",
                     "--workers", workers, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_error_line(result.stderr)
    assert f"00001.tar: sample {key}: its .text.npy cannot be decoded" in line, line


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_cut_short_after_open_is_one_line_naming_it(latent_shards, tmp_path, workers):
    """The loader exists (train has opened and counted the shards), then a shard loses its tail: the
    error was a tuple holding the stream object's address (no workers) or a worker's traceback."""
    latents = tmp_path / "latents"
    shutil.copytree(latent_shards, latents)
    shards = tuple(map(str, sorted(latents.glob("*.tar"))))
    loader = latent_loader(StreamLayout(shards, 0, 1, workers, 2, 0, 0))
    shard = latents / "00001.tar"
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[5]
    shard.write_bytes(shard.read_bytes()[:cut.offset_data + 10])
    batches = iter(loader)
    try:
        with pytest.raises(LaionkitError) as error:
            for _ in range(20):
                next(batches)
    finally:
        end_workers(batches)
    message = str(error.value)
    assert "\n" not in message and "0x" not in message and "BufferedReader" not in message, message
    assert message.startswith(f"{shard}: latent shard damaged after sample 00001000"), message
    assert "unexpected end of data" in message, message


@pytest.fixture
def mount_tmpfs():
    """``mount_tmpfs(folder, options)``: a tmpfs there (root: CI runs as root), unmounted afterwards."""
    mounted = []

    def mount(folder: Path, options: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_an_unusable_cache_dir_is_one_line_at_the_start(latent_shards, tmp_path, mount_tmpfs):
    """--cache-dir under a regular file (NotADirectoryError) or on a read-only mount: refused before the
    model is built, naming the flag and the path (was: a traceback, or a failure at the first remote read,
    inside a DataLoader worker)."""
    (tmp_path / "file").write_text("")
    read_only = mount_tmpfs(tmp_path / "ro", "ro,size=1m")
    for cache in (tmp_path / "file" / "cache", read_only):
        result = run_cli("train", latent_shards, "--output", tmp_path / "run", *TINY, "--max-steps", "1",
                         "--workers", "0", "--cache-dir", cache, check=False)
        assert result.returncode == 2, result.stderr[-3000:]
        line = _one_error_line(result.stderr)
        assert line.startswith(f"error: --cache-dir {cache}: cannot create or write a file in it"), line
        assert not (tmp_path / "run").exists()  # refused at the start: no run folder made


@pytest.mark.parametrize("size", ["2m", "6m"])  # full in the safetensors weights; in torch.save's optimizer state
def test_a_disk_full_at_a_checkpoint_is_one_line_and_leaves_no_checkpoint(latent_shards, tmp_path, mount_tmpfs,
                                                                          size):
    """A checkpoint (10 MB here) on a disk that cannot hold it: one line naming the run folder and what to
    do, and nothing under checkpoints/, neither a complete-looking folder nor a temporary. safetensors
    says "No space left on device (os error 28)"; torch.save only "unexpected pos ... vs ...", which the
    free space tells apart."""
    disk = mount_tmpfs(tmp_path / "disk", f"size={size}")
    run = disk / "run"
    result = run_cli("train", latent_shards, "--output", run, *TINY, "--max-steps", "2", "--workers", "0",
                     "--checkpoint-every", "2", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_error_line(result.stderr)
    assert line.startswith(f"error: step 2: the disk of {run} ("), line
    assert "is full: no space for checkpoint step-00000002" in line and "--resume latest" in line, line
    assert list((run / "checkpoints").iterdir()) == []


def test_train_refuses_another_stages_folder_in_one_line(latent_shards, bucket_latents, image_shards, realdata,
                                                         score_models, tmp_path):
    """train wrote checkpoints/ into a score, latents or pack folder (exit 0) where every other stage
    refuses one; --overwrite writes there anyway, as it does for the other stages."""
    from fixtures import pack_folder

    scored = tmp_path / "scored"
    run_cli("score", image_shards / "00000.tar", "--output", scored, "--clip-model", score_models["config"],
            "--clip-pretrained", score_models["weights"], "--workers", "0")
    latents = tmp_path / "latents"
    shutil.copytree(bucket_latents, latents)
    folders = {"score's scores": scored, "encode's latent shards": latents,
               "pack's image shards": pack_folder(tmp_path / "packed", realdata)}
    for kind, folder in folders.items():
        before = sorted(p.name for p in folder.iterdir())
        result = run_cli("train", latent_shards, "--output", folder, *TINY, "--max-steps", "1", "--workers", "0",
                         check=False)
        assert result.returncode == 2, result.stderr[-3000:]
        line = _one_error_line(result.stderr)
        assert f"--output {folder} holds {kind}" in line, line
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == before
    run_cli("train", latent_shards, "--output", latents, *TINY, "--max-steps", "1", "--workers", "0", "--overwrite")
    assert (latents / "unet").is_dir()
