"""Crash-safe outputs: a final name always means a complete file or folder."""

from __future__ import annotations

import pytest

from laionkit.common import atomic_output, read_json, write_json
from laionkit.common.outputs import partial_path


def test_file_appears_only_on_success(tmp_path):
    target = tmp_path / "part-00000-000000.parquet"
    with pytest.raises(RuntimeError):
        with atomic_output(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert not target.exists() and not partial_path(target).exists()
    with atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"


def test_stale_partial_from_a_killed_run_is_replaced(tmp_path):
    target = tmp_path / "step-00000010"
    stale = partial_path(target)
    stale.mkdir()
    (stale / "junk").write_text("from a kill -9")
    with atomic_output(target) as tmp:
        tmp.mkdir()
        (tmp / "model.bin").write_text("ok")
    assert sorted(p.name for p in target.iterdir()) == ["model.bin"]
    assert not stale.exists()


def test_folder_is_replaced_whole(tmp_path):
    target = tmp_path / "ckpt"
    for content in ("old", "new"):
        with atomic_output(target) as tmp:
            tmp.mkdir()
            (tmp / content).write_text(content)
    assert [p.name for p in target.iterdir()] == ["new"]


def test_json_round_trip(tmp_path):
    write_json(tmp_path / "m.json", {"b": 1, "a": [1, 2]})
    assert read_json(tmp_path / "m.json") == {"a": [1, 2], "b": 1}


@pytest.mark.parametrize("relation", ["same", "inside", "contains", "symlink"])
def test_output_overlapping_an_input_is_refused(tmp_path, relation):
    from laionkit.common import LaionkitError, refuse_overlap

    source = tmp_path / "data"
    source.mkdir()
    output = {"same": source, "inside": source / "out", "contains": tmp_path, "symlink": tmp_path / "alias"}[relation]
    if relation == "symlink":
        output.symlink_to(source)
    with pytest.raises(LaionkitError, match="outputs never overwrite inputs"):
        refuse_overlap([source], output, "encode")
    refuse_overlap([source], tmp_path / "elsewhere", "encode")  # a sibling folder is fine
