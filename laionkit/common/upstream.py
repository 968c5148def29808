"""Another stage's output is consumed as complete only when it is.

Each stage writes its output unit by unit (a shard, a filter unit) with a done record, and ranks split the
units; a folder some ranks never ran over (or that were killed) looks like a smaller complete one. Every
stage that reads another's output (dedup of score folders, pack --keep and encode of caption or pack folders
and of keep lists, encode --caption-scores, filter --scores) asks ``refuse_incomplete`` first: an unfinished
folder is refused in one line naming what it lacks, unless the user insists (``--allow-incomplete``). A folder
no laionkit stage wrote (a plain webdataset, a hand-made parquet) says nothing and passes.
"""

from __future__ import annotations

from collections.abc import Callable

from laionkit.common.errors import LaionkitError
from laionkit.common.outputs import folder_holds
from laionkit.common.storage import Location

SHOWN = 5  # missing units named in a message; the rest are counted


def refuse_incomplete(spec: str | Location, role: str, allow: bool, log: Callable[[str], None] = print,
                      options: dict | None = None) -> None:
    """Refuse the output folder of ``spec`` (a folder, or a file in one: a keep.parquet, score's scores/)
    when its stage has not finished it; with ``allow`` say what is missing and go on. ``role``: the option
    or argument that named it (``--keep``, ``input``)."""
    folder = stage_folder(Location.parse(str(spec), options))
    lacks = missing_parts(folder) if folder is not None else None
    if lacks is None:
        return
    if allow:
        log(f"{role} {folder} is incomplete ({lacks}): used as it is (--allow-incomplete)")
        return
    raise LaionkitError(f"{role} {folder} is incomplete: {lacks}; finish that stage first (a rerun resumes; every "
                        "rank of it must run), or --allow-incomplete to use what is there")


def stage_folder(location: Location) -> Location | None:
    """The stage output folder ``location`` is or lies in: a file's folder, score's folder for its scores/."""
    if not location.is_dir():
        return location.parent if location.exists() else None
    if location.name == "scores" and "score" in holdings(location.parent):
        return location.parent
    return location


def holdings(folder: Location) -> dict[str, list[str]]:
    return folder_holds([entry.name for entry in folder.list(complete_only=None)])


def missing_parts(folder: Location) -> str | None:
    """What ``folder``'s stage has not written yet, in words; None when complete or no stage's folder."""
    kinds = holdings(folder)
    for kind, lacks in LACKS.items():
        if kind in kinds:
            found = lacks(folder)
            if found is not None:
                return found
    return None


def named(missing: list[str], total: int, what: str) -> str:
    shown = ", ".join(missing[:SHOWN]) + (", ..." if len(missing) > SHOWN else "")
    return f"{len(missing)} of {total} {what} ({shown})"


def score_lacks(folder: Location) -> str | None:
    """stats.json lists the shards a rank found missing when it finished; those still without a record. A
    folder without records is not score's (a hand-made scores/ folder): it says nothing."""
    from laionkit.score.records import RECORDS, STATS, record_path

    stats = folder / STATS
    if not stats.is_complete():
        started = (folder / RECORDS).is_dir() and (folder / RECORDS).list("*.json")
        return f"no {STATS} (no rank of score has finished)" if started else None
    listed = (stats.read_json().get("shards") or {})
    missing = [stem for stem in listed.get("missing", []) if not record_path(folder, stem).is_complete()]
    total = len(listed.get("missing", [])) + listed.get("done", 0)
    return named(missing, total, "shards not scored") if missing else None


def dedup_lacks(folder: Location) -> str | None:
    from laionkit.dedup.config import STATS_NAME

    if (folder / STATS_NAME).is_complete():
        return None
    return f"no {STATS_NAME} (dedup has not finished: it writes it after keep.parquet)"


def caption_lacks(folder: Location) -> str | None:
    from laionkit.caption.records import PLAN, record_path

    shards = (folder / PLAN).read_json().get("shards", [])
    missing = [shard for shard in shards
               if not (folder / shard).is_complete() or not record_path(folder, shard).is_complete()]
    return named(missing, len(shards), "shards not captioned") if missing else None


def pack_lacks(folder: Location) -> str | None:
    """pack's records count the shards it planned (img2dataset's records, which do not, say nothing)."""
    from laionkit.pack.records import load_record

    records = [load_record(path) for path in folder.list("*_stats.json")]
    planned = max((record["planned_shards"] for record in records if record is not None), default=None)
    done = sum(record is not None for record in records)
    if planned is None or done >= planned:
        return None
    return f"{planned - done} of {planned} planned shards have no done record <shard>_stats.json"


def filter_lacks(folder: Location) -> str | None:
    from laionkit.filter.records import existing_parts, plan_location, read_record

    plan = plan_location(folder)
    if plan is None:
        return None
    units = read_record(plan).get("units", [])
    missing = sorted(set(range(len(units))) - set(existing_parts(folder)))
    return named([str(unit) for unit in missing], len(units), "units not filtered (part files)") if missing else None


LACKS: dict[str, Callable[[Location], str | None]] = {
    "score": score_lacks, "dedup": dedup_lacks, "caption": caption_lacks, "pack": pack_lacks, "filter": filter_lacks,
}


def refuse_incomplete_folders(specs, role: str, allow: bool, log: Callable[[str], None] = print,
                              options: dict | None = None) -> None:
    """``refuse_incomplete`` of each of ``specs`` that is a folder: shard inputs named one by one (files, globs)
    were chosen, and each one's done record is checked where it is read."""
    for spec in specs:
        if Location.parse(str(spec), options).is_dir():
            refuse_incomplete(spec, role, allow, log, options)
