"""`train --log-with wandb`, offline (WANDB_MODE=offline): the project, entity, run name and tags given, and
a resume that continues the same W&B run (its id kept in RUN/wandb.json)."""

from __future__ import annotations

import json
import struct
import time

import pytest
from conftest import run_cli

wandb = pytest.importorskip("wandb")


def _records(path, wait: float = 60.0):
    """The protobuf records of an offline run's .wandb file, once W&B's service has written its exit record (it
    writes in a process of its own, which may still be flushing when wandb.finish returns on a loaded host)."""
    deadline = time.monotonic() + wait
    while True:
        records = list(_read_records(path))
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _read_records(path):
    """The protobuf records of an offline run's .wandb file: W&B's header, then a LevelDB-format log
    (32 KiB blocks; each chunk a 7-byte header: crc, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    position, parts = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (length, kind) == (0, 0):
            break
        parts += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _runs(run) -> dict[str, dict]:
    """The offline W&B runs under RUN/logs by directory: each one's run record (id, project, entity, name,
    tags) and the steps it logged."""
    found = {}
    for folder in sorted((run / "logs" / "wandb").glob("offline-run-*")):
        [path] = folder.glob("run-*.wandb")
        found[folder.name] = {"steps": []}
        for record in _records(path):
            if record.WhichOneof("record_type") == "run":
                found[folder.name].update(id=record.run.run_id, project=record.run.project, entity=record.run.entity,
                                          name=record.run.display_name, tags=list(record.run.tags))
            elif record.WhichOneof("record_type") == "history":
                found[folder.name]["steps"].append(record.history.step.num)
    return found


def test_project_entity_name_tags_and_a_resume_continue_one_wandb_run(latent_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = ("train", latent_shards, "--output", run, "--unet-config", "tiny", "--batch-size", "2", "--workers",
            "0", "--quiet", "--log-every", "1", "--checkpoint-every", "2", "--log-with", "wandb",
            "--wandb-project", "laion-tests", "--wandb-entity", "me", "--wandb-run-name", "first", "--wandb-tags",
            "tiny, cpu")
    run_cli(*args, "--max-steps", "2")
    [first] = _runs(run).values()
    assert first["project"] == "laion-tests" and first["entity"] == "me" and first["name"] == "first"
    assert first["tags"] == ["tiny", "cpu"]
    assert json.loads((run / "wandb.json").read_text())["id"] == first["id"]
    run_cli(*args, "--max-steps", "4", "--resume", "latest")
    runs = _runs(run)
    assert len(runs) == 2 and {r["id"] for r in runs.values()} == {first["id"]}, runs
    assert sorted(step for r in runs.values() for step in r["steps"]) == [1, 2, 3, 4]

    fresh = tmp_path / "fresh"
    run_cli(*[str(a).replace(str(run), str(fresh)) for a in args], "--max-steps", "1")
    [other] = _runs(fresh).values()
    assert other["id"] != first["id"]
    bad = run_cli("train", latent_shards, "--output", tmp_path / "bad", "--unet-config", "tiny", "--max-steps", "1",
                  "--wandb-project", "x", check=False)
    assert bad.returncode == 2 and "--wandb-project goes with --log-with wandb" in bad.stderr, bad.stderr
