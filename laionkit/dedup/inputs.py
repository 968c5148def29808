"""dedup's inputs: the per-shard parquet files and embedding arrays of `laionkit score` outputs, checked once.

A SCORES_DIR holds ``scores/<stem>.parquet`` (one row per image: ``key``, ``shard``, ``sha256``, ``phash``,
score columns) and ``img_emb/img_emb_<stem>.npy`` (its CLIP image embeddings, row i of one is row i of the
other). A unit of work is one such shard; units are ordered by input folder (as given), then stem, and
each row's global position (``pos``) is its index in that order, the last tie-breaker of every choice. Two
folders may hold the same stems and keys (score folders of two webdatasets whose shard and key numbering both
start at 0), so a row is named by its folder too (``Unit.folder``: keep.parquet's ``input``).
Everything a layer needs is checked before any work, from the parquet footers and npy headers only, so
a mistake stops every rank at once with one line naming the file and column.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError
from laionkit.common.storage import Location, npy_layout


@dataclass(frozen=True)
class Unit:
    index: int
    scores: Path  # DIR/scores/<stem>.parquet
    embeddings: Path | None  # DIR/img_emb/img_emb_<stem>.npy, when a layer needs them
    rows: int
    start: int  # global position of its first row
    folder: str  # the input folder it is in, as given: with (shard, key), what names one of its rows

    @property
    def stop(self) -> int:
        return self.start + self.rows


def embeddings_path(scores: Path) -> Path:
    return scores.parent.parent / "img_emb" / f"img_emb_{scores.stem}.npy"


def find_units(folders: tuple[str, ...], columns: dict[str, str], embeddings: str | None,
               role: str = "input") -> list[Unit]:
    """The shards of ``folders`` with every column of ``columns`` (name -> why it is needed) checked, and
    their embeddings when ``embeddings`` (why they are needed) is given: present, 2-D, one row per row."""
    units: list[Unit] = []
    dim = None
    for folder in folders:
        root = Path(folder)
        if not root.is_dir():
            raise LaionkitError(f"{role} {folder}: not a folder (give `laionkit score --output` folders)")
        files = sorted((root / "scores").glob("*.parquet"))
        if not files:
            raise LaionkitError(f"{role} {folder}: no scores/*.parquet in it (the layout `laionkit score` writes)")
        for path in files:
            Location("", str(path)).refuse_special()
            schema = pq.read_schema(path)
            for name, why in columns.items():
                if name not in schema.names:
                    raise LaionkitError(f"{path}: no column '{name}' ({why}); it has {', '.join(schema.names)}")
                check_type(path, name, schema.field(name).type)
            rows = pq.ParquetFile(path).metadata.num_rows
            npy = None
            if embeddings is not None:
                npy = embeddings_path(path)
                Location("", str(npy)).refuse_special()
                if not npy.is_file():
                    raise LaionkitError(f"{path}: no embeddings {npy} beside it ({embeddings})")
                layout = npy_layout(str(npy))
                if len(layout.shape) != 2 or layout.shape[0] != rows:
                    raise LaionkitError(f"{npy}: shape {layout.shape}, but {path} has {rows} rows "
                                        f"(row i of the embeddings is row i of the parquet: want ({rows}, D))")
                if dim is not None and layout.shape[1] != dim:
                    raise LaionkitError(f"{npy}: {layout.shape[1]}-dimensional embeddings, the other "
                                        f"{role}s' are {dim}-dimensional")
                dim = layout.shape[1]
            start = units[-1].stop if units else 0
            units.append(Unit(len(units), path, npy, rows, start, folder))
    return units


def check_type(path: Path, name: str, kind: pa.DataType) -> None:
    if name in ("key", "shard", "sha256"):
        ok = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        want = "a string"
    elif name == "phash":
        ok = pa.types.is_integer(kind)
        want = "a 64-bit integer"
    else:  # --keep-by
        ok = pa.types.is_integer(kind) or pa.types.is_floating(kind)
        want = "a number"
    if not ok:
        raise LaionkitError(f"{path}: column '{name}' is {kind}, want {want}")


def embedding_dim(units: list[Unit]) -> int:
    return npy_layout(str(units[0].embeddings)).shape[1]


def read_embeddings(unit: Unit, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (unit-local indices, ascending) of the unit's embeddings, L2-normalised float32."""
    array = np.load(unit.embeddings, mmap_mode="r")
    return normalise(np.asarray(array[rows], dtype=np.float32))


def normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
