"""SQL text built from the user's names and paths, and the sandbox every filter connection runs in.

Names and paths are data: they enter SQL only through ``quote`` (identifiers) and ``literal`` (strings),
and DuckDB globs every path it is given, so a path is passed as ``glob_literal``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import duckdb

# Names the SQL built here uses: an input column with one of these would shadow it. file_row_number is
# DuckDB's parquet row number (a real column of that name hides it: such files are read via arrow).
ROW_NUMBER = "file_row_number"
INTERNAL_PREFIX = "__laionkit_"


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def nullable(name: str) -> str:
    """The column as written. DuckDB would mark a column NOT NULL when the input's statistics show no
    nulls, so parts of one run would get different schemas; a CASE it cannot fold keeps them nullable."""
    return f"CASE WHEN __laionkit_row >= 0 THEN {quote(name)} END AS {quote(name)}"


def glob_literal(path: str) -> str:
    """``path`` as a DuckDB file pattern matching only itself: DuckDB globs every path it is given, so
    ``g[1].parquet`` would read ``g1.parquet``; each glob character becomes a one-character class."""
    return re.sub(r"([\[\]*?{}])", r"[\1]", path)


def lock_down(connection: duckdb.DuckDBPyConnection, readable: Sequence[str], writable: Path) -> None:
    """Let ``connection`` read only the planned inputs and write only under the output folder; no
    extension may be loaded or installed. Rules are user text, so this is the backstop behind
    parse_rule. DuckDB checks a file pattern as given, so each input is allowed literally and escaped."""
    paths = [spelling for path in readable for spelling in dict.fromkeys((path, glob_literal(path)))]
    folders = dict.fromkeys(str(path).rstrip("/") + "/" for path in (writable.absolute(), writable.resolve()))
    connection.execute(f"SET allowed_paths = [{', '.join(map(literal, paths))}]").fetchall()
    connection.execute(f"SET allowed_directories = [{', '.join(map(literal, folders))}]").fetchall()
    for setting in ("autoinstall_known_extensions", "autoload_known_extensions", "enable_external_access"):
        connection.execute(f"SET {setting} = false").fetchall()
