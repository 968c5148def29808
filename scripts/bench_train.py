"""Benchmark `laionkit train` against the train-step ceiling and a raw trainer (not a test; docs/BENCHMARKS.md).

Per resolution (256 px batch 128, 512 px batch 64), SD-1.5-size UNet (random init), bf16, fused AdamW:
(a) ceiling: the same train step (laionkit.trainer.loop.train_step on the model, MasterWeights policy, optimizer
    and LR scheduler that laionkit.trainer.loop.build makes, through the same Accelerator, timed by train's
    MetricsWindow) fed by tensors already on the GPU, eager and compiled; `precision`: the same under the
    other precision policy (eager: autocast over fp32 weights, --no-bf16-weights; compiled: bf16 weights
    with fp32 master, --bf16-weights);
(b) `laionkit train` on latent shards written by `laionkit encode` (SD-VAE-size and CLIP-L-size
    random-init encoders on photo-like JPEGs), its own samples/s from metrics.jsonl, eager and compiled;
(c) raw trainer: the same loss with the VAE and text encoder in the loop, reading the JPEG shards with
    DataLoader workers (decode, resize, crop, tokenize), with diffusers' train_text_to_image.py settings
    (torch's default AdamW, no channels_last, no cuDNN autotuning);
(ddp, fsdp, deepspeed) `laionkit train` under `accelerate launch --config_file train/{ddp,fsdp,deepspeed-zero2}.yaml`
    on each GPU count of --gpus (default 2) vs (b) on one: samples/s, speed-up and scaling efficiency, and
    whether the export holds fp32 weights (export_not_bf16_share > 0) or their bf16 rounding (0).
Every measurement runs in its own process (torch.compile with dynamic=False: one shape per process).

    python scripts/bench_train.py --out results/                 # GPU machine
    python scripts/bench_train.py --smoke --out /tmp/bench-train  # CPU, tiny models, plumbing only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import make_shards, write_real_size_models  # noqa: E402  (shared photo-like data)
from benchlib import _sync, profile_steps  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = {256: 128, 512: 64}  # resolution -> batch per GPU
STRATEGIES = {"ddp": "ddp.yaml", "fsdp": "fsdp.yaml", "deepspeed": "deepspeed-zero2.yaml"}


def export_precision(folder: Path) -> dict:
    """Whether an exported UNet holds fp32 master weights or only their bf16 rounding: the share of its
    floating-point values that a bf16 round trip would change (0.0 means bf16-rounded weights were saved)."""
    from safetensors.torch import load_file

    changed = total = 0
    for path in folder.glob("*.safetensors"):
        for tensor in load_file(path).values():
            if tensor.is_floating_point():
                changed += int((tensor.float() != tensor.bfloat16().float()).sum())
                total += tensor.numel()
    return {"export_not_bf16_share": changed / max(total, 1)}


def train_args(latents: Path, run: Path, batch: int, steps: int, log_every: int, compiled: bool,
               smoke: bool, unet_config: str = "sd15", shuffle_buffer: int = 256,
               channels_last: bool = True) -> list[str]:
    """`laionkit train` flags of a (b) measurement: no checkpoints, no trackers, bf16 (smoke: the tiny
    UNet in fp32); compiled with channels_last unless ``channels_last`` is off."""
    args = ["train", str(latents), "--output", str(run), "--unet-config", "tiny" if smoke else unet_config,
            "--batch-size", str(batch), "--max-steps", str(steps), "--log-every", str(log_every),
            "--checkpoint-every", str(10**9), "--no-checkpoint-at-end", "--log-with", "none", "--quiet", "--workers", "4",
            "--mixed-precision", "no" if smoke else "bf16", "--shuffle-buffer", str(shuffle_buffer)]
    return args + (["--compile", *(["--channels-last"] if channels_last else [])] if compiled else [])


def steady_rate(run: Path) -> dict:
    """samples/s, MFU and data-wait of the log windows after the first (start-up, compilation)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = len(records[1:])
    records = records[1:] or records  # a run cut short after one window: that window, start-up included
    if not records:
        return {}
    pick = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    return {"samples_per_s": pick("samples_per_s"), "mfu": pick("mfu"), "data_wait_pct": pick("data_wait_pct"),
            "gpu_mem_gib": max(r["gpu_mem_gib"] for r in records), "timed_windows": timed}


# --- children: one measurement per process ---------------------------------------------------------

def _trainer(config, diffusers_optimizer: bool = False):
    """The model, optimizer and LR scheduler as `laionkit train` builds them (laionkit.trainer.loop.setup, in a
    scratch run folder), or for the raw trainer with the optimizer diffusers' script builds
    (torch.optim.AdamW, its defaults); and a MetricsWindow that times the steps as train's log windows do."""
    from laionkit.trainer.loop import setup
    from laionkit.trainer.metrics import MetricsWindow
    from laionkit.trainer.precision import make_optimizer

    def diffusers_adamw(config, params, lr, _device):
        return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)

    trainer = setup(config, optimizer_factory=diffusers_adamw if diffusers_optimizer else make_optimizer)
    return trainer, MetricsWindow(trainer.accelerator, trainer.schedule.global_batch, config.peak_tflops)


def _measure(trainer, window, batches, warmup: int, steps: int) -> dict:
    """laionkit.trainer.loop.train_step on ``batches``: ``warmup`` steps, then the window's figures over ``steps``."""
    from laionkit.trainer.loop import train_step

    for _ in range(warmup):
        train_step(trainer, batches, 0, window)
    _sync(trainer.device)
    window.reset()
    for _ in range(steps):
        train_step(trainer, batches, 0, window)
    _sync(trainer.device)
    return window.rates(time.perf_counter() - window.start, window.flops)


def child_ceiling(args) -> dict:
    """(a): the train step on in-GPU tensors, as fast as the step itself allows."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.loop import train_step

    if args.sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                     "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.sdpa]).__enter__()
    data = open_latents(args.latents)
    config = TrainConfig(latents=args.latents, output=Path(tempfile.mkdtemp(prefix="bench-train-")),
                         unet_config=args.unet_config, batch_size=args.batch, max_steps=1,
                         mixed_precision=args.precision, compile=args.compile,
                         compile_mode=args.compile_mode, channels_last=args.compile or args.channels_last,
                         bf16_weights=args.bf16_weights, log_with="none")
    torch.backends.cudnn.benchmark = bool(args.cudnn_benchmark)
    trainer, window = _trainer(config)
    device, dtype = trainer.device, trainer.input_dtype
    batch = {"key": [""] * args.batch, "moments": torch.randn(args.batch, *data.moments_shape, device=device).half(),
             "text": torch.randn(args.batch, *data.text_shape, device=device, dtype=dtype)}
    batches = itertools.repeat(batch)
    result = _measure(trainer, window, batches, args.warmup, args.steps)
    if args.profile:
        print(profile_steps(lambda: train_step(trainer, batches, 0, window), args.profile, device), flush=True)
    return result


def _jpeg_sample(sample: dict, resolution: int, tokenizer) -> dict:
    """The raw trainer's per-sample work: decode, resize the short side, centre-crop, normalise, tokenize."""
    import io

    import numpy as np
    from PIL import Image

    image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
    scale = resolution / min(image.size)
    image = image.resize((max(resolution, round(image.width * scale)), max(resolution, round(image.height * scale))),
                         Image.Resampling.BICUBIC)
    left, top = (image.width - resolution) // 2, (image.height - resolution) // 2
    image = image.crop((left, top, left + resolution, top + resolution))
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 127.5 - 1
    ids = tokenizer(sample["txt"].decode(), padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids[0]
    return {"key": sample["__key__"], "pixels": pixels, "input_ids": ids}


def child_raw(args) -> dict:
    """(c): JPEG shards → DataLoader workers → VAE + text encoder on the GPU → the same train step."""
    import functools

    import webdataset as wds

    from laionkit.common.models import load_text_encoder, load_tokenizer, load_vae
    from laionkit.trainer.config import TrainConfig

    config = TrainConfig(latents=args.latents, output=Path(tempfile.mkdtemp(prefix="bench-train-")),
                         unet_config=args.unet_config, batch_size=args.batch, max_steps=1,
                         mixed_precision=args.precision, channels_last=False,
                         bf16_weights=False, log_with="none")  # diffusers' scripts: autocast over fp32 weights
    trainer, window = _trainer(config, diffusers_optimizer=True)
    device = trainer.device
    dtype = torch.float32 if args.precision == "no" else torch.bfloat16
    vae = load_vae(str(args.models), dtype=dtype).to(device)
    text_encoder = load_text_encoder(str(args.models), dtype=dtype).to(device)
    tokenizer = load_tokenizer(str(args.models))
    shards = [str(p) for p in sorted(Path(args.jpegs).glob("*.tar"))]
    dataset = (wds.WebDataset(shards, shardshuffle=False, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, empty_check=False).repeat()
               .map(functools.partial(_jpeg_sample, resolution=args.resolution, tokenizer=tokenizer)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, num_workers=args.workers,
                                         pin_memory=device.type == "cuda", prefetch_factor=4)

    def encoded():
        """The loader's batches through the VAE and text encoder. train_step counts all of next() as data
        wait; the encoders' share is taken off again, so that data_wait_pct is the loader's, as train's."""
        for batch in loader:
            began = time.perf_counter()
            with torch.no_grad():
                pixels = batch["pixels"].to(device, dtype, non_blocking=True)
                moments = vae.encode(pixels).latent_dist.parameters
                text = text_encoder(batch["input_ids"].to(device, non_blocking=True))[0].float()
            window.data_wait -= time.perf_counter() - began
            yield {"key": batch["key"], "moments": moments, "text": text}

    return _measure(trainer, window, encoded(), args.warmup, args.steps)


# --- the orchestrator -------------------------------------------------------------------------------

def run_child(out: Path, name: str, argv: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run one measurement in its own process; its failure is recorded, not fatal to the others."""
    began = time.perf_counter()
    log = out / f"{name}.log"
    try:
        with open(log, "w") as handle:
            subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout, check=True,
                           env=env, cwd=REPO)
        result = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else {}
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        result = {"error": f"{type(error).__name__}: {log.read_text()[-600:]}"}
    result["wall_s"] = round(time.perf_counter() - began, 1)
    return result


def family_bench_parser(doc: str) -> argparse.ArgumentParser:
    """The flags bench_train_sdxl.py and bench_train_flow.py share: the work folder and report, the
    resolutions, steps and time budget, and a child measurement's own (--name, --resolution, --batch,
    --warmup, --compile)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="work folder: models, shards, latents, runs")
    parser.add_argument("--report", type=Path, help="also copy results.json and the child logs here")
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny models, 64 px, few steps")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--images", type=int, default=256, help="photos per latent set")
    parser.add_argument("--steps", type=int, default=15, help="timed steps (b: 3 log windows of steps/3 after one)")
    parser.add_argument("--budget", type=float, default=560, help="seconds; later measurements are skipped")
    parser.add_argument("--name")
    parser.add_argument("--resolution", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    return parser


def time_bare_step(step, one_sample, model, steps: int, warmup: int, batch: int, device: torch.device) -> dict:
    """A bare ceiling's figures: the model FLOPs of ``one_sample()`` (forward + backward of one sample, by
    torch's flop counter), ``warmup`` untimed calls of ``step()``, then ``steps`` timed ones, reported as
    train's metrics.jsonl reports a window (laionkit.trainer.metrics.throughput: samples/s, MFU, peak memory)."""
    from laionkit.trainer.metrics import throughput
    from laionkit.trainer.model import flop_counter

    counter = flop_counter()  # train's own counter (grouped convolutions' backward per group)
    with counter:
        one_sample()
    model.zero_grad(set_to_none=True)
    flops = float(counter.get_total_flops())
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    result = throughput(steps * batch, steps * batch * flops, time.perf_counter() - started, 0.0, device)
    return {**result, "tflops": flops * result["samples_per_s"] / 1e12, "flops_per_sample": flops,
            "parameters": sum(p.numel() for p in model.parameters())}


def measurer(out: Path, budget: float, started: float, env: dict, results: dict[str, dict], show: int = 400,
             report: Path | None = None):
    """``measure(name, argv, run=None)``: one child measurement under the call's time budget (skipped with
    under 40 s left), recorded in ``results[name]``; a `laionkit train` run folder adds its steady rate and
    its samples per bucket from metrics.jsonl, kept as OUT/<name>-metrics.jsonl, and the run folder is then
    removed (a real-size export is GBs); with ``report``, the results so far are rewritten to
    REPORT/results-partial.json after each measurement."""

    def measure(name: str, argv: list[str], run: Path | None = None) -> None:
        left = budget - (time.perf_counter() - started)
        if left < 40:
            results[name] = {"error": "skipped: out of time budget"}
            print(f"{name}: skipped", flush=True)
            return
        if run is not None:
            shutil.rmtree(run, ignore_errors=True)
        results[name] = run_child(out, name, argv, timeout=left, env=env)
        if run is not None and (run / "metrics.jsonl").exists():
            # also after an error past the timed steps (a 12B export cut off by the time budget): the rates
            # are the steps' own, and the error stays in the record beside them
            results[name].update(steady_rate(run))
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            results[name]["samples_per_bucket"] = records[-1].get("samples_per_bucket") if records else None
            shutil.copy(run / "metrics.jsonl", out / f"{name}-metrics.jsonl")
        if run is not None:  # a real-size run's export and last checkpoint are GBs: a call's runs filled 64 GB
            shutil.rmtree(run, ignore_errors=True)
        print(f"{name}: {json.dumps(results[name])[:show]}", flush=True)
        if report is not None:  # what is measured so far survives a call cut short by its time limit
            report.mkdir(parents=True, exist_ok=True)
            (report / "results-partial.json").write_text(json.dumps(results, indent=1))

    return measure


def child_argv(out: Path, name: str, mode: str, *, script: str = __file__, **kw) -> list[str]:
    """The command of one child measurement of ``script``: keyword arguments become its flags."""
    argv = [sys.executable, script, "--child", mode, "--out", str(out), "--name", name]
    for key, value in kw.items():
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
        elif value is not None and value is not False:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def prepare(out: Path, args) -> dict:
    """Models, photo-like JPEG shards and their latent shards (`laionkit encode`), per resolution."""
    from laionkit.common.models import write_tiny_models
    from laionkit.encode import EncodeConfig, run

    models = out / "models"
    if not models.exists():
        write_tiny_models(models) if args.smoke else write_real_size_models(models)
    made = {}
    for resolution in args.resolutions:
        jpegs = out / f"jpeg-{resolution}"
        if not any(jpegs.glob("*.tar")):  # a warm machine keeps them between calls
            make_shards(jpegs, args.images, resolution, os.cpu_count() or 2)
        latents = out / f"latents-{resolution}"
        run(EncodeConfig(shards=(str(jpegs),), output=latents, model=str(models), resolution=resolution,
                         batch_size=32, workers=min(8, os.cpu_count() or 2), quiet=True), log=lambda _: None)
        made[resolution] = (jpegs, latents)
    return {"models": models, "data": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="work folder: models, shards, runs, logs")
    parser.add_argument("--report", type=Path, help="also copy results.json and the child logs (one file) here")
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny models, 64 px, few steps")
    parser.add_argument("--parts", default="a,b,c,ddp",
                        help="comma list of a, b, c, ddp, fsdp, deepspeed, precision (ceiling under the other precision "
                             "policy), variants (eager ceiling with channels_last, with cuDNN autotuning), push")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    parser.add_argument("--images", type=int, default=1024, help="JPEGs (= latent samples) per resolution")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per measurement")
    parser.add_argument("--budget", type=float, default=520, help="seconds; later measurements are skipped")
    parser.add_argument("--gpus", type=int, nargs="+", default=[2], help="GPU counts for the ddp / fsdp parts")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after timing, profile this many ceiling steps (torch.profiler) into the child's log")
    # child-only arguments
    parser.add_argument("--child", choices=["ceiling", "raw"])
    parser.add_argument("--name")
    parser.add_argument("--latents", type=Path)
    parser.add_argument("--jpegs", type=Path)
    parser.add_argument("--models", type=Path)
    parser.add_argument("--resolution", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--sdpa", choices=["flash", "cudnn", "efficient"])
    parser.add_argument("--channels-last", action="store_true", help="eager ceiling in channels_last")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="ceiling with cuDNN autotuning")
    parser.add_argument("--bf16-weights", action=argparse.BooleanOptionalAction,
                        help="ceiling with bf16 weights + fp32 master (or autocast); default: laionkit's choice")
    parser.add_argument("--unet-config", default="sd15")
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        result = {"ceiling": child_ceiling, "raw": child_raw}[args.child](args)
        (args.out / f"{args.name}.json").write_text(json.dumps(result))
        return

    started = time.perf_counter()
    if args.smoke:
        args.resolutions, args.images, args.steps = [64], 16, 4
    smoke = dict(unet_config="tiny", precision="no") if args.smoke else {}
    parts = set(args.parts.split(","))
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    prepared = prepare(args.out, args)
    print(f"prepared data in {time.perf_counter() - started:.0f} s", flush=True)
    results: dict[str, dict] = {}
    left = lambda: args.budget - (time.perf_counter() - started)  # noqa: E731

    def measure(name: str, argv: list[str], run: Path | None = None, **kw) -> None:
        if left() < 30:
            results[name] = {"error": "skipped: out of time budget"}
            return
        if run is not None:
            shutil.rmtree(run, ignore_errors=True)
        results[name] = run_child(args.out, name, argv, timeout=left(), **kw)
        if run is not None and (run / "metrics.jsonl").exists():
            # also after an error past the timed steps (a 12B export cut off by the time budget): the rates
            # are the steps' own, and the error stays in the record beside them
            results[name].update(steady_rate(run))
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)

    # Eager first at every resolution (the targets' baseline), then compiled: what the budget cuts is last.
    for compiled in [mode == "compiled" for mode in args.modes.split(",")]:
        for resolution in args.resolutions:
            batch = 4 if args.smoke else SIZES[resolution]
            jpegs, latents = prepared["data"][resolution]
            log_every = max(2, args.steps // 3)
            common = dict(latents=latents, batch=batch, warmup=3, profile=args.profile or None, **smoke)
            tag = f"{resolution}-{'compiled' if compiled else 'eager'}"
            if "a" in parts:
                measure(f"a-{tag}", child_argv(args.out, f"a-{tag}", "ceiling", steps=args.steps,
                                               compile=compiled, **common), env=env)
            if "precision" in parts:  # the policy laionkit does not pick in this mode
                other = "bf16-weights" if compiled else "autocast"
                name = f"a-{tag}-{other}"
                flag = "--bf16-weights" if compiled else "--no-bf16-weights"
                measure(name, [*child_argv(args.out, name, "ceiling", steps=args.steps, compile=compiled, **common),
                               flag], env=env)
            if "variants" in parts and not compiled and resolution == args.resolutions[0]:
                # Eager step options laionkit leaves off by default; what each would buy.
                for name, extra in [("channels-last", dict(channels_last=True)),
                                    ("autotune", dict(cudnn_benchmark=True))]:
                    name = f"a-{tag}-{name}"
                    measure(name, child_argv(args.out, name, "ceiling", steps=args.steps, **common, **extra),
                            env=env)
            if "b" in parts:
                run = args.out / f"run-b-{tag}"
                cli = [sys.executable, "-m", "laionkit.cli",
                       *train_args(latents, run, batch, log_every * 4, log_every, compiled, args.smoke)]
                measure(f"b-{tag}", cli, run=run, env=env)
            if "c" in parts and not compiled:
                measure(f"c-{tag}", child_argv(args.out, f"c-{tag}", "raw", steps=args.steps, jpegs=jpegs,
                                               models=prepared["models"], resolution=resolution, **common),
                        env=env)
        for strategy, gpus in itertools.product(STRATEGIES, args.gpus):  # the launch configs in train/
            if strategy not in parts or compiled:
                continue
            resolution = args.resolutions[0]
            batch = 4 if args.smoke else SIZES[resolution]
            log_every = max(2, args.steps // 3)
            run = args.out / f"run-{strategy}"
            launch = [sys.executable, "-m", "accelerate.commands.launch",
                      "--config_file", str(REPO / "train" / STRATEGIES[strategy]), "--num_processes", str(gpus),
                      *(["--cpu", "--mixed_precision", "no"] if args.smoke else [])]
            latents = prepared["data"][resolution][1]
            cli = [*launch, "-m", "laionkit.cli",
                   *train_args(latents, run, batch, log_every * 4, log_every, False, args.smoke)]
            measure(f"{strategy}{gpus}-{resolution}-eager", cli, run=run, env=env)
            if (run / "unet").is_dir():
                results[f"{strategy}{gpus}-{resolution}-eager"].update(export_precision(run / "unet"))
    if "push" in parts:
        resolution = args.resolutions[0]
        batch = 4 if args.smoke else SIZES[resolution]
        latents = prepared["data"][resolution][1]
        # Same shapes first (they reuse the compiled ceiling's inductor cache), the new batch shape last.
        for name, extra in [("cudnn-attn", dict(sdpa="cudnn")), ("cudagraphs", dict(compile_mode="reduce-overhead")),
                            ("bs2x", dict(batch=2 * batch))]:
            kw = dict(latents=latents, batch=batch, warmup=3, steps=args.steps, compile=not args.smoke,
                      **smoke) | extra
            name = f"push-{resolution}-{name}"
            measure(name, child_argv(args.out, name, "ceiling", **kw), env=env)

    report(results, args)


def print_table(results: dict[str, dict], title: str, width: int = 30) -> None:
    """One row per measurement: samples/s, MFU, data-wait, peak GiB, wall seconds (or its error)."""
    print(f"\n{title}")
    print(f"{'measurement':<{width}}{'samples/s':>11}{'MFU':>8}{'wait %':>8}{'GiB':>8}{'wall s':>8}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<{width}} ERROR {r['error'][-300:]!r}")
            continue
        print(f"{name:<{width}}{r['samples_per_s']:>11.2f}{r['mfu']:>8.3f}{r['data_wait_pct']:>8.2f}"
              f"{r['gpu_mem_gib']:>8.1f}{r['wall_s']:>8.0f}")


def save_results(summary: dict, out: Path, report: Path | None, suffix: str = "", tail: int = 20000) -> None:
    """results.json in ``out``; with ``report``, a copy and the children's logs (their last ``tail``
    characters each, one file) there too."""
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    if report:
        report.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "results.json", report / f"results{suffix}.json")
        logs = "".join(f"===== {log.name}\n{log.read_text()[-tail:]}\n" for log in sorted(out.glob("*.log")))
        (report / f"children{suffix}.log").write_text(logs)


def report(results: dict[str, dict], args) -> None:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    summary = {"device": device, "torch": torch.__version__, "results": results}
    save_results(summary, args.out, args.report)
    rate = lambda name: results.get(name, {}).get("samples_per_s")  # noqa: E731
    print_table(results, f"{device}, torch {torch.__version__}")
    print("\nratios")
    for resolution in args.resolutions:
        for mode in ("eager", "compiled"):
            a, b = rate(f"a-{resolution}-{mode}"), rate(f"b-{resolution}-{mode}")
            if a and b:
                print(f"  b/a {resolution} {mode}: {b / a:.3f}  (target >= 0.98)")
        b, c = rate(f"b-{resolution}-eager"), rate(f"c-{resolution}-eager")
        if b and c:
            print(f"  b/c {resolution} eager: {b / c:.2f}  (target >= 1.6)")
    for resolution, mode in itertools.product(args.resolutions, ("eager", "compiled")):
        bf16 = rate(f"a-{resolution}-{mode}" if mode == "eager" else f"a-{resolution}-{mode}-bf16-weights")
        autocast = rate(f"a-{resolution}-{mode}-autocast" if mode == "eager" else f"a-{resolution}-{mode}")
        if bf16 and autocast:
            print(f"  {mode} ceiling {resolution}, bf16 weights + fp32 master / autocast: {bf16 / autocast:.3f}")
    resolution = args.resolutions[0]
    for variant in ("channels-last", "autotune"):
        plain, other = rate(f"a-{resolution}-eager"), rate(f"a-{resolution}-eager-{variant}")
        if plain and other:
            print(f"  eager ceiling with {variant} / without: {other / plain:.3f}")
    one = rate(f"b-{resolution}-eager")
    for strategy, gpus in itertools.product(STRATEGIES, args.gpus):
        many = rate(f"{strategy}{gpus}-{resolution}-eager")
        if one and many:
            print(f"  {strategy} {gpus} GPUs / 1 GPU {resolution} eager: {many / one:.2f}x, scaling efficiency "
                  f"{many / one / gpus:.3f}  (targets: 1.9x at 2, 7.5x at 8 for DDP)")
    eager, compiled = rate(f"a-{resolution}-eager"), rate(f"a-{resolution}-compiled")
    for name in results:
        if name.startswith("push-") and rate(name) and eager:
            print(f"  {name}: {rate(name) / eager:.2f}x eager ceiling"
                  + (f", {rate(name) / compiled:.2f}x compiled" if compiled else ""))


if __name__ == "__main__":
    main()
