"""Benchmark `laionkit caption`: captions/s per GPU for a 2B-class VLM, against the bare model's generate
(not a test; results go to docs/BENCHMARKS.md once measured on the GPU machine).

The model is Qwen2-VL-2B's real architecture (laionkit.caption.tiny.QWEN2_VL_2B: 28 decoder layers 1536 wide,
a 32-block 1280-wide vision tower, 151,936-token vocabulary, 2.2B parameters), random init, saved in the real
layout with the tiny VLM's processor (the image processor at Qwen2-VL's own pixel budget, the tokenizer trained
on laionkit's shipped captions) and loaded by `laionkit caption` as users load theirs. Its generation_config
has no end-of-sequence token, so every caption is exactly --max-new-tokens long (a random-init model would
otherwise stop at random places) and captions/s x max-new-tokens is the decode rate.

For each batch size: (a) the ceiling, the bare transformers generate (greedy, the same batch size, dtype and
max-new-tokens) over the first --repeats batches that (b) forms, the same images in the same order, each
preprocessed beforehand and copied from pinned memory just before its generate, no laionkit code (until
2026-12-06 it repeated one batch, whose padding need not be the average batch's); (b) `laionkit caption` (its
run(): DataLoader workers decode + preprocess, generate, tar writing) on photo-like JPEG shards generated here.
Prints captions/s, the ratio b/a and where (b)'s loop waited; the json is rewritten after each row.

    python scripts/bench_caption.py --out results/                      # on the GPU machine
    python scripts/bench_caption.py --out results/ --batch-sizes 32 64 128 --max-new-tokens 64
    python scripts/bench_caption.py --out results/ --backends transformers vllm   # vllm where installed
    python scripts/bench_caption.py --smoke --out /tmp/bench            # CPU, the tiny VLM, about a minute
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import make_shards  # noqa: E402 - photo-like JPEG shards, as encode's bench writes them

from laionkit.caption import CaptionConfig, run  # noqa: E402
from laionkit.caption.config import DEFAULT_PROMPT  # noqa: E402
from laionkit.caption.tiny import QWEN2_VL_2B, SPECIAL_TOKENS, write_tiny_vlm  # noqa: E402


def write_real_size_vlm(folder: Path, device: str) -> Path:
    """Qwen2-VL-2B's architecture, random init in bf16, with the tiny VLM's processor (its special tokens' ids
    in the config) and the real image budget (Qwen2-VL's default min / max pixels)."""
    from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if (folder / "model.safetensors.index.json").exists() or (folder / "model.safetensors").exists():
        return folder
    write_tiny_vlm(folder)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        (folder / name).unlink()
    processor = AutoProcessor.from_pretrained(folder)
    processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}  # Qwen2-VL's own
    processor.save_pretrained(folder)
    ids = {token: processor.tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = json.loads(json.dumps(QWEN2_VL_2B))
    config["text_config"].update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                                 pad_token_id=ids["<|endoftext|>"])
    config.update(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**config)).to(torch.bfloat16)
    _fixed_length(model, ids)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _fixed_length(model, ids: dict) -> None:
    """No end-of-sequence token: every caption runs to max_new_tokens."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False


def tiny_fixed_length(folder: Path) -> Path:
    """The tiny VLM with its end-of-sequence token removed (--smoke)."""
    from transformers import GenerationConfig

    if not (folder / "config.json").exists():
        write_tiny_vlm(folder)
        generation = GenerationConfig.from_pretrained(folder)
        generation.eos_token_id = None
        generation.save_pretrained(folder)
    return folder


def ceiling(model_dir: Path, shards: Path, batch_size: int, max_new_tokens: int, device: str, repeats: int) -> dict:
    """The bare model: transformers' generate over the first ``repeats`` batches `laionkit caption` forms (a shard's
    images in order, ``batch_size`` at a time), each preprocessed beforehand and kept in pinned host memory, copied
    to the device just before its generate (no laionkit code): the same images and padding as (b)'s batches."""
    import io
    import tarfile

    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DEFAULT_PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batches = []
    for tar_path in sorted(shards.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            images = [Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                      for member in tar if member.name.endswith(".jpg")]
        for begin in range(0, len(images), batch_size):
            if len(batches) < repeats:
                chunk = images[begin: begin + batch_size]
                inputs = processor(text=[text] * len(chunk), images=chunk, return_tensors="pt", padding=True)
                batches.append({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()})
                if device == "cuda":
                    batches[-1] = {k: v.pin_memory() for k, v in batches[-1].items()}
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def generate(batch: dict) -> torch.Tensor:
        return model.generate(**{k: v.to(device, non_blocking=True) for k, v in batch.items()}, **kwargs)

    with torch.inference_mode():
        generate(batches[0])  # warm-up
        sync()
        started = time.perf_counter()
        for batch in batches:
            output = generate(batch)
        sync()
    seconds = time.perf_counter() - started
    captions = sum(len(batch["input_ids"]) for batch in batches)
    prompts = [batch["input_ids"].shape[1] for batch in batches]
    return {"captions_per_s": captions / seconds, "new_tokens": output.shape[1] - batches[-1]["input_ids"].shape[1],
            "prompt_tokens": round(sum(prompts) / len(prompts), 1), "batches": len(batches), "seconds": seconds}


def laionkit_run(model_dir: Path, shards: Path, output: Path, batch_size: int, max_new_tokens: int, workers: int,
                 backend: str) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    started = time.perf_counter()
    summary = run(CaptionConfig(shards=(str(shards),), output=str(output), model=str(model_dir), backend=backend,
                                batch_size=batch_size, max_new_tokens=max_new_tokens, workers=workers, quiet=True),
                  log=lambda _: None)
    seconds = time.perf_counter() - started
    return {"captions": summary["captioned"], "seconds_loop": summary["seconds"], "seconds_with_load": seconds,
            "captions_per_s": summary["captioned"] / summary["seconds"],
            # the loop's waits for the workers' batches and its time in generate (the rest: its own host work)
            "wait_seconds": summary.get("wait_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (bench_caption.json)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_caption"), help="scratch folder")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=1024, help="images `laionkit caption` captions per run")
    parser.add_argument("--image-size", type=int, default=512, help="short side of the generated photos (px)")
    parser.add_argument("--workers", type=int, default=min(8, (os.cpu_count() or 2) - 1))
    parser.add_argument("--repeats", type=int, default=4,
                        help="batches the ceiling generates, timed (the first ones `laionkit caption` forms)")
    parser.add_argument("--backends", nargs="+", default=["transformers"], choices=["transformers", "vllm"])
    parser.add_argument("--smoke", action="store_true", help="the tiny VLM, tiny images, CPU: checks the script")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.batch_sizes, args.max_new_tokens, args.images, args.image_size = [4], 8, 16, 64
        args.workers, args.repeats = min(args.workers, 1), 1
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = (tiny_fixed_length(args.work / "tiny-vlm") if args.smoke
                 else write_real_size_vlm(args.work / "qwen2-vl-2b-random", device))
    # caption batches within a shard (outputs independent of the split), so a shard holds whole batches of
    # every size measured: smaller shards would cap the batch laionkit runs below the ceiling's
    shard_size = min(2 * max(args.batch_sizes), args.images)
    uneven = [size for size in args.batch_sizes if shard_size % size]
    if uneven:
        parser.error(f"--batch-sizes {uneven} do not divide the shard size {shard_size} (twice the largest)")
    shards = args.work / f"shards-{args.image_size}-{args.images}-{shard_size}"
    if not shards.exists():
        make_shards(shards, args.images, args.image_size, processes=max(1, args.workers), shard_size=shard_size)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               "model": "tiny-vlm (smoke)" if args.smoke else "Qwen2-VL-2B architecture, random init",
               "max_new_tokens": args.max_new_tokens, "images": args.images, "image_size": args.image_size,
               "shard_size": shard_size, "workers": args.workers, "runs": []}
    for batch_size in args.batch_sizes:
        bare = ceiling(model_dir, shards, batch_size, args.max_new_tokens, device, args.repeats)
        for backend in args.backends:
            if backend == "vllm" and importlib.util.find_spec("vllm") is None:
                print("vllm is not installed here: its run is left out")
                continue
            ours = laionkit_run(model_dir, shards, args.work / "captioned", batch_size, args.max_new_tokens,
                                args.workers, backend)
            row = {"batch_size": batch_size, "backend": backend, "ceiling": bare, "laionkit": ours,
                   "ratio": ours["captions_per_s"] / bare["captions_per_s"]}
            results["runs"].append(row)
            print(f"batch {batch_size:4d} {backend:12s}: laionkit caption {ours['captions_per_s']:8.2f} captions/s, "
                  f"bare generate {bare['captions_per_s']:8.2f} captions/s ({bare['new_tokens']} new tokens, "
                  f"{bare['prompt_tokens']} prompt tokens on average over {bare['batches']} batches), ratio "
                  f"{row['ratio']:.2f}, waits {ours['wait_seconds']} of {ours['seconds_loop']:.1f} s", flush=True)
            (args.out / "bench_caption.json").write_text(json.dumps(results, indent=2) + "\n")  # a row at a time
    (args.out / "bench_caption.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / 'bench_caption.json'}")


if __name__ == "__main__":
    main()
