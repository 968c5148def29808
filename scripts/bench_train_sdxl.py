"""Benchmark `laionkit train` on an SDXL-size UNet against the bare diffusers step (not a test; docs/BENCHMARKS.md).

SDXL base's UNet architecture (2.57B parameters, random init: ``--unet-config sdxl``), bf16, per resolution
(1024 px batch 8, 512 px batch 32 by default):

(a) the ceiling: bare diffusers + torch, no laionkit code: ``UNet2DConditionModel.from_config`` (SDXL base's
    config), DDPMScheduler.add_noise, the UNet with ``added_cond_kwargs`` (pooled text + time_ids), MSE,
    backward, fused ``torch.optim.AdamW``, on tensors already on the GPU. Two precision policies, each in
    its own process: ``autocast`` (fp32 weights under bf16 autocast, as diffusers' SDXL script trains) and
    ``bf16`` (the whole model in bf16, optimizer on the bf16 weights: the fastest bare step, numerically
    weaker than either of laionkit's policies). The faster one is the ceiling. Only its figures come from
    laionkit (train.throughput, the arithmetic of metrics.jsonl), so that (a) and (b) are measured alike.
(b) `laionkit train` on SDXL-format latent shards written by `laionkit encode` (both text encoders' states,
    77 x 2048, pooled 1280, true sizes for time_ids), its samples/s, MFU, data-wait and peak memory from
    metrics.jsonl.
(buckets) the same on aspect-ratio buckets of the same pixel area (``encode --buckets``; photos of aspect
    1:2 .. 2:1), against (b) square.
(dynamic) compiled only: (buckets) under ``--compile-dynamic`` (symbolic shapes, one graph for every bucket)
    against (buckets) compiled with one static graph per bucket shape; ``wall_s`` holds each run's compile time.
(full) `laionkit train --full-bf16`: the bare ``bf16`` policy (bf16 weights and AdamW state, no fp32 master
    weights) in laionkit, against (a) ``bf16``: the same numerics on both sides.
(lora) `laionkit train --lora-rank 64` on the same UNet (frozen base) against (b) full: samples/s and memory.
(maxbatch) (b) at larger batches: the largest that fits.

Eager and compiled (``--compile``: each ResnetBlock2D / BasicTransformerBlock compiled on its own, in
laionkit and in the bare ceiling alike; the whole-UNet compile ran past 320 s). The latents come from a
small SDXL-shaped pipeline (tiny VAE with SDXL's 8x downsampling, one-layer CLIP encoders of SDXL's widths
768 + 1280): the train step only sees their shapes. Every measurement runs in its own process.

    python scripts/bench_train_sdxl.py --out /tmp/sdxl --report $OUT              # GPU machine
    python scripts/bench_train_sdxl.py --smoke --out /tmp/sdxl-smoke               # CPU plumbing check
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import (  # noqa: E402
    child_argv,
    family_bench_parser,
    measurer,
    print_table,
    save_results,
    time_bare_step,
    train_args,
)

REPO = Path(__file__).resolve().parents[1]
BATCH = {1024: 8, 512: 32, 64: 4}
ASPECTS = (0.5, 0.75, 1.0, 1.333, 2.0)  # width / height of the bucket photos


def write_sdxl_shaped_models(folder: Path, smoke: bool) -> Path:
    """A StableDiffusionXLPipeline folder whose encoders give SDXL's shapes: 8x VAE, states 768 + 1280 wide,
    pooled 1280 (one-layer CLIP text encoders); the tiny family writer's otherwise."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW
    from laionkit.families import get_family

    get_family("sdxl").write_tiny(folder, 0)
    if smoke:
        return folder
    torch.manual_seed(0)
    for sub, cls, hidden, act in (("text_encoder", CLIPTextModel, 768, "quick_gelu"),
                                  ("text_encoder_2", CLIPTextModelWithProjection, 1280, "gelu")):
        shutil.rmtree(folder / sub)
        cls(CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=2, num_attention_heads=hidden // 64, projection_dim=1280,
                           max_position_embeddings=CLIP_WINDOW, hidden_act=act, bos_token_id=49406,
                           eos_token_id=49407, pad_token_id=1)).save_pretrained(folder / sub)
    return folder


def _photo(seed: int, width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(6, 6, 3)).astype(np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    image += rng.normal(0, 10, size=image.shape).astype(np.float32)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _write_shard(job: tuple[Path, int, int, int, bool]) -> None:
    import webdataset as wds

    path, shard, per_shard, resolution, mixed = job
    with wds.TarWriter(str(path)) as sink:
        for index in range(per_shard):
            seed = shard * per_shard + index
            aspect = ASPECTS[seed % len(ASPECTS)] if mixed else 1.0
            area = (resolution * 1.2) ** 2
            width, height = int((area * aspect) ** 0.5), int((area / aspect) ** 0.5)
            key = f"{seed:09d}"
            caption = f"a photo number {seed} of a thing at aspect {aspect}"
            sink.write({"__key__": key, "jpg": _photo(seed, width, height), "txt": caption,
                        "json": json.dumps({"key": key, "caption": caption, "status": "success",
                                            "width": width, "height": height})})


def prepare(out: Path, resolution: int, images: int, mixed: bool, models: Path, text: str = "stored",
            window: int | None = None) -> Path:
    """JPEG shards (square-ish or mixed aspects) and their latents by ``models`` (`laionkit encode --text
    TEXT`, with --max-sequence-length ``window`` where given); shards and latents are made once per work folder.
    Encode runs in a process of its own, as a user runs it: whatever it holds on the GPU (its models, torch's
    cache) is gone when the timed runs start, not left in the benchmark's process beside them."""
    tag = f"{resolution}-{'buckets' if mixed else 'square'}"
    latents = out / f"latents-{tag}{'' if text == 'stored' else f'-{text}'}{f'-w{window}' if window else ''}"
    if (latents / "manifest.json").exists():
        return latents
    jpegs = out / f"jpeg-{tag}"
    if not jpegs.exists():
        jpegs.mkdir(parents=True)
        per_shard = 64
        jobs = [(jpegs / f"{s:05d}.tar", s, per_shard, resolution, mixed) for s in range(max(1, images // per_shard))]
        with Pool(min(len(jobs), os.cpu_count() or 2)) as pool:
            pool.map(_write_shard, jobs)
    command = [sys.executable, "-m", "laionkit.cli", "encode", str(jpegs), "--output", str(latents), "--model",
               str(models), "--resolution", str(resolution), "--buckets" if mixed else "--no-buckets", "--text", text,
               "--batch-size", "8", "--workers", str(min(8, os.cpu_count() or 2)), "--quiet"]
    if window:
        command += ["--max-sequence-length", str(window)]
    subprocess.run(command, check=True)
    return latents


# --- (a): the bare diffusers step, one process per measurement -------------------------------------

def child_bare(args) -> dict:
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from laionkit.families import get_family
    from laionkit.families.sdxl import SCHEDULER_CONFIG, TINY_UNET_CONFIG, UNET_CONFIG

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    config = dict(TINY_UNET_CONFIG if args.smoke else UNET_CONFIG)
    latent = args.resolution // 8
    config["sample_size"] = latent
    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel.from_config(config)
    pure_bf16 = args.policy == "bf16"
    if pure_bf16:
        unet = unet.to(torch.bfloat16)
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=cuda)
    scheduler = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    text_dim, pooled_dim = config["cross_attention_dim"], config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    batch = args.batch
    dtype = torch.bfloat16 if pure_bf16 else torch.float32
    latents = torch.randn(batch, 4, latent, latent, device=device, dtype=dtype)
    states = torch.randn(batch, 77, text_dim, device=device, dtype=dtype)
    pooled = torch.randn(batch, pooled_dim, device=device, dtype=dtype)
    time_ids = torch.tensor([[args.resolution] * 2 + [0, 0] + [args.resolution] * 2] * batch, device=device,
                            dtype=dtype)
    model = unet
    if args.compile:  # per block, as laionkit's --compile for SDXL (the whole-UNet compile ran past 320 s)
        blocks = get_family("sdxl").blocks(unet)  # ResnetBlock2D, BasicTransformerBlock, as bench_train_flow
        torch._dynamo.config.recompile_limit = max(8, len(blocks))
        for block in blocks:
            block.compile(dynamic=False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and not pure_bf16)
    alphas = scheduler.alphas_cumprod.to(device)

    def step():
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (batch,), device=device)
        a = alphas[t].to(dtype).view(-1, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise  # DDPMScheduler.add_noise, on the GPU
        with autocast:
            pred = model(noisy, t, encoder_hidden_states=states,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def one_sample():
        with autocast:
            unet(latents[:1], torch.tensor([500], device=device), encoder_hidden_states=states[:1],
                 added_cond_kwargs={"text_embeds": pooled[:1], "time_ids": time_ids[:1]}).sample.float().sum().backward()

    return time_bare_step(step, one_sample, unet, args.steps, args.warmup, batch, device)


def main() -> None:
    parser = family_bench_parser(__doc__)
    parser.add_argument("--parts", default="a,b,buckets,lora",
                        help="comma list of a, b, full, buckets, dynamic, lora, maxbatch")
    parser.add_argument("--modes", default="eager", help="comma list of eager, compiled")
    parser.add_argument("--max-batches", type=int, nargs="+", default=[12, 16], help="maxbatch: batches to try")
    parser.add_argument("--child", choices=["bare"])
    parser.add_argument("--policy", choices=["autocast", "bf16"], default="autocast")
    parser.add_argument("--policies", default="autocast,bf16", help="a: the bare policies to measure")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        (args.out / f"{args.name}.json").write_text(json.dumps(child_bare(args)))
        return

    started = time.perf_counter()
    if args.smoke:
        args.resolutions, args.images, args.steps, args.max_batches = [64], 32, 3, [8]
    parts = set(args.parts.split(","))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    models = args.out / "models"
    if not (models / "model_index.json").exists():
        write_sdxl_shaped_models(models, args.smoke)
    results: dict[str, dict] = {}
    measure = measurer(args.out, args.budget, started, env, results, report=args.report)

    def laionkit_train(name: str, latents: Path, batch: int, compiled: bool, *extra: str) -> None:
        run = args.out / f"run-{name}"
        window = max(2, args.steps // 3)
        cli = [sys.executable, "-m", "laionkit.cli", *train_args(
            latents, run, batch, window * 4, window, compiled, args.smoke, unet_config="sdxl", shuffle_buffer=64,
            channels_last=False), *extra]
        measure(name, cli, run=run)

    for compiled in [mode == "compiled" for mode in args.modes.split(",")]:
        mode = "compiled" if compiled else "eager"
        for resolution in args.resolutions:
            batch = BATCH.get(resolution, 8)
            square = prepare(args.out, resolution, args.images, False, models)
            tag = f"{resolution}-{mode}"
            if "a" in parts:
                for policy in args.policies.split(","):
                    name = f"a-{policy}-{tag}"
                    measure(name, child_argv(args.out, name, "bare", script=__file__, policy=policy,
                                             resolution=resolution, batch=batch, steps=args.steps,
                                             compile=compiled, smoke=args.smoke))
            if "b" in parts:
                laionkit_train(f"b-{tag}", square, batch, compiled)
            if "full" in parts:  # --full-bf16: the bare pure-bf16 step's policy (no fp32 master weights)
                laionkit_train(f"full-{tag}", square, batch, compiled, "--full-bf16", "--mixed-precision", "bf16")
            if "buckets" in parts and resolution == args.resolutions[0]:
                laionkit_train(f"buckets-{tag}", prepare(args.out, resolution, args.images, True, models), batch,
                               compiled)
            if "dynamic" in parts and compiled and resolution == args.resolutions[0]:  # symbolic shapes
                laionkit_train(f"buckets-dynamic-{tag}", prepare(args.out, resolution, args.images, True, models),
                               batch, compiled, "--compile-dynamic")
            if "lora" in parts and resolution == args.resolutions[0]:
                laionkit_train(f"lora64-{tag}", square, batch, compiled, "--lora-rank", "64", "--lora-random-base")
            if "maxbatch" in parts and resolution == args.resolutions[0]:
                for bigger in args.max_batches:
                    laionkit_train(f"b-{tag}-bs{bigger}", square, bigger, compiled)

    summary = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0)
               if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "results": results}
    save_results(summary, args.out, args.report, suffix="-sdxl", tail=8000)
    rate = lambda name: results.get(name, {}).get("samples_per_s")  # noqa: E731
    print_table(results, f"{summary['device']}, torch {torch.__version__}")
    print("\nratios")
    for mode in args.modes.split(","):
        for resolution in args.resolutions:
            tag = f"{resolution}-{mode}"
            ceilings = {p: rate(f"a-{p}-{tag}") for p in ("autocast", "bf16") if rate(f"a-{p}-{tag}")}
            b = rate(f"b-{tag}")
            for policy, a in ceilings.items():
                if b:
                    print(f"  b/a({policy}) {tag}: {b / a:.3f}")
            if b and ceilings:
                print(f"  b / best bare {tag}: {b / max(ceilings.values()):.3f}  (target >= 0.98)")
            if rate(f"full-{tag}") and ceilings.get("bf16"):
                print(f"  full-bf16 / bare bf16 {tag}: {rate(f'full-{tag}') / ceilings['bf16']:.3f}  (same policy)")
            for other in ("buckets", "buckets-dynamic", "lora64"):
                if rate(f"{other}-{tag}") and b:
                    print(f"  {other}/square {tag}: {rate(f'{other}-{tag}') / b:.3f}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
