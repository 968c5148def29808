"""filter's output folder: one part file per unit, the plan and rank-stats sidecars in ``_laionkit/``, and
the checks that refuse to mix two runs in one folder.

Invariant: a unit is done iff its part exists (written atomically; its stats in the part's footer).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, Rank, refuse_other_settings, storage, versions
from laionkit.common.storage import Location
from laionkit.filter.config import FilterConfig
from laionkit.filter.inputs import Unit
from laionkit.filter.plan import Plan
from laionkit.filter.sql import glob_literal, literal, nullable, quote

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


@dataclass
class RuleCounts:
    """Per rule: rows it rejected (false) and rows it could not test (null / NaN), counted independently."""

    dropped: int = 0
    nulls: int = 0


def existing_parts(output: Location) -> dict[int, Location]:
    """Finished parts (in an object store: those with their done record)."""
    parts = {}
    for path in output.list("part-*.parquet"):
        match = PART_NAME.match(path.name)
        if match:
            parts[int(match.group(2))] = path
    return parts


def unit_stats_from_part(path: Location) -> dict:
    """A finished unit's stats: the counts its footer records, and its rows kept, which the part holds."""
    with path.open_read(block_size=2**20) as handle:
        footer = pq.read_metadata(handle)
    metadata = footer.metadata or {}
    if STATS_KEY.encode() not in metadata:
        raise LaionkitError(f"{path}: no laionkit stats in its footer (not written by laionkit filter?)")
    return {**json.loads(metadata[STATS_KEY.encode()]), "rows_out": footer.num_rows}


def plan_location(folder: Location | Path | str) -> Location | None:
    """The folder's plan sidecar (an older folder's JSON one), None when it has none."""
    folder = Location.parse(folder)
    for path in (folder / PLAN_NAME, folder / JSON_PLAN_NAME):
        if path.is_complete() and not path.is_dir():
            return path
    return None


def stats_paths(folder: Location | Path | str) -> list[Location]:
    """The rank stats sidecars of a filter folder (an older folder's ``_stats-*.json``)."""
    folder = Location.parse(folder)
    return (folder / SIDECARS).list(STATS_GLOB) or folder.list(JSON_STATS_GLOB)


def write_sidecar(path: Location, record: dict, plan: Plan, connection: duckdb.DuckDBPyConnection,
                  shared: bool = False) -> None:
    """``record`` in the footer of a parquet file with the columns of a part of the plan's first input and
    no row group (DuckDB writes none for no rows): readers of the folder get the same schema, no row."""
    file = plan.files[0]
    columns = [f"{quote(name)} AS {quote(plan.renames.get(name, name))}" for name in file.schema.names]
    columns += [f"NULL::FLOAT AS {quote(spec.name)}" for spec in plan.scores]
    output = [plan.renames.get(name, name) for name in file.schema.names] + [spec.name for spec in plan.scores]
    source = (f"SELECT {', '.join(columns)}, 0::BIGINT AS __laionkit_row "
              f"FROM read_parquet({literal(glob_literal(file.path))}) LIMIT 0")
    metadata = literal(json.dumps(record, sort_keys=True, default=str))
    with storage.atomic_write(path, shared=shared, staging=plan.staging) as tmp:
        connection.execute(f"COPY (SELECT {', '.join(map(nullable, output))} FROM ({source})) TO {literal(str(tmp))} "
                           f"(FORMAT parquet, KV_METADATA {{{literal(SIDECAR_KEY)}: {metadata}}})").fetchall()


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


def refuse_changed_inputs(plan_path: Location, found: dict, wanted: dict) -> None:
    """An input replaced since the folder was filtered (same path, other size, mtime or footer) would mix
    rows of two files in one output: name it."""
    now = {entry["path"]: entry for entry in wanted["inputs"]}
    for entry in found.get("inputs", []):
        current = now.get(entry.get("path"))
        keys = ("bytes", "mtime_ns", "etag", "footer_sha256")
        if current is not None and any(entry.get(key) != current.get(key) for key in keys):
            raise LaionkitError(f"{entry['path']} changed since {plan_path.parent} was filtered from it "
                                "(size, mtime or footer differ); use --overwrite to redo it, or another --output")


def prepare_output(output: Location, plan: Plan, rank: Rank, overwrite: bool,
                   connection: duckdb.DuckDBPyConnection) -> None:
    """Refuse to mix runs; with --overwrite each rank clears only what it owns (no race between ranks)."""
    plan_path = plan_location(output)
    if (output / LEGACY_PLAN_NAME).is_complete() and not overwrite:
        raise LaionkitError(f"{output} was filtered by an older laionkit ({LEGACY_PLAN_NAME}); "
                            "use --overwrite to redo it, or another --output")
    if plan_path is not None and not overwrite:
        found = read_record(plan_path)
        refuse_changed_inputs(plan_path, found, plan.record)
        refuse_other_settings(plan_path, found, plan.record, "filtered",
                              "use --overwrite to redo it, or another --output")
    try:
        if output.local:
            Path(output.path).mkdir(parents=True, exist_ok=True)
        if overwrite:
            for unit, path in existing_parts(output).items():
                if unit % rank.world_size == rank.rank:
                    path.remove()
            for path in [*(output / SIDECARS).list(STATS_GLOB), *output.list(JSON_STATS_GLOB),
                         *output.list("stats-*.json")]:
                number = re.search(r"-(\d+)\.(json|parquet)$", path.name)
                if number is None or int(number.group(1)) % rank.world_size == rank.rank:
                    path.remove()
            (output / LEGACY_PLAN_NAME).remove()
        write_sidecar(output / PLAN_NAME, plan.record, plan, connection, shared=True)  # the same from every rank
        (output / JSON_PLAN_NAME).remove()  # an older folder's plan, now rewritten as the sidecar
    except OSError as error:
        raise LaionkitError(f"--output {output}: cannot write there ({error.strerror or error})") from None


def part_path(output: Location, rank: Rank, unit: Unit) -> Location:
    return output / f"part-{rank.rank:05d}-{unit.index:06d}.parquet"


def rank_stats(units: list[dict], plan: Plan, rank: Rank, config: FilterConfig, seconds: float) -> dict:
    rules: dict[str, RuleCounts] = {}
    for unit in units:
        for name, count in unit["rules"].items():
            total = rules.setdefault(name, RuleCounts())
            total.dropped += count["dropped"]
            total.nulls += count["nulls"]
    return {
        "stage": "filter",
        "plan_id": plan.plan_id,
        "rank": rank.rank,
        "world_size": rank.world_size,
        "units_total": len(plan.units),
        "rows_in": sum(u["rows_in"] for u in units),
        "rows_out": sum(u["rows_out"] for u in units),
        "rows_filtered_now": sum(u["rows_in"] for u in units if "seconds" in u),  # not resumed
        "rules": {name: asdict(count) for name, count in rules.items()},
        "top": plan.record.get("top", []),  # each --top rule's pool, count kept, threshold and tie cut
        "bad_inputs": plan.bad_inputs,
        "bad_units": [
            {"unit": u["unit"], "input": u["input"], "rows": u["bad_rows"], "error": u["bad"]}
            for u in units
            if "bad" in u
        ],
        "seconds": round(seconds, 3),
        "units": units,
        "arguments": asdict(config),
        "versions": versions(),
    }
