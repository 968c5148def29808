"""filter's inputs: the parquet files (sorted by path: the unit order), their footers and versions, the CLIP
embeddings paired with them by number, and the work units cut from their row groups.

Invariant: units cover every row of every readable input exactly once, in input order; a unit never
spans two files.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, storage
from laionkit.common.storage import Location


@dataclass(frozen=True)
class InputFile:
    path: str
    rows: int
    row_group_rows: tuple[int, ...]
    schema: pa.Schema = field(compare=False, repr=False)
    embeddings: str | None = None
    location: Location | None = field(default=None, compare=False, repr=False)  # where to open ``path``
    embeddings_layout: storage.NpyLayout | None = field(default=None, compare=False, repr=False)

    def open(self) -> pq.ParquetFile:
        return pq.ParquetFile(self.location.open_read() if self.location else self.path)

    @functools.cached_property
    def scanned(self) -> dict[str, str]:
        """Each column's name as DuckDB reads the file: names equal but for case would be one to SQL, so DuckDB
        gives every later one a ``_N`` suffix (``width``, ``WIDTH`` -> ``width``, ``WIDTH_1``)."""
        counts: dict[str, int] = {}
        taken: set[str] = set()
        names = {}
        for name in self.schema.names:
            scanned = name
            while scanned.lower() in taken:
                counts[name.lower()] = counts.get(name.lower(), 0) + 1
                scanned = f"{name}_{counts[name.lower()]}"
            taken.add(scanned.lower())
            names[name] = scanned
        return names


@dataclass(frozen=True)
class Unit:
    """Row groups [start, stop) of input file ``file``; ``offset`` = the file row of its first row."""

    index: int
    file: int
    start: int
    stop: int
    offset: int
    rows: int


def make_units(files: Sequence[InputFile], unit_rows: int) -> list[Unit]:
    """Cut each file into runs of row groups holding at least ``unit_rows`` rows (the last run may be
    smaller); a file without row groups still gets one empty unit, so it leaves a record."""
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        start, rows, offset = 0, 0, 0
        for group, group_rows in enumerate(file.row_group_rows):
            rows += group_rows
            if rows >= unit_rows or group == len(file.row_group_rows) - 1:
                units.append(Unit(len(units), file_index, start, group + 1, offset, rows))
                start, offset, rows = group + 1, offset + rows, 0
        if not file.row_group_rows:
            units.append(Unit(len(units), file_index, 0, 0, 0, 0))
    return units


def find_inputs(paths: Sequence[str], options: dict | None = None) -> list[Location]:
    """Files given, plus every ``*.parquet`` under folders given; sorted by path (the unit order).

    Expanded here, once: a path that exists is literal (even ``star*.parquet``), one that does not is
    a glob pattern. Files and folders named with "." or "_" are skipped in folders, as dataset readers do."""
    found: set[Path] = set()
    remote: set[Location] = set()
    for given in paths:
        location = Location.parse(given, options)
        if not location.local:
            remote.update(find_remote_inputs(location, given))
            continue
        given = location.path
        matches = [given] if Path(given).exists() else sorted(glob.glob(given, recursive=True))
        if not matches:
            raise LaionkitError(f"input not found: {given}")
        for match in map(Path, matches):
            if match.is_dir():
                found.update(p for p in match.rglob("*.parquet") if p.is_file() and not any(
                    part.startswith((".", "_")) for part in p.relative_to(match).parts))
            elif match.is_file():
                found.add(match)
    if not found and not remote:
        raise LaionkitError(f"no parquet files in {', '.join(paths)}")
    return sorted([Location("", str(p.resolve())) for p in found] + list(remote), key=str)


def find_remote_inputs(location: Location, given: str) -> list[Location]:
    """``find_inputs`` for a URL. In a folder that holds done records (a laionkit output, possibly of a
    killed run) only objects with their record count; a folder uploaded by other tools has none, so
    all its ``*.parquet`` objects do."""
    if location.exists() and not location.is_dir():
        return [location]
    if not location.is_dir():
        matches = [m for m in location.parent.glob(location.name) if m.name.endswith(".parquet")]
        if not matches:
            raise LaionkitError(f"input not found: {given}")
        return matches
    try:
        names = [str(name) for name in location.fs.find(location.path)]
    except Exception as error:  # noqa: BLE001 -- storage errors of any fsspec backend, named in one line
        raise LaionkitError(f"cannot list {given}: {type(error).__name__}: {error}") from None
    relative = [name[len(location.path.rstrip("/")) + 1:] for name in names]
    done = set()
    for rel in relative:
        folder, _, name = rel.rpartition("/")
        if name.startswith(".") and name.endswith(storage.DONE_SUFFIX):
            done.add(f"{folder}/{name[1:-len(storage.DONE_SUFFIX)]}".lstrip("/"))
    return [location.join(rel) for rel in relative if rel.endswith(".parquet")
            and not any(part.startswith((".", "_")) for part in rel.split("/")) and (not done or rel in done)]


def read_footer(location: Location) -> tuple[pq.ParquetFile, dict]:
    """The file's footer, and what identifies this version of the file: size, mtime (an object's ETag)
    and a hash of the footer bytes (which hold every row group's offsets and statistics), so a replaced
    input is noticed."""
    try:
        with location.open_read(block_size=2**20) as file:
            footer = pq.ParquetFile(file)
            file.seek(-8, 2)
            length = int.from_bytes(file.read(4), "little")
            file.seek(-8 - length, 2)
            digest = hashlib.sha256(file.read(length + 8)).hexdigest()
        if location.local:
            stat = os.stat(location.path)
            identity = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        else:
            info = location.fs.info(location.path)
            identity = {"bytes": int(info["size"]), "etag": str(info.get("ETag") or info.get("etag") or "")}
    except (pa.ArrowException, OSError, ValueError) as error:
        raise LaionkitError(f"{location}: not a readable parquet file ({error})") from None
    return footer, {**identity, "footer_sha256": digest}


def embeddings_by_number(paths: Sequence[str], options: dict | None = None) -> list[Location]:
    """The ``.npy`` files given, or in the folders given (a local path or any fsspec URL)."""
    found: list[Location] = []
    for given in paths:
        location = Location.parse(given, options)
        if location.is_dir():
            found += location.list("*.npy", complete_only=None)
        elif location.exists():
            found.append(location)
        else:
            raise LaionkitError(f"--embeddings not found: {given}")
    if not found:
        raise LaionkitError(f"no .npy files in --embeddings {', '.join(paths)}")
    return found


def trailing_number(path: Path | Location) -> str | None:
    match = re.search(r"(\d+)$", Path(path.name).stem)
    return str(int(match.group(1))) if match else None


def match_embeddings(inputs: Sequence[Location], npys: Sequence[Location]) -> dict[Location, Location]:
    """One file <-> one file; else by name, as `laionkit score` writes them (scores/<stem>.parquet <->
    img_emb/img_emb_<stem>.npy, any stem), when every input has one; else LAION's layout: img_emb_0003.npy
    <-> metadata_0003.parquet by number."""
    if len(inputs) == 1 and len(npys) == 1:
        return {inputs[0]: npys[0]}
    by_name = {npy.name: npy for npy in npys}
    named = {parquet: by_name.get(f"img_emb_{Path(parquet.name).stem}.npy") for parquet in inputs}
    if all(named.values()):
        return named
    by_number: dict[str, Location] = {}
    for npy in npys:
        number = trailing_number(npy)
        if number is None or number in by_number:
            raise LaionkitError(f"--embeddings {npy}: cannot pair it with an input by its number")
        by_number[number] = npy
    pairs = {}
    for parquet in inputs:
        number = trailing_number(parquet)
        if number is None or number not in by_number:
            raise LaionkitError(f"no embeddings file for {parquet} (looked for a .npy numbered {number})")
        pairs[parquet] = by_number[number]
    return pairs


def check_embeddings(npy: Location, parquet: Location, rows: int) -> storage.NpyLayout:
    """The array's header, checked against its parquet file (local: memory-mapped later; URL: row
    ranges read per unit, so no file is downloaded whole)."""
    layout = storage.npy_layout(npy)
    if len(layout.shape) != 2 or layout.dtype not in (np.float16, np.float32):
        raise LaionkitError(f"{npy}: expected a float16/float32 N x D array, got {layout.dtype} {layout.shape}")
    if layout.shape[0] != rows:
        raise LaionkitError(
            f"{npy} has {layout.shape[0]} rows but {parquet} has {rows}: they must align row by row"
        )
    return layout
