"""`pack --keep`: the kept samples of existing shards (pack's, img2dataset's, plain WebDataset), written as
a new pack folder without downloading anything again.

Each input shard becomes the output shard of the same name holding only the samples the keep list has (by
shard and key: laionkit.common.keys), members byte for byte, in order; shard *i* belongs to rank *i mod W*, as
in every stage. Per shard the tar, then img2dataset's per-sample parquet (the kept samples' json rows), then ``<shard>_stats.json`` last,
with every key pack's records carry (``count`` = ``successes`` = samples kept, ``not_kept``, ``input`` naming
the source shard and the keep list's identity), so encode, score and `laionkit stats` read the folder as
pack's. A shard is done iff its record is complete and made with the same keep list; a rerun redoes the rest.
Shards are not merged: a 30 % keep gives shards of 30 % the size.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from contextlib import ExitStack

import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, resolve_rank, split, storage, versions
from laionkit.common.keys import KeepList, read_keep_list, refuse_none_kept
from laionkit.common.storage import Location
from laionkit.common.upstream import refuse_incomplete, refuse_incomplete_folders
from laionkit.encode.reader import PACK_RECORD_SUFFIX, find_shards, shard_stem, unit_samples
from laionkit.pack.config import PackConfig
from laionkit.pack.records import load_record, size_bucket, write_manifest


def run_subset(config: PackConfig, log=print) -> dict:
    """Subset this rank's input shards that are not done yet into ``config.output``; returns the manifest."""
    rank = resolve_rank(config.rank, config.world_size)
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(str(config.output), options)
    inputs = find_shards([str(path) for path in config.inputs], log if not config.quiet else (lambda _: None),
                         options, "pack")
    storage.refuse_overlap([*(Location.parse(str(p), options) for p in config.inputs), *inputs], output, "pack")
    refuse_incomplete_folders(config.inputs, "input", config.allow_incomplete, log, options)
    refuse_incomplete(config.keep, "--keep", config.allow_incomplete, log, options)
    storage.claim_output(output, "pack", config.overwrite)
    if output.local:
        os.makedirs(output.path, exist_ok=True)
    keep = read_keep_list(config.keep, options)
    identity = keep.identity()
    shards = list(inputs)
    mine = split(shards, rank)
    todo = []
    for shard in mine:
        record = output / f"{shard_stem(shard)}{PACK_RECORD_SUFFIX}"
        found = load_record(record) if record.is_complete() else None
        if found is not None and found["options"].get("keep") != identity:
            raise LaionkitError(f"{record} was packed with another --keep list ({found['options'].get('keep')}); "
                                "use a new --output")
        if found is None:
            todo.append(shard)
    if not config.quiet:
        log(f"pack --keep: rank {rank.rank}/{rank.world_size}, {len(keep):,} samples kept, {len(shards)} shards, "
            f"{len(mine)} mine, {len(todo)} to do -> {output}")
    for shard in todo:
        subset_shard(shard, output, keep, identity, len(shards))
    manifest = write_manifest(output)
    samples = sum(shard["input"]["samples"] for shard in manifest["shards"])
    if manifest["complete"] and samples and not manifest["samples"]:
        refuse_none_kept(config.keep, samples)
    return manifest


def subset_shard(shard: Location, output: Location, keep: KeepList, identity: dict, planned: int) -> None:
    import webdataset as wds

    stem = shard_stem(shard)
    samples_in, rows, sizes = 0, [], Counter()
    with storage.atomic_write(output / f"{stem}.tar") as tmp, ExitStack() as stream:
        # mtime 0 as encode's and caption's tars: a shard redone after a kill is the same bytes (webdataset stamps
        # each member with the time of writing otherwise)
        with wds.TarWriter(str(tmp), mtime=0) as sink:
            for sample in unit_samples(shard, stream):
                samples_in += 1
                if not keep.kept(stem, sample["__key__"]):
                    continue
                sink.write({name: value for name, value in sample.items()
                            if name == "__key__" or not name.startswith("__")})
                meta = json.loads(sample["json"]) if "json" in sample else {"key": sample["__key__"]}
                rows.append(meta)
                width = meta.get("original_width") or meta.get("width")
                height = meta.get("original_height") or meta.get("height")
                if width and height:
                    sizes[size_bucket(int(width), int(height))] += 1
        tar_bytes = tmp.stat().st_size if tmp.exists() else 0
    try:
        table = pa.Table.from_pylist(rows) if rows else pa.table({"key": pa.array([], pa.string())})
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # rows whose types differ: img2dataset's key/status and the json
        table = pa.Table.from_pylist([{"key": row.get("key"), "status": "success", "json": json.dumps(row)}
                                      for row in rows])
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    storage.write_bytes(output / f"{stem}.parquet", buffer.getvalue())
    kept = len(rows)
    storage.write_json(output / f"{stem}{PACK_RECORD_SUFFIX}", {
        "count": kept, "successes": kept, "failures": {}, "original_sizes": dict(sizes),
        "status_dict": {"success": kept} if kept else {}, "shard": stem, "tar": f"{stem}.tar",
        "tar_bytes": tar_bytes, "parquet_bytes": len(buffer.getvalue()),
        "input": {"file": str(shard), "samples": samples_in, "keep": identity}, "not_kept": samples_in - kept,
        "planned_shards": planned, "options": {"keep": identity}, "versions": versions(),
    })
