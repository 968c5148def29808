"""What trains on a 24, 48, 80 (and 141) GB GPU, per family: `laionkit plan` under `--gpu-memory-gib` on one
large GPU, printed as the Markdown cells of the README's family table (not a test).

Each (family, memory) pair is one `laionkit plan` of the family's real-size architecture (random init, as
scripts/bench_plan.py builds it: SDXL full-parameter, Flux-12B LoRA-64 on a frozen random base) at 1024 px, with
each candidate's train process capped at G GiB (torch.cuda.set_per_process_memory_fraction): what does not fit
raises out of memory as it would on the smaller card (the CUDA context, ~0.5 GiB, is not counted). The
candidates: batch x --checkpointing none/blocks, eager, and the memory ladder (LoRA: --base-dtypes bf16, fp8,
nf4; full-parameter: FSDP2 --cpu-offload last). A memory at or above the card's own is the card uncapped; one
above it is "not measured" (141 GB needs an H200). The whole run keeps to --budget: each plan gets an equal
share of what is left, and a plan stopped at its share reports what it measured ("partial").

    python scripts/bench_plan_memory.py --out /tmp/plan-memory --report $OUT   # one H100, < 8 min
    python scripts/bench_plan_memory.py --smoke --out /tmp/plan-memory-smoke  # CPU plumbing check, tiny models
    python scripts/bench_plan_memory.py --families flux --gib 24,48 --out /tmp/plan-memory --report $OUT
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
from bench_plan import SETUPS, write_models  # noqa: E402
from bench_train_sdxl import prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAMILIES = {  # per family: its plan's batch sizes and memory ladder (SETUPS: architecture and flags)
    "sdxl": dict(batches="1,4", ladder=["--cpu-offload"]),
    "flux": dict(batches="1,2", ladder=["--base-dtypes", "bf16,fp8,nf4"]),
}


def card_gib() -> float | None:
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def plan_argv(latents: Path, folder: Path, family: str, gib: float | None, smoke: bool) -> list[str]:
    flags = list(SETUPS[family]["flags"])
    if smoke:
        flags[1] = "tiny"
    cap = ["--gpu-memory-gib", f"{gib:g}"] if gib else []
    return [sys.executable, "-m", "laionkit.cli", "plan", str(latents), "--output", str(folder), "--batch-sizes",
            "1" if smoke else FAMILIES[family]["batches"], "--checkpointing", "none" if smoke else "none,blocks",
            "--compile", "off", *FAMILIES[family]["ladder"], *cap, "--steps", "2", "--timeout", "240", "--quiet", "--",
            *flags, "--mixed-precision", "no" if smoke else "bf16", "--workers", "0" if smoke else "4",
            "--shuffle-buffer", "64"]


def run_plan(argv: list[str], seconds: float, env: dict) -> tuple[str, bool]:
    """The plan's output, and whether it finished within ``seconds`` (else it is stopped; plan.json keeps
    what it measured)."""
    process = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        return process.communicate(timeout=max(1.0, seconds))[0], True
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0], False


def cell(plan: dict, finished: bool) -> str:
    """A table cell: the fastest candidate that fit (its flags and samples/s), or why none did."""
    found = plan.get("candidates", [])
    fitting = [c for c in found if c["status"] == "fits"]
    partial = "" if finished else " (partial)"
    if not fitting:
        tried = sorted({c["status"] for c in found if c["status"] != "skipped"}) or ["nothing measured"]
        return f"does not fit ({', '.join(tried)}){partial}"
    best = max(fitting, key=lambda c: c["samples_per_s"])
    flags = " ".join(flag for flag in best["flags"] if flag not in ("--checkpointing", "none"))
    memory = f", {best['gpu_mem_gib']:.1f} GiB" if best["gpu_mem_gib"] else ""
    return f"`{flags}`: {best['samples_per_s']:.2f} samples/s{memory}{partial}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--families", default="sdxl,flux", help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--gib", default="24,48,80,141", help="GPU memories to answer for, comma-separated")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole script")
    parser.add_argument("--smoke", action="store_true", help="tiny models at 64 px on any machine")
    args = parser.parse_args()
    started = time.perf_counter()
    families = [name.strip() for name in args.families.split(",")]
    memories = [float(value) for value in args.gib.split(",")]
    if args.smoke:
        args.resolution, args.images = 64, 16
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    card = card_gib()
    latents = {}
    for family in families:
        work = args.out / family
        work.mkdir(parents=True, exist_ok=True)
        latents[family] = prepare(work, args.resolution, args.images, False,
                                  write_models(work / "models", family, args.smoke), "stored")
    print(f"models and latents ready after {time.perf_counter() - started:.0f} s; card: {card and round(card, 1)} GiB",
          flush=True)
    runs = [(family, gib) for family in families for gib in memories]
    cells, record = {}, []
    for done, (family, gib) in enumerate(runs):
        if card is not None and gib > card + 2:  # a larger card than this one: nothing to cap down from
            cells[family, gib] = "not measured yet"
            continue
        cap = gib if card is None or gib < card else None  # the card itself: uncapped
        folder = args.out / family / f"plan-{gib:g}"
        shutil.rmtree(folder, ignore_errors=True)
        argv = plan_argv(latents[family], folder, family, cap, args.smoke)
        share = (args.budget - (time.perf_counter() - started)) / (len(runs) - done)
        print(" ".join(argv), flush=True)
        output, finished = run_plan(argv, share, env)
        print(output[-3000:], flush=True)
        plan = json.loads((folder / "plan.json").read_text()) if (folder / "plan.json").exists() else {}
        cells[family, gib] = cell(plan, finished)
        record.append({"family": family, "gib": gib, "cap": cap, "finished": finished, "plan": plan})
    header = "| family, run | px | " + " | ".join(f"{gib:g} GB" for gib in memories) + " |"
    rows = [header, "| --- | --- | " + " | ".join("---" for _ in memories) + " |"]
    for family in families:
        what = "LoRA rank 64" if "--lora-rank" in SETUPS[family]["flags"] else "full-parameter"
        rows.append(f"| {family}, {what} | {args.resolution} | "
                    + " | ".join(cells[family, gib] for gib in memories) + " |")
    table = "\n".join(rows)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s\n\n{table}")
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "plan-memory.md").write_text(table + "\n")
        (args.report / "plan-memory.json").write_text(json.dumps(
            {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__, "runs": record}, indent=1))


if __name__ == "__main__":
    main()
