"""Benchmark `laionkit score` against the bare open_clip image forward (not a test; results in docs/BENCHMARKS.md).

Measured in one run, one after the other on the same device:

(a) the ceiling: open_clip's ``encode_image`` alone on a batch already on the device, at its fastest of
    {contiguous, channels_last} x {bf16 autocast, bf16 weights}, and bf16 weights under torch.compile
    (``--bare-compile``, on by default on CUDA), per batch size: no decode, no I/O, no laionkit code; also (a')
    open_clip's ``encode_image`` and ``encode_text`` of the batch (the captions at the tokenizer's full context,
    as open_clip runs them) in the model's own weights, eager or compiled, the faster: what ``model(image,
    text)`` runs, the bare forwards of everything a row's similarity column needs (``vs_bare_with_text``;
    ``vs_bare`` against (a));
(b) `laionkit score` end to end (its run(), models loaded once beforehand) from JPEG tars in pack's layout
    generated here (photo-like JPEGs, short side ``--image-size``): read, decode once, sha256, pHash, CLIP
    image + caption embeddings, aesthetic v2 and NSFW heads (``core``: what NeMo Curator's floor counts:
    read + embed + aesthetic), the same with ``--decode draft`` (JPEGs decoded at a reduced DCT scale: less
    CPU per image), with ``--decode device`` (workers read and hash; baseline JPEGs are decoded by nvJPEG and
    resized on the GPU; the generated JPEGs are all baseline, as Pillow writes them), with ``--decode
    draft-device`` (workers decode at the draft scale, the GPU resizes and hashes), and again with LAION's
    watermark detector (``+watermark``: an EfficientNet-B3 forward at 256 px per image on top);
(c) the CPU side alone: the same workers reading and preparing the same shards through score's own
    DataLoader dataset (laionkit.score.reader.ScoreSamples: read, decode, sha256, pHash, CLIP pixels; per
    label, as (b) runs it; with --decode device: read, sha256 and the JPEG header only) with no model, which
    bounds (b) from above on a host with few cores per GPU.

On CUDA, each label's loop also runs once over one shard under torch's sync debug mode (``sync_check``): the
source lines where the host waited for the device, and how often (a line per batch stalls the pipeline). With
``--profile``, once more over ``--profile-shards`` shards (default 2) under torch.profiler (``profile_check``): the
device's busy share and the ops that cost the most device and host time. With one shard per worker (the default
``--shards``), 2 shards keep 2 workers busy: a profile of start-up and data waits; as many shards as workers profile
the loop as the timed run has it.

The json is rewritten after each row, so a run cut short by a time limit keeps the rows it finished.

Rates are samples / seconds from run() called (models already loaded) to its return, for (b) and (c) alike
(``loop_seconds`` is kept: from the first batch's arrival, which counts the samples decoded before it and
so reads high on short runs). The shards are split evenly over the workers (``--shards``, default one per
worker), since workers take whole shards: fewer shards than workers leave cores idle. Each shard holds
several batches (default 4 of the largest; a worker yields a batch only once all of it is prepared, so
one-batch shards would run the whole CPU side before any GPU work); ``--distinct`` JPEGs are generated and
the shards cycle through them under distinct keys, so a run long enough to amortise start-up costs no more
generation.

Prints images/s, (b) / (a) (issue 30's target: >= 0.9) and images/s per GPU against NeMo Curator's
published nightly floor (>= 900 images/s for read + embed + aesthetic on 8 GPUs: 112.5 per GPU).
Models are random init at real sizes (ViT-L/14 by default; the GPU machine has no network), heads in their
released layouts; numbers depend on the weights' shapes only.

    python scripts/bench_score.py --out results/                      # H200: ViT-L-14, 4 batches per worker
    python scripts/bench_score.py --out results/ --clip-model ViT-H-14 --batch-sizes 256 512
    python scripts/bench_score.py --out results/ --labels core "core --decode device"
    python scripts/bench_score.py --out results/ --labels "core --decode draft" "core --decode draft-device"
    python scripts/bench_score.py --out results/ --labels "core --decode device" --progressive 0.3   # a web-like mix
    python scripts/bench_score.py --out results/ --batch-sizes 512 --labels "core --decode draft-device" --profile
    python scripts/bench_score.py --smoke --out /tmp/bench-score      # CPU, tiny CLIP, plumbing only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import make_shards  # noqa: E402 - photo-like JPEG tars in pack's layout

import laionkit.score as score_module  # noqa: E402
from laionkit.score import ScoreConfig, Scorers, run, score_loader  # noqa: E402
from laionkit.score.models import write_random_nsfw, write_random_watermark, write_tiny_score_clip  # noqa: E402

NEMO_FLOOR_PER_GPU = 900 / 8  # NeMo Curator nightly: read + embed + aesthetic, 8 GPUs
# Batches per shard: a worker yields a batch once it has prepared all of it, so shards of one batch each
# would serialise the whole CPU side before the GPU side (img2dataset's shards hold 10,000 samples).
SHARD_BATCHES = 4
# (b)'s runs: core (read + embed + aesthetic + NSFW), the same decoded three ways, and with the watermark detector
LABELS = (("core", {}), ("core --decode draft", {"decode": "draft"}), ("core --decode device", {"decode": "device"}),
          ("core --decode draft-device", {"decode": "draft-device"}), ("+watermark", {}),
          ("+watermark --decode draft", {"decode": "draft"}), ("+watermark --decode device", {"decode": "device"}),
          ("+watermark --decode draft-device", {"decode": "draft-device"}),
          # CLIP's forwards replayed from CUDA graphs: the main thread's ~700 launches a batch become one
          ("core --decode draft --cuda-graphs", {"decode": "draft", "cuda_graphs": True}),
          ("core --decode draft-device --cuda-graphs", {"decode": "draft-device", "cuda_graphs": True}),
          # CLIP's image forward under torch.compile for full batches (score --compile)
          ("core --decode draft-device --compile", {"decode": "draft-device", "compile": True}))


def _cycle_shard(job: tuple) -> None:
    """One benchmark shard: ``size`` samples cycling through the distinct ones, each under its own key."""
    import tarfile as tarfile_module

    import webdataset as wds

    path, shard, size, distinct_folder = job
    pool = []
    for tar_path in sorted(Path(distinct_folder).glob("*.tar")):
        with tarfile_module.open(tar_path) as tar:
            members = {}
            for member in tar:
                stem, _, extension = member.name.partition(".")
                members.setdefault(stem, {})[extension] = tar.extractfile(member).read()
            pool += [members[stem] for stem in sorted(members)]
    with wds.TarWriter(str(path)) as sink:
        for index in range(size):
            key = f"{shard:05d}{index:05d}"
            sample = pool[(shard * size + index) % len(pool)]
            caption = sample["txt"].decode()
            sink.write({"__key__": key, "jpg": sample["jpg"], "txt": caption,
                        "json": json.dumps({"key": key, "caption": caption, "status": "success"})})


def _progressive_tar(job: tuple) -> None:
    """A copy of one distinct tar with every sample whose running index falls in ``share`` re-encoded as a
    progressive JPEG (the same pixels through Pillow, quality 90)."""
    import io
    import tarfile as tarfile_module

    from PIL import Image

    source, target, first, share = job
    with tarfile_module.open(source) as tar, tarfile_module.open(target, "w") as out:
        index = first
        for member in tar:
            data = tar.extractfile(member).read()
            if member.name.endswith(".jpg"):
                if int((index + 1) * share) > int(index * share):  # spread evenly: share of the samples
                    buffer = io.BytesIO()
                    Image.open(io.BytesIO(data)).save(buffer, format="JPEG", quality=90, progressive=True)
                    data = buffer.getvalue()
                index += 1
            member.size = len(data)
            out.addfile(member, io.BytesIO(data))


def bench_shards(out: Path, count: int, shard_size: int, distinct: int, image_size: int,
                 progressive: float = 0.0) -> Path:
    """``count`` tars of ``shard_size`` samples in pack's layout, done records included: ``distinct`` photo-like
    JPEGs generated once (the slow part), cycled under distinct keys (decode, hash and forward cost the same per
    image); ``progressive``: the share of the distinct JPEGs re-encoded as progressive ones (web images mix both)."""
    from multiprocessing import Pool

    tag = f"-p{progressive:g}" if progressive else ""
    folder = out / f"shards-{count}x{shard_size}-{distinct}-{image_size}{tag}"
    if (folder / "complete").exists():
        return _pack_records(folder, shard_size)
    shutil.rmtree(folder, ignore_errors=True)
    distinct_folder = out / f"distinct-{distinct}-{image_size}"
    processes = min(8, os.cpu_count() or 1)
    if not (distinct_folder / "complete").exists():
        shutil.rmtree(distinct_folder, ignore_errors=True)
        make_shards(distinct_folder, distinct, image_size, processes, min(distinct, 256))
        (distinct_folder / "complete").write_text("")
    if progressive:
        mixed = out / f"distinct-{distinct}-{image_size}{tag}"
        if not (mixed / "complete").exists():
            shutil.rmtree(mixed, ignore_errors=True)
            mixed.mkdir(parents=True)
            tars = sorted(distinct_folder.glob("*.tar"))
            with Pool(processes) as pool:
                pool.map(_progressive_tar, [(tar, mixed / tar.name, number * min(distinct, 256), progressive)
                                            for number, tar in enumerate(tars)])
            (mixed / "complete").write_text("")
        distinct_folder = mixed
    folder.mkdir(parents=True)
    with Pool(processes) as pool:
        pool.map(_cycle_shard, [(folder / f"{shard:05d}.tar", shard, shard_size, distinct_folder)
                                for shard in range(count)])
    (folder / "complete").write_text("")
    return _pack_records(folder, shard_size)


def _pack_records(folder: Path, shard_size: int) -> Path:
    """Each tar's done record, as pack (img2dataset) writes it beside the tar: a stage plans the shards from these,
    as it does a pack folder's, instead of counting every tar's headers first (a folder without them is plain
    webdataset)."""
    for tar in sorted(folder.glob("*.tar")):
        record = folder / f"{tar.stem}_stats.json"
        if not record.exists():
            record.write_text(json.dumps({"count": shard_size, "successes": shard_size, "failed_to_download": 0,
                                          "failed_to_resize": 0}))
    return folder


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_forward(model_name: str, pretrained: str | None, batch: int, device: torch.device, seconds: float,
                 compiled: bool = False) -> dict:
    """images/s of encode_image alone, the fastest layout x precision; also (a'), encode_image and encode_text per
    batch in the model's own weights (bf16 on CUDA: ``images_per_s_with_text``). ``compiled``: those two also
    under torch.compile (the library's code at its fastest may be compiled; score runs eager), the faster kept."""
    from laionkit.score.models import load_score_clip

    clip, preprocess, tokenizer, _ = load_score_clip(model_name, pretrained, device)
    size = clip.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    pixels = torch.randn(batch, 3, size, size, device=device)
    results, with_text = {}, None
    variants = [("contiguous", "autocast"), ("channels_last", "autocast"), ("channels_last", "bf16_weights")] \
        if device.type == "cuda" else [("contiguous", "fp32")]
    for layout, precision in variants:
        model = clip
        x = pixels.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else pixels
        if layout == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        if precision == "bf16_weights":
            model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast")
        with autocast:
            results[f"{layout}/{precision}"] = _rate(functools.partial(model.encode_image, x), batch, seconds, device)
        if precision in ("bf16_weights", "fp32"):  # the model in its own weights' dtype (score's way)
            # (a'): open_clip's own encode_image and encode_text (the captions at the tokenizer's full context, as
            # open_clip runs them): the bare forwards of what a score row computes for its similarity column
            tokens = tokenizer(["a photo"] * batch).to(device)

            def both(x, tokens, model=model):
                return model.encode_image(x), model.encode_text(tokens)

            with_text = _rate(functools.partial(both, x, tokens), batch, seconds, device)
            if compiled:
                results[f"{layout}/{precision}/compiled"] = _rate(
                    functools.partial(torch.compile(model.encode_image), x), batch, seconds, device)
                with_text = max(with_text, _rate(functools.partial(torch.compile(both), x, tokens), batch, seconds,
                                                 device))
            clip = clip.float()
    best = max(results, key=results.get)
    found = {"batch": batch, "variants": results, "best": best, "images_per_s": results[best]}
    if with_text is not None:
        found["images_per_s_with_text"] = with_text
    return found


def _rate(step, batch: int, seconds: float, device: torch.device) -> float:
    """images/s of ``step()`` (one batch of ``batch`` images) over ``seconds``, after 3 untimed warm-up steps."""
    with torch.inference_mode():
        for _ in range(3):
            step()
        _sync(device)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            step()
            done += batch
        _sync(device)
    return done / (time.perf_counter() - started)


def cpu_side(scorers: Scorers, config: ScoreConfig, label: str) -> dict:
    """(c): score's own DataLoader (read, decode, hash, CLIP and watermark pixels) with no model behind it."""
    from laionkit.encode.reader import find_shards

    shards = list(find_shards(config.shards, lambda _: None, None, "score"))
    started, count = time.perf_counter(), 0
    for item in score_loader(config, scorers, shards):
        count += len(item["key"]) if isinstance(item, dict) else 0
    seconds = time.perf_counter() - started
    return {"label": label, "samples": count, "seconds": seconds, "images_per_s": count / seconds}


def first_shards(config: ScoreConfig, count: int, suffix: str) -> ScoreConfig:
    """``config`` over its first ``count`` input shards, into a fresh output folder beside its own (``suffix``)."""
    import dataclasses

    from laionkit.encode.reader import find_shards

    first = sorted(str(shard) for shard in find_shards(config.shards, lambda _: None, None, "score"))[:count]
    checked = dataclasses.replace(config, shards=tuple(first), output=config.output + suffix)
    shutil.rmtree(checked.output, ignore_errors=True)
    return checked


def sync_check(scorers: Scorers, config: ScoreConfig, label: str) -> dict:
    """The host-device synchronisations of `laionkit score`'s loop, by source line: run() over one shard under
    torch's CUDA sync debug mode (a blocking copy or stream synchronisation warns). A line that syncs once per
    batch stalls the pipeline (the device idles while the host queues the next batch); the loop's intended wait
    is an event's, which the mode does not count."""
    import warnings

    checked = first_shards(config, 1, "-sync")
    lines: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            summary = run(checked, log=lambda _: None, scorers=scorers)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            where = f"{Path(warning.filename).name}:{warning.lineno}"
            lines[where] = lines.get(where, 0) + 1
    return {"label": label, "samples": summary["samples_out"], "batches_about": -(-summary["samples_out"] // config.batch_size),
            "syncs_by_line": dict(sorted(lines.items(), key=lambda item: -item[1]))}


HOST_MARKERS = ("Command Buffer Full",)


def brief(profiled: dict) -> dict:
    """A profile_check record to print: its top 5 ops each way, names cut (the json keeps them whole)."""
    cut = lambda rows: [[name[:80], ms, count] for name, ms, count in rows[:5]]  # noqa: E731
    return {**profiled, "top_device_ms": cut(profiled["top_device_ms"]), "top_host_ms": cut(profiled["top_host_ms"])}


def profile_check(scorers: Scorers, config: ScoreConfig, label: str, shards: int = 2) -> dict:
    """run() over the first ``shards`` shards under torch.profiler: how busy the device was (its kernels' time over
    the wall time, streams summed) and the ops that took the most device time and the most host time. A device
    busy well under 1 while the main thread waits for neither data nor the device (``wait_seconds``) means the
    host's launches are the bound; near 1, the device's work beyond the bare forward is."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    checked = first_shards(config, shards, "-profile")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if scorers.device.type == "cuda" else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        summary = run(checked, log=lambda _: None, scorers=scorers)
    wall = time.perf_counter() - started
    events = prof.key_averages()
    # the device's own records (kernels, copies, memsets): an aten op's device time is its kernels' again, and
    # CUPTI's "Command Buffer Full" marks host launches that waited for room in the launch queue
    device = [event for event in events if event.device_type != DeviceType.CPU and event.key not in HOST_MARKERS]
    device_us = sum(event.self_device_time_total for event in device)

    # the device's busy wall time: the union of its records' intervals (streams that overlap count once, where the
    # sum above counts each), and the longest idle gaps between them, from the device's first record to its last
    intervals = sorted((event.time_range.start, event.time_range.end) for event in prof.events()
                       if event.device_type != DeviceType.CPU and event.name not in HOST_MARKERS)
    busy_us, gaps, end = 0.0, [], None
    for start, stop in intervals:
        if end is not None and start > end:
            gaps.append(start - end)
        if end is None or start > end:
            busy_us += stop - start
            end = stop
        elif stop > end:
            busy_us += stop - end
            end = stop
    span_us = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    gaps.sort(reverse=True)

    def top(ranked_events: list, key: str) -> list:
        ranked = sorted(ranked_events, key=lambda event: -getattr(event, key))[:15]
        return [[event.key, round(getattr(event, key) / 1e3, 1), event.count] for event in ranked]

    return {"label": label, "samples": summary["samples_out"], "wall_seconds": round(wall, 3),
            "device_seconds": round(device_us / 1e6, 3), "device_busy": round(device_us / 1e6 / wall, 3),
            # from the first batch on (start-up, the workers' first batches, left out), as loop_seconds
            "device_busy_loop": round(device_us / 1e6 / summary["seconds"], 3) if summary["seconds"] else None,
            "device_ms_per_image": round(device_us / 1e3 / max(summary["samples_out"], 1), 4),
            # the union: the share of the span from the device's first record to its last with any record running
            "device_union_seconds": round(busy_us / 1e6, 3), "device_span_seconds": round(span_us / 1e6, 3),
            "device_union_busy": round(busy_us / span_us, 3) if span_us else None,
            "idle_gaps_ms": {"over_1ms_total": round(sum(gap for gap in gaps if gap > 1e3) / 1e3, 1),
                             "count_over_1ms": sum(gap > 1e3 for gap in gaps),
                             "longest": [round(gap / 1e3, 2) for gap in gaps[:10]]},
            "wait_seconds": summary.get("wait_seconds"), "top_device_ms": top(device, "self_device_time_total"),
            "top_host_ms": top(list(events), "self_cpu_time_total")}


def end_to_end(scorers: Scorers, config: ScoreConfig, label: str) -> dict:
    shutil.rmtree(config.output, ignore_errors=True)  # a fresh folder: nothing resumed
    size = scorers.clip.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    with torch.inference_mode():  # kernels warmed outside the timing, as the bare forward's are
        scorers.clip.encode_image(torch.zeros(2, 3, size, size, device=scorers.device, dtype=scorers.dtype))
    started = time.perf_counter()
    summary = run(config, log=lambda _: None, scorers=scorers)
    wall = time.perf_counter() - started
    stats = getattr(torch.cuda, "host_memory_stats", None) if scorers.device.type == "cuda" else None
    # the caching host allocator's pinned pool so far in this process (bytes in GiB, and its counts): what the
    # batches in flight (workers x --prefetch) hold
    pinned = {key: round(value / 2**30, 2) if "bytes" in key else value
              for key, value in (stats() if stats else {}).items() if isinstance(value, (int, float))}
    return {"label": label, "samples": summary["samples_out"], "loop_seconds": summary["seconds"],
            "pinned_host": pinned, "prefetch": score_module.PREFETCH,
            "wall_seconds": wall, "images_per_s": summary["samples_out"] / wall,
            "images_per_s_from_first_batch": summary["samples_out"] / summary["seconds"], "workers": config.workers,
            "batch": config.batch_size,
            # the main thread's waits for data and for the device (the rest of loop_seconds: its own work), and the
            # pixel thread's (device modes): which side bounds the run
            "wait_seconds": summary.get("wait_seconds"), "cuda_graphs": summary.get("cuda_graphs"),
            # run()'s time outside the loop: before the first batch, and writing the last shards after it
            "startup_seconds": summary.get("startup_seconds"), "drain_seconds": summary.get("drain_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny CLIP, a few images: plumbing only")
    parser.add_argument("--clip-model", default="ViT-L-14")
    parser.add_argument("--images", type=int, default=0,
                        help=f"images in all (default: {SHARD_BATCHES} of the largest batch per shard)")
    parser.add_argument("--distinct", type=int, default=2048,
                        help="distinct JPEGs generated; the shards cycle through them under distinct keys")
    parser.add_argument("--image-size", type=int, default=512, help="short side of the generated JPEGs")
    parser.add_argument("--progressive", type=float, default=0.0,
                        help="share of the JPEGs made progressive (--decode device leaves those to the workers)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--shards", type=int, default=0, help="input shards (default: one per worker)")
    parser.add_argument("--bare-seconds", type=float, default=10.0)
    parser.add_argument("--no-cpu-side", action="store_true", help="skip the CPU side's run of each label (c)")
    parser.add_argument("--bare-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the bare forwards (a) and (a') under torch.compile, the faster kept as the "
                             "ceiling (default: on CUDA)")
    parser.add_argument("--prefetch", type=int, default=score_module.PREFETCH,
                        help="batches each worker prepares ahead (laionkit.score.PREFETCH; all sit in pinned host "
                             "memory)")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="time the first label without an untimed run of it first (its row then pays the "
                             "process's warm-up)")
    parser.add_argument("--profile-shards", type=int, default=2,
                        help="--profile's shards: as many as --workers keeps every worker busy, as the timed run "
                             "does (2 leave 2 workers feeding the device: a profile of start-up and data waits)")
    parser.add_argument("--profile", action="store_true",
                        help="also run each label over --profile-shards shards under torch.profiler (profile_check)")
    names = [label for label, _ in LABELS]
    parser.add_argument("--labels", nargs="+", choices=names, default=names, metavar="LABEL",
                        help=f"(b) rows to run, of: {'; '.join(names)}")
    args = parser.parse_args()
    score_module.PREFETCH = args.prefetch
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.bare_compile = device.type == "cuda" if args.bare_compile is None else args.bare_compile
    model, pretrained = args.clip_model, None
    if args.smoke:
        args.images, args.image_size, args.batch_sizes, args.workers, args.bare_seconds = 32, 96, [8], 2, 1.0
        config_file, weights = write_tiny_score_clip(args.out / "models")
        model, pretrained = str(config_file), str(weights)
    heads = args.out / "models"
    nsfw = write_random_nsfw(heads / "nsfw.safetensors", dim=768)
    watermark = write_random_watermark(heads / "watermark.safetensors")
    aesthetic = heads / "aesthetic-v2.pth"
    torch.manual_seed(0)
    layers = [torch.nn.Linear(i, o) for i, o in ((768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1))]
    torch.save({f"layers.{n}.{k}": v for n, layer in zip((0, 2, 4, 6, 7), layers)
                for k, v in layer.state_dict().items()}, aesthetic)  # the released v2 predictor's keys
    count = args.shards or args.workers
    shard_size = max(1, args.images // count) if args.images else SHARD_BATCHES * max(args.batch_sizes)
    shards = bench_shards(args.out, count, shard_size, min(args.distinct, count * shard_size), args.image_size,
                          args.progressive)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "clip_model": args.clip_model if not args.smoke else "tiny-clip-768", "images": shard_size * count,
               "image_size": args.image_size, "progressive": args.progressive, "cpus": os.cpu_count(), "shards": count,
               "shard_size": shard_size,
               "bare": [], "score": [], "cpu_side": []}

    def save() -> None:  # a row at a time
        (args.out / "bench_score.json").write_text(json.dumps(results, indent=2) + "\n")

    for batch in args.batch_sizes:
        results["bare"].append(bare_forward(model, pretrained, batch, device, args.bare_seconds, args.bare_compile))
        print(json.dumps(results["bare"][-1]), flush=True)
        for label, extra in (row for row in LABELS if row[0] in args.labels):
            extra = {**extra, **({"watermark": str(watermark)} if label.startswith("+watermark") else {})}
            slug = (label.replace("--decode ", "").replace("--cuda-graphs", "graphs").replace("--compile", "compiled")
                    .replace("+", "").replace(" ", "-"))
            config = ScoreConfig(shards=(str(shards),), output=str(args.out / f"scored-{batch}-{slug}"),
                                 clip_model=model, clip_pretrained=pretrained,
                                 scores=(f"aesthetic=aesthetic-v2:{aesthetic}",), nsfw=str(nsfw), batch_size=batch,
                                 workers=args.workers, device=str(device), quiet=True, overwrite=True, **extra)
            scorers = Scorers(config, torch.device(config.device), lambda _: None)
            if not args.no_warm_up and ("warm_up" not in results or config.compile):
                # the first run of a process pays for what later ones find made (the pinned host pool growing to
                # the batches in flight, cuDNN's and cuBLAS' choices, the shards' pages): measured once, untimed,
                # so that the rows compare (the fourteenth session's rows ran faster the later they came); a
                # compiled row's own warm-up run is its compiling, once per Scorers (reported: compile_warm_up)
                key = "compile_warm_up" if config.compile else "warm_up"
                results.setdefault(key, []).append(end_to_end(scorers, config, label))
                print(json.dumps({key: results[key][-1]}), flush=True)
            found = end_to_end(scorers, config, label)
            found["vs_bare"] = found["images_per_s"] / results["bare"][-1]["images_per_s"]
            if "images_per_s_with_text" in results["bare"][-1]:  # against both of open_clip's bare forwards
                found["vs_bare_with_text"] = found["images_per_s"] / results["bare"][-1]["images_per_s_with_text"]
            found["vs_nemo_floor_per_gpu"] = found["images_per_s"] / NEMO_FLOOR_PER_GPU
            results["score"].append(found)  # kept before the checks below, which a call's timeout may cut
            print(json.dumps(found), flush=True)
            save()
            if device.type == "cuda" and batch == args.batch_sizes[0]:
                results.setdefault("sync_check", []).append(sync_check(scorers, config, label))
                print(json.dumps(results["sync_check"][-1]), flush=True)
                save()
            if args.profile and batch == args.batch_sizes[0]:
                results.setdefault("profile", []).append(profile_check(scorers, config, label, args.profile_shards))
                print(json.dumps(brief(results["profile"][-1])), flush=True)
                save()
            if batch == args.batch_sizes[0] and not args.no_cpu_side:  # once per label: the GPU's batch matters little
                results["cpu_side"].append(cpu_side(scorers, config, label))
                found["vs_cpu_side"] = found["images_per_s"] / results["cpu_side"][-1]["images_per_s"]
                print(json.dumps(results["cpu_side"][-1]), f"(b/c {found['vs_cpu_side']:.3f})", flush=True)
                save()
    print(f"wrote {args.out / 'bench_score.json'}")


if __name__ == "__main__":
    main()
