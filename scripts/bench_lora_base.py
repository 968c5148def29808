"""Benchmark LoRA on a quantized or float8 frozen base (`laionkit train --base-dtype`, `--fp8 --lora-rank`) against
the bare diffusers + PEFT bf16 step (not a test; results in docs/BENCHMARKS.md).

Flux-12B (``--transformer-config flux-dev``, random init) LoRA-64 at 1024 px, batch 2, compiled, every row on the
same latents with the same seed (so the same noise and timesteps step by step):

(bare)      the ceiling: bench_train_flow.py's bare diffusers step, PEFT ``add_adapter`` rank 64 on the frozen bf16
            model, each block compiled.
(bf16)      `laionkit train --lora-rank 64 --lora-random-base --compile`: the frozen base in bf16.
(fp8-tw)    the same with ``--fp8`` (``--fp8-recipe tensorwise``): the bf16 base's block matmuls in float8.
(fp8-rw)    the same with ``--fp8-recipe rowwise``.
(nf4, int8) ``--base-dtype nf4`` / ``int8``: the base's block linears stored so, dequantized per matmul (bf16).
(fp8-base)  ``--base-dtype fp8 --fp8``: the stored float8 weights straight into float8 matmuls (tensorwise: the
            per-channel weight scales multiply an fp32 output).
(fp8-base-rw) the same with ``--fp8-recipe rowwise``: the per-channel weight scales go into the rowwise GEMM, and
            no weight is cast in the step.
(flux2)     FLUX.2 [dev] (32B, random init drawn block by block straight into ``--flux2-dtype``, nf4 by default:
            its 64 GB of bf16 never exist) LoRA-64 at 1024 px, batch 1, ``--checkpointing blocks``, eager.
(bare-flux2) its ceiling: the bare diffusers step, PEFT rank 64, the block linears as torchao's NF4Tensor (as
            torchtune's QLoRA and diffusers' QLoRA example keep them), diffusers' gradient checkpointing, eager.
(qwen, qwen-nf4)  Qwen-Image (20B) LoRA-64 at 1024 px, batch 1, ``--checkpointing blocks``, eager, on a bf16 / nf4
            base; (bare-qwen, bare-qwen-nf4) their bare ceilings as bare-flux2's (bf16: no quantization);
            (bare-qwen-bnb, bare-flux2-bnb) the same on bitsandbytes' Linear4bit nf4 base, as diffusers' QLoRA
            example loads it; (qwen-nf4-torch, flux2-torch) laionkit's nf4 rows with bitsandbytes hidden, so the
            base dequantizes by torch ops instead of bitsandbytes' kernel.

Each row reports samples/s (median of the steps after the first ``--warmup``), peak GPU memory, and its loss per
step; the summary gives each row's rate against bf16 and against the bare ceiling, and its mean |loss - bf16's
loss| over the steps against the bf16 run's own step-to-step spread (the float8 / quantization noise it adds).
Rows run in order, each in its own process, until ``--budget`` seconds are spent (a row needs 40 s to start).

    python scripts/bench_lora_base.py --out /tmp/lora-base --report $OUT            # H100: one call, < 8 min
    python scripts/bench_lora_base.py --smoke --out /tmp/lora-base-smoke --budget 1200   # CPU plumbing (eager)
    python scripts/bench_lora_base.py --rows bf16,fp8-rw --steps 200 --out /tmp/x   # loss parity, longer
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_flow  # noqa: E402
from bench_train import family_bench_parser, measurer, print_table, save_results  # noqa: E402
from bench_train_sdxl import prepare  # noqa: E402

LORA = ("--lora-rank", "64", "--lora-random-base")
# row -> `laionkit train` flags besides LORA (Flux-12B, compiled)
ROWS = {"bf16": (), "fp8-tw": ("--fp8", "--fp8-recipe", "tensorwise"), "fp8-rw": ("--fp8", "--fp8-recipe", "rowwise"),
        "nf4": ("--base-dtype", "nf4"), "fp8-base": ("--base-dtype", "fp8", "--fp8"), "int8": ("--base-dtype", "int8"),
        "fp8-base-rw": ("--base-dtype", "fp8", "--fp8", "--fp8-recipe", "rowwise")}
ORDER = "bare,bf16,fp8-tw,fp8-rw,flux2,nf4,fp8-base,int8"
# rows of the 20-32B families, eager at batch 1 with checkpointed blocks: row -> (family, base dtype, bare or not)
LARGE = {"flux2": ("flux2-dev", None, False), "bare-flux2": ("flux2-dev", "nf4", True),
         "qwen": ("qwen-image", "bf16", False), "qwen-nf4": ("qwen-image", "nf4", False),
         "bare-qwen": ("qwen-image", "bf16", True), "bare-qwen-nf4": ("qwen-image", "nf4", True),
         "bare-qwen-bnb": ("qwen-image", "bnb-nf4", True), "bare-flux2-bnb": ("flux2-dev", "bnb-nf4", True),
         "qwen-nf4-torch": ("qwen-image", "nf4", False), "flux2-torch": ("flux2-dev", "nf4", False)}
PAIRS = (("flux2", "bare-flux2"), ("flux2", "bare-flux2-bnb"), ("flux2-torch", "bare-flux2"), ("qwen", "bare-qwen"),
         ("qwen-nf4", "bare-qwen-nf4"), ("qwen-nf4", "bare-qwen-bnb"), ("qwen-nf4-torch", "bare-qwen-nf4"))
# a `laionkit train` that cannot import bitsandbytes (the *-torch rows)
WITHOUT_BNB = [sys.executable, "-c", "import runpy, sys; sys.modules['bitsandbytes'] = None; "
               "runpy.run_module('laionkit.cli', run_name='__main__')"]


def main() -> None:
    parser = family_bench_parser(__doc__)
    parser.add_argument("--rows", default=ORDER, help=f"comma list of {','.join(['bare', *ROWS, *LARGE])} (default: {ORDER})")
    parser.add_argument("--batch-size", type=int, default=2, help="Flux-12B's batch")
    parser.add_argument("--flux2-dtype", default="nf4", choices=["nf4", "int8", "fp8"])
    parser.set_defaults(resolutions=[1024], images=64, steps=24, budget=470)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.smoke:
        args.resolutions, args.images, args.steps, args.batch_size = [64], 8, 4, 2
    resolution = args.resolutions[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(bench_train_flow.REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    results: dict[str, dict] = {}
    measure = measurer(args.out, args.budget, started, env, results, show=300, report=args.report)
    rows = args.rows.split(",")
    latents = {}
    families = {LARGE[row][0] if row in LARGE else "flux" for row in rows}
    for family in sorted(families):  # real-width text, 1 layer deep
        models = bench_train_flow.write_models(args.out / f"models-{family}", family, args.smoke, text_layers=1)
        bench_train_flow.free_gpu()  # the text encoders built here: encode's process needs the card
        latents[family] = prepare(args.out / family, resolution, args.images, False, models)
    bench_train_flow.free_gpu()
    print(f"latents ready after {time.perf_counter() - started:.0f} s", flush=True)

    def train(name: str, family: str, batch: int, *flags: str) -> None:
        run = args.out / f"run-{name}"
        python = WITHOUT_BNB if name.endswith("-torch") else [sys.executable, "-m", "laionkit.cli"]
        measure(name, [*python, "train", str(latents[family]), "--output", str(run),
                       "--transformer-config", "tiny" if args.smoke else bench_train_flow.CONFIG[family],
                       "--batch-size", str(batch), "--max-steps", str(args.steps), "--log-every", "1", "--seed", "0",
                       "--checkpoint-every", str(10**9), "--no-checkpoint-at-end", "--export", "none",
                       "--log-with", "none", "--quiet", "--workers", "4", "--shuffle-buffer", "64",
                       "--mixed-precision", "no" if args.smoke else "bf16", *LORA, *flags], run)
        logged = args.out / f"{name}-metrics.jsonl"
        if logged.exists():
            records = [json.loads(line) for line in logged.read_text().splitlines()]
            results[name]["losses"] = [record["loss"] for record in records]
            rates = [record["samples_per_s"] for record in records][args.warmup:]
            results[name]["samples_per_s"] = statistics.median(rates) if rates else None

    for row in rows:
        if row == "bare":
            measure("bare", bench_train_flow.child_argv(
                args.out, "bare", "bare", script=bench_train_flow.__file__, family="flux", resolution=resolution,
                batch=args.batch_size, steps=args.steps, warmup=args.warmup, compile=not args.smoke, smoke=args.smoke,
                lora=64))
        elif row in LARGE:
            family, dtype, bare = LARGE[row]
            dtype = dtype or args.flux2_dtype
            if bare:
                text_len = bench_train_flow.stored_text_len(latents[family]) if family == "qwen-image" else None
                measure(row, bench_train_flow.child_argv(
                    args.out, row, "bare", script=bench_train_flow.__file__, family=family, resolution=resolution,
                    batch=1, steps=args.steps, warmup=args.warmup, smoke=args.smoke, lora=64, checkpointing=True,
                    text_len=text_len, base_quant=None if dtype == "bf16" else dtype))
            else:
                train(row, family, 1, "--base-dtype", dtype, "--checkpointing", "blocks")
        else:
            train(row, "flux", args.batch_size, *(() if args.smoke else ("--compile",)), *ROWS[row])

    summary = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0)
               if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "results": results}
    save_results(summary, args.out, args.report, suffix="-lora-base", tail=8000)
    print_table({name: {k: v for k, v in result.items() if k != "losses"} for name, result in results.items()},
                f"{summary['device']}, torch {torch.__version__}")
    report(results)
    print(f"total {time.perf_counter() - started:.0f} s")


def report(results: dict[str, dict]) -> None:
    """Each Flux row's rate against bf16 and the bare ceiling, and its loss against bf16's, step by step."""
    rate = lambda name: results.get(name, {}).get("samples_per_s")  # noqa: E731
    base = results.get("bf16", {}).get("losses") or []
    spread = statistics.pstdev(base) if len(base) > 1 else None
    for name in ROWS:
        if not rate(name):
            continue
        line = f"  {name}: {rate(name):.3f} samples/s, peak {results[name].get('gpu_mem_gib')} GiB"
        if rate("bf16"):
            line += f"; x{rate(name) / rate('bf16'):.3f} bf16"
        if rate("bare"):
            line += f", {rate(name) / rate('bare'):.3f} of bare"
        losses = results[name].get("losses") or []
        if base and losses and name != "bf16":
            steps = min(len(base), len(losses))
            gap = statistics.mean(abs(a - b) for a, b in zip(losses[:steps], base[:steps]))
            line += f"; mean |loss - bf16's| {gap:.4f} over {steps} steps (bf16's step-to-step std {spread:.4f})"
        print(line)
    for name, bare in PAIRS:
        if rate(name):
            line = f"  {name}: {rate(name):.3f} samples/s, peak {results[name].get('gpu_mem_gib')} GiB"
            if rate(bare):
                line += (f"; {bare}: {rate(bare):.3f} samples/s, peak {results[bare].get('gpu_mem_gib')} GiB; "
                         f"b/a {rate(name) / rate(bare):.3f}")
            print(line)


if __name__ == "__main__":
    main()
