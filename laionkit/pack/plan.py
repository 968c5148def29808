"""The global shard list: input files in path order cut into shards of ``shard_size`` rows.

Invariant: deterministic given the sorted files, their row counts and ``shard_size``; a shard never spans
two files, so shard names are global and the ranks together cover the input exactly once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError
from laionkit.common.columns import find_column
from laionkit.common.storage import Location
from laionkit.pack.config import MIN_SHARD_NAME_WIDTH, PackConfig

# Columns img2dataset writes itself; an input column with one of these names is carried as source_<name>.
RESERVED_COLUMNS = frozenset({
    "key", "caption", "url", "width", "height", "original_width", "original_height", "status",
    "error_message", "exif", "md5", "sha256", "sha512",
})


@dataclass(frozen=True)
class ShardTask:
    """One global shard: rows [start, stop) of one input file, and how its columns map to img2dataset's."""

    shard_id: int
    name: str
    input: str
    start: int
    stop: int
    url_column: str
    caption_column: str
    extra_columns: tuple[tuple[str, str], ...]  # (input name, name in the sample json)


def input_files(inputs: Sequence[Path | Location]) -> list[Location]:
    """Parquet files named or inside the named folders, sorted by path: the global row order.

    In an object-store folder written by laionkit (it holds done records) only complete objects count,
    so a killed filter's leftovers are never packed; a folder uploaded by other tools has no records."""
    files = []
    for given in inputs:
        path = Location.parse(given)
        if path.is_dir():
            # Hidden and underscore names are sidecars or temporaries (an older filter folder's _filter-plan.json,
            # .x.partial); filter's _laionkit/ sidecar folder is not listed (files of this folder only).
            found = [p for p in path.list("*.parquet", complete_only=None) if not p.name.startswith("_")]
            if not found:
                raise LaionkitError(f"{path}: folder holds no .parquet files")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise LaionkitError(f"{path}: no such file or folder")
    return sorted({Location("", str(Path(p.path).resolve())) if p.local else p for p in files}, key=str)


def carried_columns(columns: Sequence[str], url: str, caption: str) -> tuple[tuple[str, str], ...]:
    """Every input column but url/caption and pandas' index, renamed where img2dataset owns the name."""
    carried = []
    for column in columns:
        if column in (url, caption) or re.fullmatch(r"__index_level_\d+__", column):
            continue
        carried.append((column, f"source_{column}" if column in RESERVED_COLUMNS else column))
    return tuple(carried)


def plan_shards(files: Sequence[Location | Path], config: PackConfig) -> list[ShardTask]:
    """The global shard list; deterministic given the sorted files, their row counts and shard_size."""
    per_file = []
    for path in map(Location.parse, files):
        try:
            with path.open_read(block_size=2**20) as handle:
                metadata = pq.ParquetFile(handle)
        except (OSError, pa.ArrowInvalid) as error:
            raise LaionkitError(f"{path}: not a readable parquet file ({error})") from None
        names = metadata.schema_arrow.names
        url = find_column(names, "url", config.url_column, source=str(path))
        caption = find_column(names, "caption", config.caption_column, source=str(path))
        extra = carried_columns(names, url, caption)
        per_file.append((path, metadata.metadata.num_rows, url, caption, extra))
    total = sum(math.ceil(rows / config.shard_size) for _, rows, *_ in per_file)
    width = max(MIN_SHARD_NAME_WIDTH, len(str(max(total - 1, 0))))
    tasks = []
    for path, rows, url, caption, extra in per_file:
        for start in range(0, rows, config.shard_size):
            shard_id = len(tasks)
            tasks.append(ShardTask(
                shard_id, f"{shard_id:0{width}d}", str(path), start, min(start + config.shard_size, rows),
                url, caption, extra,
            ))
    return tasks


def task_input(task: ShardTask) -> dict[str, Any]:
    """Where a shard's rows come from, as recorded (and checked again on resume)."""
    return {
        "file": task.input, "rows": [task.start, task.stop], "url_column": task.url_column,
        "caption_column": task.caption_column,
    }
