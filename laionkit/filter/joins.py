"""filter --scores DIR: the per-sample score parquets of `laionkit score` joined onto the input rows by
sample, so rules, ``--top`` and ``--dedup`` use their columns (aesthetic, pwatermark, punsafe, similarity,
phash, ...) as any other.

The inputs must carry img2dataset's ``key`` (pack's per-shard parquets, img2dataset metadata, or score's
own parquets). The join adds every score column except ``key`` and those an input (or a --score) already
names; an input row without a score row gets nulls, which fail any rule on those columns. When every input
has a score parquet of its own file name (pack's ``00003.parquet`` <-> score's ``scores/00003.parquet``)
each input joins only that one; otherwise every input joins all of them. A sample is its (``shard``, ``key``)
(laionkit.common.keys: keys restart in every shard of a plain webdataset), so inputs that carry ``shard``
(score's parquets, dedup's keep.parquet) join by both. A join in which one input row would meet several score
rows (a key in several shards for inputs without ``shard``, or score folders of the same shard names) is
refused before any work, naming the sample and its files. The score files are planned inputs: DuckDB's
sandbox lets rules read them and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError
from laionkit.common.keys import SHARD_COLUMN, check_key_type
from laionkit.common.storage import Location
from laionkit.filter.sql import glob_literal, literal, quote

JOIN_KEY = "key"
JOINED_KEY = "__laionkit_join_key"
JOINED_SHARD = "__laionkit_join_shard"


@dataclass(frozen=True)
class Join:
    files: tuple[str, ...]  # the score parquets, as DuckDB reads them
    columns: tuple[pa.Field, ...]  # the columns the join adds
    by_name: bool  # each input joins only the score parquet of its own file name
    by_shard: bool  # joined by (shard, key): every input and score parquet has a shard column

    def files_for(self, path: str) -> list[str]:
        if not self.by_name:
            return list(self.files)
        name = PurePosixPath(path).name
        return [file for file in self.files if PurePosixPath(file).name == name]

    def relation(self, path: str) -> str:
        """The score rows an input at ``path`` joins: the join key and the added columns."""
        sources = ", ".join(literal(glob_literal(file)) for file in self.files_for(path))
        columns = "".join(f", {quote(field.name)}" for field in self.columns)
        shard = f", {quote(SHARD_COLUMN)} AS {JOINED_SHARD}" if self.by_shard else ""
        return f"SELECT {quote(JOIN_KEY)} AS {JOINED_KEY}{shard}{columns} FROM read_parquet([{sources}])"

    def joined(self, source: str, path: str) -> str:
        """``source`` (a query over one input) with the score columns joined on by sample."""
        on = f"__laionkit_rows.{quote(JOIN_KEY)} = __laionkit_scores.{JOINED_KEY}"
        if self.by_shard:
            on += f" AND __laionkit_rows.{quote(SHARD_COLUMN)} = __laionkit_scores.{JOINED_SHARD}"
        return (f"SELECT * FROM ({source}) AS __laionkit_rows LEFT JOIN ({self.relation(path)}) AS __laionkit_scores "
                f"ON {on}")

    def refuse_ambiguous(self, connection, input_paths: Sequence[str]) -> None:
        """One input row meets one score row at most: the same sample in two score parquets an input joins
        would double its row (and give it the other image's scores)."""
        groups = {tuple(self.files_for(path)) for path in input_paths}
        for files in sorted(groups):
            if len(files) < 2:
                continue
            sources = ", ".join(literal(glob_literal(file)) for file in files)
            by = f"{quote(JOIN_KEY)}" + (f", {quote(SHARD_COLUMN)}" if self.by_shard else "")
            found = connection.sql(
                f"SELECT {by}, list(DISTINCT filename ORDER BY filename) FROM read_parquet([{sources}], "
                f"filename = true) GROUP BY ALL HAVING count(*) > 1 LIMIT 1").fetchall()
            if found:
                *sample, where = found[0]
                named = f"shard {sample[1]!r}, key {sample[0]!r}" if self.by_shard else f"key {sample[0]!r}"
                why = ("give one score folder per set of shards" if self.by_shard else
                       "the inputs have no 'shard' column to tell them apart (keys restart in every shard): "
                       "filter inputs that carry it (score's parquets, dedup's keep.parquet) or of one shard each")
                raise LaionkitError(f"--scores: {named} is in more than one score row ({', '.join(where[:3])}), "
                                    f"so its input rows would be joined to each: {why}")


def find_score_tables(given: Sequence[str], options: dict | None = None) -> list[Location]:
    """The score parquets of each --scores DIR (score's output folder, or its scores/ folder itself)."""
    found: list[Location] = []
    for text in given:
        folder = Location.parse(text, options)
        if (folder / "scores").is_dir():
            folder = folder / "scores"
        if not folder.is_dir():
            raise LaionkitError(f"--scores {text}: not a folder (laionkit score's output, or its scores/ folder)")
        files = folder.list("*.parquet")
        if not files:
            raise LaionkitError(f"--scores {text}: no score parquets (*.parquet) in {folder}")
        found += files
    return sorted(set(found), key=str)


def plan_join(tables: Sequence[Location], input_paths: Sequence[str], input_schemas: Sequence[pa.Schema],
              taken: set[str], connection) -> Join:
    """The join of ``tables`` onto inputs with these schemas; ``taken``: names (lower case) the rows have
    already (inputs after --rename, --score columns)."""
    try:
        with tables[0].open_read() as handle:
            schema = pq.read_schema(handle)
    except (OSError, pa.ArrowException) as error:
        raise LaionkitError(f"--scores: {tables[0]} is not a readable parquet file ({error})") from None
    if JOIN_KEY not in schema.names:
        raise LaionkitError(f"--scores: {tables[0]} has no {JOIN_KEY!r} column (not laionkit score output?)")
    check_key_type(f"--scores {tables[0]}", JOIN_KEY, schema.field(JOIN_KEY).type)
    for path, input_schema in zip(input_paths, input_schemas):
        if JOIN_KEY not in input_schema.names:
            raise LaionkitError(f"--scores joins by {JOIN_KEY!r}, but the input {path} has no such column "
                                f"(filter pack's per-shard parquets or img2dataset metadata, which carry it)")
        check_key_type(f"--scores joins by {JOIN_KEY!r}, but the input {path}", JOIN_KEY,
                       input_schema.field(JOIN_KEY).type)
    by_shard = SHARD_COLUMN in schema.names and all(SHARD_COLUMN in s.names for s in input_schemas)
    columns = tuple(field for field in schema if field.name != JOIN_KEY and field.name.lower() not in taken
                    and not (by_shard and field.name == SHARD_COLUMN))
    names = {PurePosixPath(str(table)).name for table in tables}
    by_name = all(PurePosixPath(path).name in names for path in input_paths)
    join = Join(tuple(str(table) for table in tables), columns, by_name, by_shard)
    join.refuse_ambiguous(connection, input_paths)
    return join
