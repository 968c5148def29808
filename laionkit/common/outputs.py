"""Crash-safe outputs: everything is written under a temporary name and renamed when complete.

A file or folder with its final name is therefore always complete, which is what every stage's
resume logic relies on: "exists" means "done". Temporary names start with a dot and end in
``.partial`` so they never match a stage's output glob, and a rerun simply overwrites them.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import shutil
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from laionkit.common.errors import LaionkitError, write_refused, write_refused_line

PARTIAL_SUFFIX = ".partial"

VERSIONED_PACKAGES = (
    "laionkit", "torch", "torchvision", "pyarrow", "pandas", "duckdb", "webdataset", "img2dataset",
    "diffusers", "transformers", "accelerate", "open_clip_torch",
)


def partial_path(path: Path, writer: str = "") -> Path:
    return path.with_name(f".{path.name}{writer}{PARTIAL_SUFFIX}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_output(path: str | os.PathLike[str], shared: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write a file or folder into; rename it to ``path`` on success.

    On any exception the temporary is removed and ``path`` is left untouched. After a kill -9 the
    temporary stays behind under a dot-name and is replaced by the next attempt. ``shared=True`` is for
    a file several ranks rewrite (a merged manifest): each writer gets its own temporary name, so two
    writers never write into one file, and the last rename wins whole.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(final, f".{socket.gethostname()}-{os.getpid()}" if shared else "")
    if tmp.exists():
        _remove(tmp)
    try:
        yield tmp
    except BaseException as error:
        if tmp.exists():
            _remove(tmp)
        if write_refused(error):  # a full or read-only disk, named by the output (numpy's and pyarrow's errors do not)
            raise LaionkitError(write_refused_line(error, final)) from None
        raise
    if final.is_dir() and tmp.is_dir():
        shutil.rmtree(final)
    os.replace(tmp, final)


def write_json(path: str | os.PathLike[str], obj: Any, shared: bool = False) -> None:
    with atomic_output(path, shared) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    return json.loads(Path(path).read_text())


def strict_json(record: dict) -> str:
    """One JSON line as the standard has it: a non-finite number (a diverged loss) becomes null, not NaN."""
    clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def save_image_grid(images, path: str | os.PathLike[str]) -> None:
    """A PNG grid of float (N, 3, H, W) images in [0, 1], about square, written crash-safe (train's
    validation grids, eval's grid)."""
    from torchvision.utils import save_image

    with atomic_output(path) as tmp:
        save_image(images, tmp, nrow=math.ceil(math.sqrt(len(images))), format="png")


def refuse_other_settings(record: Path, found: dict, wanted: dict, made: str, remedy: str) -> None:
    """Outputs in one folder must come from one set of settings: a rerun with others is refused,
    naming every setting that differs, its recorded value and this run's."""
    changed = [key for key in sorted(set(found) | set(wanted)) if found.get(key) != wanted.get(key)]
    if changed:
        show = lambda values: ", ".join(f"{key}={json.dumps(values.get(key), default=str)[:200]}"  # noqa: E731
                                        for key in changed)
        raise LaionkitError(f"{record} was {made} with other {', '.join(changed)} ({show(found)}; this run: "
                            f"{show(wanted)}); {remedy}")


def refuse_overlap(inputs, output: str | os.PathLike[str], stage: str) -> None:
    """Outputs never overwrite inputs: refuse an ``output`` that is, contains, or lies inside an input.

    Paths are compared after resolving symlinks, so another spelling of the same folder is caught too.
    """
    out = Path(output).expanduser().resolve()
    for given in inputs:
        source = Path(given).expanduser().resolve()
        if out == source or out in source.parents or source in out.parents:
            relation = "is" if out == source else ("lies inside" if source in out.parents else "contains")
            raise LaionkitError(f"{stage}: --output {output} {relation} the input {given}; "
                                "outputs never overwrite inputs, choose another folder")


# What each stage leaves in its output folder, by name: the records that say whose folder it is. Each kind
# is (description, test on one top-level entry name). Tar shards belong to the stage whose per-shard
# records sit beside them; tars with neither are another tool's (a WebDataset of images, say).
FOLDER_KINDS: dict[str, tuple[str, Any]] = {
    "filter": ("filter's parquet parts", lambda name: name in ("_laionkit", "_filter-plan.json", "filter-plan.json")
               or re.fullmatch(r"part-\d{5}-\d{6}\.parquet", name) is not None),
    "pack": ("pack's image shards", lambda name: name.endswith("_stats.json")),
    "caption": ("caption's captioned image shards", lambda name: name == "caption.json"),
    "encode": ("encode's latent shards", lambda name: name in ("plan.json", "empty_caption.npy")
               or name.endswith(".stats.json")),
    # not stats.json: dedup's folder has one too (a score folder's records/ come before its stats.json)
    "score": ("score's scores and embeddings", lambda name: name in ("scores", "img_emb", "records")),
    "dedup": ("dedup's keep / removed lists", lambda name: name in ("keep.parquet", "removed.parquet")
              or name.startswith(".work-")),
    "train": ("a training run", lambda name: name in ("metrics.jsonl", "trainer.json", "checkpoints")),
    "model": ("a model", lambda name: name == "model_index.json"),
}
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# A kind whose folders also hold another kind's files as their own: caption writes pack's shard records
# (<shard>_stats.json) beside its tars, so that its folder reads as pack's.
ALSO_HOLDS = {"caption": ("pack",)}


def folder_holds(names: Sequence[str]) -> dict[str, list[str]]:
    """The kinds of stage output among a folder's entry ``names`` (top level only), each with its names.

    ``shards``: tar files no stage's records account for."""
    found: dict[str, list[str]] = {}
    for name in sorted(names):
        for kind, (_, owns) in FOLDER_KINDS.items():
            if owns(name):
                found.setdefault(kind, []).append(name)
    for name in sorted(names):
        if name.endswith(TAR_SUFFIXES) and not any(kind in found for kind in ("pack", "encode", "caption")):
            found.setdefault("shards", []).append(name)
    for kind, others in ALSO_HOLDS.items():
        if kind in found:
            for other in others:
                found.pop(other, None)
    return found


def describe_holdings(found: dict[str, list[str]]) -> str:
    """``found`` (folder_holds) in words, naming a few entries of each kind."""
    words = {**{kind: text for kind, (text, _) in FOLDER_KINDS.items()}, "shards": "WebDataset tar shards"}
    parts = []
    for kind, names in found.items():
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        parts.append(f"{words.get(kind, kind)} ({shown})")
    return "; ".join(parts)


def refuse_other_stage(names: Sequence[str], output: str, stage: str) -> None:
    """One stage never writes into another's folder: same-named files (``00000.tar``, ``manifest.json``)
    would be replaced, and the rest mixed. ``names``: the folder's top-level entries."""
    others = {kind: found for kind, found in folder_holds(names).items() if kind != stage}
    if others:
        raise LaionkitError(f"{stage}: --output {output} holds {describe_holdings(others)}; "
                            "choose another folder, or --overwrite to write there anyway")


def versions() -> dict[str, str]:
    """Installed versions of the packages that shape outputs, recorded in every manifest."""
    found = {}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
