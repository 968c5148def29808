"""``--top FRACTION:COLUMN``: the top fraction of the pool by a column, turned into a plain rule.

Invariant: every rank derives the same threshold and tie cut from the same column of every input, so no
rank waits for another, and exactly floor(FRACTION x rows with a value) rows pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import duckdb
import pyarrow as pa

from laionkit.common import LaionkitError
from laionkit.common.clip_scores import ScoreSpec
from laionkit.filter.inputs import InputFile
from laionkit.filter.joins import Join
from laionkit.filter.rules import PRESETS, TOP_PREFIX, Rule, alias_names
from laionkit.filter.sql import glob_literal, literal, quote


@dataclass(frozen=True)
class TopSpec:
    """``--top FRACTION:COLUMN``: keep the rows whose COLUMN is among the top FRACTION of the pool."""

    fraction: str  # as given: the count kept is floor(Fraction(fraction) x pool), exact in decimal
    column: str
    source: str

    @classmethod
    def parse(cls, text: str, source: str = "--top") -> TopSpec:
        fraction, sep, column = text.partition(":")
        try:
            value = Fraction(fraction)
        except (ValueError, ZeroDivisionError):
            value = None
        if not sep or not column or value is None or not 0 < value <= 1:
            raise LaionkitError(f"{source} {text!r}: expected FRACTION:COLUMN with 0 < FRACTION <= 1, "
                                "e.g. 0.3:clip_l14_similarity_score")
        return cls(fraction, column, source)

    @property
    def label(self) -> str:
        """Its name in the stats and the plan."""
        return f"top({self.fraction}:{self.column})"


def top_specs(presets: Sequence[str], top: Sequence[str]) -> list[TopSpec]:
    specs = [TopSpec.parse(expr[len(TOP_PREFIX):], f"preset {name}") for name in presets
             for expr in PRESETS.get(name, ()) if expr.startswith(TOP_PREFIX)]
    specs += [TopSpec.parse(text) for text in top]
    unique = {(spec.fraction, spec.column): spec for spec in reversed(specs)}
    return [spec for spec in specs if unique[(spec.fraction, spec.column)] is spec]


def top_rule(spec: TopSpec, files: Sequence[InputFile], renames: dict[str, str], scores: Sequence[ScoreSpec],
             connection: duckdb.DuckDBPyConnection, join: Join | None = None) -> tuple[Rule, dict]:
    """``--top``: the threshold that keeps exactly floor(FRACTION x N) of the N input rows whose COLUMN has
    a value (null and NaN are never kept), as a plain rule every rank evaluates alike.

    Every rank reads COLUMN of every input (only that column) and derives the same threshold, so no rank
    waits for another. Ties: rows are ranked by value, then by input order (file order, then row), so
    among rows equal to the threshold value the earlier ones are kept, and the count is exact. A column
    --scores joins (``join``) is read through the same join by key the units make, so the pool is the
    input rows with their joined values (an input row without a score row has none)."""
    if spec.column.lower() in {s.name.lower() for s in scores}:
        raise LaionkitError(f"{spec.source} {spec.fraction}:{spec.column}: a --score column is computed per unit; "
                            "--top needs a column of the input files")
    selects, base = [], 0
    numeric = True
    floats = False
    joined = {field.name.lower(): field for field in (join.columns if join else ())}
    for file in files:
        names = [renames.get(name, name) for name in file.schema.names]
        present = {name.lower(): original for name, original in zip(names, file.schema.names)}
        aliased = alias_names(names + [field.name for field in joined.values()])
        wanted = spec.column.lower()
        target = present.get(wanted) or (
            file.schema.names[names.index(aliased[wanted])] if aliased.get(wanted) in names else None)
        score_field = None
        if target is None:
            score_field = joined.get(wanted) or joined.get(str(aliased.get(wanted, "")).lower())
        if target is None and score_field is None:
            raise LaionkitError(f"{spec.source} {spec.fraction}:{spec.column}: {file.path} has no such column; "
                                f"available columns: {', '.join(names + [f.name for f in joined.values()])}")
        kind = score_field.type if score_field is not None else file.schema.field(target).type
        numeric = numeric and (pa.types.is_integer(kind) or pa.types.is_floating(kind))
        floats = floats or pa.types.is_floating(kind)
        if not numeric:
            raise LaionkitError(f"{spec.source} {spec.fraction}:{spec.column}: {file.path} holds {kind}; "
                                "--top ranks a number column")
        source = f"read_parquet({literal(glob_literal(file.path))}, file_row_number = true)"
        if score_field is not None:  # the units' join, by key (a key without a score row: null, not ranked)
            source = f"({join.joined(f'SELECT * FROM {source}', file.path)})"
        column_sql = quote(score_field.name if score_field is not None else file.scanned[target])
        selects.append(f"SELECT {column_sql}::DOUBLE AS v, file_row_number + {base} AS pos FROM {source}")
        base += file.rows
    valid = "v IS NOT NULL" + (" AND NOT isnan(v)" if floats else "")
    pool = f"(SELECT * FROM ({' UNION ALL '.join(selects)}) WHERE {valid})"
    [(rows,)] = connection.execute(f"SELECT count(*) FROM {pool}").fetchall()
    keep = math.floor(Fraction(spec.fraction) * rows)
    column = quote(spec.column)
    found = {"rule": spec.label, "source": spec.source, "fraction": spec.fraction, "column": spec.column,
             "pool_rows": rows, "kept": keep, "threshold": None, "ties_kept_through": None}
    if keep == 0:
        expr = f"{column} IS NULL AND false"
    elif keep == rows:
        expr = f"{column} IS NOT NULL"
    else:
        [(threshold,)] = connection.execute(f"SELECT v FROM {pool} ORDER BY v DESC LIMIT 1 OFFSET {keep - 1}").fetchall()
        value = f"CAST({literal(repr(float(threshold)))} AS DOUBLE)"
        [(above,)] = connection.execute(f"SELECT count(*) FROM {pool} WHERE v > {value}").fetchall()
        [(last,)] = connection.execute(
            f"SELECT pos FROM {pool} WHERE v = {value} ORDER BY pos LIMIT 1 OFFSET {keep - above - 1}").fetchall()
        found.update(threshold=float(threshold), ties_kept_through=int(last))
        expr = f"({column}::DOUBLE > {value} OR ({column}::DOUBLE = {value} AND __laionkit_gpos <= {int(last)}))"
    return Rule(expr, spec.source), found
