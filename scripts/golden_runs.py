"""Golden runs: tiny deterministic `laionkit train` runs through the real CLI, digested file by file.

A refactor of the trainer must not change a single number it writes. This script builds tiny latents from
the real photos in ../shared/realdata (the tiny models, 64 px, as tests/fixtures.py builds them), trains

  sd          SD from scratch (--unet-config tiny, EMA), a checkpoint every 2 steps, unet/ exported;
  sdxl        SDXL from scratch on aspect-ratio buckets (encode --buckets);
  flux-lora   Flux LoRA adapters on the tiny pretrained transformer, text encoded online by train;
  ddp         SD from scratch on 2 ranks under `accelerate launch --config_file train/ddp.yaml` (gloo, CPU);

and records the sha256 of every file in each run folder (checkpoints, exports, records) and of
metrics.jsonl with its timing fields removed. tests/test_golden_runs.py reruns them and compares with
tests/data/golden_runs.json. Rewrite that file (``--write``) only in a commit that explains the change in
numerics.

    python scripts/golden_runs.py            # compare with tests/data/golden_runs.json
    python scripts/golden_runs.py --write    # record the digests
    python scripts/golden_runs.py --show     # print them
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "data" / "golden_runs.json"
REALDATA = REPO.parent / "shared" / "realdata"
# metrics.jsonl fields that measure the machine, not the training (they differ between two identical runs).
TIMING = ("samples_per_s", "samples_per_s_per_gpu", "mfu", "data_wait_pct", "gpu_mem_gib",
          "rank_forward_s", "rank_data_wait_s", "straggler_rank", "straggler_ratio")
# Files that hold a process id and a time by design (the run folder's lock).
UNSTABLE = (".laionkit-train.lock",)
VERSION_KEYS = ("transformers_version", "_diffusers_version")
# The digests are of float results of torch's CPU kernels, which change between torch releases: those recorded
# hold from torch 2.11 (checked: 2.11.0 and 2.14.1); under 2.9.1 every run's numbers differ (2026-12-05).
DIGESTS_FROM_TORCH = (2, 11)
FAST = ("--batch-size", "2", "--log-with", "none", "--quiet", "--workers", "0", "--log-every", "1",
        "--shuffle-buffer", "3", "--lr", "1e-3")


def cli_process(*args, env: dict | None = None) -> None:
    """`laionkit ARGS` in a subprocess."""
    result = subprocess.run([sys.executable, "-m", "laionkit.cli", *map(str, args)], capture_output=True, text=True,
                            env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"laionkit {' '.join(map(str, args))} failed ({result.returncode}):\n{result.stderr[-3000:]}")


def launch(*args, env: dict) -> None:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "train" / "ddp.yaml"),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "29611",
               "-m", "laionkit.cli", "train", *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"accelerate launch failed ({result.returncode}):\n{result.stderr[-3000:]}")


def metrics_digest(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        lines.append(json.dumps({k: v for k, v in record.items() if k not in TIMING}, sort_keys=True))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def trainer_digest(path: Path, work: Path) -> str:
    """trainer.json without the package versions and its files' digests, with the run's folder as WORK (its paths
    move with it)."""
    record = json.loads(path.read_text().replace(str(work), "WORK"))
    record.pop("versions", None)
    record["files"] = sorted(record.get("files", {}))  # their content is digested file by file (paths normalised)
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def safetensors_digest(path: Path, work: Path) -> str:
    """A safetensors file with the run's folder in its metadata (a LoRA base's path) written as WORK, its header's
    keys sorted (safetensors writes metadata in hash-map order)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True).replace(str(work), "WORK")
    return hashlib.sha256(header.encode() + data[8 + size :]).hexdigest()


def config_digest(path: Path) -> str:
    """A model's config.json without the library versions that saved it (a new transformers or diffusers release
    rewrites them, not the model)."""
    record = json.loads(path.read_text())
    for key in VERSION_KEYS:
        record.pop(key, None)
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def digests(run: Path, work: Path) -> dict[str, str]:
    found = {}
    for path in sorted(run.rglob("*")):
        if not path.is_file() or path.name in UNSTABLE:
            continue
        name = path.relative_to(run).as_posix()
        if path.name == "metrics.jsonl":
            found[name] = metrics_digest(path)
        elif path.name == "trainer.json":
            found[name] = trainer_digest(path, work)
        elif path.name == "model_index.json" or path.name.endswith("config.json"):
            found[name] = config_digest(path)
        elif path.suffix == ".safetensors":
            found[name] = safetensors_digest(path, work)
        else:
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def golden_runs(work: Path, cli=cli_process, only: tuple[str, ...] = ()) -> dict[str, dict[str, str]]:
    """Build the inputs in ``work``, train the runs (all, or ``only``), return {run: {file: sha256}}.
    ``cli(*args, env=...)`` runs `laionkit ARGS` (tests run it in-process); the DDP run is always a launch."""
    import runpy

    # The image shards the tests build (tests/fixtures.py), loaded by path: tests/ is not a package.
    write_image_shards = runpy.run_path(str(REPO / "tests" / "fixtures.py"))["write_image_shards"]
    from laionkit.common.models import write_tiny_models
    from laionkit.families import get_family

    # PYTHONHASHSEED: the Flux LoRA run's numbers depend on the string hash seed (found by these runs; its
    # run goes through a subprocess with a fixed seed, whatever ``cli`` is).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    images = work / "images"
    write_image_shards(REALDATA / "images", images)
    wanted = set(only) or {"sd", "sdxl", "flux-lora", "ddp"}
    runs = {}
    if wanted & {"sd", "ddp"}:
        sd_model = write_tiny_models(work / "tiny-sd")
        cli("encode", images, "--output", work / "sd-latents", "--model", sd_model, "--resolution", "64",
            "--batch-size", "4", "--workers", "0", "--quiet", env=env)
    if "sd" in wanted:
        runs["sd"] = work / "sd"
        cli("train", work / "sd-latents", "--output", runs["sd"], *FAST, "--unet-config", "tiny", "--max-steps", "4",
            "--checkpoint-every", "2", "--keep-checkpoints", "3", "--ema", "--ema-decay", "0.9",
            "--caption-dropout", "0.5", "--val-latents", work / "sd-latents", "--val-samples", "3", "--val-every", "2",
            env=env)
    if "sdxl" in wanted:
        sdxl_model = get_family("sdxl").write_tiny(work / "tiny-sdxl", 0)
        cli("encode", images, "--output", work / "sdxl-latents", "--model", sdxl_model, "--resolution", "64",
            "--buckets", "--batch-size", "4", "--workers", "0", "--quiet", env=env)
        runs["sdxl"] = work / "sdxl"
        cli("train", work / "sdxl-latents", "--output", runs["sdxl"], *FAST, "--unet-config", "tiny", "--max-steps",
            "3", "--checkpoint-every", "3", env=env)
    if "flux-lora" in wanted:
        flux_model = get_family("flux").write_tiny(work / "tiny-flux", 0)
        cli("encode", images, "--output", work / "flux-latents", "--model", flux_model, "--resolution", "64",
            "--batch-size", "4", "--workers", "0", "--quiet", env=env)  # Flux's default text: online
        runs["flux-lora"] = work / "flux-lora"
        cli_process("train", work / "flux-latents", "--output", runs["flux-lora"], *FAST, "--transformer", flux_model,
            "--lora-rank", "2", "--max-steps", "2", "--checkpoint-every", "2", env=env)
    if "ddp" in wanted:
        runs["ddp"] = work / "ddp"
        launch(work / "sd-latents", "--output", runs["ddp"], *FAST, "--unet-config", "tiny", "--max-steps", "2",
               "--checkpoint-every", "2", env=env)
    return {name: digests(run, work) for name, run in runs.items()}


def differences(expected: dict, got: dict) -> list[str]:
    """One line per file that differs, is missing or is new."""
    lines = []
    for run in sorted(set(expected) | set(got)):
        want, have = expected.get(run, {}), got.get(run, {})
        for name in sorted(set(want) | set(have)):
            if name not in have:
                lines.append(f"{run}/{name}: missing (recorded {want[name][:12]})")
            elif name not in want:
                lines.append(f"{run}/{name}: new file, not in the golden digests")
            elif want[name] != have[name]:
                lines.append(f"{run}/{name}: differs (recorded {want[name][:12]}, now {have[name][:12]})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record the digests in tests/data/golden_runs.json")
    parser.add_argument("--show", action="store_true", help="print the digests")
    parser.add_argument("--keep", type=Path, help="train in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        work = args.keep or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        got = golden_runs(work)
    if args.show:
        print(json.dumps(got, indent=1, sort_keys=True))
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
        return
    lines = differences(json.loads(GOLDEN.read_text()), got)
    if lines:
        raise SystemExit("golden runs differ:\n" + "\n".join(lines))
    print("golden runs: identical")


if __name__ == "__main__":
    main()
