"""`laionkit caption`'s run: this rank's unfinished shards through the DataLoader workers (read, decode,
preprocess) and the model (generate), into one output tar per input shard, each with its done record."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.utils.data
from tqdm import tqdm

from laionkit.caption.backends import load_captioner, model_fingerprint
from laionkit.caption.config import CaptionConfig
from laionkit.caption.reader import CaptionBatches
from laionkit.caption.records import record_path, settings_of, shard_complete, shard_record, write_plan
from laionkit.caption.writer import CaptionedShard
from laionkit.common import LaionkitError, resolve_rank, runlock, stage_device, storage
from laionkit.common.background import timed
from laionkit.common.storage import Location
from laionkit.common.upstream import refuse_incomplete_folders
from laionkit.encode.reader import ShardDone, checked_reads, find_shards, rank_todo

QUEUE_DEPTH = 2  # batches each worker prepares ahead


def run(config: CaptionConfig, log: Callable[[str], None] = print) -> dict:
    """Caption this rank's shards that are not complete yet; return this rank's counts."""
    rank = resolve_rank(config.rank, config.world_size)
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(str(config.output), options)
    inputs = find_shards(config.shards, log if rank.rank == 0 else (lambda _: None), options, "caption")
    shards = list(inputs)
    storage.refuse_overlap([*(Location.parse(spec, options) for spec in config.shards), *shards], output, "caption")
    refuse_incomplete_folders(config.shards, "input", config.allow_incomplete, log, options)
    storage.claim_output(output, "caption", config.overwrite)
    with runlock.holding(runlock.output_lock(output, "caption", rank.rank)):  # one process per rank
        if config.quiet:
            import transformers.utils.logging

            transformers.utils.logging.disable_progress_bar()
        captioner = load_captioner(config, stage_device(config.device, rank))
        settings = settings_of(config, captioner, model_fingerprint(config.model))
        write_plan(output, shards, settings)

        counts, todo = rank_todo(shards, inputs, rank, lambda shard, samples: shard_complete(output, shard, settings, samples))
        if not config.quiet:
            log(f"laionkit caption: rank {rank.rank}/{rank.world_size}, {len(todo)} of {len(counts)} shards to do, "
                f"device {captioner.device}, {settings['dtype']}, config {json.dumps(asdict(config), default=str)}")
        summary = {"rank": rank.rank, "shards": len(todo), "captioned": 0, "skipped": 0, "empty_captions": 0,
                   "seconds": 0.0}
        if todo:
            with tqdm(total=sum(counts[shard] for shard in todo), desc=f"caption rank {rank.rank}", unit="img",
                      disable=config.quiet) as progress:
                summary.update(_caption_shards(config, captioner, todo, output, settings, rank.rank, progress,
                                               checked_reads(todo, inputs)))
        return summary


def _caption_shards(config, captioner, todo, output, settings, rank, progress, check) -> dict:
    workers = min(config.workers, len(todo))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loader = torch.utils.data.DataLoader(
        CaptionBatches(todo, config.batch_size, captioner.prepare), batch_size=None, num_workers=workers,
        prefetch_factor=QUEUE_DEPTH if workers else None, pin_memory=captioner.device.type == "cuda",
        # Batches carry their shard and each worker's own stay in order, so outputs do not depend on which
        # worker answers first (as encode's loader).
        in_order=False,
    )
    open_shards: dict[str, CaptionedShard] = {}
    totals = {"captioned": 0, "skipped": 0, "empty_captions": 0}
    # where the loop's time goes: waiting for the workers' next batch (after the first: start-up) and in generate;
    # the rest of ``seconds`` is the main thread's own work (decoding ids, writing the tars)
    clock = {"data": 0.0, "generate": 0.0}
    started = time.perf_counter()
    try:
        for item in timed(loader, clock, "data", first=False):
            if isinstance(item, ShardDone):
                check(item)  # its samples against its input's done record, before its tar is finished
                _finish(item, open_shards, output, settings, rank, config, totals)
                progress.update(len(item.skips))
                continue
            if item["shard"] not in open_shards:
                open_shards[item["shard"]] = CaptionedShard(output / item["shard"])
            shard = open_shards[item["shard"]]
            generating = time.perf_counter()
            captions = captioner.generate(item["inputs"])
            clock["generate"] += time.perf_counter() - generating
            if len(captions) != len(item["keys"]):
                raise RuntimeError(f"{item['shard']}: {len(captions)} captions for {len(item['keys'])} images")
            for key, members, caption in zip(item["keys"], item["members"], captions):
                shard.write(key, members, config.name, caption, config.model)
            progress.update(len(item["keys"]))
    except BaseException as error:
        for shard in open_shards.values():
            shard.abort(error)
        raise
    return {**totals, "seconds": time.perf_counter() - started,
            "wait_seconds": {name: round(value, 3) for name, value in clock.items()}}


def _finish(done: ShardDone, open_shards: dict, output: Location, settings: dict, rank: int,
            config: CaptionConfig, totals: dict) -> None:
    """The shard's tar renamed into place (uploaded), then its done record: a tar without one is redone."""
    shard = open_shards.pop(done.shard, None) or CaptionedShard(output / done.shard)  # every sample skipped
    skips = sorted(done.skips, key=lambda skip: skip["key"])
    if shard.samples + len(skips) != done.samples_in:
        raise LaionkitError(f"{done.shard}: {shard.samples} captioned + {len(skips)} skipped != {done.samples_in} read")
    seconds = time.perf_counter() - shard.started
    shard.finish()
    record = shard_record(done, shard, skips, seconds, rank, settings, config.model, config.batch_size)
    storage.write_json(record_path(output, done.shard), record)
    totals["captioned"] += shard.samples
    totals["skipped"] += len(skips)
    totals["empty_captions"] += shard.empty

