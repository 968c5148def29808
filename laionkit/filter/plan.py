"""The filter plan: inputs, units, rules (``--top`` ones resolved), scores and renames, every rule bound
against every input schema before anything is written.

Invariant: equal plan records mean interchangeable runs; ``plan_id`` names the plan in every rank's stats.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from laionkit.common import LaionkitError, storage
from laionkit.common.clip_scores import ScoreSpec
from laionkit.common.upstream import refuse_incomplete
from laionkit.filter.config import FilterConfig
from laionkit.filter.inputs import (
    InputFile,
    Unit,
    check_embeddings,
    embeddings_by_number,
    find_inputs,
    make_units,
    match_embeddings,
    read_footer,
)
from laionkit.filter.joins import Join, find_score_tables, plan_join
from laionkit.filter.rules import Rule, alias_names, parse_renames, parse_rule, preset_rules
from laionkit.filter.sql import INTERNAL_PREFIX, glob_literal, literal, lock_down, quote
from laionkit.filter.top import top_rule, top_specs
from laionkit.pack.plan import RESERVED_COLUMNS


@dataclass
class Plan:
    files: list[InputFile]
    bad_inputs: list[dict]
    units: list[Unit]
    rules: list[Rule]
    scores: list[ScoreSpec]
    renames: dict[str, str]
    record: dict  # what the plan sidecar holds; equal records = interchangeable runs
    staging: str | None = None  # local folder for parts on their way to an object store
    labels: dict[str, str] = field(default_factory=dict)  # rule expr -> its name in the stats (--top rules)
    join: Join | None = None  # --scores: score columns joined by key

    @functools.cached_property
    def bases(self) -> list[int]:
        """Global position of each file's first row: the input order --top breaks ties by."""
        return [sum(f.rows for f in self.files[:i]) for i in range(len(self.files))]

    @property
    def plan_id(self) -> str:
        return plan_id(self.record)

    @functools.cached_property
    def parsed_rules(self) -> list[tuple[str, set[str]]]:
        """Each rule as DuckDB renders it (exactly one expression, comments gone) and the columns it reads.
        Parsed once, on the main thread: parse_rule uses DuckDB's default connection, which the
        unit threads cannot share."""
        return [(str(duckdb.SQLExpression(rule.expr)), parse_rule(rule)) for rule in self.rules]


def plan_id(record: dict) -> str:
    """Names a plan in every rank's stats, so stats of another (older) plan in the folder are ignored."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def make_plan(config: FilterConfig, connection: duckdb.DuckDBPyConnection, writable: Path | None = None) -> Plan:
    """Find and check the inputs, and lock ``connection`` down to them (and writes to ``writable``, by
    default the output folder) before any rule is bound."""
    rules = preset_rules(config.presets, config.where)
    for rule in rules:
        parse_rule(rule)
    renames = parse_renames(config.rename)
    scores = [ScoreSpec.parse(text) for text in config.scores]
    if scores and not config.embeddings:
        raise LaionkitError(
            "--score needs --embeddings (the CLIP image embeddings the scores are computed from)"
        )
    if config.unit_rows < 1:
        raise LaionkitError(f"--unit-rows must be >= 1, got {config.unit_rows}")
    if config.dedup_bucket_rows < 1:
        raise LaionkitError(f"--dedup-bucket-rows must be >= 1, got {config.dedup_bucket_rows}")
    if config.threads is not None and config.threads < 1:
        raise LaionkitError(f"--threads must be >= 1, got {config.threads}")
    locations = find_inputs(config.inputs, storage.parse_storage_options(config.storage_options))
    npys = match_embeddings(locations, embeddings_by_number(
        config.embeddings, storage.parse_storage_options(config.storage_options))) if config.embeddings else {}
    files, bad, versions_of = [], [], {}
    for location in locations:
        try:
            footer, version = read_footer(location)
        except LaionkitError as error:
            if not config.skip_bad:
                raise
            bad.append({"path": str(location), "error": str(error)})
            continue
        meta = footer.metadata
        rows = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        npy = npys.get(location)
        layout = check_embeddings(npy, location, meta.num_rows) if npy is not None else None
        files.append(InputFile(str(location), meta.num_rows, rows, footer.schema_arrow, npy and str(npy),
                               None if location.local else location, layout))
        versions_of[str(location)] = version
    if not files:
        raise LaionkitError(f"every input is unreadable: {'; '.join(b['error'] for b in bad)}")
    renames = {**source_renames(files, renames), **renames}
    for location in {file.location.protocol: file.location for file in files if file.location}.values():
        storage.register_with_duckdb(connection, location)  # one fsspec filesystem per protocol
    join = None
    if config.score_tables:
        options = storage.parse_storage_options(config.storage_options)
        for given in config.score_tables:  # a score run some ranks never finished would join as a smaller one
            refuse_incomplete(given, "--scores", config.allow_incomplete, lambda line: print(line, file=sys.stderr),
                              options)
        tables = find_score_tables(config.score_tables, options)
        for location in {table.protocol: table for table in tables if not table.local}.values():
            storage.register_with_duckdb(connection, location)
        taken = {name.lower() for f in files for name in renamed_schema(f.schema, renames, scores).names}
        join = plan_join(tables, [f.path for f in files], [f.schema for f in files], taken, connection)
    lock_down(connection, [f.path for f in files] + list(join.files if join else ()), writable or Path(config.output))
    check_columns(files, rules, renames, scores, config.dedup, connection, join)
    tops = [top_rule(spec, files, renames, scores, connection, join)
            for spec in top_specs(config.presets, config.top)]
    rules += [rule for rule, _ in tops]
    units = make_units(files, config.unit_rows)
    uses_clip = any(spec.kind == "prompt" for spec in scores)
    record = {
        "inputs": [
            {"path": f.path, "rows": f.rows, "row_groups": len(f.row_group_rows), "embeddings": f.embeddings,
             **versions_of[f.path]}
            for f in files
        ],
        "bad_inputs": bad,
        "units": [[u.file, u.start, u.stop, u.rows] for u in units],
        "rules": [asdict(rule) for rule in rules],
        "scores": [asdict(spec) for spec in scores],
        "clip": [config.clip_model, config.clip_pretrained] if uses_clip else None,
        "rename": renames,
        "dedup": config.dedup,
    }
    if tops:  # only then, so plans of folders filtered before --top existed stay equal
        record["top"] = [found for _, found in tops]
    if join:  # likewise
        record["scores_joined"] = {"files": list(join.files), "columns": [f.name for f in join.columns],
                                   "by_name": join.by_name,
                                   **({"by_shard": True} if join.by_shard else {})}  # a key join's plan stays
    return Plan(files, bad, units, rules, scores, renames, record,
                labels={rule.expr: found["rule"] for rule, found in tops}, join=join)


def source_renames(files: Sequence[InputFile], renames: dict[str, str]) -> dict[str, str]:
    """Input columns named like one img2dataset measures but for case (pack of laion2B-en rows carries LAION's
    claimed ``WIDTH`` beside the ``width`` of the pixels it saved): DuckDB cannot tell them apart, so the
    input's own one is read as ``source_<name>``, the name pack gives such a column, and rules on ``width``
    mean the image's. Not where the user renames either one."""
    found = {}
    for file in files:
        names = set(file.schema.names)
        for name in sorted(names - RESERVED_COLUMNS):
            if name.lower() in RESERVED_COLUMNS & names and not {name, name.lower()} & set(renames):
                found[name] = f"source_{name}"
    return found


def renamed_schema(schema: pa.Schema, renames: dict[str, str], scores: Sequence[ScoreSpec],
                   joined: Sequence[pa.Field] = ()) -> pa.Schema:
    """The output columns: the input's (renamed), one float32 per --score, then --scores' joined ones."""
    names = [renames.get(name, name) for name in schema.names]
    taken = {name.lower() for name in names}
    for spec in scores:
        if spec.name.lower() in taken:
            raise LaionkitError(f"--score {spec.name}: the input already has a column named {spec.name}")
        taken.add(spec.name.lower())
    fields = [schema.field(i).with_name(name) for i, name in enumerate(names)]
    # pandas' metadata describes the input frame (its index, its names); it would mislead on the output.
    metadata = {k: v for k, v in (schema.metadata or {}).items() if k != b"pandas"}
    return pa.schema(
        fields + [pa.field(spec.name, pa.float32()) for spec in scores] + list(joined), metadata=metadata or None
    )


def check_columns(
    files: Sequence[InputFile],
    rules: Sequence[Rule],
    renames: dict[str, str],
    scores: Sequence[ScoreSpec],
    dedup: str | None,
    connection: duckdb.DuckDBPyConnection,
    join: Join | None = None,
) -> None:
    """Bind every rule against every distinct input schema before anything is written: all rules in one
    DESCRIBE (one bind of the footer), and rule by rule only to name the one that fails."""
    for old in renames:
        if not any(old in f.schema.names for f in files):
            raise LaionkitError(f"--rename {old}=...: no input has a column {old!r}")
    seen: set[pa.Schema] = set()
    for file in files:
        check_names(file, renames, scores)
        schema = renamed_schema(file.schema, renames, scores, join.columns if join else ())
        if schema in seen:
            continue
        seen.add(schema)
        available = ", ".join(schema.names)
        if dedup is not None and dedup not in schema.names:
            raise LaionkitError(
                f"--dedup {dedup}: {file.path} has no such column; available columns: {available}"
            )
        relation = empty_relation(file, renames, scores, join)

        def kinds(checked: Sequence[Rule], relation: str = relation) -> list[str]:
            exprs = ", ".join(f"({duckdb.SQLExpression(rule.expr)})" for rule in checked)  # one expression each
            return [row[1] for row in connection.execute(f"DESCRIBE SELECT {exprs} FROM ({relation})").fetchall()]

        try:
            all_kinds = kinds(rules) if rules else []
        except duckdb.Error:
            all_kinds = []
            for rule in rules:
                try:
                    all_kinds += kinds([rule])
                except duckdb.Error as error:
                    message = str(error).splitlines()[0]
                    raise LaionkitError(
                        f"{rule.source} {rule.expr!r} on {file.path}: {message}; available columns: {available}"
                    ) from None
        for rule, kind in zip(rules, all_kinds):
            if kind != "BOOLEAN":
                raise LaionkitError(f"{rule.source} {rule.expr!r} is not a true/false test (it gives {kind})")


def check_names(file: InputFile, renames: dict[str, str], scores: Sequence[ScoreSpec]) -> None:
    """Refuse names DuckDB would silently change or that collide with the SQL built here: two columns
    one name apart only in case (DuckDB would write the second as ``URL_1``) and laionkit's own prefix."""
    sources = {**{name: renames.get(name, name) for name in file.schema.names},
               **{f"--score {spec.name}": spec.name for spec in scores}}
    seen: dict[str, str] = {}
    for source, name in sources.items():
        for checked in (source, name):
            if checked.lower().startswith(INTERNAL_PREFIX):
                raise LaionkitError(f"{file.path}: column name {checked!r} is reserved (prefix {INTERNAL_PREFIX})")
        if name.lower() in seen:
            raise LaionkitError(
                f"{file.path}: columns {seen[name.lower()]!r} and {source!r} would both be named {name!r} "
                "(DuckDB matches names ignoring case); choose another --rename"
            )
        seen[name.lower()] = source


def empty_relation(file: InputFile, renames: dict[str, str], scores: Sequence[ScoreSpec], join: Join | None = None
                   ) -> str:
    """SQL for a unit's columns as rules see them (renamed, score columns, alias names), with no rows.

    DuckDB reads only the file's footer for it, and no pandas import (an arrow table would cost one)."""
    joined = [field.name for field in join.columns] if join else []
    output = [renames.get(name, name) for name in file.schema.names] + [spec.name for spec in scores] + joined
    columns = [f"{quote(file.scanned[name])} AS {quote(renames.get(name, name))}" for name in file.schema.names]
    columns += [f"NULL::FLOAT AS {quote(spec.name)}" for spec in scores] + [quote(name) for name in joined]
    aliases = "".join(f", {quote(name)} AS {quote(alias)}" for alias, name in alias_names(output).items())
    source = f"read_parquet({literal(glob_literal(file.path))})"
    if join:
        source = f"({join.joined(f'SELECT * FROM {source} LIMIT 0', file.path)})"
    return f"SELECT *{aliases} FROM (SELECT {', '.join(columns)} FROM {source} LIMIT 0)"
