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
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, Rank, refuse_other_settings, storage, versions
from laionkit.common.storage import Location
from laionkit.filter.config import FilterConfig
from laionkit.filter.inputs import Unit
from laionkit.filter.plan import Plan
from laionkit.filter.records import (
    JSON_PLAN_NAME,
    JSON_STATS_GLOB,
    LEGACY_PLAN_NAME,
    PLAN_NAME,
    SIDECAR_KEY,
    SIDECARS,
    STATS_GLOB,
    STATS_KEY,
    existing_parts,
    plan_location,
    read_record,
)
from laionkit.filter.sql import glob_literal, literal, nullable, quote


@dataclass
class RuleCounts:
    """Per rule: rows it rejected (false) and rows it could not test (null / NaN), counted independently."""

    dropped: int = 0
    nulls: int = 0


def unit_stats_from_part(path: Location) -> dict:
    """A finished unit's stats: the counts its footer records, and its rows kept, which the part holds."""
    with path.open_read(block_size=2**20) as handle:
        footer = pq.read_metadata(handle)
    metadata = footer.metadata or {}
    if STATS_KEY.encode() not in metadata:
        raise LaionkitError(f"{path}: no laionkit stats in its footer (not written by laionkit filter?)")
    return {**json.loads(metadata[STATS_KEY.encode()]), "rows_out": footer.num_rows}


def stats_paths(folder: Location | Path | str) -> list[Location]:
    """The rank stats sidecars of a filter folder (an older folder's ``_stats-*.json``)."""
    folder = Location.parse(folder)
    return (folder / SIDECARS).list(STATS_GLOB) or folder.list(JSON_STATS_GLOB)


def write_sidecar(path: Location, record: dict, plan: Plan, connection: duckdb.DuckDBPyConnection,
                  shared: bool = False) -> None:
    """``record`` in the footer of a parquet file with the columns of a part of the plan's first input and
    no row group (DuckDB writes none for no rows): readers of the folder get the same schema, no row."""
    file = plan.files[0]
    columns = [f"{quote(file.scanned[name])} AS {quote(plan.renames.get(name, name))}" for name in file.schema.names]
    columns += [f"NULL::FLOAT AS {quote(spec.name)}" for spec in plan.scores]
    output = [plan.renames.get(name, name) for name in file.schema.names] + [spec.name for spec in plan.scores]
    source = (f"SELECT {', '.join(columns)}, 0::BIGINT AS __laionkit_row "
              f"FROM read_parquet({literal(glob_literal(file.path))}) LIMIT 0")
    metadata = literal(json.dumps(record, sort_keys=True, default=str))
    with storage.atomic_write(path, shared=shared, staging=plan.staging) as tmp:
        connection.execute(f"COPY (SELECT {', '.join(map(nullable, output))} FROM ({source})) TO {literal(str(tmp))} "
                           f"(FORMAT parquet, KV_METADATA {{{literal(SIDECAR_KEY)}: {metadata}}})").fetchall()


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
    if plan_path is not None and not overwrite and (existing_parts(output) or stats_paths(output)):
        # only a plan some unit was filtered by: a run that failed before any unit is retried with other arguments
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
