"""`laionkit plan`: measure a few steps of candidate train configurations and name the fastest that fits.

The fastest configuration that fits a GPU is rarely the one with the largest batch: activation checkpointing
buys memory with about a third more compute per block, compile changes both, and a larger batch only pays
while the GPU is not yet busy. So plan measures instead of guessing: each candidate (per-GPU batch x
--checkpointing x compile) runs as its own `laionkit train` process on the user's latents and flags, in a
throwaway run folder, for one window of ``--steps`` steps to warm up (compilation, allocator, data
workers) and one window of ``--steps`` steps that is measured (metrics.jsonl's samples/s and peak memory:
the numbers train itself reports). Once the measured window's record is written the process is stopped
(its --max-steps is never reached), so no checkpoint or export is paid for. A candidate that runs out of memory is recorded as not fitting,
and the larger batches with the same or less checkpointing and the same compile setting are skipped
(they need more memory), and so is ``auto`` where ``none`` fits the same batch (auto would take none).
The table is printed, and OUTPUT/plan.json holds every candidate and the
fastest's command line.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from laionkit.common import LaionkitError
from laionkit.common.storage import write_json

MAX_STEPS = 10**6  # never reached: the process is stopped after its measured window
OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError", "does not fit even with every block checkpointed")


@dataclass(frozen=True)
class PlanConfig:
    latents: str
    output: Path
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    checkpointing: tuple[str, ...] = ("none", "blocks")
    compile: tuple[bool, ...] = (False, True)
    steps: int = 5
    timeout: float = 1800.0
    train_args: tuple[str, ...] = ()
    quiet: bool = False


@dataclass
class Candidate:
    batch_size: int
    checkpointing: str
    compile: bool
    status: str = "pending"  # fits, out of memory, skipped, failed, timed out
    samples_per_s: float | None = None
    gpu_mem_gib: float | None = None
    chosen_checkpointing: str | None = None  # what --checkpointing auto picked
    seconds: float | None = None
    detail: str = ""
    flags: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"bs{self.batch_size}-{self.checkpointing}-{'compiled' if self.compile else 'eager'}"


def density(checkpointing: str) -> float:
    """How much of the denoiser a --checkpointing value checkpoints (none 0 ... blocks 1); auto adapts."""
    value = checkpointing.strip().lower()
    if value == "none":
        return 0.0
    if value == "blocks":
        return 1.0
    if value == "auto":
        return float("nan")
    return 1.0 / int(value.removeprefix("every-"))


def needs_more_memory(candidate: Candidate, failed: Candidate) -> bool:
    """``candidate`` needs at least what ``failed`` (out of memory) needed: a larger or equal batch with
    the same compile setting and no more checkpointing (auto only against auto: it adapts)."""
    if candidate.compile != failed.compile or candidate.batch_size < failed.batch_size:
        return False
    mine, theirs = density(candidate.checkpointing), density(failed.checkpointing)
    if mine != mine or theirs != theirs:  # auto
        return candidate.checkpointing == failed.checkpointing
    return mine <= theirs


def candidates(config: PlanConfig) -> list[Candidate]:
    """Every combination, smallest batch first (so that an out-of-memory result prunes the larger ones)."""
    from laionkit.trainer.config import TrainConfig

    for value in config.checkpointing:  # the flag's own check, once, before anything runs
        TrainConfig(latents=Path("."), output=Path("."), unet_config="tiny", max_steps=1,
                    checkpointing=value).checkpoint_interval()
    return [Candidate(batch, checking, compiled) for batch, checking, compiled
            in itertools.product(sorted(set(config.batch_sizes)), config.checkpointing, config.compile)]


def train_argv(config: PlanConfig, candidate: Candidate, folder: Path) -> list[str]:
    flags = ["--batch-size", str(candidate.batch_size), "--checkpointing", candidate.checkpointing]
    if candidate.compile:
        flags.append("--compile")
    candidate.flags = flags
    return [sys.executable, "-m", "laionkit.cli", "train", config.latents, *config.train_args, *flags,
            "--output", str(folder), "--overwrite", "--max-steps", str(MAX_STEPS),
            "--log-every", str(config.steps), "--checkpoint-every", str(10**9), "--log-with", "none",
            "--validate-every", "0", "--quiet"]


def measure(config: PlanConfig, candidate: Candidate) -> None:
    """Run one candidate until metrics.jsonl holds its measured window (steps steps+1 .. 2 steps), then stop it."""
    folder = config.output / "runs" / candidate.name
    argv = train_argv(config, candidate, folder)
    metrics = folder / "metrics.jsonl"
    log = config.output / "logs" / f"{candidate.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=die_with_parent)
        record = None
        while record is None and process.poll() is None:
            if time.perf_counter() - started > config.timeout:
                candidate.status = "timed out"
                break
            time.sleep(0.2)
            record = window(metrics, 2 * config.steps)
        if process.poll() is None:  # measured (or timed out): no checkpoint, no export
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        record = record or window(metrics, 2 * config.steps)
    candidate.seconds = round(time.perf_counter() - started, 1)
    auto = folder / "checkpointing.json"
    if auto.is_file():
        candidate.chosen_checkpointing = json.loads(auto.read_text()).get("chosen")
    if record is not None:
        candidate.status = "fits"
        candidate.samples_per_s = record["samples_per_s"]
        candidate.gpu_mem_gib = record.get("gpu_mem_gib") or None
        return
    if candidate.status == "timed out":
        return
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    candidate.detail = lines[-1][:300] if lines else f"exit {process.returncode}"
    candidate.status = "out of memory" if any(mark in text for mark in OUT_OF_MEMORY) else "failed"


def die_with_parent() -> None:
    """In the candidate's process before it starts (Linux): SIGKILL when plan dies. The candidate runs in
    a session of its own (so that plan can stop it with its DataLoader workers), which a signal to plan's
    own process group, or a SIGKILL of plan, would not reach: without this an interrupted plan leaves a
    training process running towards a --max-steps it never reaches."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def window(metrics: Path, step: int) -> dict | None:
    """The metrics.jsonl record of ``step``, if written."""
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("step") == step and "samples_per_s" in record:
            return record
    return None


def fastest(found: list[Candidate]) -> Candidate | None:
    fitting = [c for c in found if c.status == "fits"]
    return max(fitting, key=lambda c: c.samples_per_s) if fitting else None


def run(config: PlanConfig) -> list[Candidate]:
    """Measure every candidate (skipping those an out-of-memory one rules out); OUTPUT/plan.json is
    rewritten after each, so a plan cut short keeps what it measured."""
    if config.steps < 1:
        raise LaionkitError(f"--steps {config.steps}: measure at least one step")
    found = candidates(config)
    config.output.mkdir(parents=True, exist_ok=True)
    for candidate in found:
        failed = [c for c in found if c.status == "out of memory"]
        blocker = next((c for c in failed if needs_more_memory(candidate, c)), None)
        plain = next((c for c in found if c.status == "fits" and c.checkpointing == "none"
                      and (c.batch_size, c.compile) == (candidate.batch_size, candidate.compile)), None)
        if blocker is not None:
            candidate.status, candidate.detail = "skipped", f"{blocker.name} ran out of memory"
        elif candidate.checkpointing == "auto" and plain is not None:  # auto takes none where none fits
            candidate.status, candidate.detail = "skipped", f"{plain.name} fits: auto is none there"
        else:
            if not config.quiet:
                print(f"plan: {candidate.name} ...", flush=True)
            measure(config, candidate)
            if not config.quiet:
                print(f"plan: {candidate.name}: {describe(candidate)}", flush=True)
        write_plan(config, found)
        if candidate.status == "failed":
            raise LaionkitError(f"plan: {candidate.name} failed: {candidate.detail} "
                                f"(log: {config.output / 'logs' / (candidate.name + '.log')})")
    return found


def write_plan(config: PlanConfig, found: list[Candidate]) -> None:
    """OUTPUT/plan.json: every candidate so far, the fastest that fits and its command line."""
    best = fastest(found)
    command = None
    if best is not None:
        command = " ".join(["laionkit", "train", shlex.quote(config.latents), *map(shlex.quote, config.train_args),
                            *best.flags])
    write_json(str(config.output / "plan.json"), {
        "latents": config.latents, "train_args": list(config.train_args), "steps": config.steps,
        "candidates": [asdict(c) for c in found], "fastest": best and best.name, "command": command})


def describe(candidate: Candidate) -> str:
    if candidate.status != "fits":
        return f"{candidate.status}{': ' + candidate.detail if candidate.detail else ''}"
    memory = f", {candidate.gpu_mem_gib:.1f} GiB" if candidate.gpu_mem_gib else ""
    chosen = f" (auto: {candidate.chosen_checkpointing})" if candidate.chosen_checkpointing else ""
    return f"{candidate.samples_per_s:.3f} samples/s{memory}{chosen}"
