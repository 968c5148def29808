"""score's outputs (docs/FORMATS.md section 6): per shard ``scores/<stem>.parquet`` and
``img_emb/img_emb_<stem>.npy`` (rows in the same order), then ``records/<stem>.json``, written last:
a shard is done iff its record exists (in an object store: its done record) and was made with this
run's settings. ``stats.json`` merges the records; any rank rewrites it whole.
"""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, refuse_other_settings, storage, versions
from laionkit.common.storage import Location

SCORES = "scores"
EMBEDDINGS = "img_emb"
RECORDS = "records"
STATS = "stats.json"
FORMAT = "laionkit-scores/1"
RERUN_REMEDY = "write to a new --output, or --overwrite to redo every shard with this run's settings"

# Columns every score parquet has, in this order; then pwatermark / punsafe (when their weights are given)
# and one float32 column per --score.
BASE_COLUMNS = (
    ("key", pa.string()), ("shard", pa.string()), ("source", pa.string()), ("caption", pa.string()),
    ("width", pa.int32()), ("height", pa.int32()), ("sha256", pa.string()), ("phash", pa.int64()),
    ("similarity", pa.float32()),
)


def scores_path(output: Location, stem: str) -> Location:
    return output / SCORES / f"{stem}.parquet"


def embeddings_path(output: Location, stem: str) -> Location:
    return output / EMBEDDINGS / f"img_emb_{stem}.npy"


def record_path(output: Location, stem: str) -> Location:
    return output / RECORDS / f"{stem}.json"


def schema(score_columns: Sequence[str]) -> pa.Schema:
    return pa.schema([pa.field(name, kind) for name, kind in BASE_COLUMNS]
                     + [pa.field(name, pa.float32()) for name in score_columns])


def file_sha256(path: str | None) -> str | None:
    """A local weights file's content hash (settings compare models by content); None for tags and ids."""
    if not path or not Path(path).expanduser().is_file():
        return None
    digest = hashlib.sha256()
    with open(Path(path).expanduser(), "rb") as handle:
        for block in iter(lambda: handle.read(2**24), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_done(output: Location, stem: str, settings: dict, samples: int, overwrite: bool) -> bool:
    """The shard's record exists, its settings are this run's (else refused, unless --overwrite: redone)
    and it read as many samples as the input holds now."""
    record_file = record_path(output, stem)
    if not record_file.is_complete() or not (scores_path(output, stem).is_complete()
                                             and embeddings_path(output, stem).is_complete()):
        return False
    record = record_file.read_json()
    if overwrite and record.get("settings") != settings:
        return False
    refuse_other_settings(record_file, record.get("settings", {}), settings, "scored", RERUN_REMEDY)
    return record.get("samples_in") == samples


def write_shard(output: Location, stem: str, columns: dict[str, list], embeddings: np.ndarray,
                score_columns: Sequence[str], record: dict) -> None:
    """The shard's embeddings, then its parquet, then its record (the done mark)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(embeddings, dtype=np.float16))
    storage.write_bytes(embeddings_path(output, stem), buffer.getvalue())
    table = pa.table({name: pa.array(columns[name], type=field.type) for name, field in
                      zip(schema(score_columns).names, schema(score_columns))}, schema=schema(score_columns))
    with storage.atomic_write(scores_path(output, stem)) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    storage.write_json(record_path(output, stem), record)


def merge_stats(output: Location, expected: Sequence[str]) -> dict:
    """stats.json: the merge of every shard record present (no coordinator)."""
    records = []
    for path in output.join(RECORDS).list("*.json") if output.join(RECORDS).is_dir() else []:
        try:
            records.append(path.read_json())
        except (OSError, ValueError, LaionkitError) as error:
            raise LaionkitError(f"{path} cannot be read as JSON ({error}): remove it and rerun score") from None
    skips: Counter = Counter()
    for record in records:
        skips.update(record.get("skipped", {}))
    done = sorted(record["shard"] for record in records)
    return {
        "format": FORMAT,
        "settings": records[-1]["settings"] if records else None,
        "columns": records[-1]["columns"] if records else None,
        "shards": {"done": len(done), "expected": len(expected), "missing": sorted(set(expected) - set(done))},
        "counts": {"samples_in": sum(record["samples_in"] for record in records),
                   "samples_out": sum(record["samples_out"] for record in records),
                   "skipped": sum(skips.values())},
        "skips": dict(sorted(skips.items())),
        # score --captions: per name, the records' scored / missing counts summed
        **({"caption_counts": {name: {count: sum(record["captions"][name][count] for record in records
                                                 if name in record.get("captions", {}))
                                      for count in ("scored", "missing")}
                               for name in records[-1]["captions"]}} if records and "captions" in records[-1] else {}),
        "complete": not set(expected) - set(done),
        "versions": versions(),
    }


def update_stats(output: Location, expected: Sequence[str]) -> dict:
    stats = merge_stats(output, expected)
    storage.write_json(output / STATS, stats, shared=True)
    return stats


def summarize(folder: Location | str):
    """`laionkit stats DIR` for a score folder: its records merged (stats.json's shard list for what is missing)."""
    from rich.console import Group
    from rich.table import Table

    from laionkit.encode.records import count_table

    folder = Location.parse(folder)
    cached = (folder / STATS).read_json() if (folder / STATS).is_complete() else {}
    expected = [*(cached.get("shards") or {}).get("missing", [])]
    expected += [record.name.removesuffix(".json") for record in (folder / RECORDS).list("*.json")]
    stats = merge_stats(folder, expected)
    overview = Table(title=f"score: {folder}", show_header=False)
    overview.add_row("shards", f"{stats['shards']['done']} done, {len(stats['shards']['missing'])} missing")
    counts = stats["counts"]
    overview.add_row("samples", f"{counts['samples_out']:,} of {counts['samples_in']:,} ({counts['skipped']:,} skipped)")
    settings = stats["settings"] or {}
    model = settings.get("clip_model")
    overview.add_row("CLIP", f"{model if isinstance(model, str) else 'config file'} "
                             f"({settings.get('embedding_dim')}-d, {settings.get('compute_dtype')})")
    overview.add_row("columns", ", ".join(stats["columns"] or []))
    tables = [overview]
    if stats["skips"]:
        tables.append(count_table("skips by reason", stats["skips"]))
    return Group(*tables)
