"""Benchmark `laionkit plan` and `--checkpointing auto` on Flux-12B LoRA-64 at 1024 px (not a test; results in
docs/BENCHMARKS.md).

The question: which per-GPU batch, --checkpointing and compile setting trains fastest on this GPU, and does
`laionkit plan` find it. The transformer is flux-dev's architecture at real size (11.9B, random init,
``--lora-random-base``: LoRA rank 64 on a frozen bf16 base, as a fine-tune of FLUX.1-dev trains). The latents
come from `laionkit encode --text stored` of generated JPEGs at 1024 px with a tiny 16-channel VAE (8x, as
Flux's) and text encoders of the real widths but one layer each (T5: d_model 4096, CLIP-L: 768): the stored
text has T5-XXL's 512 x 4096 states and CLIP-L's pooled 768, so the train step sees real shapes; what the
text says does not matter to its speed, and building the 24-layer T5-XXL would cost minutes of the call.

    python scripts/bench_plan.py --out /tmp/plan --compile off --report $OUT   # GPU machine, call 1
    python scripts/bench_plan.py --out /tmp/plan --compile on --report $OUT    # GPU machine, call 2
    python scripts/bench_plan.py --smoke --out /tmp/plan-smoke                 # CPU plumbing check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_sdxl import prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_models(folder: Path, smoke: bool) -> Path:
    """Flux's tiny pipeline (16-channel VAE) with one-layer text encoders of the real widths."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW
    from laionkit.families import get_family

    if (folder / "model_index.json").exists():
        return folder
    get_family("flux").write_tiny(folder, 0)
    if smoke:
        return folder
    torch.manual_seed(0)
    parts = {
        "text_encoder": CLIPTextModel(CLIPTextConfig(
            vocab_size=CLIP_VOCAB_SIZE, hidden_size=768, intermediate_size=3072, num_hidden_layers=1,
            num_attention_heads=12, projection_dim=768, max_position_embeddings=CLIP_WINDOW, hidden_act="quick_gelu",
            bos_token_id=49406, eos_token_id=49407, pad_token_id=1)),
        "text_encoder_2": T5EncoderModel(T5Config(
            vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
            feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, is_encoder_decoder=False)),
    }
    for sub, model in parts.items():
        shutil.rmtree(folder / sub)
        model.to(torch.bfloat16).save_pretrained(folder / sub)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--checkpointing", default="none,auto")
    parser.add_argument("--compile", default="off", choices=["off", "on", "both"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.smoke:
        args.resolution, args.images, args.batch_sizes, args.steps = 64, 16, "1,2", 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    models = write_models(args.out / "models", args.smoke)
    latents = prepare(args.out, args.resolution, args.images, False, models, "stored")
    print(f"models and latents ready after {time.perf_counter() - started:.0f} s", flush=True)
    plan = args.out / f"plan-{args.compile}"
    shutil.rmtree(plan, ignore_errors=True)
    train = ["--transformer-config", "tiny" if args.smoke else "flux-dev", "--lora-rank", "64", "--lora-random-base",
             "--mixed-precision", "no" if args.smoke else "bf16", "--workers", "4", "--shuffle-buffer", "64"]
    argv = [sys.executable, "-m", "laionkit.cli", "plan", str(latents), "--output", str(plan), "--batch-sizes",
            args.batch_sizes, "--checkpointing", args.checkpointing, "--compile", args.compile, "--steps",
            str(args.steps), "--timeout", "420", "--", *train]
    print(" ".join(argv), flush=True)
    result = subprocess.run(argv, env=env, text=True, capture_output=True)
    print(result.stdout[-6000:], result.stderr[-3000:], flush=True)
    found = json.loads((plan / "plan.json").read_text()) if (plan / "plan.json").exists() else {}
    summary = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
               else "cpu", "torch": torch.__version__, "argv": argv, "plan": found, "seconds": time.perf_counter() - started}
    for candidate in found.get("candidates", []):
        auto = plan / "runs" / f"bs{candidate['batch_size']}-{candidate['checkpointing']}-" \
            f"{'compiled' if candidate['compile'] else 'eager'}" / "checkpointing.json"
        if auto.is_file():
            candidate["auto_record"] = json.loads(auto.read_text())
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / f"plan-{args.compile}.json").write_text(json.dumps(summary, indent=1))
        for log in sorted((plan / "logs").glob("*.log"))[:4] if (plan / "logs").exists() else ():
            shutil.copy(log, args.report / f"{args.compile}-{log.name}")
    print(json.dumps({k: v for k, v in summary.items() if k != "plan"}))
    for candidate in found.get("candidates", []):
        print(f"{candidate['batch_size']:>3} {candidate['checkpointing']:>8} {'compiled' if candidate['compile'] else 'eager':>8} "
              f"{candidate['status']:>14} {candidate['samples_per_s'] or 0:8.3f} samples/s "
              f"{candidate['gpu_mem_gib'] or 0:6.1f} GiB  auto: {candidate['chosen_checkpointing']} {candidate['seconds']} s "
              f"{candidate['detail'][:120]}")
    print(f"fastest: {found.get('command')}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
