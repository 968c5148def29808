"""DuckDB reading a location through its fsspec filesystem."""

from __future__ import annotations

from laionkit.common.storage.location import Location


def register_with_duckdb(connection, location: Location) -> str:
    """Let DuckDB read ``location`` through fsspec (no httpfs download on offline clusters); returns
    the string to put in ``read_parquet(...)``."""
    if location.local:
        return location.path
    connection.register_filesystem(location.fs)
    return str(location)
