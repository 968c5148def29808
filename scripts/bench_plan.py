"""Benchmark `laionkit plan` and `--checkpointing auto` per family at real size (not a test; results in
docs/BENCHMARKS.md): Flux-12B LoRA-64 at 1024 px (the default), and full-parameter SD-1.5 (512 px), SDXL,
SD3-medium and PixArt-Σ (1024 px) from scratch (``--family``, ``SETUPS``).

The question: which per-GPU batch, --checkpointing and compile setting trains fastest on this GPU, and does
`laionkit plan` find it. The transformer is flux-dev's architecture at real size (11.9B, random init,
``--lora-random-base``: LoRA rank 64 on a frozen bf16 base, as a fine-tune of FLUX.1-dev trains). The latents
come from `laionkit encode --text stored` of generated JPEGs at 1024 px with a tiny 16-channel VAE (8x, as
Flux's) and text encoders of the real widths but one layer each (T5: d_model 4096, CLIP-L: 768): the stored
text has T5-XXL's 512 x 4096 states and CLIP-L's pooled 768, so the train step sees real shapes; what the
text says does not matter to its speed, and building the 24-layer T5-XXL would cost minutes of the call.

    python scripts/bench_plan.py --out /tmp/plan --compile off --report $OUT   # GPU machine, call 1
    python scripts/bench_plan.py --out /tmp/plan --compile on --report $OUT    # GPU machine, call 2
    python scripts/bench_plan.py --family sd3 --compile both --out /tmp/plan --report $OUT
    python scripts/bench_plan.py --smoke --out /tmp/plan-smoke                 # CPU plumbing check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_sdxl import prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def clip(projection: bool, hidden: int, act: str):
    """A one-layer CLIP text encoder of a real width (CLIP-L 768, CLIP-G 1280)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW

    config = CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden,
                            num_hidden_layers=1, num_attention_heads=hidden // 64, projection_dim=hidden,
                            max_position_embeddings=CLIP_WINDOW, hidden_act=act, bos_token_id=49406,
                            eos_token_id=49407, pad_token_id=1)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def t5():
    """A one-layer T5 encoder of T5-XXL's width (d_model 4096, 64 heads, d_ff 10240)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                   is_encoder_decoder=False))


TEXT_ENCODERS = {  # per family: its text encoders at their real widths, one layer each
    "sd": lambda: {"text_encoder": clip(False, 768, "quick_gelu")},
    "sdxl": lambda: {"text_encoder": clip(False, 768, "quick_gelu"), "text_encoder_2": clip(True, 1280, "gelu")},
    "sd3": lambda: {"text_encoder": clip(True, 768, "quick_gelu"), "text_encoder_2": clip(True, 1280, "gelu"),
                    "text_encoder_3": t5()},
    "flux": lambda: {"text_encoder": clip(False, 768, "quick_gelu"), "text_encoder_2": t5()},
    "pixart": lambda: {"text_encoder": t5()},
}
# per family: the real-size architecture, the resolution its presets train at, LoRA or full-parameter
SETUPS = {
    "sd": dict(flags=["--unet-config", "sd15"], resolution=512, batches="16,32,64"),
    "sdxl": dict(flags=["--unet-config", "sdxl"], resolution=1024, batches="4,8,16"),
    "sd3": dict(flags=["--transformer-config", "sd3-medium"], resolution=1024, batches="4,8,16"),
    "pixart": dict(flags=["--transformer-config", "pixart-sigma-xl"], resolution=1024, batches="8,16,32"),
    "flux": dict(flags=["--transformer-config", "flux-dev", "--lora-rank", "64", "--lora-random-base"],
                 resolution=1024, batches="1,2,4"),
}


def write_models(folder: Path, family: str, smoke: bool) -> Path:
    """The family's tiny pipeline (8x VAE) with one-layer text encoders of the real widths."""
    from laionkit.families import get_family

    if (folder / "model_index.json").exists():
        return folder
    get_family(family).write_tiny(folder, 0)
    if smoke:
        return folder
    torch.manual_seed(0)
    for sub, model in TEXT_ENCODERS[family]().items():
        shutil.rmtree(folder / sub)
        model.to(torch.bfloat16).save_pretrained(folder / sub)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--family", choices=sorted(SETUPS), default="flux")
    parser.add_argument("--resolution", type=int, help="default: the family's (SETUPS)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch-sizes", help="default: the family's (SETUPS)")
    parser.add_argument("--checkpointing", default="none,auto")
    parser.add_argument("--compile", default="off", choices=["off", "on", "both"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole script")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    setup = SETUPS[args.family]
    args.resolution = args.resolution or setup["resolution"]
    args.batch_sizes = args.batch_sizes or setup["batches"]
    if args.smoke:
        args.resolution, args.images, args.batch_sizes, args.steps = 64, 16, "1,2", 2
    args.out = args.out / args.family
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    models = write_models(args.out / "models", args.family, args.smoke)
    latents = prepare(args.out, args.resolution, args.images, False, models, "stored")
    print(f"models and latents ready after {time.perf_counter() - started:.0f} s", flush=True)
    plan = args.out / f"plan-{args.compile}"
    shutil.rmtree(plan, ignore_errors=True)
    flags = list(setup["flags"])
    if args.smoke:
        flags[1] = "tiny"
    train = [*flags, "--mixed-precision", "no" if args.smoke else "bf16", "--workers", "4", "--shuffle-buffer", "64"]
    argv = [sys.executable, "-m", "laionkit.cli", "plan", str(latents), "--output", str(plan), "--batch-sizes",
            args.batch_sizes, "--checkpointing", args.checkpointing, "--compile", args.compile, "--steps",
            str(args.steps), "--timeout", "420", "--", *train]
    print(" ".join(argv), flush=True)
    process = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:  # plan.json is rewritten after each candidate: a plan stopped by --budget keeps what it measured
        output, _ = process.communicate(timeout=max(1.0, args.budget - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += "\n(stopped by --budget)"
    print(output[-6000:], flush=True)
    found = json.loads((plan / "plan.json").read_text()) if (plan / "plan.json").exists() else {}
    summary = {"date": time.strftime("%Y-%m-%d"), "family": args.family, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
               else "cpu", "torch": torch.__version__, "argv": argv, "plan": found, "seconds": time.perf_counter() - started}
    for candidate in found.get("candidates", []):
        auto = plan / "runs" / f"bs{candidate['batch_size']}-{candidate['checkpointing']}-" \
            f"{'compiled' if candidate['compile'] else 'eager'}" / "checkpointing.json"
        if auto.is_file():
            candidate["auto_record"] = json.loads(auto.read_text())
        log = plan / "logs" / f"{auto.parent.name}.log"
        if log.is_file() and candidate["status"] != "fits":  # why it did not fit or failed
            candidate["log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / f"plan-{args.family}-{args.compile}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "plan"}))
    for candidate in found.get("candidates", []):
        print(f"{candidate['batch_size']:>3} {candidate['checkpointing']:>8} {'compiled' if candidate['compile'] else 'eager':>8} "
              f"{candidate['status']:>14} {candidate['samples_per_s'] or 0:8.3f} samples/s "
              f"{candidate['gpu_mem_gib'] or 0:6.1f} GiB  auto: {candidate['chosen_checkpointing']} {candidate['seconds']} s "
              f"{candidate['detail'][:120]}")
    print(f"fastest: {found.get('command')}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
