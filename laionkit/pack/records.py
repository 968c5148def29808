"""Shard records (``<shard>_stats.json``), the manifest merged from them, and `laionkit stats` of a shard folder.

Invariant: a shard is done iff its record is complete and holds every ``RECORD_KEYS`` key; the manifest
is only a merge of the records on disk (any rank, or `laionkit stats`, can rebuild it).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from laionkit.common import LaionkitError, refuse_other_settings, storage
from laionkit.common.storage import Location
from laionkit.pack.config import OUTPUT_SHAPING_OPTIONS
from laionkit.pack.plan import ShardTask, task_input

# Shorter side of the original image, for the size histogram: bucket edges in pixels.
SIZE_BUCKETS = (128, 256, 512, 1024, 2048)


# Failure reasons, checked in order against img2dataset's error_message: (pattern, reason).
FAILURE_REASONS: tuple[tuple[str, str], ...] = (
    (r"URL refused: scheme", "refused scheme"),
    (r"URL refused: .* address", "refused address"),
    (r"--max-bytes", "body too large"),
    (r"HTTP Error (\d{3})", "http {0}"),
    (r"timed out", "timeout"),
    (r"X-Robots-Tag", "opt-out header"),
    (r"CV_IO_MAX_IMAGE_PIXELS|image area too large", "image too large"),
    (r"image too small", "image too small"),
    (r"aspect ratio too large", "aspect ratio too large"),
    (r"!buf\.empty\(\)", "empty body"),
    (r"Image decoding error|imdecode", "decode error"),
    (r"IncompleteRead", "truncated transfer"),
    (r"hash mismatch", "hash mismatch"),
    (r"urlopen error|Connection|RemoteDisconnected|Errno|SSL", "connection error"),
)


def failure_reason(error_message: str) -> str:
    """Map one of img2dataset's raw error messages to a stable reason category."""
    for pattern, reason in FAILURE_REASONS:
        match = re.search(pattern, error_message)
        if match:
            return reason.format(*match.groups())
    return "other"


def size_bucket(width: int, height: int) -> str:
    shorter = min(width, height)
    lower = 0
    for edge in SIZE_BUCKETS:
        if shorter < edge:
            return f"{lower}-{edge - 1}"
        lower = edge
    return f">={SIZE_BUCKETS[-1]}"


# Keys every shard record has; a record without them (or not JSON) marks no shard done.
RECORD_KEYS = ("count", "successes", "failures", "original_sizes", "status_dict", "shard", "tar", "tar_bytes",
               "parquet_bytes", "input", "planned_shards", "options", "versions")


def load_record(path: Location) -> dict | None:
    """A shard record, or None if it is not valid JSON with every key (a damaged file, not a done shard)."""
    try:
        record = path.read_json()
    except (OSError, ValueError, LaionkitError):
        return None
    if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
        return None
    return record


def check_done_record(record_path: Location, task: ShardTask, options: dict[str, Any]) -> None:
    """A finished shard must come from the same rows and the same output-shaping options."""
    record = record_path.read_json()
    planned = task_input(task)
    if record.get("input") != planned:
        raise LaionkitError(
            f"{record_path} was packed from {record.get('input')}, but this run plans {planned} for that "
            "shard: the input changed; use a new --output"
        )
    shaping = lambda values: {key: values.get(key) for key in OUTPUT_SHAPING_OPTIONS}  # noqa: E731
    refuse_other_settings(record_path, shaping(record.get("options", {})), shaping(options), "packed",
                          "rerun with the same options or a new --output")


def write_manifest(folder: Location) -> dict:
    """Merge the shard records on disk into manifest.json, atomically, safe against concurrent ranks.

    Every rank rewrites it, so the temporary name carries host and pid: two ranks finishing together
    never share (and delete) each other's temporary, and the last rename wins with a full merge.
    """
    manifest = merge_records(folder)
    storage.write_json(folder / "manifest.json", manifest, shared=True)
    return manifest


def merge_records(folder: Path | Location) -> dict:
    """The manifest: totals over readable records; damaged ones are listed under ``unreadable_records``
    (their shards count as not done, and a pack rerun redoes them)."""
    paths = Location.parse(folder).list("*_stats.json")
    loaded = {path.name: load_record(path) for path in paths}
    records = [record for record in loaded.values() if record is not None]
    failures, sizes, messages, invalid_utf8 = Counter(), Counter(), Counter(), Counter()
    for record in records:
        failures.update(record["failures"])
        sizes.update(record["original_sizes"])
        messages.update({key: value for key, value in record["status_dict"].items() if key != "success"})
        invalid_utf8.update(record.get("invalid_utf8", {}))
    rows = sum(record["count"] for record in records)
    samples = sum(record["successes"] for record in records)

    def distinct(key: str) -> list:
        return [json.loads(text) for text in sorted({json.dumps(r[key], sort_keys=True) for r in records})]

    planned = max((record["planned_shards"] for record in records), default=0)
    return {
        "stage": "pack",
        "shards": [
            {
                "shard": record["shard"], "tar": record["tar"], "samples": record["successes"],
                "rows": record["count"], "bytes": record["tar_bytes"],
                "success_rate": record["successes"] / record["count"] if record["count"] else 0.0,
                "failures": record["failures"], "input": record["input"],
            }
            for record in records
        ],
        "planned_shards": planned,
        "complete": bool(records) and len(records) == planned,
        "unreadable_records": sorted(name for name, record in loaded.items() if record is None),
        "invalid_utf8": dict(sorted(invalid_utf8.items())),
        "rows": rows,
        "samples": samples,
        "success_rate": samples / rows if rows else 0.0,
        "bytes": sum(record["tar_bytes"] + record["parquet_bytes"] for record in records),
        "failures": dict(failures.most_common()),
        "error_messages": dict(messages.most_common(20)),
        "original_sizes": dict(sorted(sizes.items(), key=lambda item: _bucket_order(item[0]))),
        "inputs": sorted({record["input"]["file"] for record in records}),
        "options": distinct("options"),
        "versions": distinct("versions"),
    }


def _bucket_order(bucket: str) -> int:
    return int(bucket.removeprefix(">=").split("-")[0])


def summarize(folder: Path | Location) -> Group:
    """`laionkit stats DIR` for a shard folder: the merged records as tables (read-only: writes nothing)."""
    manifest = merge_records(folder)
    overview = Table(title=f"pack: {folder}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    overview.add_row("shards", f"{len(manifest['shards'])} / {manifest['planned_shards']} planned")
    overview.add_row("rows", f"{manifest['rows']:,}")
    overview.add_row("samples", f"{manifest['samples']:,}")
    overview.add_row("success rate", f"{manifest['success_rate']:.1%}")
    overview.add_row("size on disk", f"{manifest['bytes'] / 2**20:,.1f} MiB")
    if manifest["invalid_utf8"]:
        overview.add_row("invalid UTF-8 repaired", ", ".join(f"{k}: {v:,}" for k, v in manifest["invalid_utf8"].items()))
    if manifest["unreadable_records"]:
        overview.add_row("unreadable records (rerun pack)", ", ".join(manifest["unreadable_records"]))
    failures = Table(title="failures by reason")
    failures.add_column("reason")
    failures.add_column("rows", justify="right")
    failures.add_column("share", justify="right")
    for reason, count in manifest["failures"].items():
        failures.add_row(reason, f"{count:,}", f"{count / manifest['rows']:.1%}")
    sizes = Table(title="original image size (shorter side, px)")
    sizes.add_column("size")
    sizes.add_column("samples", justify="right")
    sizes.add_column("")
    most = max(manifest["original_sizes"].values(), default=1)
    for bucket, count in manifest["original_sizes"].items():
        sizes.add_row(bucket, f"{count:,}", "█" * max(1, round(30 * count / most)))
    return Group(overview, failures, sizes)
