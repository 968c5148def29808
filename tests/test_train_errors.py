"""train's failures that are the user's data or disk, not a bug: one line naming the file or flag, exit 2.

A latent shard damaged after train opened it, read by DataLoader workers or without; a --cache-dir that
cannot be written; a disk that fills up at a checkpoint.
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import run_cli

from laionkit.common import LaionkitError
from laionkit.latents import StreamLayout, latent_loader

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
    with pytest.raises(LaionkitError) as error:
        for _ in range(20):
            next(batches)
    message = str(error.value)
    assert "\n" not in message and "0x" not in message and "BufferedReader" not in message, message
    assert message.startswith(f"{shard}: latent shard damaged after sample 00001000"), message
    assert "unexpected end of data" in message, message
