"""A run folder, a model folder or a weights file a user hands over is data, never code: every place laionkit
deserializes such a file is tried with a hostile one whose payload would create a marker file. Each is refused
in one line naming the file (exit 2 through the CLI), and the marker never appears."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path, PosixPath

import pytest
import torch
from conftest import run_cli

from laionkit.common import LaionkitError

TINY = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "0", "--log-every", "1")


def _text(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def calls(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle calling ``module.name(argument)``: STACK_GLOBAL, which resolves a dotted ``name``
    attribute by attribute inside ``module``, then REDUCE."""
    return b"\x80\x04" + _text(module) + _text(name) + b"\x93" + _text(argument) + b"\x85R."


class _Bound:
    """``getattr(PosixPath(marker), "touch")``: getattr on something other than an enum."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __call__(self):
        raise AssertionError("only pickled")

    def __reduce__(self):
        return getattr, (PosixPath(self.marker), "touch")


class _Touches:
    """Calls what _Bound's getattr returns: the marker's Path.touch()."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return _Bound(self.marker), ()


class _System:
    """What ``pickle.dumps`` writes for an os.system call (the global ``posix.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def hostile_pickles(marker: Path) -> dict[str, bytes]:
    """Pickles that would create ``marker``, each in another shape."""
    command = f"touch {marker}"
    return {
        "dotted name through DCP's module": calls("torch.distributed.checkpoint.metadata", "os.system", command),
        "dotted name through torch": calls("torch", "os.system", command),
        "os.system": pickle.dumps(_System(marker), protocol=2),
        "builtins.eval": calls("builtins", "eval", f"__import__('os').system('{command}')"),
        "getattr on a path": pickle.dumps(_Touches(marker), protocol=4),
    }


def test_the_hostile_pickles_run_their_payload_when_unpickled_plainly(tmp_path):
    """The control: each pickle the tests below hand over does create its marker under plain pickle.loads."""
    for shape, data in hostile_pickles(tmp_path / "marker").items():
        pickle.loads(data)
        assert (tmp_path / "marker").exists(), shape
        (tmp_path / "marker").unlink()


# ---- DCP's .metadata (checkpoint_async) -----------------------------------------------------------------
def dcp_state(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.randn(3, 4)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.mark.parametrize("shape", list(hostile_pickles(Path("m"))))
def test_a_hostile_dcp_metadata_is_refused_in_one_line_and_its_payload_never_runs(shape, tmp_path):
    """Each shape of hostile .metadata (a dotted name through a module DCP's classes live in, a plain
    os.system, builtins.eval, getattr on a path) is refused before anything is called."""
    from laionkit.trainer.checkpoint_async import _reader

    state, marker = dcp_state(tmp_path / "state"), tmp_path / "marker"
    (state / ".metadata").write_bytes(hostile_pickles(marker)[shape])
    with pytest.raises(LaionkitError, match=r"\.metadata: not plain checkpoint metadata, refused to load it") as error:
        _reader(state).read_metadata()
    assert "\n" not in str(error.value)
    assert not marker.exists()


def test_a_dcp_entry_that_is_not_a_tensor_is_refused_before_dcp_unpickles_it(tmp_path):
    """DCP stores a non-tensor value as a torch.save pickle and reads it back with weights_only=False: laionkit's
    checkpoints hold tensors only, so such an entry (metadata made of DCP's own classes) is refused, and the
    pickle in the .distcp file is never read."""
    import torch.distributed.checkpoint as dcp

    from laionkit.trainer.checkpoint_async import _reader

    marker = tmp_path / "marker"
    dcp.save({"model": {"w": _System(marker)}}, checkpoint_id=str(tmp_path / "state"), no_dist=True)
    with pytest.raises(LaionkitError, match=r"refused to load it .*BytesStorageMetadata"):
        _reader(tmp_path / "state").read_metadata()
    assert not marker.exists()


def forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace ``name`` in ``checkpoint`` and its size and sha256 in trainer.json, as anyone who can write the
    run folder can."""
    (checkpoint / name).write_bytes(data)
    record = json.loads((checkpoint / "trainer.json").read_text())
    record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "trainer.json").write_text(json.dumps(record))


def assert_refused(result, marker: Path, *words: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert all(word in line for word in words), line
    assert not marker.exists()


def test_train_resume_latest_refuses_a_forged_dcp_metadata_in_one_line(latent_shards, tmp_path):
    """End to end: a run with DCP checkpoints whose step-2 .metadata is replaced by a hostile pickle (its hash
    in trainer.json updated to match): ``train --resume latest`` exits 2 with one line, the command never ran."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    args = (*TINY, "--checkpoint-every", "2", "--checkpoint-writer", "async")
    run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "2")
    checkpoint = run / "checkpoints" / "step-00000002"
    forge(checkpoint, "state/.metadata", hostile_pickles(marker)["dotted name through DCP's module"])
    result = run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "4", "--resume", "latest",
                     check=False)
    assert_refused(result, marker, "state/.metadata", "refused to load it", "os.system")
