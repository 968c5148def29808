"""A keep list: the samples of a parquet file or folder (dedup's keep.parquet, filter's output, score's scores/,
pack's per-shard parquets), for stages that take a subset of existing shards (`pack --keep`, `encode --keep`,
`dedup --keep`) instead of downloading again.

A sample is named by its ``shard`` (the shard's stem, as score and dedup write it) and its ``key``: plain
webdatasets restart their key numbering in every shard, so a key alone may name a sample in each. A list with
a ``shard`` column keeps exactly those (shard, key) pairs; a list without one keeps keys wherever they are,
and is refused where a key repeats in it. Keys are strings, as the shards name their samples (``000001``): a
list of numbers is refused, since ``1`` never matches ``000001``. dedup's keep.parquet names each row's score
folder too (``input``): a list whose inputs share shard names is refused, since (shard, key) there names a
sample of each input.
"""

from __future__ import annotations

import functools
import hashlib
from collections import defaultdict
from dataclasses import dataclass

import pyarrow as pa

from laionkit.common.errors import LaionkitError
from laionkit.common.storage import Location

KEY_COLUMN = "key"
SHARD_COLUMN = "shard"
INPUT_COLUMN = "input"  # dedup's keep.parquet: the score folder each row came from


def is_text(kind: pa.DataType) -> bool:
    """A string column, dictionary-encoded or not."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def check_key_type(where: str, column: str, kind: pa.DataType) -> None:
    """The one rule for key types: a ``key`` or ``shard`` column holds strings; numbers are refused, since
    the shards name their samples with zero-padded strings that a number never equals."""
    if not is_text(kind):
        raise LaionkitError(f"{where}: column {column!r} is {kind}, but sample {column}s are strings as the shards "
                            f"name them (e.g. '000001', not 1): write the column as strings")


def refuse_none_kept(spec: str, samples: int) -> None:
    """A keep list that matched none of the shards' samples is a mistake (another dataset's list, keys
    written otherwise), never an empty result."""
    raise LaionkitError(f"--keep {spec}: none of the {samples:,} samples of the input shards is in the list (a "
                        f"sample is kept where the list has its shard's stem and its key, as strings, or its key "
                        f"alone in a list without a {SHARD_COLUMN!r} column): is it these shards' list?")


@dataclass(frozen=True)
class KeepList:
    """The samples of a keep list: (shard, key) pairs, shard None where the list names a key alone."""

    samples: frozenset[tuple[str | None, str]]

    def kept(self, shard: str, key: str) -> bool:
        return (shard, key) in self.samples or (None, key) in self.samples

    @functools.cached_property
    def _value_sets(self) -> tuple[pa.Array, pa.Array]:
        """The list as arrow value sets, (shard NUL key) pairs and keys alone: built once, not per unit masked."""
        pairs = pa.array(sorted(f"{shard}\x00{key}" for shard, key in self.samples if shard is not None), pa.string())
        alone = pa.array(sorted(key for shard, key in self.samples if shard is None), pa.string())
        return pairs, alone

    def mask(self, shards: pa.Array, keys: pa.Array) -> pa.Array:
        """``kept`` of every row of two string columns, as a boolean array."""
        import pyarrow.compute as pc

        pairs, alone = self._value_sets
        joined = pc.binary_join_element_wise(shards.cast(pa.string()), keys.cast(pa.string()), "\x00")
        return pc.or_(pc.is_in(joined, value_set=pairs), pc.is_in(keys.cast(pa.string()), value_set=alone))

    def identity(self) -> dict:
        """What a folder records of its keep list: a rerun with another list is refused, not mixed. A list of
        keys alone keeps the digest it always had."""
        lines = sorted(key if shard is None else f"{shard}/{key}" for shard, key in self.samples)
        return {"keys": len(self.samples), "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}

    def __len__(self) -> int:
        return len(self.samples)


def read_keep_list(spec: str, options: dict | None = None) -> KeepList:
    """The samples of the parquet file ``spec``, or of the ``*.parquet`` files of the folder ``spec`` (names
    starting with ``_`` or ``.`` skipped, as dataset readers do)."""
    location = Location.parse(spec, options)
    if location.is_dir():
        files = [p for p in location.list("*.parquet") if not p.name.startswith(("_", "."))]
    elif location.exists():
        files = [location]
    else:
        raise LaionkitError(f"--keep {spec}: no such file or folder")
    if not files:
        raise LaionkitError(f"--keep {spec}: no parquet files in that folder")
    samples: set[tuple[str | None, str]] = set()
    inputs: dict[str, set[str]] = defaultdict(set)  # shard -> the inputs naming it
    for file in files:
        for shard, key, source in _rows(file):
            if shard is None and (None, key) in samples:
                raise LaionkitError(f"--keep {file}: key {key!r} is listed twice and the list has no "
                                    f"{SHARD_COLUMN!r} column to say which shard's sample each one is (keys "
                                    "restart in every shard of a plain webdataset): give a list with a shard column "
                                    "(score's or dedup's)")
            samples.add((shard, key))
            if shard is not None and source is not None:
                inputs[shard].add(source)
    shared = sorted((shard, sorted(sources)) for shard, sources in inputs.items() if len(sources) > 1)
    if shared:
        shard, sources = shared[0]
        raise LaionkitError(f"--keep {spec}: its rows come from several inputs whose shard names coincide (shard "
                            f"{shard} of {' and '.join(sources)}), so (shard, key) names a sample of each: keep one "
                            f"input's rows (those whose {INPUT_COLUMN!r} is that input's) for that input's shards")
    return KeepList(frozenset(samples))


def _rows(file: Location) -> list[tuple[str | None, str, str | None]]:
    """(shard or None, key, input or None) of every row of one keep file with a key."""
    import pyarrow.parquet as pq

    try:
        with file.open_read() as handle:
            parquet = pq.ParquetFile(handle)
            names = parquet.schema_arrow.names
            if KEY_COLUMN not in names:
                raise LaionkitError(f"--keep {file}: no {KEY_COLUMN!r} column (columns: {', '.join(names[:12])})")
            columns = [name for name in (KEY_COLUMN, SHARD_COLUMN, INPUT_COLUMN) if name in names]
            for name in columns[:2]:
                check_key_type(f"--keep {file}", name, parquet.schema_arrow.field(name).type)
            table = parquet.read(columns=columns)
    except (OSError, pa.ArrowException) as error:
        raise LaionkitError(f"--keep {file}: not a readable parquet file ({error})") from None
    keys = table.column(KEY_COLUMN).to_pylist()
    shards = table.column(SHARD_COLUMN).to_pylist() if SHARD_COLUMN in columns else [None] * len(keys)
    sources = table.column(INPUT_COLUMN).to_pylist() if INPUT_COLUMN in columns else [None] * len(keys)
    return [(shard, key, source) for shard, key, source in zip(shards, keys, sources) if key is not None]
