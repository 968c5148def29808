"""Filtering one unit (a run of row groups of one input) into one part file, two DuckDB queries each.

Invariant: a part holds the unit's rows that pass every rule (and, with --dedup, are a first occurrence),
in row order, whatever the schedule; its footer holds the unit's per-rule counts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from laionkit.common import LaionkitError, storage
from laionkit.common.clip_scores import Scorer, score_embeddings
from laionkit.common.storage import Location
from laionkit.filter.folder import RuleCounts
from laionkit.filter.inputs import InputFile, Unit
from laionkit.filter.plan import Plan, renamed_schema
from laionkit.filter.records import STATS_KEY
from laionkit.filter.rules import alias_names
from laionkit.filter.sql import ROW_NUMBER, glob_literal, literal, nullable, quote


class Duplicates(Protocol):
    """What a unit asks of ``--dedup`` (laionkit.filter.dedup.Dedup) in phase 3. A protocol, not an import:
    dedup drives UnitFilter in phases 1-2, so importing it back here would close an import circle."""

    column: str

    def bad(self, unit: Unit) -> str | None: ...

    def dropped(self, unit: Unit) -> str: ...


class UnitFilter:
    """Filters one unit into one part file with two DuckDB queries over the parquet file itself: per-rule
    counts (reads only the rule columns), then ``COPY (SELECT ... WHERE all rules)``, which decodes the
    other columns only for surviving rows (late materialisation) and streams them to the part file.

    One UnitFilter (one cursor of the run's DuckDB database) filters one unit at a time; ``run`` keeps
    several busy."""

    def __init__(self, plan: Plan, scorers: list[Scorer], skip_bad: bool, dedup: Duplicates | None,
                 connection: duckdb.DuckDBPyConnection):
        self.plan = plan
        self.scorers = scorers
        self.rules = plan.parsed_rules  # parsed on the thread that builds the workers
        self.skip_bad = skip_bad
        self.dedup = dedup
        self.connection = connection
        # A session setting, so one per cursor. Else DuckDB assumes a parquet float column holds no NaN
        # beyond its min/max statistics (which writers compute without NaN) and folds isnan() to false:
        # NaN scores would pass `>=` rules.
        self.connection.execute("SET parquet_can_have_nan = true").fetchall()

    def source_sql(self, unit: Unit, file: InputFile, via_arrow: bool) -> tuple[str, list[str]]:
        """A query yielding the unit's rows: renamed input columns, score columns, alias columns.

        ``via_arrow``: the unit is read by pyarrow and scanned from memory instead, for files whose
        string columns hold bytes that are not UTF-8 (DuckDB's parquet reader refuses them; pyarrow
        and DuckDB's arrow scan pass them through untouched). Costs one unit of memory.
        """
        if via_arrow:
            table = file.open().read_row_groups(range(unit.start, unit.stop), use_threads=True)
            rows = pa.array(np.arange(unit.offset, unit.offset + table.num_rows))
            self.connection.register("unit_rows", table.append_column("__laionkit_row", rows))
            source = "SELECT * FROM unit_rows"
        else:
            whole = unit.start == 0 and unit.stop == len(file.row_group_rows)
            rows = (
                ""
                if whole
                else f" WHERE file_row_number BETWEEN {unit.offset} AND {unit.offset + unit.rows - 1}"
            )
            source = (
                f"SELECT *, file_row_number AS __laionkit_row "
                f"FROM read_parquet({literal(glob_literal(file.path))}){rows}"
            )
        if self.scorers:
            self.connection.register("unit_scores", self.unit_scores(unit, file))
            source = f"SELECT * FROM ({source}) POSITIONAL JOIN unit_scores"
        joined = [field.name for field in self.plan.join.columns] if self.plan.join else []
        if self.plan.join:  # --scores: by key (the join reorders rows; the part is written ORDER BY row)
            source = self.plan.join.joined(source, file.path)
        output = [self.plan.renames.get(name, name) for name in file.schema.names] + [
            s.spec.name for s in self.scorers
        ] + joined
        columns = [
            f"{quote(file.scanned[name])} AS {quote(self.plan.renames.get(name, name))}" for name in file.schema.names
        ]
        columns += [quote(s.spec.name) for s in self.scorers] + [quote(name) for name in joined] + ["__laionkit_row"]
        columns.append(f"__laionkit_row + {self.plan.bases[unit.file]} AS __laionkit_gpos")  # --top's input order
        columns += [f"{quote(name)} AS {quote(alias)}" for alias, name in alias_names(output).items()]
        return f"SELECT {', '.join(columns)} FROM ({source})", output

    def unit_scores(self, unit: Unit, file: InputFile) -> pa.Table:
        embeddings = file.embeddings_layout.rows(unit.offset, unit.offset + unit.rows)
        return pa.table({s.spec.name: score_embeddings(s, embeddings, file.embeddings) for s in self.scorers})

    def tested_rules(self, file: InputFile) -> tuple[list[str], str]:
        """Each rule as SQL that is null where a float column it reads is NaN (NaN fails a rule, as
        null does; DuckDB orders NaN above every number, so ``NaN >= 5`` would otherwise pass), and
        the same AND-ed as a plain WHERE, which DuckDB pushes into the parquet scan (late decoding)."""
        schema = renamed_schema(file.schema, self.plan.renames, self.plan.scores,
                                self.plan.join.columns if self.plan.join else ())
        floats = {f.name.lower() for f in schema if pa.types.is_floating(f.type)}
        floats |= {alias for alias, name in alias_names(schema.names).items() if name.lower() in floats}
        tested, keep = [], []
        for rule, columns in self.rules:
            nan_columns = sorted(name for name in columns if name.lower() in floats)
            keep.append(f"({rule})")
            if nan_columns:
                test = " OR ".join(f"isnan({quote(name)})" for name in nan_columns)
                tested.append(f"CASE WHEN {test} THEN NULL ELSE ({rule}) END")
                keep += [f"coalesce(NOT isnan({quote(name)}), true)" for name in nan_columns]
            else:
                tested.append(f"({rule})")
        return tested, " AND ".join(keep) or "true"

    def run(self, unit: Unit, part: Location, progress: tqdm) -> dict:
        file = self.plan.files[unit.file]
        started = time.perf_counter()
        if self.dedup and (message := self.dedup.bad(unit)):  # unreadable in phase 1 (--skip-bad)
            progress.update(unit.rows)
            return self.record_bad_unit(unit, part, file, message)
        try:
            with storage.atomic_write(part, staging=self.plan.staging) as tmp:
                try:
                    stats = self.write_unit(unit, file, tmp, via_arrow=ROW_NUMBER in file.schema.names)
                except duckdb.InvalidInputException as error:
                    if "string encoding" not in str(error):
                        raise
                    stats = self.write_unit(unit, file, tmp, via_arrow=True)
        except duckdb.Error as error:
            bug = isinstance(error, duckdb.ProgrammingError) and not isinstance(error, duckdb.InvalidInputException)
            if bug or isinstance(error, duckdb.PermissionException):
                raise  # the SQL or sandbox built here, not bad data (a corrupt page is InvalidInput): traceback
            message = str(error).splitlines()[0]
            if not self.skip_bad:
                raise LaionkitError(
                    f"{file.path}: cannot read row groups {unit.start}-{unit.stop - 1}: {message}"
                ) from None
            return self.record_bad_unit(unit, part, file, message)
        finally:
            progress.update(unit.rows)
        return {**stats, "seconds": round(time.perf_counter() - started, 3)}

    def write_unit(self, unit: Unit, file: InputFile, tmp: Path, via_arrow: bool) -> dict:
        """Count per rule, then COPY the kept rows to ``tmp`` with the unit's stats in the footer."""
        stats = {
            "unit": unit.index,
            "input": file.path,
            "row_groups": [unit.start, unit.stop],
            "rows_in": unit.rows,
        }
        source, output = self.source_sql(unit, file, via_arrow)
        rules, where = self.tested_rules(file)
        keep = " AND ".join(f"__laionkit_r{i}" for i in range(len(rules))) or "true"  # null: not kept
        tested = (
            f"(SELECT {', '.join(f'{rule} AS __laionkit_r{i}' for i, rule in enumerate(rules))}"
            f"{', ' if rules else ''}* FROM ({source}))"
        )
        # count(r) = rows where r is not null, count_if(r) = rows where r is true: plain aggregates, about
        # twice as fast as count(*) FILTER (WHERE ...) pairs.
        # Rows kept need no count here: COPY returns it (a count_if of all rules costs a third of this scan).
        counts = ["count(*)"] + [f"count(__laionkit_r{i}), count_if(__laionkit_r{i})" for i in range(len(rules))]
        if self.dedup:
            counts.append(f"count_if({keep} AND {quote(self.dedup.column)} IS NULL)")
        row = [value or 0 for value in  # count_if over no rows is NULL
               self.connection.execute(f"SELECT {', '.join(counts)} FROM {tested}").fetchall()[0]]
        total = row[0]
        stats["rules"] = {
            self.plan.labels.get(rule.expr, rule.expr): asdict(RuleCounts(dropped=row[1 + 2 * i] - row[2 + 2 * i], nulls=total - row[1 + 2 * i]))
            for i, rule in enumerate(self.plan.rules)
        }
        kept = f"({source}) WHERE {where}"  # the rows passing: keep == where, row for row
        if self.dedup:  # phase 3: the rows phase 2 found taken by an earlier position are left out
            column = quote(self.dedup.column)
            [(dropped,)] = self.connection.execute(f"SELECT count(*) FROM ({self.dedup.dropped(unit)})").fetchall()
            stats["rules"][f"dedup({self.dedup.column})"] = asdict(RuleCounts(dropped, row[-1]))
            selected = (
                f"SELECT {', '.join(map(nullable, output))} FROM {kept} AND {column} IS NOT NULL "
                f"AND __laionkit_row NOT IN ({self.dedup.dropped(unit)}) ORDER BY __laionkit_row"
            )
        else:
            selected = f"SELECT {', '.join(map(nullable, output))} FROM {kept}" + (
                " ORDER BY __laionkit_row" if self.plan.join else "")
        metadata = literal(json.dumps(stats))  # rows_out is the part's row count (unit_stats_from_part)
        options = f"FORMAT parquet, KV_METADATA {{{literal(STATS_KEY)}: {metadata}}}"
        [(written,)] = self.connection.execute(f"COPY ({selected}) TO {literal(str(tmp))} ({options})").fetchall()
        return {**stats, "rows_out": written}

    def record_bad_unit(self, unit: Unit, part: Location, file: InputFile, message: str) -> dict:
        """--skip-bad: an empty part marks the unit done; its footer says why, so the skip is counted."""
        stats = {
            "unit": unit.index,
            "input": file.path,
            "row_groups": [unit.start, unit.stop],
            "rows_in": 0,
            "rules": {},
            "bad": message,
            "bad_rows": unit.rows,
        }
        schema = renamed_schema(file.schema, self.plan.renames, self.plan.scores,
                                self.plan.join.columns if self.plan.join else ())
        with storage.atomic_write(part, staging=self.plan.staging) as tmp, pq.ParquetWriter(tmp, schema) as writer:
            writer.add_key_value_metadata({STATS_KEY: json.dumps(stats)})
        return {**stats, "rows_out": 0}
