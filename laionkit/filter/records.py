"""filter's output folder as records: the sidecars' names, its finished parts, its plan and a sidecar's record.
Its own module, light on imports, so what checks a filter folder from outside (common.upstream) needs none of
filter's planning code; filter/folder.py writes the folder and imports these from here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError
from laionkit.common.storage import Location

# Sidecars (the plan, each rank's stats) live in _laionkit/ as parquet files with no rows, the parts'
# columns and the record in their footer: pandas, pyarrow.dataset and Spark skip "_" names, while
# polars.read_parquet(DIR) reads every file below DIR (refusing other extensions) and
# datasets.load_dataset(DIR) every non-hidden one; a parquet file with the same columns and no row group
# adds no row to either.
SIDECARS = "_laionkit"
PLAN_NAME = f"{SIDECARS}/filter-plan.parquet"
STATS_GLOB = "filter-stats-*.parquet"  # in SIDECARS
SIDECAR_KEY = "laionkit.filter.record"
JSON_PLAN_NAME = "_filter-plan.json"  # folders filtered before the sidecars moved: still read, resumed
JSON_STATS_GLOB = "_stats-*.json"
LEGACY_PLAN_NAME = "filter-plan.json"  # before sidecars were "_"-named


STATS_KEY = "laionkit.filter.unit"
PART_NAME = re.compile(r"^part-(\d{5})-(\d{6})\.parquet$")


def existing_parts(output: Location) -> dict[int, Location]:
    """Finished parts (in an object store: those with their done record)."""
    parts = {}
    for path in output.list("part-*.parquet"):
        match = PART_NAME.match(path.name)
        if match:
            parts[int(match.group(2))] = path
    return parts


def plan_location(folder: Location | Path | str) -> Location | None:
    """The folder's plan sidecar (an older folder's JSON one), None when it has none."""
    folder = Location.parse(folder)
    for path in (folder / PLAN_NAME, folder / JSON_PLAN_NAME):
        if path.is_complete() and not path.is_dir():
            return path
    return None


def read_record(path: Location) -> dict:
    """A sidecar record (plan or rank stats; parquet footer or older JSON), or a one-line error naming it."""
    try:
        if path.name.endswith(".parquet"):
            # Read whole (a footer and no row): one GET, and no stale listing cache of an object store
            metadata = pq.read_metadata(pa.BufferReader(path.read_bytes())).metadata or {}
            if SIDECAR_KEY.encode() not in metadata:
                raise ValueError(f"no {SIDECAR_KEY} in its footer")
            record = json.loads(metadata[SIDECAR_KEY.encode()])
        else:
            record = path.read_json()
    except (OSError, ValueError, pa.ArrowException, LaionkitError) as error:
        raise LaionkitError(f"{path}: unreadable ({error}); delete it and rerun the filter") from None
    if not isinstance(record, dict):
        raise LaionkitError(f"{path}: not a laionkit filter record; delete it and rerun the filter")
    return record
