"""Benchmark score's device-side pixels (`--decode device` / `draft-device`): per-group vs stacked resampling
(not a test; results in docs/BENCHMARKS.md).

A batch of photo-like JPEGs of many sizes (as bench_score.py generates them: short side 1-1.5x ``--image-size``,
aspect 3:4..4:3) decoded by Pillow at ``--decode draft``'s reduced DCT scale, as draft-device's workers ship
them, goes through ``laionkit.score.pixels.DevicePixels`` on the device, timed per batch (after a warm-up, the
device synchronised) with:

* ``grouped``: torchvision's Resize + CenterCrop, the watermark squash and the pHash per group of same-size
  images (on web images nearly one group per image: some 25 small kernels each, launched from Python);
* ``stacked``: the batch padded into stacks and each output made by batched resampling matrices;
* ``worker-stacked``: the same, from the stacks the workers padded (``pad_stacks``, what ``score --decode
  draft-device`` ships on an accelerator), so the device takes each stack as one view;
* ``worker-stacked-tf32`` (CUDA): the same with TF32 matmuls allowed, to weigh what the float32 resampling matmuls
  cost against how many pixels then move by a level.

``--profile`` (CUDA) also records the device's own time per batch of ``worker-stacked`` and its kernels with the
most of it: whether the pixels' device work, beside CLIP's forward, is the matmuls, the weights' float64
elementwise work or the copies.

Each row also records the host's milliseconds a batch (the calls' own time, the device not waited for: what the
pixel thread spends beside the main thread's launches).

Also prints the largest difference between the two (CLIP / watermark pixels in levels, pHash bits) and, per
path, images/s of the pixels alone: with the CLIP forward's images/s beside (bench_score.py's (a)) it says what
share of the GPU's time per image the pixels take. The JPEG decode is not timed (the workers do it).

    python scripts/bench_pixels.py --batch 512 --profile        # GPU: ViT-L/14's preprocess, watermark on
    python scripts/bench_pixels.py --smoke                      # CPU, a few images: plumbing only
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_encode import photo_like  # noqa: E402

from laionkit.common.phash import hamming  # noqa: E402
from laionkit.score.models import WATERMARK_SIZE  # noqa: E402
from laionkit.score.pixels import PAD_PIXELS, DevicePixels  # noqa: E402
from laionkit.score.reader import ScoreSamples, split_clip_transform  # noqa: E402


def batch_of(rgb: list[np.ndarray], padded: bool = False) -> dict:
    """A collated draft-device batch (laionkit.score.reader.ScoreSamples.collate's layout) of decoded images:
    end to end, or (``padded``) in the stacks the workers pad."""
    items = [{"key": str(index), "source": None, "caption": str(index), "width": 0, "height": 0,
              "sha256": str(index), "images": image} for index, image in enumerate(rgb)]
    return ScoreSamples.collate("00000", items, PAD_PIXELS if padded else None)


def timed(pixels: DevicePixels, rgb: list[np.ndarray], device: torch.device, repeats: int,
          padded: bool = False) -> tuple[float, float, dict]:
    """(seconds per batch, host seconds per batch, the last output) of ``pixels`` over the batch, the flat RGB
    pinned as the loader's."""
    batch = batch_of(rgb, padded)
    if device.type == "cuda":
        batch["rgb"] = batch["rgb"].pin_memory()
    for _ in range(2):  # warm-up: kernels, caches
        out, _ = pixels(dict(batch))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started, host = time.perf_counter(), 0.0
    for _ in range(repeats):
        call = time.perf_counter()
        out, _ = pixels(dict(batch))
        host += time.perf_counter() - call
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeats, host / repeats, out


def device_profile(pixels: DevicePixels, rgb: list[np.ndarray], repeats: int) -> dict:
    """The device's own milliseconds per batch of ``pixels`` over the workers' padded stacks, and its 12 kernels
    (or copies) with the most of it, per batch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    batch = batch_of(rgb, True)
    batch["rgb"] = batch["rgb"].pin_memory()
    pixels(dict(batch))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            pixels(dict(batch))
        torch.cuda.synchronize()
    device = [event for event in prof.key_averages() if event.device_type != DeviceType.CPU]
    ranked = sorted(device, key=lambda event: -event.self_device_time_total)[:12]
    return {"device_ms_per_batch": sum(event.self_device_time_total for event in device) / 1e3 / repeats,
            "top_device_ms_per_batch": [[event.key[:90], round(event.self_device_time_total / 1e3 / repeats, 2),
                                         event.count // repeats] for event in ranked]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip-model", default="ViT-L-14")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=512, help="short side of the generated JPEGs (x1-1.5)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-watermark", action="store_true")
    parser.add_argument("--out", type=Path, help="write the results as json here")
    parser.add_argument("--smoke", action="store_true", help="CPU, 8 images of 96 px, 1 repeat: plumbing only")
    parser.add_argument("--profile", action="store_true", help="CUDA: the device's time per batch, by kernel")
    args = parser.parse_args()
    import open_clip

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch, args.image_size, args.repeats = 8, 96, 1
    _, _, preprocess = open_clip.create_model_and_transforms(args.clip_model)
    transform, _ = split_clip_transform(preprocess)
    side = max(transform.transforms[0].size if isinstance(transform.transforms[0].size, int) else 224,
               0 if args.no_watermark else WATERMARK_SIZE)
    rgb = []
    for seed in range(args.batch):
        with Image.open(io.BytesIO(photo_like(seed, args.image_size)[0])) as image:
            image.draft("RGB", (side, side))  # --decode draft's scale, as the workers decode
            rgb.append(np.asarray(image.convert("RGB")))
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "clip_model": args.clip_model, "batch": args.batch, "watermark": not args.no_watermark,
               "distinct_sizes": len({image.shape for image in rgb}),
               "mean_pixels": float(np.mean([image.shape[0] * image.shape[1] for image in rgb]))}
    outputs = {}
    for name, stacked, padded in (("grouped", False, False), ("stacked", True, False), ("worker-stacked", True, True)):
        pixels = DevicePixels(transform, not args.no_watermark, device, stacked=stacked)
        seconds, host, outputs[name] = timed(pixels, rgb, device, args.repeats, padded)
        results[name] = {"ms_per_batch": seconds * 1e3, "host_ms_per_batch": host * 1e3,
                         "images_per_s": args.batch / seconds}
        print(json.dumps({name: results[name]}), flush=True)
    if device.type == "cuda":
        pixels = DevicePixels(transform, not args.no_watermark, device, stacked=True)
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            seconds, host, tf32 = timed(pixels, rgb, device, args.repeats, True)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
        exact = outputs["worker-stacked"]
        results["worker-stacked-tf32"] = {
            "ms_per_batch": seconds * 1e3, "host_ms_per_batch": host * 1e3, "images_per_s": args.batch / seconds,
            "max_level_difference": {name: int((tf32[name].int() - exact[name].int()).abs().max())
                                     for name in ("clip", "watermark") if name in exact},
            "share_of_levels_moved": {name: float((tf32[name] != exact[name]).float().mean())
                                      for name in ("clip", "watermark") if name in exact},
            "phash_bits_moved": sum(hamming(int(x), int(y)) for x, y in zip(tf32["phash"].tolist(),
                                                                            exact["phash"].tolist()))}
        print(json.dumps({"worker-stacked-tf32": results["worker-stacked-tf32"]}), flush=True)
        if args.profile:
            results["profile"] = device_profile(pixels, rgb, args.repeats)
            print(json.dumps({"profile": results["profile"]}), flush=True)
    a, b = outputs["grouped"], outputs["stacked"]
    results["max_level_difference"] = {name: int((a[name].int() - b[name].int()).abs().max())
                                       for name in ("clip", "watermark") if name in a}
    results["max_phash_bits"] = max(hamming(int(x), int(y)) for x, y in zip(a["phash"].tolist(), b["phash"].tolist()))
    results["stacked_vs_grouped"] = results["stacked"]["images_per_s"] / results["grouped"]["images_per_s"]
    results["worker_stacked_equal"] = all(outputs["stacked"][name].equal(outputs["worker-stacked"][name])
                                          for name in ("clip", "watermark", "phash") if name in a)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
