"""laionkit encode: pack's image shards -> VAE posterior moments + text hidden states (docs/FORMATS.md section 3).

Data flows one way through four stages, each bounded so memory stays flat:

    DataLoader workers      read tars, decode + resize on CPU (or pass JPEG bytes on), tokenize, batch by size
    -> prepare thread       host->GPU copy, nvjpeg decode + resize on its own CUDA stream
    -> main thread          VAE encode + text encode (bf16/fp16; channels_last only when compiled)
    -> writer thread        GPU->host copy lands, one tar per input shard, renamed when complete

The shard is the unit of work, of resume and of record: each worker owns whole shards, so every batch
belongs to one shard and each output tar is written sequentially. Batch composition depends only on
the shard and the options, never on ranks or workers, so outputs are identical for any split.

This module is the loop (``run``); the stages live beside it: ``config`` (EncodeConfig), ``reader``
(input shards and the DataLoader side), ``device`` (the encoders and everything on the device),
``tars`` (one output tar and its .npy members), ``writer`` (the writer thread) and ``records`` (per-shard
records, plan, manifest).
Every name laionkit.encode had before the split is still importable from here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.utils.data
from tqdm import tqdm

from laionkit.common import LaionkitError, resolve_rank, split, stage_device, storage
from laionkit.common.background import background
from laionkit.common.keys import read_keep_list, refuse_none_kept
from laionkit.common.storage import Location
from laionkit.common.upstream import refuse_incomplete, refuse_incomplete_folders
from laionkit.encode.caption_scores import check_scores, scores_folder, scores_identity
from laionkit.encode.config import (
    COMPUTE_DTYPES,
    DECODE_MODES,
    QUEUE_DEPTH,
    TEXT_LAYERS,
    TEXT_MODES,
    EncodeConfig,
)
from laionkit.encode.device import (
    GPU_DECODE_BELOW_WORKERS,
    Encoders,
    _decode_on_gpu,
    _encode_batch,
    _gpu_batch,
    _prepared,
    _warm_up,
)
from laionkit.encode.reader import (
    IMAGE_EXTENSIONS,
    PACK_RECORD_SUFFIX,
    SHARD_SUFFIXES,
    ShardBatches,
    ShardDone,
    bucket_sizes,
    caption_of,
    center_crop_box,
    check_caption_key,
    check_count,
    checked_reads,
    crop_top_left,
    drafted_box,
    find_shards,
    original_size,
    output_name,
    rank_todo,
    resize_rgb,
    shard_stem,
    target_size,
)
from laionkit.encode.records import (
    EMPTY_CAPTION,
    FORMAT,
    MANIFEST,
    PLAN,
    RECORD_SUFFIX,
    RERUN_REMEDY,
    _models,
    _settings,
    describe_cost,
    latent_family,
    latent_status,
    merge_records,
    record_path,
    recorded_text_mode,
    refuse_mixed_settings,
    shard_complete,
    summarize,
    update_manifest,
    write_plan,
)
from laionkit.encode.tars import ShardOutput, npy_bytes, npy_rows
from laionkit.encode.writer import _Writer, write_empty_captions

__all__ = [  # the names laionkit.encode had before its split into these modules (_gpu_batch: tests)
    "COMPUTE_DTYPES", "DECODE_MODES", "EMPTY_CAPTION", "FORMAT", "GPU_DECODE_BELOW_WORKERS", "IMAGE_EXTENSIONS",
    "MANIFEST", "PACK_RECORD_SUFFIX", "PLAN", "QUEUE_DEPTH", "RECORD_SUFFIX", "RERUN_REMEDY", "SHARD_SUFFIXES",
    "TEXT_LAYERS", "TEXT_MODES",
    "EncodeConfig", "Encoders", "ShardBatches", "ShardDone", "ShardOutput",
    "_gpu_batch", "bucket_sizes", "caption_of", "center_crop_box", "check_count", "crop_top_left", "drafted_box",
    "find_shards", "latent_family", "latent_status", "merge_records", "npy_bytes", "npy_rows", "original_size",
    "output_name", "record_path", "resize_rgb", "run", "shard_complete", "shard_stem", "summarize",
    "target_size", "update_manifest", "write_plan",
]


def run(config: EncodeConfig, log: Callable[[str], None] = print, encoders: Encoders | None = None) -> dict:
    """Encode this rank's shards that are not complete yet; rewrite the manifest; return this rank's counts.

    ``encoders`` lets a caller that already loaded (and compiled) the models for this config reuse them.
    """

    rank = resolve_rank(config.rank, config.world_size)
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(str(config.output), options)
    inputs = find_shards(config.shards, log if rank.rank == 0 else (lambda _: None), options)
    shards = list(inputs)
    if config.caption_key and shards:  # before any model loads
        check_caption_key(shards[0], config.caption_key)
    storage.refuse_overlap([*(Location.parse(spec, options) for spec in config.shards), *shards], output, "encode")
    refuse_incomplete_folders(config.shards, "input", config.allow_incomplete, log, options)
    for role, spec in (("--keep", config.keep), ("--caption-scores", config.caption_scores)):
        if spec:
            refuse_incomplete(spec, role, config.allow_incomplete, log, options)
    scores = scores_folder(config.caption_scores, options) if config.caption_scores else None
    if scores is not None:  # before any model loads: a missing file or column is a one-line error now
        check_scores(scores, [shard_stem(shard) for shard in split(shards, rank)], config.captions)
    scored_with = scores_identity(scores, config.captions, config.caption_key) if scores is not None else None
    storage.claim_output(output, "encode", config.overwrite)  # no other stage's folder
    if config.quiet:
        import diffusers.utils.logging
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
    if output.local:
        Path(output.path).mkdir(parents=True, exist_ok=True)
    if config.text is None:  # no --text: the folder's mode on a rerun, else the family's default
        config = replace(config, text=recorded_text_mode(output))
    encoders = encoders or Encoders(config, stage_device(config.device, rank))
    gpu_decode = _decode_on_gpu(config, encoders.device)
    buckets = bucket_sizes(config.resolution) if config.buckets else None
    encoders.check_sizes(config.resolution, buckets)
    models = _models(config, encoders.family)
    keep = read_keep_list(config.keep, options) if config.keep else None
    settings = _settings(config, models, encoders, buckets, keep, scored_with)
    refuse_mixed_settings(output, settings)
    write_plan(output, shards)
    write_empty_captions(output, encoders)

    counts, todo = rank_todo(shards, inputs, rank, lambda shard, samples: shard_complete(output, shard, settings, samples))
    if not config.quiet:
        log(f"laionkit encode: rank {rank.rank}/{rank.world_size}, {len(todo)} of {len(counts)} shards to do, "
            f"device {encoders.device}, decode {'gpu' if gpu_decode else 'cpu'}, dtype {settings['compute_dtype']}, "
            f"config {json.dumps(asdict(config), default=str)}")
    summary = {"rank": rank.rank, "shards": len(todo), "samples_out": 0, "skipped": 0, "empty_captions": 0,
               "upscaled": 0, "seconds": 0.0,
               "decoded": {}, "decode": "gpu" if gpu_decode else "cpu", "workers": min(config.workers, len(todo))}
    if todo:
        progress = tqdm(total=sum(counts[shard] for shard in todo), desc=f"encode rank {rank.rank}", unit="img",
                        disable=config.quiet)
        with progress:
            summary.update(_encode_shards(config, encoders, todo, buckets, gpu_decode, settings, models, rank,
                                          progress, checked_reads(todo, inputs), keep, scores))
    manifest = update_manifest(output)
    if manifest["complete"] and not manifest["counts"]["samples_out"]:
        if manifest["counts"]["samples_in"] and manifest["counts"].get("not_kept") == manifest["counts"]["samples_in"]:
            refuse_none_kept(config.keep, manifest["counts"]["samples_in"])
        raise LaionkitError(f"encode wrote no sample: {manifest['counts']['samples_in']} read from "
                            f"{len(shards)} shard(s), all skipped ({_reasons(manifest['skips'])}); "
                            "are these image shards?")
    if manifest.get("caption_counts") and not config.quiet and rank.rank == 0:  # --captions: what each name stored
        log("laionkit encode: captions " + "; ".join(
            f"{name} {counts['stored']:,} stored" + (f", {counts['missing']:,} missing" if counts["missing"] else "")
            + (f", {counts['scored']:,} scored" if counts["scored"] else "")
            for name, counts in manifest["caption_counts"].items()))
    if summary["upscaled"] and not config.quiet:
        log(f"laionkit encode: warning: {summary['upscaled']:,} samples upscaled: their crop is smaller than the "
            f"{'bucket' if buckets else f'{config.resolution} px square'} encoded, so they train softer "
            f"(counted as upscaled in the records; pack --min-image-size {config.resolution} leaves them out)")
    cost = manifest.get("bytes")
    if cost and cost["per_sample"] is not None and not config.quiet and rank.rank == 0:
        log(f"laionkit encode: {manifest['counts']['samples_out']:,} samples in {manifest['shards']['done']} shards, "
            f"{describe_cost(cost)}")
    return summary


def _reasons(skips: dict) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in skips.items()) or "no samples in the tars"


def _encode_shards(config, encoders, todo, buckets, gpu_decode, settings, models, rank, progress, check, keep=None,
                   scores=None) -> dict:
    batches = ShardBatches(todo, encoders.tokenizer, config.resolution, buckets, config.batch_size, gpu_decode,
                           config.caption_key, keep, config.captions, scores)
    workers = min(config.workers, len(todo))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loader = torch.utils.data.DataLoader(
        batches, batch_size=None, num_workers=workers, pin_memory=encoders.device.type == "cuda",
        prefetch_factor=QUEUE_DEPTH if workers else None,
        # Batches carry their shard, and each worker's own batches stay in order, so outputs do not
        # depend on which worker answers first; a slow worker then never stalls the others.
        in_order=False,
    )
    prepared = _prepared(loader, encoders, config.compile)  # host->device copies and GPU decode
    output = Location.parse(str(config.output), storage.parse_storage_options(config.storage_options))
    writer = _Writer(output, settings, models, rank, progress)
    started = None
    try:
        with torch.inference_mode():
            if config.compile and not buckets:
                _warm_up(encoders, config)
            for item in background(prepared, QUEUE_DEPTH, "laionkit-prepare", encoders.device):
                started = started or time.perf_counter()
                if isinstance(item, ShardDone):
                    writer.put(check(item))  # its samples against its input's done record, before it is finished
                    continue
                batch, ready = item
                writer.put(_encode_batch(encoders, batch, config, ready))
        writer.close()
    except BaseException as error:
        writer.abort(error)
        raise
    return {"samples_out": writer.samples_out, "skipped": writer.skipped, "empty_captions": writer.empty_captions,
            "upscaled": writer.upscaled, "decoded": dict(writer.decoded),
            "seconds": time.perf_counter() - started if started else 0.0}
