"""Benchmark `laionkit encode` against the bare-encoder ceiling (not a test; results in docs/BENCHMARKS.md).

For each resolution: (a) the ceiling, in a child process of its own: the bare libraries at their fastest, no laionkit
code at all: diffusers' ``AutoencoderKL.encode`` + transformers' ``CLIPTextModel`` on tensors already on
the GPU, same batch size, resolution and dtype, in both memory layouts (contiguous and channels_last),
measured in this run (side by side with (b), one after the other), per mode (eager, and each torch.compile'd), the faster layout kept; (b)
`laionkit encode` (its run()) on photo-like JPEG shards generated here, eager and with --compile. Prints
img/s, the ratio b/a (target >= 0.95), the CPU workers used and where the JPEGs were decoded. Models are random-init at real sizes: the SD VAE (block_out_channels
128,256,512,512) and CLIP ViT-L/14's text encoder (12 layers, 768 wide, 77 tokens).

With --gpus 2 4 8, also (c) `laionkit encode` eager on N GPUs (torchrun, one rank per GPU, the same
shards): aggregate img/s = all samples / the slowest rank's seconds, and the scaling efficiency against
the one-GPU eager run.

    python scripts/bench_encode.py --out results/            # on the GPU machine (about 5 minutes)
    python scripts/bench_encode.py --out results/ --modes eager --decodes cpu --gpus 2 4 8
    python scripts/bench_encode.py --out results/ --modes compile --decodes cpu --resolutions 256 --profile 8
                                                             # + torch.profiler of run() on 8 shards: GPU busy %
    python scripts/bench_encode.py --writer 40 --out /tmp/bench  # CPU: the tar writer alone, vs webdataset's
    python scripts/bench_encode.py --smoke --out /tmp/bench  # CPU, tiny models, minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from functools import partial
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from laionkit.common.models import clip_tokenizer, write_tiny_models
from laionkit.encode import run
from laionkit.encode.config import EncodeConfig
from laionkit.encode.device import Encoders

WORDS = ("a photo of the red old small city house dog cat river mountain at sunset in snow with a "
         "portrait close-up view blue sky tree garden street night light film painting detailed").split()
SHARD_SIZE = 256  # small shards keep all workers busy to the end


def write_real_size_models(folder: Path) -> Path:
    """SD-VAE-size AutoencoderKL and CLIP-L-size CLIPTextModel, random init, in the real folder layout."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    AutoencoderKL(
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4, sample_size=512,
    ).save_pretrained(folder / "vae")
    CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    )).save_pretrained(folder / "text_encoder")
    clip_tokenizer(folder / "tokenizer").save_pretrained(folder / "tokenizer")
    return folder


def photo_like(seed: int, resolution: int) -> tuple[bytes, str]:
    """A JPEG with photo statistics (smooth shapes, gradients, fine noise), short side 1-1.5x resolution,
    aspect 3:4..4:3, as img2dataset leaves images with a minimum side; plus a random caption."""
    rng = np.random.default_rng(seed)
    short = int(resolution * rng.uniform(1.0, 1.5))
    aspect = rng.uniform(0.75, 1.333)
    width, height = (int(short * aspect), short) if aspect >= 1 else (short, int(short / aspect))
    coarse = rng.uniform(0, 255, size=(rng.integers(3, 9), rng.integers(3, 9), 3)).astype(np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    ramp = np.linspace(-40, 40, width, dtype=np.float32)[None, :, None]
    image = image + ramp + rng.normal(0, 12, size=image.shape).astype(np.float32)
    buffer = __import__("io").BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    caption = " ".join(random.Random(seed).choices(WORDS, k=int(rng.integers(5, 25))))
    return buffer.getvalue(), caption


def _write_shard(args: tuple) -> None:
    """One tar of photo-like JPEGs: (path, shard number, resolution[, samples per shard])."""
    import webdataset as wds

    path, shard, resolution, *rest = args
    size = rest[0] if rest else SHARD_SIZE
    with wds.TarWriter(str(path)) as sink:
        for index in range(size):
            key = f"{shard:05d}{index:04d}"
            data, caption = photo_like(shard * size + index, resolution)
            sink.write({"__key__": key, "jpg": data, "txt": caption,
                        "json": json.dumps({"key": key, "caption": caption, "status": "success"})})


def make_shards(folder: Path, images: int, resolution: int, processes: int, shard_size: int = SHARD_SIZE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(folder / f"{shard:05d}.tar", shard, resolution, shard_size)
            for shard in range(max(1, images // shard_size))]
    with Pool(processes) as pool:
        pool.map(_write_shard, jobs)
    return folder


def _bare_models(models: Path, dtype, device):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    vae = AutoencoderKL.from_pretrained(models / "vae", torch_dtype=dtype).to(device).eval().requires_grad_(False)
    text = CLIPTextModel.from_pretrained(models / "text_encoder", dtype=dtype).to(device).eval().requires_grad_(False)
    return vae, text


def _rate(step, batch_size: int, seconds: float, device: str, images: int = 0) -> tuple[float, list]:
    """img/s of ``step`` over ``images`` (whole batches), or over ``seconds`` when ``images`` is 0; and its
    trace: (images, seconds) every 16 steps, from CUDA events (no sync inside the timed loop), which shows
    whether the rate drifts over a long run (clocks, heat) as a short window cannot."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps_wanted = -(-images // batch_size) if images else 0
    with torch.inference_mode():
        for _ in range(3):  # warm-up (and compilation)
            step()
        sync()
        marks = []
        first = torch.cuda.Event(enable_timing=True) if cuda else None
        first.record() if cuda else None
        started, steps = time.perf_counter(), 0
        while steps < steps_wanted if steps_wanted else (time.perf_counter() - started < seconds or steps < 2):
            step()
            steps += 1
            if cuda and steps % 16 == 0:
                mark = torch.cuda.Event(enable_timing=True)
                mark.record()
                marks.append((steps * batch_size, mark))
        sync()
        elapsed = time.perf_counter() - started
        trace = [(done, first.elapsed_time(mark) / 1000) for done, mark in marks]
        return steps * batch_size / elapsed, trace


def _drift(trace: list, parts: int = 4) -> list[float]:
    """img/s in each of ``parts`` equal stretches of a trace (first to last): a falling list is a GPU
    slowing down as the run goes on."""
    if len(trace) < parts + 1:
        return []
    points = [(0, 0.0), *trace]
    cuts = [points[round(i * (len(points) - 1) / parts)] for i in range(parts + 1)]
    return [round((b[0] - a[0]) / (b[1] - a[1]), 1) for a, b in zip(cuts, cuts[1:]) if b[1] > a[1]]


def ceiling(models: Path, dtype, device: str, batch_size: int, resolution: int, seconds: float,
            compiled: bool, images: int = 0) -> dict:
    """(a): img/s of the bare diffusers VAE encode + transformers text encode (fp16 outputs, as stored),
    in each memory layout, over ``images`` (as many as (b) encodes: the same length of run, so the same
    sustained clocks) or ``seconds``; ``best`` is the faster one. No laionkit code runs here."""
    vae, text = _bare_models(models, dtype, device)
    ids = torch.randint(0, 49406, (batch_size, 77), device=device)
    rates, drift = {}, {}
    for name, layout in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
        vae.to(memory_format=layout)
        pixels = torch.randn((batch_size, 3, resolution, resolution), device=device).to(dtype)
        pixels = pixels.contiguous(memory_format=layout)

        def step(vae=vae, pixels=pixels, text=text):  # returns its outputs: a compiled graph drops unused work
            return (vae.encode(pixels).latent_dist.parameters.to(torch.float16),
                    text(ids).last_hidden_state.to(torch.float16))

        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, dynamic=False)
        rates[name], trace = _rate(step, batch_size, seconds, device, images)
        drift[name] = _drift(trace)
    del vae, text
    torch._dynamo.reset()
    best = max(rates, key=rates.get)
    return {"ceiling_img_s": rates[best], "ceiling_layout": best, "ceiling_by_layout": rates,
            "ceiling_drift_by_quarter": drift, "ceiling_images": images}


def ceiling_in_child(models: Path, dtype, batch_size: int, resolution: int, seconds: float, compiled: bool,
                     out: Path, images: int = 0) -> dict:
    """(a) in a fresh child process: torch.compile of the bare models (and its cache reset) must not share
    a process with (b), or (b) measures the compiler's leftovers instead of laionkit encode."""
    spec = {"models": str(models), "dtype": str(dtype).removeprefix("torch."), "batch_size": batch_size,
            "resolution": resolution, "seconds": seconds, "compiled": compiled, "images": images}
    result = out / "ceiling.json"
    result.unlink(missing_ok=True)
    subprocess.run([sys.executable, __file__, "--out", str(out), "--ceiling-child", json.dumps(spec)], check=True)
    return json.loads(result.read_text())


def ceiling_child(spec: str, out: Path) -> None:
    fields = json.loads(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cudnn.benchmark = True
    row = ceiling(Path(fields["models"]), getattr(torch, fields["dtype"]), device, fields["batch_size"],
                  fields["resolution"], fields["seconds"], fields["compiled"], fields.get("images", 0))
    (out / "ceiling.json").write_text(json.dumps(row))


def rank_child(spec: str, out: Path) -> None:
    """One torchrun rank of the multi-GPU run: encode its shards, write its summary."""
    fields = json.loads(spec)
    config = EncodeConfig(**{**fields, "shards": tuple(fields["shards"]), "output": Path(fields["output"])})
    summary = run(config, log=lambda _: None)
    (out / f"rank-{summary['rank']:03d}.json").write_text(json.dumps(summary))


def multi_gpu(config: EncodeConfig, gpus: int, out: Path) -> dict:
    """(c): `laionkit encode` on ``gpus`` ranks over the same shards; aggregate img/s and per-rank facts."""
    ranks = out / f"ranks-{gpus}"
    shutil.rmtree(ranks, ignore_errors=True)
    shutil.rmtree(config.output, ignore_errors=True)
    ranks.mkdir(parents=True)
    spec = {**config.__dict__, "output": str(config.output), "decode": "cpu",
            "workers": max(1, (os.cpu_count() or 2) // gpus - 1)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), __file__,
                    "--out", str(ranks), "--rank-child", json.dumps(spec)], check=True)
    summaries = [json.loads(path.read_text()) for path in sorted(ranks.glob("rank-*.json"))]
    samples = sum(summary["samples_out"] for summary in summaries)
    return {"gpus": gpus, "samples": samples, "img_s": samples / max(s["seconds"] for s in summaries),
            "workers_per_rank": spec["workers"], "rank_seconds": [round(s["seconds"], 2) for s in summaries]}


def bench_writer(batches: int, repeats: int) -> dict:
    """The writer's CPU per batch (CPU only, no models): laionkit's TarMembers against webdataset's TarWriter
    (the library path, mtime 0: no PAX headers), alternated ``repeats`` times in this process, on SD 256 px
    shapes (64 samples of moments 8x32x32 and text 77x768 in float16, plus the json), the same bytes out."""
    import webdataset as wds

    from laionkit.encode.tars import TarMembers, npy_rows

    rng = np.random.default_rng(0)
    moments = rng.standard_normal((64, 8, 32, 32)).astype(np.float16)
    text = rng.standard_normal((64, 77, 768)).astype(np.float16)
    records = [json.dumps({"key": f"{i:09d}", "caption": " ".join(WORDS[:12]), "size": [256, 256]}).encode()
               for i in range(64)]

    def samples(batch: int):
        for index, (m, t, j) in enumerate(zip(npy_rows(moments), npy_rows(text), records)):
            yield f"{batch:05d}{index:04d}", {"json": j, "moments.npy": m, "text.npy": t}

    def webdataset_writer(path: Path) -> None:
        with wds.TarWriter(str(path), encoder=False, mtime=0) as sink:
            for batch in range(batches):
                for key, members in samples(batch):
                    sink.write({"__key__": key, **members})

    def tar_members(path: Path) -> None:
        sink = TarMembers(str(path))
        for batch in range(batches):
            for key, members in samples(batch):
                sink.add_sample(key, members)
        sink.close()

    work = Path("/tmp/bench_writer")
    work.mkdir(exist_ok=True)
    ms: dict[str, list[float]] = {"webdataset": [], "laionkit": []}
    for _ in range(repeats):
        for name, write in (("webdataset", webdataset_writer), ("laionkit", tar_members)):
            started = time.perf_counter()
            write(work / f"{name}.tar")
            ms[name].append(1000 * (time.perf_counter() - started) / batches)
    same = (work / "webdataset.tar").read_bytes() == (work / "laionkit.tar").read_bytes()
    shutil.rmtree(work)
    return {"ms_per_batch": ms, "same_bytes": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (bench_encode.json)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_encode"), help="scratch folder")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--images", type=int, nargs="+", default=[15360, 3840], help="per resolution")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=min(15, (os.cpu_count() or 2) - 1))
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"])
    parser.add_argument("--decodes", nargs="+", default=["gpu", "cpu"], choices=["gpu", "cpu"],
                        help="encode's --decode values to run in every mode (gpu needs CUDA)")
    parser.add_argument("--ceiling-images", default="same",
                        help="(a) is timed over this many images per layout; 'same' (default): as many as (b) "
                             "encodes, so both run as long; 0: over --ceiling-seconds")
    parser.add_argument("--ceiling-seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="(b) this many times per row on the same loaded encoders; every run is reported")
    parser.add_argument("--writer", type=int, default=0, metavar="BATCHES",
                        help="only the writer's CPU per batch of 64: laionkit's tar writer vs webdataset's (CPU)")
    parser.add_argument("--profile", type=int, default=0, metavar="SHARDS",
                        help="after timing, profile laionkit's run() over this many shards (torch.profiler): "
                             "its top ops and how busy the GPU was")
    parser.add_argument("--smoke", action="store_true", help="tiny models, tiny images, CPU: checks the script")
    parser.add_argument("--gpus", type=int, nargs="+", default=[], help="also encode on N GPUs (eager, torchrun)")
    parser.add_argument("--rank-child", help=argparse.SUPPRESS)
    parser.add_argument("--ceiling-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        result = bench_writer(args.writer, repeats=5)
        print(json.dumps(result))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_writer.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    if args.ceiling_child:
        ceiling_child(args.ceiling_child, args.out)
        return
    if args.rank_child:
        rank_child(args.rank_child, args.out)
        return
    if args.smoke:
        args.resolutions, args.images, args.batch_size, args.ceiling_seconds = [64], [1024], 16, 1.0
        args.workers = min(args.workers, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cudnn.benchmark = True

    started = time.perf_counter()
    models = (write_tiny_models(args.work / "models") if args.smoke
              else write_real_size_models(args.work / "models"))
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda"
               else platform.processor() or "cpu", "cpu_cores": os.cpu_count(), "torch": torch.__version__,
               "batch_size": args.batch_size, "workers": args.workers, "smoke": args.smoke, "runs": []}
    print(f"models ready in {time.perf_counter() - started:.0f}s; {results['device']}, {os.cpu_count()} cores",
          flush=True)

    def save():
        (args.out / "bench_encode.json").write_text(json.dumps(results, indent=2) + "\n")

    for resolution, images in zip(args.resolutions, args.images):
        t0 = time.perf_counter()
        shards = make_shards(args.work / f"shards-{resolution}", images, resolution, os.cpu_count() or 2)
        print(f"{resolution}px: {images} JPEGs generated in {time.perf_counter() - t0:.0f}s", flush=True)
        for mode in args.modes:
            compiled = mode == "compile"
            config = EncodeConfig(shards=(str(shards),), output=args.work / "out", model=str(models),
                                  resolution=resolution, batch_size=args.batch_size, workers=args.workers,
                                  compile=compiled, quiet=True)
            row = {"resolution": resolution, "mode": mode, "images": images}
            try:
                t0 = time.perf_counter()
                dtype = torch.bfloat16 if device == "cuda" else torch.float32  # encode's --dtype auto
                same = images // SHARD_SIZE * SHARD_SIZE  # what (b) encodes: whole shards
                row.update(ceiling_in_child(models, dtype, args.batch_size, resolution, args.ceiling_seconds,
                                            compiled, args.work,
                                            same if args.ceiling_images == "same" else int(args.ceiling_images)))
                row["ceiling_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                encoders = Encoders(config, torch.device(device))
                row["load_s"] = time.perf_counter() - t0
            except Exception:  # noqa: BLE001 - record and go on: one GPU call must return every number it can
                row["error"] = traceback.format_exc()
                print(row["error"], file=sys.stderr, flush=True)
                results["runs"].append(row)
                save()
                continue
            for decode in args.decodes if device == "cuda" else ["cpu"]:
                try:
                    rates = []
                    for _ in range(args.repeats):
                        shutil.rmtree(config.output, ignore_errors=True)
                        summary = run(EncodeConfig(**{**config.__dict__, "decode": decode}), encoders=encoders)
                        assert summary["samples_out"] == images // SHARD_SIZE * SHARD_SIZE, summary
                        rates.append(summary["samples_out"] / summary["seconds"])
                    where, rate = summary["decode"], rates[0]
                    row[f"encode_{where}_repeats_img_s"] = rates
                    row.update({f"encode_{where}_img_s": rate, f"ratio_{where}": rate / row["ceiling_img_s"],
                                f"decoded_{where}": summary["decoded"], "workers": summary["workers"]})
                    print(f"{resolution}px {mode:8s} decode={where}: ceiling {row['ceiling_img_s']:.0f} img/s "
                          f"over {row['ceiling_images'] or 'a few seconds of'} images (by quarter: "
                          f"{row['ceiling_drift_by_quarter']}), "
                          f"encode {rate:.0f} img/s, ratio {rate / row['ceiling_img_s']:.3f}, "
                          f"repeats {[round(r) for r in rates]}, "
                          f"workers {summary['workers']}, decoded {summary['decoded']}", flush=True)
                except Exception:  # noqa: BLE001 - as above
                    row[f"error_{decode}"] = traceback.format_exc()
                    print(row[f"error_{decode}"], file=sys.stderr, flush=True)
            if args.profile:  # where a run's time goes: laionkit's run() on the first shards, profiled
                try:
                    sys.path.insert(0, str(Path(__file__).resolve().parent))
                    from benchlib import profile_steps

                    subset = args.work / f"profile-{resolution}"
                    subset.mkdir(exist_ok=True)
                    for tar in sorted(shards.glob("*.tar"))[: args.profile]:
                        (subset / tar.name).unlink(missing_ok=True)
                        (subset / tar.name).symlink_to(tar)
                    profiled = EncodeConfig(**{**config.__dict__, "shards": (str(subset),),
                                               "output": args.work / "profile-out", "decode": "cpu"})
                    shutil.rmtree(profiled.output, ignore_errors=True)
                    report = profile_steps(partial(run, profiled, encoders=encoders), 1, torch.device(device))
                    print(f"{resolution}px {mode} profile of run() over {args.profile} shards:\n{report}", flush=True)
                    row["profile_gpu_busy"] = report.rsplit("\n", 1)[-1]
                except Exception:  # noqa: BLE001 - as above
                    row["error_profile"] = traceback.format_exc()
                    print(row["error_profile"], file=sys.stderr, flush=True)
            if mode == "eager":
                for gpus in args.gpus:
                    try:
                        scaled = multi_gpu(config, gpus, args.work)
                        one = row.get("encode_cpu_img_s") or row.get("encode_gpu_img_s")
                        scaled["efficiency"] = scaled["img_s"] / (gpus * one) if one else None
                        row.setdefault("multi_gpu", []).append(scaled)
                        print(f"{resolution}px eager on {gpus} GPUs: {scaled}", flush=True)
                    except Exception:  # noqa: BLE001 - as above
                        row[f"error_gpus_{gpus}"] = traceback.format_exc()
                        print(row[f"error_gpus_{gpus}"], file=sys.stderr, flush=True)
            results["runs"].append(row)
            save()
            del encoders
            torch.cuda.empty_cache() if device == "cuda" else None
        shutil.rmtree(shards, ignore_errors=True)
        shutil.rmtree(args.work / "out", ignore_errors=True)

    print("\n| res | mode | (a) ceiling img/s: contiguous / channels_last | (b) encode img/s (decode) | b/a "
          "| >= 0.95 | workers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in results["runs"]:
        if "ceiling_img_s" not in row:
            print(f"| {row['resolution']} | {row['mode']} | error | | | | |")
            continue
        layouts = row["ceiling_by_layout"]
        ceiling_text = " / ".join(f"{layouts[name]:.0f}" + ("*" if name == row["ceiling_layout"] else "")
                                  for name in ("contiguous", "channels_last"))
        measured = [decode for decode in ("gpu", "cpu") if f"encode_{decode}_img_s" in row] or [None]
        for decode in measured:
            if decode is None:
                print(f"| {row['resolution']} | {row['mode']} | {ceiling_text} | error | | | |")
                continue
            ratio = row[f"ratio_{decode}"]
            print(f"| {row['resolution']} | {row['mode']} | {ceiling_text} | "
                  f"{row[f'encode_{decode}_img_s']:.0f} ({decode}) | {ratio:.3f} | "
                  f"{'yes' if ratio >= 0.95 else 'NO'} | {row['workers']} |")
    print("(* the faster layout, the ceiling used for b/a)")
    for row in results["runs"]:
        for scaled in row.get("multi_gpu", []):
            print(f"{row['resolution']} px eager, {scaled['gpus']} GPUs: {scaled['img_s']:.0f} img/s, scaling "
                  f"efficiency {scaled['efficiency'] or float('nan'):.3f} (target at 8 GPUs: 7.8x = 0.975)")
    print(f"total {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
