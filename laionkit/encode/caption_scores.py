"""encode --caption-scores DIR: each caption's CLIP score from `laionkit score --captions`'s parquet (column
``similarity_NAME``), joined per input shard by stem (score names ``scores/<stem>.parquet`` after the shard, as
encode names its tar) and then by key, so nothing LAION-sized is held: each worker reads its shard's rows.

With the flag the join is the only source of scores: json ``caption_scores`` are ignored, since scores from
different CLIP models do not compare inside one softmax (train --caption-mix clip). A key or value the parquet
lacks leaves that caption unscored. Every file and column is checked before any shard is encoded, so a
missing one is a one-line error naming it, not a worker's traceback.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from laionkit.common import LaionkitError
from laionkit.common.caption_mix import ALT, similarity_column
from laionkit.common.storage import Location

SCORES = "scores"  # laionkit.score.records.SCORES: score's per-shard parquet folder
STATS = "stats.json"  # score's merged records (its settings)


def scores_folder(spec: str, options: dict | None = None) -> Location:
    """The folder of ``<stem>.parquet`` files: score's output folder (its scores/), or scores/ itself."""
    location = Location.parse(spec, options)
    if (location / SCORES).is_dir():
        return location / SCORES
    if location.is_dir() and location.list("*.parquet"):
        return location
    raise LaionkitError(f"--caption-scores {spec}: not a `laionkit score` output folder (no {SCORES}/*.parquet); "
                        "run laionkit score SHARDS --captions NAMES --output DIR first")


def shard_scores_path(folder: Location, stem: str) -> Location:
    return folder / f"{stem}.parquet"


def check_scores(folder: Location, stems: Sequence[str], names: Sequence[str]) -> None:
    """Every shard's parquet exists and has ``key`` and each name's column (footers only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ["key", *(similarity_column(name) for name in names)]
    for stem in stems:
        path = shard_scores_path(folder, stem)
        if not path.is_complete():
            raise LaionkitError(f"--caption-scores: no {path} (shard {stem} was not scored; run laionkit score on "
                                "the shards encoded here)")
        try:
            with path.open_read() as handle:
                have = pq.ParquetFile(handle).schema_arrow.names
        except (OSError, pa.ArrowException) as error:
            raise LaionkitError(f"--caption-scores {path}: not a readable parquet file ({error})") from None
        for column in columns:
            if column not in have:
                raise LaionkitError(f"--caption-scores {path}: no column {column!r} (has "
                                    f"{', '.join(name for name in have if name.startswith('similarity')) or 'none'}"
                                    f"); score with --captions {','.join(names)}")


def read_shard_scores(folder: Location, stem: str, names: Sequence[str]) -> dict[str, dict[str, float]]:
    """{key: {name: score}} of one shard (nulls left out: an empty or missing caption has no score)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {name: similarity_column(name) for name in names}
    path = shard_scores_path(folder, stem)
    try:
        with path.open_read() as handle:
            table = pq.read_table(handle, columns=["key", *columns.values()])
    except (OSError, pa.ArrowException) as error:
        raise LaionkitError(f"--caption-scores {path}: not a readable parquet file ({error})") from None
    found: dict[str, dict[str, float]] = {}
    values = {name: table.column(column).to_pylist() for name, column in columns.items()}
    for row, key in enumerate(table.column("key").to_pylist()):
        found[str(key)] = {name: float(values[name][row]) for name in names if values[name][row] is not None}
    return found


def scores_identity(folder: Location, names: Sequence[str], caption_key: str | None) -> dict:
    """What an encode folder records of its scores: the columns and the score folder's settings (CLIP model
    and weights by content), hashed; a rerun joining another model's scores is refused, not mixed. ``alt``
    scored from another --caption-key than encode's would be another text's score: refused."""
    stats = folder.parent / STATS if folder.name == SCORES else None
    settings = stats.read_json().get("settings") if stats is not None and stats.is_complete() else None
    if settings and ALT in names and settings.get("caption_key") != caption_key:
        raise LaionkitError(f"--caption-scores {stats}: alt was scored with --caption-key "
                            f"{settings.get('caption_key')}, this encode takes it with --caption-key {caption_key}: "
                            "give both stages the same one")
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest() if settings else None
    return {"columns": [similarity_column(name) for name in names], "score_settings_sha256": digest}
