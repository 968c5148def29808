"""Stage 1: stream LAION parquet and keep the rows that pass SQL rules and custom CLIP-score thresholds.

Work units are (input file, contiguous row groups) in sorted-path order, split round-robin by rank.
Each unit is read one row group at a time, in two steps (late materialisation): first only the columns
the rules name, evaluated by DuckDB as one boolean column per rule; then, only if any row survives,
the remaining columns, of which only the kept rows are written. Peak memory is one row group.

Invariants: the union of ``part-*-<unit>.parquet`` over ranks equals a one-rank run row for row; a
unit is done iff its part file exists (written atomically, its stats in the parquet footer), so a
killed run is simply rerun; ``_laionkit/filter-plan.parquet`` pins inputs, units and rules so a rerun with
other arguments is refused instead of mixing outputs.

``--top FRACTION:COLUMN`` is global too, without a coordinator: every rank reads that one column of every
input and derives the same threshold (and tie cut, by input order), which then acts as a plain rule.

``--dedup COLUMN`` is global: among rows passing every rule, the first occurrence of a value in global
unit order is kept, with any number of ranks: the column is hash-partitioned to disk and resolved
bucket by bucket before the parts are written (``dedup`` says how ranks meet through files).

This module wires one run (``run``); the pieces live beside it: ``config`` (FilterConfig), ``rules``
(presets, aliases, rule checks), ``sql`` (quoting and the DuckDB sandbox), ``inputs`` (files, embeddings,
units), ``top`` (--top thresholds), ``plan`` (the plan, checked against every input), ``units`` (one
unit into one part), ``folder`` (parts, sidecars, stats) and ``dedup``. Every name laionkit.filter had
before the split is still importable from here.
"""

from __future__ import annotations

import queue
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import duckdb
from tqdm import tqdm

from laionkit.common import LaionkitError, Rank, available_cpus, resolve_rank, split, storage
from laionkit.common.clip_scores import ClipChoice, Scorer, build_scorer
from laionkit.common.storage import Location
from laionkit.filter.config import DEFAULT_UNIT_ROWS, FilterConfig
from laionkit.filter.dedup import Dedup
from laionkit.filter.folder import (
    RuleCounts,
    part_path,
    prepare_output,
    rank_stats,
    refuse_changed_inputs,
    stats_paths,
    unit_stats_from_part,
    write_sidecar,
)
from laionkit.filter.inputs import (
    InputFile,
    Unit,
    check_embeddings,
    embeddings_by_number,
    find_inputs,
    find_remote_inputs,
    make_units,
    match_embeddings,
    read_footer,
    trailing_number,
)
from laionkit.filter.plan import (
    Plan,
    check_columns,
    check_names,
    empty_relation,
    make_plan,
    plan_id,
    renamed_schema,
)
from laionkit.filter.records import (
    JSON_PLAN_NAME,
    JSON_STATS_GLOB,
    LEGACY_PLAN_NAME,
    PART_NAME,
    PLAN_NAME,
    SIDECAR_KEY,
    SIDECARS,
    STATS_GLOB,
    STATS_KEY,
    existing_parts,
    plan_location,
    read_record,
)
from laionkit.filter.rules import (
    ALIASES,
    FILTER_ALIASES,
    FORBIDDEN_NODES,
    PRESETS,
    TOP_PREFIX,
    Rule,
    alias_names,
    parse_renames,
    parse_rule,
    preset_rules,
)
from laionkit.filter.sql import INTERNAL_PREFIX, ROW_NUMBER, glob_literal, literal, lock_down, nullable, quote
from laionkit.filter.top import TopSpec, top_rule, top_specs
from laionkit.filter.units import UnitFilter

__all__ = [  # the names laionkit.filter had before its split into these modules
    "ALIASES", "DEFAULT_UNIT_ROWS", "FILTER_ALIASES", "FORBIDDEN_NODES", "INTERNAL_PREFIX", "JSON_PLAN_NAME",
    "JSON_STATS_GLOB", "LEGACY_PLAN_NAME", "PART_NAME", "PLAN_NAME", "PRESETS", "ROW_NUMBER", "SIDECARS",
    "SIDECAR_KEY", "STATS_GLOB", "STATS_KEY", "TOP_PREFIX",
    "FilterConfig", "InputFile", "Plan", "Rule", "RuleCounts", "TopSpec", "Unit", "UnitFilter",
    "alias_names", "check_columns", "check_embeddings", "check_names", "embeddings_by_number", "empty_relation",
    "existing_parts", "filter_in_parallel", "find_inputs", "find_remote_inputs", "glob_literal", "literal",
    "lock_down", "make_plan", "make_units", "match_embeddings", "nullable", "parse_renames", "parse_rule",
    "part_path", "plan_id", "plan_location", "prepare_output", "preset_rules", "quote", "rank_stats",
    "read_footer", "read_record", "refuse_changed_inputs", "renamed_schema", "run", "run_in", "stats_paths",
    "top_rule", "top_specs", "trailing_number", "unit_stats_from_part", "write_sidecar",
]


def run(config: FilterConfig) -> dict:
    """Filter this rank's units into ``config.output``; return (and write) this rank's stats."""
    started = time.perf_counter()
    rank = resolve_rank(config.rank, config.world_size)
    # One database for the whole run, a cursor per worker: a cursor costs microseconds, a database ~25 ms.
    # A query runs on its calling thread plus the database's threads - 1 background threads.
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(config.output, options)
    storage.refuse_overlap([Location.parse(given, options) for given in config.inputs], output, "filter")
    if output.exists() and not output.is_dir():
        raise LaionkitError(f"--output {output} is a file; filter writes a folder of parquet parts")
    storage.claim_output(output, "filter", config.overwrite)
    with tempfile.TemporaryDirectory(prefix="laionkit-filter-", dir=storage.staging_dir()) \
            if not output.local else nullcontext() as staging:
        return run_in(config, rank, output, staging, started)


def run_in(config: FilterConfig, rank: Rank, output: Location, staging: str | None, started: float) -> dict:
    """``run`` once the output is known; ``staging``: where parts bound for an object store are written."""
    database = duckdb.connect(config={"threads": 1})
    plan = make_plan(config, database, Path(staging) if staging else None)
    plan.staging = staging
    prepare_output(output, plan, rank, config.overwrite, database)
    clip = ClipChoice(
        config.clip_model, None if config.clip_pretrained.lower() == "none" else config.clip_pretrained
    )
    scorers = [build_scorer(spec, clip) for spec in plan.scores]
    mine = split(plan.units, rank)
    done = existing_parts(output)
    todo = [unit for unit in mine if unit.index not in done]
    if not config.quiet:
        given = parse_renames(config.rename)
        for old, new in plan.renames.items():
            if old not in given:  # plan.source_renames: said once, as the rules read the name differently
                print(f"laionkit filter: {old} read as {new} ({old.lower()} is the image's, as img2dataset "
                      "measured it)", file=sys.stderr)
        tqdm.write(
            f"laionkit filter: rank {rank.rank}/{rank.world_size}, {len(mine)} of {len(plan.units)} units "
            f"({len(mine) - len(todo)} already done), "
            f"{len(plan.rules)} rules, {len(plan.scores)} scores -> {output}"
        )
    threads = config.threads or available_cpus()
    progress = tqdm(total=sum(u.rows for u in todo), unit="rows", unit_scale=True, disable=config.quiet,
                    desc="filter")
    dedup = None
    if config.dedup is not None:
        dedup = Dedup(plan, output, config.dedup, config.dedup_bucket_rows, staging)
    if dedup is not None and len(done) < len(plan.units):  # phases 1-2, until every part exists
        workers = [UnitFilter(plan, scorers, config.skip_bad, None, database.cursor()) for _ in range(threads)]
        dedup.prepare(workers, rank, config.dedup_wait, config.overwrite, config.skip_bad)
    with progress:
        filtered = filter_in_parallel(todo, plan, scorers, config, database, threads, output, rank, progress, dedup)
    if dedup is not None:
        dedup.finish(set(existing_parts(output)))
    unit_records = [filtered[u.index] if u.index in filtered else unit_stats_from_part(done[u.index]) for u in mine]
    stats = rank_stats(unit_records, plan, rank, config, time.perf_counter() - started)
    write_sidecar(output / SIDECARS / f"filter-stats-{rank.rank:05d}.parquet", stats, plan, database)
    (output / f"_stats-{rank.rank:05d}.json").remove()  # an older folder's stats of this rank, now rewritten
    return stats


def filter_in_parallel(todo: list[Unit], plan: Plan, scorers: list[Scorer], config: FilterConfig,
                       database: duckdb.DuckDBPyConnection, threads: int, output: Location, rank: Rank,
                       progress: tqdm, dedup: Dedup | None = None) -> dict[int, dict]:
    """Several units at once, one DuckDB thread each: this beats one unit on every thread, whose COPY
    leaves cores idle while its pipeline starts and its writer flushes (10M rows, 2 cores: 1.3 s vs 1.9 s).
    Outputs do not depend on the schedule: each unit writes its own part, in its own row order."""
    parallel = max(1, min(threads, len(todo)))
    idle: queue.SimpleQueue[UnitFilter] = queue.SimpleQueue()
    database.execute(f"SET threads = {threads - parallel + 1}").fetchall()  # + one calling thread per unit
    workers = [UnitFilter(plan, scorers, config.skip_bad, dedup, database.cursor()) for _ in range(parallel)]
    for worker in workers:
        idle.put(worker)

    def filter_unit(unit: Unit) -> dict:
        worker = idle.get()
        try:
            return worker.run(unit, part_path(output, rank, unit), progress)
        finally:
            idle.put(worker)

    with ThreadPoolExecutor(parallel, thread_name_prefix="laionkit-filter") as pool:
        try:
            return dict(zip([unit.index for unit in todo], pool.map(filter_unit, todo)))
        except BaseException:  # a failed unit or Ctrl-C: start no more units, stop the running ones
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.connection.interrupt()
            raise
