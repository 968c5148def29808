"""laionkit score: image shards -> per-sample scores, hashes and CLIP embeddings (docs/FORMATS.md section 6).

Data flows one way, as in encode:

    DataLoader workers   read whole shards (encode's reader), decode each image once: sha256, pHash, size,
                         CLIP pixels and watermark pixels (uint8); tokenize the captions
    -> main thread       CLIP image + caption embeddings (CLIP's weights in the compute dtype: bf16 on CUDA),
                         watermark detector (bf16/fp16 autocast on CUDA), then heads over the stored float16
                         embeddings (aesthetic, prompt, NSFW)
    -> per shard         img_emb/img_emb_<stem>.npy, scores/<stem>.parquet, records/<stem>.json last

Scores of the embedding heads are computed from the float16 embeddings as stored, by laionkit.common.clip_scores, so
``laionkit filter DIR/scores --embeddings DIR/img_emb --score ...`` gives the same numbers. The shard is the
unit of work, resume and record; batches never span shards, so outputs are the same for any ranks/workers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import numpy as np
import torch
import torch.utils.data
from tqdm import tqdm

from laionkit.common import LaionkitError, Rank, resolve_rank, stage_device, storage, versions
from laionkit.common.background import background, timed
from laionkit.common.caption_mix import similarity_column
from laionkit.common.clip_scores import ClipChoice, ScoreSpec, build_scorer, score_embeddings
from laionkit.common.cudagraphs import Graphed
from laionkit.common.storage import Location
from laionkit.common.upstream import refuse_incomplete_folders
from laionkit.encode.reader import (
    ShardDone,
    check_caption_key,
    checked_reads,
    find_shards,
    rank_todo,
    shard_stem,
)
from laionkit.score.config import DEVICE_PIXEL_MODES, ScoreConfig
from laionkit.score.models import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    WATERMARK_SIZE,
    load_nsfw,
    load_score_clip,
    load_watermark,
    watermark_probability,
)
from laionkit.score.pixels import PAD_PIXELS, DevicePixels
from laionkit.score.reader import ScoreSamples, split_clip_transform
from laionkit.score.records import file_sha256, shard_done, update_stats, write_shard
from laionkit.score.text import TextEncoder

__all__ = ["ScoreConfig", "Scorers", "run"]

QUEUE_DEPTH = 4
# batches each DataLoader worker prepares ahead; all of them sit in pinned host memory once the pin thread has them.
# 2 fed the device as fast as 4 did, in a third less pinned memory (BENCHMARKS: score, fifteenth session)
PREFETCH = 2
RESERVED = {"key", "shard", "source", "caption", "width", "height", "sha256", "phash", "similarity",
            "pwatermark", "punsafe"}


def compiled_full_batches(forward: Callable[[torch.Tensor], torch.Tensor], batch_size: int
                          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``forward`` under torch.compile for batches of ``batch_size`` (one graph, dynamic=False), eager for the
    others: a shard's ramping first batches (reader.batch_sizes) and its last one. A graph per ramp size would
    cost a compile each at start-up for the few hundred images a shard ramps through; no size recompiles."""
    compiled = torch.compile(forward, dynamic=False)

    def run(pixels: torch.Tensor) -> torch.Tensor:
        return compiled(pixels) if pixels.shape[0] == batch_size else forward(pixels)

    return run


class Scorers:
    """Every model of one run, loaded once: CLIP (+ its tokenizer and preprocess), the optional watermark
    detector and NSFW head, and the embedding heads of --score (laionkit.common.clip_scores)."""

    def __init__(self, config: ScoreConfig, device: torch.device, log: Callable[[str], None] = print) -> None:
        self.device = device
        self._norms: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (mean, std) -> their device tensors
        wanted = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "fp32": torch.float32,
                  "fp16": torch.float16, "bf16": torch.bfloat16}[config.dtype]
        self.dtype = wanted
        self.clip, preprocess, self.tokenizer, name = load_score_clip(config.clip_model, config.clip_pretrained, device)
        self.clip.requires_grad_(False)
        self.pil_transform, self.normalize = split_clip_transform(preprocess)
        self.preprocess = preprocess
        # CLIP runs in the compute dtype's own weights (open_clip's pure_bf16 / pure_fp16; LAION's embeddings came
        # from OpenAI's CLIP in fp16 weights), not under autocast over fp32 ones: autocast keeps the residual
        # stream and every LayerNorm's output in fp32, which costs ViT-L/14 more than its bf16 matmuls save
        # (BENCHMARKS: score)
        self.clip = self.clip.to(self.dtype)
        if device.type == "cuda":
            self.clip = self.clip.to(memory_format=torch.channels_last)
        self.text = TextEncoder(self.clip, config.cuda_graphs, log)  # captions over their own tokens
        image_forward = (compiled_full_batches(self.clip.encode_image, config.batch_size) if config.compile
                         else self.clip.encode_image)
        self.image_forward = (Graphed(image_forward, "score's CLIP image forward", log=log)
                              if config.cuda_graphs else image_forward)
        specs = [ScoreSpec.parse(text) for text in config.scores]
        for spec in specs:
            if spec.name in RESERVED:
                raise LaionkitError(f"--score {spec.name}=...: {spec.name} is a column score always writes; "
                                    "choose another name")
        self.captions = config.captions or ()  # --captions: a similarity_NAME column each
        self.caption_columns = [similarity_column(name) for name in self.captions]
        for spec in specs:
            if spec.name in self.caption_columns:
                raise LaionkitError(f"--score {spec.name}=...: {spec.name} is --captions' similarity column; "
                                    "choose another name")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise LaionkitError(f"--score names must differ: {', '.join(names)}")
        self.scorers = [build_scorer(spec, ClipChoice(name, config.clip_pretrained)) for spec in specs]
        self.watermark = load_watermark(config.watermark).to(device) if config.watermark else None
        if self.watermark is not None and device.type == "cuda":
            self.watermark = self.watermark.to(memory_format=torch.channels_last)
        self.nsfw = load_nsfw(config.nsfw) if config.nsfw else None
        self.dim = int(self.clip.visual.output_dim) if hasattr(self.clip.visual, "output_dim") else None
        for scorer in self.scorers:
            if self.dim is not None and scorer.dim != self.dim:
                raise LaionkitError(f"--score {scorer.spec.name}: expects {scorer.dim}-d embeddings, but --clip-model "
                                    f"{config.clip_model} gives {self.dim}-d ones")
        if self.nsfw is not None and self.dim is not None and self.nsfw.dim != self.dim:
            raise LaionkitError(f"--nsfw {config.nsfw}: a head over {self.nsfw.dim}-d embeddings (LAION's is ViT-L/14's "
                                f"768), but --clip-model {config.clip_model} gives {self.dim}-d ones")
        for flag, given, column in (("--watermark", config.watermark, "pwatermark"), ("--nsfw", config.nsfw, "punsafe")):
            if not given and not config.quiet:
                log(f"laionkit score: no {flag} weights given: the {column} column is not computed")

    @property
    def score_columns(self) -> list[str]:
        return (self.caption_columns + (["pwatermark"] if self.watermark is not None else [])
                + (["punsafe"] if self.nsfw is not None else [])
                + [scorer.spec.name for scorer in self.scorers])

    def _autocast(self):  # the watermark detector's (timm; CLIP runs in the dtype's own weights)
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _pixels(self, batch: torch.Tensor, mean, std, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 (B, H, W, 3) -> normalised (B, 3, H, W) of ``dtype`` on the device."""
        pixels = batch.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        if (mean, std) not in self._norms:  # made once: a tensor from a list per batch is a blocking copy, which
            # waits for the device to finish the previous batch before this one is queued
            self._norms[mean, std] = tuple(torch.tensor(values, device=self.device).view(1, 3, 1, 1)
                                           for values in (mean, std))
        mean, std = self._norms[mean, std]
        pixels = ((pixels - mean) / std).to(dtype)
        return pixels.contiguous(memory_format=torch.channels_last) if self.device.type == "cuda" else pixels

    @torch.inference_mode()
    def image_embeddings(self, batch: dict) -> torch.Tensor:
        """L2-normalised float32 CLIP image embeddings of a batch (on the device)."""
        if self.normalize is not None:
            pixels = self._pixels(batch["clip"], *self.normalize, dtype=self.dtype)
        else:
            pixels = batch["clip"].to(self.device, non_blocking=True).to(self.dtype)
        features = self.image_forward(pixels)
        return torch.nn.functional.normalize(features.float(), dim=-1)

    @torch.inference_mode()
    def launch(self, batch: dict) -> dict[str, torch.Tensor]:
        """Queue one batch's device work and the copies of its results to the host; ``collect`` waits for
        this batch's copies only, so the loop can queue the next batch before it waits for this one's."""
        image = self.image_embeddings(batch)
        tokens = batch["tokens"] if "tokens" in batch else self.tokenizer(batch["caption"])  # the workers' or here
        text = self.text(tokens, self.device)
        launched = {"image": image.half(), "similarity": (image * text).sum(-1)}
        for name, texts in batch.get("captions", {}).items():
            if texts == batch["caption"]:  # alt (caption_of, as the default caption): the same embeddings
                launched[similarity_column(name)] = launched["similarity"]
                continue
            named_tokens = batch["caption_tokens"][name] if "caption_tokens" in batch else self.tokenizer(texts)
            launched[similarity_column(name)] = (image * self.text(named_tokens, self.device)).sum(-1)
        with torch.inference_mode():
            if self.watermark is not None:
                with self._autocast():
                    logits = self.watermark(self._pixels(batch["watermark"], IMAGENET_MEAN, IMAGENET_STD))
                launched["pwatermark"] = watermark_probability(logits)
            if isinstance(batch.get("phash"), torch.Tensor):  # --decode device: computed on the device
                launched["phash"] = batch["phash"]
        if self.device.type != "cuda":
            return launched
        # pinned host copies behind this batch's work, and an event after them: collect waits for this batch
        # alone (a blocking .cpu() would wait for the batch queued after it too)
        host = {name: torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)
                for name, value in launched.items()}
        host["ready"] = torch.cuda.Event()
        host["ready"].record()
        return host

    @staticmethod
    def collect(batch: dict, launched: dict[str, torch.Tensor]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(float16 embeddings, {column: float32 values}) of a launched batch, on the host."""
        launched = dict(launched)
        if "ready" in launched:
            launched.pop("ready").synchronize()
        if "phash" in launched:  # --decode device: computed on the device
            batch["phash"] = launched.pop("phash").cpu().tolist()
        columns = {name: value.cpu().numpy().astype(np.float32) for name, value in launched.items() if name != "image"}
        columns["similarity"][[not caption.strip() for caption in batch["caption"]]] = np.nan  # no caption: null
        for name, texts in batch.get("captions", {}).items():  # a caption the sample lacks (or blank): null
            columns[similarity_column(name)][[not text.strip() for text in texts]] = np.nan
        return launched["image"].cpu().numpy(), columns

    def score(self, batch: dict) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(float16 embeddings, {column: float32 values}) of one batch."""
        return self.collect(batch, self.launch(batch))

    @torch.inference_mode()
    def head_scores(self, stored: np.ndarray, shard: str) -> dict[str, np.ndarray]:
        """The heads over a whole shard's stored (float16, L2-normalised) embeddings, as LAION's release is
        scored: laionkit.common.clip_scores on the same array gives the same numbers, bit for bit (filter --score)."""
        columns = {}
        if self.nsfw is not None:
            columns["punsafe"] = self.nsfw(torch.from_numpy(stored).float()).numpy().astype(np.float32)
        for scorer in self.scorers:
            columns[scorer.spec.name] = score_embeddings(scorer, stored, f"{shard} embeddings")
        return columns

    def settings(self, config: ScoreConfig) -> dict:
        """What every shard of one output folder must share (weights by content where they are files)."""
        files = {name: file_sha256(path) for name, path in (("clip_pretrained", config.clip_pretrained),
                 ("watermark", config.watermark), ("nsfw", config.nsfw))}
        return {
            "clip_model": config.clip_model if not config.clip_model.endswith(".json")
            else json.loads(open(config.clip_model).read()),
            "clip_pretrained": files["clip_pretrained"] or config.clip_pretrained,
            "watermark": files["watermark"], "nsfw": files["nsfw"],
            "scores": [{**asdict(scorer.spec), "sha256": file_sha256(scorer.spec.arg)
                        if scorer.spec.kind != "prompt" else None} for scorer in self.scorers],
            "embedding_dim": self.dim, "compute_dtype": str(self.dtype).removeprefix("torch."),
            "caption_key": config.caption_key, "columns": self.score_columns,
            **({"captions": list(self.captions)} if self.captions else {}),
            **({"decode": config.decode} if config.decode != "exact" else {}),
        }


def run(config: ScoreConfig, log: Callable[[str], None] = print, scorers: Scorers | None = None) -> dict:
    """Score this rank's shards that are not done yet; rewrite stats.json; return this rank's counts."""
    started = time.perf_counter()
    rank = resolve_rank(config.rank, config.world_size)
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(str(config.output), options)
    inputs = find_shards(config.shards, log if rank.rank == 0 and not config.quiet else (lambda _: None), options,
                         "score")
    shards = list(inputs)
    storage.refuse_overlap([*(Location.parse(spec, options) for spec in config.shards), *shards], output, "score")
    refuse_incomplete_folders(config.shards, "input", config.allow_incomplete, log, options)
    if config.caption_key and shards:  # as encode: before any model loads
        check_caption_key(shards[0], config.caption_key)
    storage.claim_output(output, "score", config.overwrite)
    if output.local:
        os.makedirs(output.path, exist_ok=True)
    scorers = scorers or Scorers(config, stage_device(config.device, rank), log)
    settings = scorers.settings(config)
    stems = [shard_stem(shard) for shard in shards]
    counts, todo = rank_todo(shards, inputs, rank,
                           lambda shard, samples: shard_done(output, shard_stem(shard), settings, samples, config.overwrite))
    if not config.quiet:
        log(f"laionkit score: rank {rank.rank}/{rank.world_size}, {len(todo)} of {len(counts)} shards to do, "
            f"device {scorers.device}, dtype {settings['compute_dtype']}, decode {config.decode}, columns "
            f"{', '.join(scorers.score_columns) or '(similarity only)'}")
    summary = {"rank": rank.rank, "shards": len(todo), "samples_out": 0, "skipped": 0, "seconds": 0.0}
    if todo:
        progress = tqdm(total=sum(counts[shard] for shard in todo), desc=f"score rank {rank.rank}", unit="img",
                        disable=config.quiet)
        with progress:
            summary.update(_score_shards(config, scorers, todo, settings, rank, output, progress,
                                         checked_reads(todo, inputs, shard_stem), started))
    stats = update_stats(output, stems)
    if stats["complete"] and stats["counts"]["samples_in"] and not stats["counts"]["samples_out"]:
        raise LaionkitError(f"score wrote no sample: all {stats['counts']['samples_in']} skipped "
                            f"({', '.join(f'{k}: {v}' for k, v in stats['skips'].items())}); are these image shards?")
    summary["wall_seconds"] = round(time.perf_counter() - started, 3)
    return summary


def score_loader(config: ScoreConfig, scorers: Scorers, todo: list[Location],
                 pixels: DevicePixels | None = None) -> torch.utils.data.DataLoader:
    """The DataLoader of ``todo``'s batches as ``scorers`` take them (the CPU side of the stage; the
    benchmark times it alone); with --decode draft-device, as ``pixels`` (default: the run's) takes them."""
    stack_pixels = None
    if config.decode == "draft-device":  # the workers decode every file: they pad it into the device's stacks
        pixels = pixels or device_pixels(config, scorers)
        stack_pixels = PAD_PIXELS if pixels.resample is not None else None
    clip_transform = scorers.pil_transform or scorers.preprocess
    draft_side = None
    if config.decode != "exact":  # device: for the files the workers still decode (progressive JPEGs ...)
        side = scorers.clip.visual.image_size
        draft_side = max(side[0] if isinstance(side, (tuple, list)) else side,
                         WATERMARK_SIZE if scorers.watermark is not None else 0)
    samples = ScoreSamples(todo, clip_transform, scorers.normalize is not None, scorers.watermark is not None,
                           config.batch_size, config.caption_key, draft_side, scorers.captions,
                           device_decode=config.decode in DEVICE_PIXEL_MODES, device_jpegs=config.decode == "device",
                           tokenizer=scorers.tokenizer, stack_pixels=stack_pixels)
    workers = min(config.workers, len(todo))
    return torch.utils.data.DataLoader(
        samples, batch_size=None, num_workers=workers, pin_memory=scorers.device.type == "cuda",
        prefetch_factor=PREFETCH if workers else None, in_order=False)


def device_pixels(config: ScoreConfig, scorers: Scorers) -> DevicePixels:
    """--decode device / draft-device: what makes the models' inputs on the device."""
    if scorers.pil_transform is None:
        raise LaionkitError(f"--decode {config.decode}: --clip-model {config.clip_model}'s preprocess is not resize/crop "
                            "steps, ToTensor and Normalize; use --decode exact or draft")
    return DevicePixels(scorers.pil_transform, scorers.watermark is not None, scorers.device)


def _device_batches(loader, pixels: DevicePixels, device: torch.device, clock: dict[str, float]) -> Iterator:
    """--decode device: each batch's pixels and pHash made on the device, on a CUDA stream of their own (run
    in a thread, batches ahead of the models): (batch, skips, ready event or None); ShardDone passes through.
    ``clock`` gathers the thread's seconds waiting for the loader and making pixels (host time)."""
    stream = None
    if device.type == "cuda":
        stream = torch.cuda.Stream()  # the current device: background() made it this rank's
    with torch.inference_mode():  # per thread: the models' loop runs under it too
        for item in timed(loader, clock, "pixels_loader_wait"):
            if isinstance(item, ShardDone):
                yield item
                continue
            started = time.perf_counter()
            if stream is None:
                made = (*pixels(item), None)
            else:
                with torch.cuda.stream(stream):
                    batch, skips = pixels(item)
                    ready = torch.cuda.Event()
                    ready.record(stream)
                made = batch, skips, ready
            clock["pixels"] += time.perf_counter() - started
            yield made


def _score_shards(config: ScoreConfig, scorers: Scorers, todo: list[Location], settings: dict, rank: Rank,
                  output: Location, progress: tqdm, check: Callable[[ShardDone], ShardDone], started: float) -> dict:
    """Score ``todo``; return counts and where the main thread's time went (``wait_seconds``: ``data``, waiting
    for the next batch; ``device``, for a launched batch's results; with --decode device / draft-device also the
    pixel thread's ``pixels_loader_wait`` and ``pixels``, host seconds): which side bounds the stage. ``started``:
    when run() was called (``startup_seconds``: from then to the first batch)."""
    clock = {"data": 0.0, "device": 0.0}
    device_decode = config.decode in DEVICE_PIXEL_MODES
    pixels = device_pixels(config, scorers) if device_decode else None
    loader = score_loader(config, scorers, todo, pixels)
    if device_decode:
        clock.update(pixels_loader_wait=0.0, pixels=0.0)
        loader = background(_device_batches(loader, pixels, scorers.device, clock), QUEUE_DEPTH,
                            "laionkit-score-pixels", scorers.device)
    pending: dict[str, dict] = {}
    summary = {"samples_out": 0, "skipped": 0}
    first = None
    in_flight = None  # (batch, its launched device work): collected after the next batch is queued
    # A finished shard's heads, parquet, npy and record are written by one thread of their own, so the device is
    # fed meanwhile; a shard whose last batch is still in flight is finished once that batch is collected, after
    # the next batch is queued (finishing it at once would drain the device at every shard's end).
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="laionkit-score-writer")
    writes: list = []
    waiting: list[ShardDone] = []

    def finish(done: ShardDone) -> None:
        for write in writes:  # a failed write stops the run at the next shard, not at the end
            if write.done():
                write.result()
        shard = pending.pop(done.shard, None) or new_shard()
        done.skips.extend(shard["skips"])  # --decode device: samples the device could not decode
        writes.append(writer.submit(_finish_shard, output, done, shard, scorers, settings, rank))
        summary["samples_out"] += done.samples_in - len(done.skips)
        summary["skipped"] += len(done.skips)
        progress.update(len(done.skips))

    def new_shard() -> dict:
        return {"columns": {}, "embeddings": [], "skips": [], "started": time.perf_counter()}

    def collect() -> None:
        batch, launched = in_flight
        shard = pending.setdefault(batch["shard"], new_shard())
        started = time.perf_counter()
        embeddings, values = scorers.collect(batch, launched)
        clock["device"] += time.perf_counter() - started
        shard["embeddings"].append(embeddings)
        for name in ("key", "source", "caption", "width", "height", "sha256", "phash"):
            shard["columns"].setdefault(name, []).extend(batch[name])
        shard["columns"].setdefault("shard", []).extend([batch["shard"]] * len(batch["key"]))
        for name, column in values.items():
            shard["columns"].setdefault(name, []).extend(None if np.isnan(v) else float(v) for v in column)
        progress.update(len(batch["key"]))

    def collected() -> None:
        """Collect the batch in flight and finish the shards that waited for it."""
        collect()
        for done in [done for done in waiting if done.shard == in_flight[0]["shard"]]:
            waiting.remove(done)
            finish(done)

    try:
        # the wait for the first batch is start-up, not counted: run()'s wall time minus ``seconds`` shows it
        for item in timed(loader, clock, "data", first=False):
            first = first or time.perf_counter()
            if isinstance(item, ShardDone):
                check(item)  # its samples against its input's done record, before any of it is written
                if in_flight is not None and in_flight[0]["shard"] == item.shard:
                    waiting.append(item)  # its last batch is in flight: finished once that is collected
                else:
                    finish(item)
                continue
            if device_decode:
                item, skips, ready = item
                pending.setdefault(item["shard"], new_shard())["skips"].extend(skips)
                if ready is not None:  # made on the pixels' stream: this stream waits for them, and owns them too
                    torch.cuda.current_stream(scorers.device).wait_event(ready)
                    for name in ("clip", "watermark", "phash"):
                        if name in item:
                            item[name].record_stream(torch.cuda.current_stream(scorers.device))
                if not item["key"]:
                    continue
            launched = scorers.launch(item)  # queued on the device before the previous batch is waited for
            if in_flight is not None:
                collected()
            in_flight = (item, launched)
        if in_flight is not None:
            collected()  # the last batch, and the shard that waited for it
    finally:
        drained = time.perf_counter()
        writer.shutdown(wait=True)  # shards already collected are written, also when the loop failed
    for write in writes:
        write.result()  # a write's error, raised here
    summary["seconds"] = round(time.perf_counter() - first, 3) if first else 0.0
    # where run()'s time outside the loop goes: before the first batch (set-up, the plan, the workers' first batch)
    # and the shards still being written once the device's last batch is collected
    if first:
        summary["startup_seconds"] = round(first - started, 3)
    summary["drain_seconds"] = round(time.perf_counter() - drained, 3)
    summary["wait_seconds"] = {name: round(value, 3) for name, value in clock.items()}
    if config.cuda_graphs:  # how many forwards replayed from graphs, or why none did
        summary["cuda_graphs"] = {name: forward.stats() for name, forward in
                                  (("image", scorers.image_forward), ("text", scorers.text.forward))
                                  if isinstance(forward, Graphed)}
    return summary


def _finish_shard(output: Location, done: ShardDone, shard: dict, scorers: Scorers, settings: dict, rank: Rank) -> None:
    columns = shard["columns"]
    names = ["key", "shard", "source", "caption", "width", "height", "sha256", "phash", "similarity",
             *scorers.score_columns]
    columns = {name: columns.get(name, []) for name in names}
    dim = scorers.dim or (shard["embeddings"][0].shape[1] if shard["embeddings"] else 0)
    embeddings = np.concatenate(shard["embeddings"]) if shard["embeddings"] else np.zeros((0, dim), np.float16)
    for name, values in scorers.head_scores(embeddings, done.shard).items():
        columns[name] = [None if np.isnan(value) else float(value) for value in values]
    skipped: dict[str, int] = {}
    for skip in done.skips:
        skipped[skip["reason"]] = skipped.get(skip["reason"], 0) + 1
    record = {
        "shard": done.shard, "rank": rank.rank, "samples_in": done.samples_in, "samples_out": len(columns["key"]),
        "skipped": skipped, "skips": done.skips, "columns": names,
        "seconds": round(time.perf_counter() - shard["started"], 3), "settings": settings, "versions": versions(),
    }
    if scorers.captions:  # --captions: per name, the samples with a similarity and those without (caption lacking)
        record["captions"] = {name: {"scored": sum(value is not None for value in columns[similarity_column(name)]),
                                     "missing": sum(value is None for value in columns[similarity_column(name)])}
                              for name in scorers.captions}
    write_shard(output, done.shard, columns, embeddings, scorers.score_columns, record)
