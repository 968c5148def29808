"""`laionkit stats DIR`: a readable summary of a stage's output folder, merged across ranks.

What the folder holds decides the summary (SUMMARIES: marker glob -> summariser), so each stage adds
its own entry. Filter: every rank's ``_laionkit/filter-stats-<rank>.parquet`` (``_stats-<rank>.json`` in
older folders) carries per-unit records; they are merged by
unit index and only those of the folder's current plan count, so stale files from an earlier world
size or a resumed run never count twice.

Read-only: a summary writes nothing (folders may sit on read-only storage, or be shared), and it also
covers folders laionkit did not write: plain img2dataset output and plain WebDataset tars. The folder
may be a URL (s3://...): there, in a folder holding done records, only complete objects count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from laionkit.common import LaionkitError, storage
from laionkit.common.storage import Location
from laionkit.common.tars import count_samples


@dataclass(frozen=True)
class StatsConfig:
    folder: str | Path
    storage_options: str | None = None  # --storage-options JSON for a URL folder


def listed(folder: Location, pattern: str) -> list[Location]:
    """Complete entries (done records count where the folder has them; other tools' uploads have none)."""
    return folder.list(pattern, complete_only=None)


def filter_totals(folder: Location | Path) -> dict:
    """Merge a filter folder's rank stats: one record per unit, totals, per-rank and per-rule counts."""
    from laionkit.filter import PLAN_NAME, plan_id, plan_location, read_record, stats_paths

    folder = Location.parse(folder)
    plan_path = plan_location(folder)
    if plan_path is None:
        raise LaionkitError(f"{folder}: no {PLAN_NAME}, so not a laionkit filter folder")
    plan_record = read_record(plan_path)
    current = plan_id(plan_record)
    units: dict[int, dict] = {}
    ranks = []
    for path in stats_paths(folder):
        stats = read_record(path)
        if stats.get("plan_id") != current:
            continue
        if not isinstance(stats.get("units"), list):
            raise LaionkitError(f"{path}: no per-unit records; delete it and rerun that filter rank")
        ranks.append(stats)
        for unit in stats["units"]:
            units[unit["unit"]] = unit
    rules: dict[str, dict[str, int]] = {}
    for unit in units.values():
        for name, count in unit["rules"].items():
            total = rules.setdefault(name, {"dropped": 0, "nulls": 0})
            total["dropped"] += count["dropped"]
            total["nulls"] += count["nulls"]
    return {
        "units_done": len(units),
        "units_total": len(plan_record["units"]),
        "rows_in": sum(u["rows_in"] for u in units.values()),
        "rows_out": sum(u["rows_out"] for u in units.values()),
        "rules": rules,
        "ranks": ranks,
        "bad_inputs": plan_record["bad_inputs"],
        "bad_units": [u for u in units.values() if "bad" in u],
    }


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def print_filter_summary(folder: Location, console: Console) -> None:
    totals = filter_totals(folder)
    rows_in = totals["rows_in"]
    ranks = Table("rank", "world", "rows in", "rows out", "kept", "seconds", "rows/s",
                  title=f"laionkit filter: {folder}")
    for stats in sorted(totals["ranks"], key=lambda s: (s["world_size"], s["rank"])):
        rate = f"{stats['rows_filtered_now'] / stats['seconds']:,.0f}" if stats["seconds"] else "-"
        ranks.add_row(str(stats["rank"]), str(stats["world_size"]), f"{stats['rows_in']:,}",
                      f"{stats['rows_out']:,}", percent(stats["rows_out"], stats["rows_in"]),
                      f"{stats['seconds']:.2f}", rate)
    ranks.add_row("all", "", f"{rows_in:,}", f"{totals['rows_out']:,}", percent(totals["rows_out"], rows_in),
                  "", "", style="bold")
    console.print(ranks)
    rules = Table("rule", "dropped", "nulls (failed)", "of rows in",
                  title="rows failing each rule (counted independently)")
    for name, count in totals["rules"].items():
        rules.add_row(name, f"{count['dropped']:,}", f"{count['nulls']:,}",
                      percent(count["dropped"] + count["nulls"], rows_in))
    console.print(rules)
    status = "complete" if totals["units_done"] == totals["units_total"] else "INCOMPLETE: rerun to finish"
    console.print(f"units: {totals['units_done']} of {totals['units_total']} done ({status})")
    for bad in totals["bad_inputs"]:
        console.print(Text.assemble(("skipped input", "yellow"), f" {bad['path']}: {bad['error']}"))
    for bad in totals["bad_units"]:
        first, stop = bad["row_groups"]
        console.print(Text.assemble((f"skipped {bad['bad_rows']:,} rows", "yellow"),
                                    f" of {bad['input']} (row groups {first}-{stop - 1}): {bad['bad']}"))


def _is_pack_folder(folder: Location, records: list) -> bool:
    """laionkit pack wrote this folder: a record carries its fields, or its manifest cache says so."""
    if any(isinstance(record, dict) and "failures" in record for record in records):
        return True
    try:
        return "planned_shards" in (folder / "manifest.json").read_json()
    except (OSError, ValueError, TypeError, LaionkitError):
        return False


def print_shard_summary(folder: Location, console: Console) -> None:
    """Shard folders: laionkit pack's (its records carry laionkit's fields), else plain img2dataset."""
    records, unreadable = [], []
    for path in listed(folder, "*_stats.json"):
        try:
            records.append(path.read_json())
        except (OSError, ValueError, LaionkitError) as error:
            unreadable.append(f"{path}: unreadable shard record ({error})")
    if _is_pack_folder(folder, records):
        # laionkit pack's own folder: its summary lists damaged records (a rerun of pack redoes them)
        from laionkit.pack import summarize

        console.print(summarize(folder))
        return
    if unreadable:
        raise LaionkitError(unreadable[0])
    try:
        rows = sum(r["count"] for r in records)
        samples = sum(r["successes"] for r in records)
        download = sum(r.get("failed_to_download", 0) for r in records)
        resize = sum(r.get("failed_to_resize", 0) for r in records)
        messages = Counter()
        for record in records:
            messages.update({k: v for k, v in (record.get("status_dict") or {}).items() if k != "success"})
    except (KeyError, TypeError, AttributeError) as error:
        raise LaionkitError(f"{folder}: a *_stats.json is not an img2dataset shard record ({error!r})") from None
    table = Table(title=f"img2dataset shards: {folder}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("shards (stats records)", f"{len(records):,}")
    table.add_row("rows", f"{rows:,}")
    table.add_row("samples", f"{samples:,} ({percent(samples, rows)})")
    table.add_row("failed to download", f"{download:,}")
    table.add_row("failed to resize", f"{resize:,}")
    table.add_row("tar bytes", f"{sum(p.size() for p in listed(folder, '*.tar')):,}")
    console.print(table)
    errors = Table("error", "rows", title="commonest errors")
    for message, count in messages.most_common(20):
        errors.add_row(message, f"{count:,}")
    console.print(errors)


def print_tar_summary(folder: Location, console: Console) -> None:
    """Plain WebDataset: only tars; samples are counted from the tar headers."""
    table = Table("shard", "samples", "bytes", title=f"webdataset: {folder}")
    total = 0
    for path in listed(folder, "*.tar"):
        samples = count_samples(path)
        total += samples
        table.add_row(path.name, f"{samples:,}", f"{path.size():,}")
    table.add_row("all", f"{total:,}", "", style="bold")
    console.print(table)


def print_caption_summary(folder: Location, console: Console) -> None:
    from laionkit.caption.records import summarize

    console.print(summarize(folder))


def print_encode_summary(folder: Location, console: Console) -> None:
    from laionkit.encode import summarize

    console.print(summarize(folder))


def print_score_summary(folder: Location, console: Console) -> None:
    from laionkit.score.records import summarize

    console.print(summarize(folder))


def print_dedup_summary(folder: Location, console: Console) -> None:
    from laionkit.dedup.summary import summarize

    console.print(summarize(folder))


def print_run_summary(folder: Location, console: Console) -> None:
    from laionkit.trainer.runsummary import summarize

    console.print(summarize(folder))


# Marker glob -> summary; the first whose marker the folder holds wins.
SUMMARIES: dict[str, Callable[[Location, Console], None]] = {
    "_stats-*.json": print_filter_summary,  # and a folder with a filter plan (filter.plan_location)
    "caption.json": print_caption_summary,  # caption: pack's shard records plus its plan
    "*_stats.json": print_shard_summary,  # pack / img2dataset: one record per shard
    "*.stats.json": print_encode_summary,  # encode: one record per latent shard
    "records": print_score_summary,  # score: records/<stem>.json per shard (laionkit.score.records)
    "keep.parquet": print_dedup_summary,  # dedup: keep.parquet, removed.parquet, stats.json
    "metrics.jsonl": print_run_summary,  # a train run: metrics.jsonl, checkpoints/, the exports
    "checkpoints": print_run_summary,  # one killed before its first logged step
    "*.tar": print_tar_summary,  # plain WebDataset
}


def run(config: StatsConfig) -> None:
    folder = Location.parse(str(config.folder), storage.parse_storage_options(config.storage_options))
    if not folder.is_dir():
        raise LaionkitError(f"not a folder: {folder}")
    from laionkit.filter import plan_location

    for marker, summarise in SUMMARIES.items():
        if listed(folder, marker) or (summarise is print_filter_summary and plan_location(folder) is not None):
            # Paths, rule SQL and model sources are data: no markup, emoji codes or highlighting.
            summarise(folder, Console(width=max(Console().width, 120), markup=False, emoji=False, highlight=False))
            return
    raise LaionkitError(
        f"{folder}: nothing laionkit stats knows how to summarise (looked for {', '.join(SUMMARIES)})"
    )
