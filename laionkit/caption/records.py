"""caption's records: the folder's plan (caption.json), per-shard done records in pack's layout
(``<shard>_stats.json``, so encode and every reader of pack's folders take a caption folder as one), the
settings a folder's captions share, and `laionkit stats` of a caption folder."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from laionkit.common import refuse_other_settings, storage, versions
from laionkit.common.storage import Location
from laionkit.encode.reader import PACK_RECORD_SUFFIX, ShardDone, output_name, shard_stem

PLAN = "caption.json"
FORMAT = "laionkit-captions/1"
RERUN_REMEDY = "write to a new --output, or remove the old shards and their records"


def record_path(output: Location, shard: str) -> Location:
    """A shard's done record: ``<stem>_stats.json``, written after its tar, as pack and img2dataset write theirs."""
    return output / (shard_stem(Location.parse(shard)) + PACK_RECORD_SUFFIX)


def settings_of(config, captioner, fingerprint: dict) -> dict:
    """What every caption of one folder shares; a rerun with others is refused (the batch size, workers and
    ranks are not among them: they change no caption)."""
    return {"name": config.name, "model": fingerprint, "prompt": config.prompt, "instruction": captioner.text,
            "max_new_tokens": config.max_new_tokens, "decoding": "greedy", "backend": captioner.backend,
            "dtype": str(captioner.dtype).removeprefix("torch.")}


def write_plan(output: Location, shards: Sequence[Location], settings: dict) -> None:
    """The run's output shards and settings; every rank writes the same bytes, and a folder captioned with
    other settings is refused before any is written."""
    plan = output / PLAN
    if plan.is_complete() and not plan.is_dir():
        refuse_other_settings(plan, plan.read_json().get("settings", {}), settings, "captioned", RERUN_REMEDY)
    storage.write_json(plan, {"format": FORMAT, "shards": sorted(output_name(shard) for shard in shards),
                              "settings": settings}, shared=True)


def shard_complete(output: Location, shard: Location, settings: dict, samples: int) -> bool:
    """Output tar and record exist, the record matches this run's settings and the input's sample count."""
    record_file = record_path(output, output_name(shard))
    if not (output / output_name(shard)).is_complete() or not record_file.is_complete():
        return False
    record = record_file.read_json()
    refuse_other_settings(record_file, record.get("settings", {}), settings, "captioned", RERUN_REMEDY)
    return record.get("count") == samples


def shard_record(done: ShardDone, written, skips: list[dict], seconds: float, rank: int, settings: dict,
                 source: str, batch_size: int) -> dict:
    """A finished shard's record: img2dataset's counts (count = samples read, successes = samples written,
    which encode checks against the tar) and caption's own."""
    skipped = Counter(skip["reason"] for skip in skips)
    return {
        "shard": done.shard, "count": done.samples_in, "successes": written.samples,
        "failed_to_download": 0, "failed_to_resize": 0,
        "status_dict": {"success": written.samples, **skipped},
        "captioned": written.samples, "empty_captions": written.empty, "caption_chars": written.chars,
        "skipped": dict(skipped), "skips": skips, "rank": rank, "seconds": round(seconds, 3),
        "batch_size": batch_size, "model_source": source, "settings": settings, "versions": versions(),
    }


def caption_status(folder: Location) -> dict:
    """The folder's totals, merged from its records (read-only)."""
    plan = (folder / PLAN).read_json()
    records = [path.read_json() for path in folder.list("*" + PACK_RECORD_SUFFIX)]
    done = [r for r in records if (folder / r["shard"]).is_complete()]
    skips: Counter = Counter()
    for record in done:
        skips.update(record["skipped"])
    return {"settings": plan["settings"], "shards": {"done": len(done), "expected": len(plan["shards"])},
            "samples_in": sum(r["count"] for r in done), "captioned": sum(r["captioned"] for r in done),
            "empty_captions": sum(r["empty_captions"] for r in done),
            "mean_chars": (sum(r["caption_chars"] for r in done) / max(1, sum(r["captioned"] for r in done))),
            "skips": dict(sorted(skips.items()))}


def summarize(folder: Location):
    """`laionkit stats DIR` for a caption folder."""
    from rich.console import Group
    from rich.table import Table

    from laionkit.encode.records import count_table

    status = caption_status(Location.parse(folder))
    settings = status["settings"]
    overview = Table(title=f"caption: {folder}", show_header=False)
    overview.add_row("shards", f"{status['shards']['done']} of {status['shards']['expected']}")
    overview.add_row("captioned", f"{status['captioned']:,} of {status['samples_in']:,} samples")
    overview.add_row("empty captions", f"{status['empty_captions']:,}")
    overview.add_row("mean caption length", f"{status['mean_chars']:.0f} characters")
    overview.add_row("json field", f"captions[{settings['name']!r}]")
    overview.add_row("backend", f"{settings['backend']} ({settings['dtype']}, {settings['decoding']}, "
                                f"max {settings['max_new_tokens']} new tokens)")
    overview.add_row("prompt", settings["prompt"])
    tables = [overview]
    if status["skips"]:
        tables.append(count_table("skips by reason", status["skips"]))
    return Group(*tables)
