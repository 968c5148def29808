"""A keep list: the sample keys of a parquet file or folder (filter's output, score's scores/, pack's
per-shard parquets), for stages that take a subset of existing shards (`encode --keep`) instead of
downloading again."""

from __future__ import annotations

import hashlib

from laionkit.common.errors import LaionkitError
from laionkit.common.storage import Location

KEY_COLUMN = "key"


def read_keep_keys(spec: str, options: dict | None = None) -> frozenset[str]:
    """Every ``key`` of the parquet file ``spec``, or of the ``*.parquet`` files of the folder ``spec``
    (names starting with ``_`` or ``.`` skipped, as dataset readers do)."""
    import pyarrow.parquet as pq

    location = Location.parse(spec, options)
    if location.is_dir():
        files = [p for p in location.list("*.parquet") if not p.name.startswith(("_", "."))]
    elif location.exists():
        files = [location]
    else:
        raise LaionkitError(f"--keep {spec}: no such file or folder")
    if not files:
        raise LaionkitError(f"--keep {spec}: no parquet files in that folder")
    keys: set[str] = set()
    for file in files:
        try:
            with file.open_read() as handle:
                parquet = pq.ParquetFile(handle)
                if KEY_COLUMN not in parquet.schema_arrow.names:
                    raise LaionkitError(f"--keep {file}: no {KEY_COLUMN!r} column (columns: "
                                        f"{', '.join(parquet.schema_arrow.names[:12])})")
                keys.update(str(key) for key in parquet.read(columns=[KEY_COLUMN]).column(0).to_pylist()
                            if key is not None)
        except OSError as error:
            raise LaionkitError(f"--keep {file}: not a readable parquet file ({error})") from None
    return frozenset(keys)


def keys_identity(keys: frozenset[str]) -> dict:
    """What a folder records of its keep list: a rerun with another list is refused, not mixed."""
    digest = hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()
    return {"keys": len(keys), "sha256": digest}
