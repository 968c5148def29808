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

The digests are of float results of torch's CPU kernels, which differ between CPUs (their vector units and
BLAS paths: an AMD EPYC with AVX-512 gave other bits than the host that first recorded them, 2026-12-06). So
the file keeps the digests per host (``host()``: vendor, family, model, torch's CPU capability) and, beside
them, the runs' numbers (``numbers()``: every logged loss, gradient norm and validation loss, and each
weights file's L2 norm). A host whose digests are recorded must reproduce them bit for bit; any other host
must reproduce the numbers within ``RTOL`` (the same runs on one host with AVX2 kernels against AVX-512 ones
moved losses by at most 2e-6 and weights' norms by at most 5e-5, relative; a change in the trainer's numerics
moves them by far more).

    python scripts/golden_runs.py              # compare with tests/data/golden_runs.json
    python scripts/golden_runs.py --write      # record this host's digests and the numbers (others' dropped)
    python scripts/golden_runs.py --add-host   # add this host's digests, its numbers within tolerance
    python scripts/golden_runs.py --show       # print them
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
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
# numbers() on a host without recorded digests: within this relative tolerance of the recorded ones
RTOL = {"metrics": 1e-4, "weights": 1e-3}
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


def host() -> str:
    """What the digests depend on besides torch: the CPU (vendor, family, model) and the kernels torch picks."""
    import torch

    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model") and key.strip() not in cpu:
                cpu[key.strip()] = value.strip()
    except OSError:
        pass
    ids = "/".join(cpu.get(key, "?") for key in ("vendor_id", "cpu family", "model"))
    return f"{platform.machine()} {ids} {torch.backends.cpu.get_cpu_capability()}"


def numbers(run: Path) -> dict:
    """A run's numbers, as far as they hold across hosts: each logged step's loss, gradient norm and validation
    losses (metrics.jsonl), and each .safetensors file's L2 norm over all its tensors (float64)."""
    from safetensors.numpy import load_file

    metrics = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics.append({key: value for key, value in record.items()
                        if key in ("step", "loss", "grad_norm", "val_loss", "val_loss_strata")})
    weights = {}
    for path in sorted(run.rglob("*.safetensors")):
        tensors = load_file(path)
        weights[path.relative_to(run).as_posix()] = math.sqrt(sum(
            float((tensor.astype("float64") ** 2).sum()) for tensor in tensors.values()))
    return {"metrics": metrics, "weights": weights}


def golden_runs(work: Path, cli=cli_process, only: tuple[str, ...] = ()) -> dict[str, dict]:
    """Build the inputs in ``work``, train the runs (all, or ``only``), return {"digests": {run: {file: sha256}},
    "numbers": {run: numbers}}. ``cli(*args, env=...)`` runs `laionkit ARGS` (tests run it in-process); the DDP
    run is always a launch."""
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
    return {"digests": {name: digests(run, work) for name, run in runs.items()},
            "numbers": {name: numbers(run) for name, run in runs.items()}}


def recorded_hosts(recorded: dict) -> dict[str, dict]:
    """{host: digests} of a golden file (one written before the digests were kept per host: its host unnamed)."""
    if "hosts" in recorded:
        return recorded["hosts"]
    return {"unnamed (recorded before hosts were named)": recorded}


def check(recorded: dict, got: dict, this_host: str) -> tuple[list[str], str]:
    """(lines that differ, how the runs were compared): bit for bit where this host's digests are recorded (or
    any recorded host's match every file), otherwise the numbers within RTOL."""
    hosts = recorded_hosts(recorded)
    if this_host in hosts:
        return differences(hosts[this_host], got["digests"]), f"digests recorded for {this_host}"
    for name, expected in hosts.items():
        if not differences(expected, got["digests"]):
            return [], f"digests recorded for {name}"
    files = next(iter(hosts.values())) if hosts else {}
    lines = [line for line in differences(files, got["digests"]) if "differs" not in line]  # the same files
    if "numbers" not in recorded:
        return lines + [f"no digests recorded for {this_host} and no numbers to compare"], "nothing"
    return lines + number_differences(recorded["numbers"], got["numbers"]), \
        f"numbers within {RTOL} (no digests recorded for {this_host})"


def _close(want: float, have: float, rtol: float) -> bool:
    return math.isclose(want, have, rel_tol=rtol, abs_tol=rtol * 1e-2)


def number_differences(expected: dict, got: dict) -> list[str]:
    """One line per run, step or weights file whose numbers are not within RTOL of the recorded ones."""
    lines = []
    for run in sorted(set(expected) | set(got)):
        want, have = expected.get(run), got.get(run)
        if want is None or have is None:
            lines.append(f"{run}: {'missing' if have is None else 'new run, not in the golden numbers'}")
            continue
        if [record.get("step") for record in want["metrics"]] != [record.get("step") for record in have["metrics"]]:
            lines.append(f"{run}/metrics.jsonl: other steps logged")
        for old, new in zip(want["metrics"], have["metrics"]):
            for key in sorted(set(old) | set(new)):
                a, b = old.get(key), new.get(key)
                pairs = list(zip(a, b)) if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) \
                    else [(a, b)]
                if any(x is None or y is None or not _close(x, y, RTOL["metrics"]) for x, y in pairs):
                    lines.append(f"{run}/metrics.jsonl step {old.get('step')} {key}: recorded {a}, now {b}")
        for name in sorted(set(want["weights"]) | set(have["weights"])):
            a, b = want["weights"].get(name), have["weights"].get(name)
            if a is None or b is None or not _close(a, b, RTOL["weights"]):
                lines.append(f"{run}/{name}: L2 norm recorded {a}, now {b}")
    return lines


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
    parser.add_argument("--write", action="store_true",
                        help="record this host's digests and the runs' numbers in tests/data/golden_runs.json, "
                             "dropping other hosts' digests (a change in numerics)")
    parser.add_argument("--add-host", action="store_true",
                        help="add this host's digests beside the recorded ones, once its numbers are within "
                             "tolerance of the recorded numbers (no change in numerics)")
    parser.add_argument("--show", action="store_true", help="print the digests and numbers")
    parser.add_argument("--keep", type=Path, help="train in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        work = args.keep or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        got = golden_runs(work)
    this_host = host()
    if args.show:
        print(json.dumps({"host": this_host, **got}, indent=1, sort_keys=True))
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    if args.write or args.add_host:
        if args.add_host:
            lines = number_differences(recorded.get("numbers", {}), got["numbers"])
            if "numbers" not in recorded or lines:
                raise SystemExit("--add-host: this host's numbers are not within tolerance of the recorded ones:\n"
                                 + "\n".join(lines or ["no numbers recorded (use --write)"]))
            written = {"hosts": {**recorded_hosts(recorded), this_host: got["digests"]},
                       "numbers": recorded["numbers"]}
        else:
            written = {"hosts": {this_host: got["digests"]}, "numbers": got["numbers"]}
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN} ({this_host})")
        return
    lines, how = check(recorded, got, this_host)
    if lines:
        raise SystemExit(f"golden runs differ ({how}):\n" + "\n".join(lines))
    print(f"golden runs: as recorded ({how})")


if __name__ == "__main__":
    main()
