"""encode's records: per-shard records, plan.json, the folder manifest (latent_status, merge_records),
the settings a folder's shards share, and `laionkit stats` of a latent folder."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from laionkit.common import LaionkitError, refuse_other_settings, storage, versions
from laionkit.common.keys import KeepList
from laionkit.common.models import fingerprint
from laionkit.common.storage import Location
from laionkit.encode.config import EncodeConfig
from laionkit.encode.reader import ShardDone, output_name
from laionkit.families import DEFAULT_FAMILY, FamilySpec, get_family

if TYPE_CHECKING:
    from laionkit.encode.device import Encoders
    from laionkit.encode.tars import ShardOutput


RECORD_SUFFIX = ".stats.json"
MANIFEST = "manifest.json"
PLAN = "plan.json"
EMPTY_CAPTION = "empty_caption.npy"
FORMAT = "laionkit-latents/1"
RERUN_REMEDY = "write to a new --output or remove the old shards"


def latent_family(settings: dict) -> FamilySpec:
    """The family of a latent folder from its settings (manifest): SD when none is named."""
    return get_family(settings.get("family", DEFAULT_FAMILY))


def record_path(output: Location, shard: str) -> Location:
    return output / (shard.removesuffix(".tar") + RECORD_SUFFIX)


def _models(config: EncodeConfig, family: FamilySpec) -> dict:
    components = ["vae"] + [name for pair in family.text_encoders for name in reversed(pair)]
    return {component: fingerprint(config.source(component), component) for component in components}


def _settings(config: EncodeConfig, models: dict, encoders: Encoders, buckets, keep: KeepList | None = None,
              caption_scores: dict | None = None) -> dict:
    """What every shard of one folder must share; a rerun with other settings is refused.

    Models count by content (their files' sha256), not by the path they were reached through: the same
    folder via a symlink, a copy or a hub cache is the same model. Without hashes (a hub id not in the
    cache), the source string is all there is to compare.
    """
    return {
        "models": {component: {"files": model["files"]} if model.get("files") else {"source": model["source"]}
                   for component, model in models.items()},
        **encoders.facts(),
        "resolution": config.resolution,
        "buckets": [list(size) for size in buckets] if buckets else None,
        "compute_dtype": str(encoders.dtype).removeprefix("torch."),
        **({"caption_key": config.caption_key} if config.caption_key else {}),
        **({"keep": keep.identity()} if keep is not None else {}),
        # --captions: the names stored per sample, in order (absent: the one alt-text caption, as always)
        **({"captions": list(config.captions)} if config.captions else {}),
        # --caption-scores: the columns joined and the score folder's settings (encode.caption_scores)
        **({"caption_scores": caption_scores} if caption_scores is not None else {}),
    }


def recorded_text_mode(output: Location) -> str | None:
    """The text mode (stored / online) of the shards already encoded into ``output``, None for a new folder:
    a rerun without --text resumes in it, whatever the family's default is now."""
    for record_file in output.list("*" + RECORD_SUFFIX):
        return (record_file.read_json()["settings"].get("text") or {}).get("mode", "stored")
    return None


def refuse_mixed_settings(output: Location, settings: dict) -> None:
    """Refuse a folder whose shards were encoded with other settings than this run's."""
    for record_file in output.list("*" + RECORD_SUFFIX):
        refuse_other_settings(record_file, record_file.read_json()["settings"], settings, "encoded", RERUN_REMEDY)


def shard_record(done: ShardDone, written: ShardOutput, skips: list[dict], seconds: float, rank: int,
                 settings: dict, models: dict) -> dict:
    """A finished shard's record (<shard>.stats.json): what it read, wrote and skipped, and the settings."""
    return {
        "shard": done.shard, "rank": rank, "samples_in": done.samples_in,
        "samples_out": written.samples, "truncated": written.truncated, "empty_captions": written.empty_captions,
        "upscaled": written.upscaled,
        **({"not_kept": done.not_kept} if done.not_kept else {}),
        "skipped": dict(Counter(skip["reason"] for skip in skips)), "skips": skips,
        "sizes": dict(written.sizes), "bytes": written.bytes, "seconds": round(seconds, 3), "settings": settings,
        "models": models,
        **(caption_record(settings["captions"], written) if settings.get("captions") else {}),
    }


def caption_record(names: Sequence[str], written: ShardOutput) -> dict:
    """--captions: per name the samples that store it, lack it (``missing``: its caption_skips), cut it to the
    window and carry its CLIP score; and each caption skipped (key, caption, reason)."""
    missing = Counter(skip["caption"] for skip in written.caption_skips)
    return {"captions": {name: {"stored": written.captions.get(name, Counter())["stored"], "missing": missing[name],
                                "truncated": written.captions.get(name, Counter())["truncated"],
                                "scored": written.captions.get(name, Counter())["scored"]} for name in names},
            "caption_skips": sorted(written.caption_skips, key=lambda skip: (skip["key"], skip["caption"]))}


def shard_complete(output: Location, shard: Location, settings: dict, samples: int) -> bool:
    """Output tar and record exist, the record matches this run's settings and the input's sample count."""
    record_file = record_path(output, output_name(shard))
    if not (output / output_name(shard)).is_complete() or not record_file.is_complete():
        return False
    record = record_file.read_json()
    refuse_other_settings(record_file, record["settings"], settings, "encoded", RERUN_REMEDY)
    return record["samples_in"] == samples


def write_plan(output: Location, shards: Sequence[Location]) -> None:
    """The run's full list of output shards; every rank writes the same list, so any rename wins whole."""
    storage.write_json(output / PLAN, {"shards": sorted(output_name(shard) for shard in shards)}, shared=True)


def latent_status(output: Path | Location) -> dict:
    """The folder's manifest, derived from what is on disk: the plan and the per-shard records.

    manifest.json is only a cache of this: ranks rewrite it concurrently, and a rank that merged before
    another's last record landed can rename its stale merge last. Readers that decide anything (train's
    "is the encode complete") call this instead.
    """
    output = Location.parse(output)
    plan = output / PLAN
    if plan.is_complete() and not plan.is_dir():
        expected = _read_folder_json(plan).get("shards")
    else:  # written before plan.json existed: its manifest said whether every planned shard was done
        manifest = output / MANIFEST
        cached = _read_folder_json(manifest) if manifest.is_complete() and not manifest.is_dir() else {}
        expected = [_read_folder_json(r).get("shard") for r in output.list("*" + RECORD_SUFFIX)] \
            if cached.get("complete") else None
    try:
        return merge_records(output, expected)
    except (KeyError, TypeError) as error:
        raise LaionkitError(f"{output}: a shard record lacks {error} (not a laionkit encode record); "
                            "rerun encode") from None


def _read_folder_json(path: Location) -> dict:
    """A record, plan or manifest of a latent folder, or a one-line error naming the damaged file."""
    try:
        found = path.read_json()
    except (OSError, UnicodeDecodeError, ValueError, LaionkitError) as error:
        raise LaionkitError(f"{path} cannot be read as JSON ({error}): rerun encode") from None
    if not isinstance(found, dict):
        raise LaionkitError(f"{path} is not a JSON object: rerun encode")
    return found


def update_manifest(output: Location) -> dict:
    manifest = latent_status(output)
    storage.write_json(output / MANIFEST, manifest, shared=True)
    return manifest


def merge_records(output: Path | Location, expected: Sequence[str] | None = None) -> dict:
    """The folder manifest as the merge of every shard record present (no coordinator needed)."""
    output = Location.parse(output)
    records = [_read_folder_json(path) for path in output.list("*" + RECORD_SUFFIX)]
    if not records:
        raise LaionkitError(f"no encode records (*{RECORD_SUFFIX}) in {output}: is it an encode output folder?")
    settings = records[0]["settings"]
    skips: Counter = Counter()
    sizes: Counter = Counter()
    for record in records:
        skips.update(record["skipped"])
        sizes.update(record["sizes"])
    done = sorted(record["shard"] for record in records
                  if (output / record["shard"]).is_complete() and not (output / record["shard"]).is_dir())
    manifest = {
        "format": FORMAT,
        **settings,
        # Where the models were loaded from (settings keep only their content, the file hashes).
        "models": records[-1].get("models", settings["models"]),
        "stored_dtype": "float16",
        "family": latent_family(settings).name,
        "empty_caption": EMPTY_CAPTION,
        **{f"empty_{key}": latent_family(settings).empty_file(key) for key in latent_family(settings).stored
           if key != "states"},
        "shards": {"done": len(done), "expected": len(expected) if expected is not None else None,
                   "missing": sorted(set(expected or ()) - set(done))},
        "counts": {"samples_in": sum(r["samples_in"] for r in records),
                   "samples_out": sum(r["samples_out"] for r in records),
                   "skipped": sum(skips.values()), "truncated_captions": sum(r["truncated"] for r in records),
                   # samples left out by encode --keep (only in folders encoded with one)
                   **({"not_kept": sum(r.get("not_kept", 0) for r in records)} if "keep" in settings else {}),
                   # samples encoded with an empty caption (none found, or blank); None: a record predates the count
                   "empty_captions": None if any("empty_captions" not in r for r in records)
                   else sum(r["empty_captions"] for r in records),
                   # samples whose crop was enlarged to their size; None: a record predates the count
                   "upscaled": None if any("upscaled" not in r for r in records)
                   else sum(r["upscaled"] for r in records)},
        "skips": dict(sorted(skips.items())),
        **({"caption_counts": _caption_counts(settings["captions"], records)} if settings.get("captions") else {}),
        "sizes": dict(sorted(sizes.items())),
        "bytes": storage_cost(records),
        "records": {record["shard"]: record_path(output, record["shard"]).name for record in records},
        "versions": versions(),
    }
    manifest["complete"] = expected is not None and not manifest["shards"]["missing"]
    return manifest


def _caption_counts(names: Sequence[str], records: Sequence[dict]) -> dict:
    """--captions: per name, the shard records' counts summed (stored, missing, truncated, scored)."""
    return {name: {count: sum((record.get("captions") or {}).get(name, {}).get(count, 0) for record in records)
                   for count in ("stored", "missing", "truncated", "scored")} for name in names}


def storage_cost(records: Sequence[dict]) -> dict | None:
    """The done shards' bytes on disk: in all, per sample written (measured, so trimmed text counts at its
    true length) and projected to a billion samples; None when a record predates the count."""
    if any(record.get("bytes") is None for record in records):
        return None
    total, samples = sum(record["bytes"] for record in records), sum(record["samples_out"] for record in records)
    per_sample = total / samples if samples else None
    return {"total": total, "per_sample": per_sample,
            "per_billion_samples": per_sample * 1e9 if per_sample is not None else None}


def describe_cost(cost: dict) -> str:
    """A storage cost as one line: KiB per sample and PiB per billion samples."""
    return f"{cost['per_sample'] / 2**10:,.1f} KiB per sample ({cost['per_billion_samples'] / 2**50:,.2f} PiB " \
           "per billion samples)"


def summarize(folder: Path | Location):
    """`laionkit stats DIR` for a latent folder: the merged records as tables."""
    from rich.console import Group
    from rich.table import Table

    manifest = latent_status(folder)
    overview = Table(title=f"encode: {folder}", show_header=False)
    overview.add_row("shards", str(manifest["shards"]["done"]))
    counts = manifest["counts"]
    overview.add_row("samples", f"{counts['samples_out']:,} of {counts['samples_in']:,}")
    overview.add_row("truncated captions", f"{counts['truncated_captions']:,}")
    if counts.get("empty_captions") is not None:
        overview.add_row("empty captions", f"{counts['empty_captions']:,}")
    if counts.get("upscaled"):
        overview.add_row("upscaled", f"{counts['upscaled']:,} (crop smaller than the size encoded)")
    overview.add_row("resolution", str(manifest["resolution"]) + (" (buckets)" if manifest["buckets"] else ""))
    overview.add_row("latent", f"{manifest['vae']['latent_channels']} channels, /{manifest['vae']['downsample_factor']}, "
                               f"scaling {manifest['vae']['scaling_factor']}")
    overview.add_row("text", f"{manifest['text']['sequence_length']} x {manifest['text']['hidden_size']} "
                             f"({manifest['text']['layer']} layer)"
                     + (", online: token ids stored, train encodes" if manifest["text"].get("mode") == "online"
                        else "")
                     + (f", caption window {manifest['text']['max_sequence_length']} tokens (--max-sequence-length)"
                        if manifest["text"].get("max_sequence_length") else ""))
    for component, model in manifest["models"].items():
        overview.add_row(component, f"{model['source']} ({model['subfolder']})")
    size = sum(p.size() for p in Location.parse(folder).list("*.tar"))
    overview.add_row("size on disk", f"{size / 2**20:,.1f} MiB")
    if counts["samples_out"]:  # what --text stored vs online costs at web scale
        per_sample = size / counts["samples_out"]
        overview.add_row("per sample", describe_cost({"per_sample": per_sample, "per_billion_samples": per_sample * 1e9}))
    tables = [overview]
    if manifest.get("caption_counts"):  # encode --captions: what each name stored
        table = Table("", "stored", "missing", "truncated", "scored", title="captions")
        for name, found in manifest["caption_counts"].items():
            table.add_row(name, *(f"{found[count]:,}" for count in ("stored", "missing", "truncated", "scored")))
        tables.append(table)
    tables += [count_table(title, counter) for title, counter in (("skips by reason", manifest["skips"]),
                                                                   ("encoded sizes", manifest["sizes"])) if counter]
    return Group(*tables)


def count_table(title: str, counter: dict):
    """A `laionkit stats` table of samples per name (skips by reason, sizes), as every stage prints them."""
    from rich.table import Table

    table = Table("", "samples", title=title)
    for name, count in counter.items():
        table.add_row(name, f"{count:,}")
    return table
