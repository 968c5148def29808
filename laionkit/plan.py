"""`laionkit plan`: measure a few steps of candidate train configurations and name the fastest that fits.

The fastest configuration that fits a GPU is rarely the one with the largest batch: activation checkpointing
buys memory with about a third more compute per block, compile changes both, and a larger batch only pays
while the GPU is not yet busy. So plan measures instead of guessing: each candidate (per-GPU batch x
--checkpointing x compile x --fp8 x a memory strategy) runs as its own `laionkit train` process on the user's
latents and flags, in a throwaway run folder, for one window of ``--steps`` steps to warm up (compilation,
allocator, data workers) and one window of ``--steps`` steps that is measured (metrics.jsonl's samples/s and
peak memory: the numbers train itself reports). Once the measured window's record is written the process is
stopped (its --max-steps is never reached), so no checkpoint or export is paid for.

The memory strategies form a ladder (``ladder``): the frozen base's dtype (bf16, then quantized), then block
swap, then FSDP2 CPU offload; each rung saves more memory and costs more time than the one below, so a rung is
tried at a batch only where no lower rung fit that batch (``skip_reason``). A candidate that runs out of memory
is recorded as not fitting, and the larger batches with the same or less checkpointing, the same or a lower
rung and the same compile / --fp8 setting are skipped (they need more memory), and so is ``auto`` where
``none`` fits the same batch (auto would take none). A candidate whose strategy flags fail (a flag this
install lacks, a combination train refuses) is recorded and the candidates with those flags are skipped; a
plain candidate that fails stops the plan (the train flags themselves are wrong). The table is printed, and
OUTPUT/plan.json holds every candidate and the fastest's flags and command line, which `laionkit train --plan
OUTPUT/plan.json` starts.
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
BASE_DTYPES = ("bf16", "fp8", "int8", "nf4")  # the frozen base's storage (LoRA), from least to most memory saved
# --cpu-offload runs under an FSDP2 launch, a world of 1 on one GPU (laionkit/trainer/offload.py)
FSDP_CONFIG = Path(__file__).resolve().parents[1] / "train" / "fsdp.yaml"
OFFLOAD_LAUNCH = ("-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "1")


@dataclass(frozen=True)
class PlanConfig:
    latents: str
    output: Path
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    checkpointing: tuple[str, ...] = ("none", "blocks")
    compile: tuple[bool, ...] = (False, True)
    fp8: tuple[bool, ...] = (False,)
    base_dtypes: tuple[str, ...] = ("bf16",)
    block_swaps: tuple[int, ...] = (0,)
    cpu_offload: bool = False
    gpu_memory_gib: float | None = None
    steps: int = 5
    timeout: float = 1800.0
    train_args: tuple[str, ...] = ()
    quiet: bool = False


@dataclass(frozen=True)
class Strategy:
    """A memory strategy: the frozen base's dtype (LoRA), blocks swapped to the host, or FSDP2 CPU offload."""

    base_dtype: str = "bf16"
    block_swap: int = 0
    cpu_offload: bool = False

    def flags(self) -> list[str]:
        """Train flags; the default of each is left out, so that a plain candidate needs no new flag."""
        return [*(["--base-dtype", self.base_dtype] if self.base_dtype != "bf16" else []),
                *(["--block-swap", str(self.block_swap)] if self.block_swap else []),
                *(["--cpu-offload"] if self.cpu_offload else [])]


@dataclass
class Candidate:
    batch_size: int
    checkpointing: str
    compile: bool
    fp8: bool = False
    strategy: Strategy = Strategy()
    rung: int = 0  # the strategy's place on the ladder: 0 saves the least memory (and costs the least time)
    status: str = "pending"  # fits, out of memory, skipped, failed, timed out
    samples_per_s: float | None = None
    gpu_mem_gib: float | None = None
    chosen_checkpointing: str | None = None  # what --checkpointing auto picked
    seconds: float | None = None
    detail: str = ""
    flags: list[str] = field(default_factory=list)

    @property
    def extras(self) -> list[str]:
        """The flags beyond batch, checkpointing and compile: --fp8 and the strategy's."""
        return [*(["--fp8"] if self.fp8 else []), *self.strategy.flags()]

    @property
    def name(self) -> str:
        strategy = self.strategy
        parts = [f"bs{self.batch_size}", self.checkpointing, "compiled" if self.compile else "eager",
                 *(["fp8"] if self.fp8 else []), *([f"base-{strategy.base_dtype}"] if strategy.base_dtype != "bf16" else []),
                 *([f"swap{strategy.block_swap}"] if strategy.block_swap else []),
                 *(["offload"] if strategy.cpu_offload else [])]
        return "-".join(parts)


def ladder(base_dtypes: tuple[str, ...], block_swaps: tuple[int, ...], cpu_offload: bool) -> list[Strategy]:
    """The memory strategies in the order plan climbs them, each saving more memory than the one before at
    more cost in time: every base dtype given (bf16, then quantized: a dequantization per matmul), then
    block swap of more and more blocks (their weights cross PCIe twice a step) on the most saving of those
    dtypes, then FSDP2 CPU offload (every weight and the optimizer step on the host). The smallest
    --block-swaps value (0: none) goes with the base dtypes."""
    dtypes = [dtype for dtype in BASE_DTYPES if dtype in base_dtypes]
    swaps = sorted(set(block_swaps))
    rungs = [Strategy(dtype, swaps[0]) for dtype in dtypes]
    rungs += [Strategy(dtypes[-1], swap) for swap in swaps[1:]]
    return rungs + ([Strategy(dtypes[-1], cpu_offload=True)] if cpu_offload else [])


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
    the same compile and --fp8 setting, no higher rung of the ladder and no more checkpointing (auto only
    against auto: it adapts)."""
    if (candidate.compile, candidate.fp8) != (failed.compile, failed.fp8) or candidate.rung > failed.rung \
            or candidate.batch_size < failed.batch_size:
        return False
    mine, theirs = density(candidate.checkpointing), density(failed.checkpointing)
    if mine != mine or theirs != theirs:  # auto
        return candidate.checkpointing == failed.checkpointing
    return mine <= theirs


def skip_reason(candidate: Candidate, done: list[Candidate]) -> str | None:
    """Why ``candidate`` need not run, given the candidates ``done`` so far (None: run it): one that ran out
    of memory needing no more than it (needs_more_memory); one that failed with a subset of its extra flags
    (they fail again); a lower rung that fits the same batch, compile and --fp8 setting with any
    checkpointing (activation checkpointing is the cheaper way to save memory); none where it is auto."""
    for other in done:
        same = (other.batch_size, other.compile, other.fp8) == (candidate.batch_size, candidate.compile,
                                                                 candidate.fp8)
        if other.status == "out of memory" and needs_more_memory(candidate, other):
            return f"{other.name} ran out of memory"
        if other.status == "failed" and other.extras and set(other.extras) <= set(candidate.extras):
            return f"{other.name} failed"
        if other.status == "fits" and same and other.rung < candidate.rung:
            return f"{other.name} fits with less memory saved"
        if other.status == "fits" and same and other.rung == candidate.rung \
                and (candidate.checkpointing, other.checkpointing) == ("auto", "none"):
            return f"{other.name} fits: auto is none there"
    return None


def candidates(config: PlanConfig) -> list[Candidate]:
    """Every combination, smallest batch first (so that an out-of-memory result prunes the larger ones), and
    within a batch the ladder's rungs in order. --checkpointing auto is left out under CPU offload (FSDP:
    auto measures one GPU or DDP)."""
    from laionkit.trainer.config import TrainConfig

    for value in config.checkpointing:  # the flag's own check, once, before anything runs
        TrainConfig(latents=Path("."), output=Path("."), unet_config="tiny", max_steps=1,
                    checkpointing=value).checkpoint_interval()
    rungs = ladder(config.base_dtypes, config.block_swaps, config.cpu_offload)
    return [Candidate(batch, checking, compiled, fp8, rungs[rung], rung) for batch, rung, checking, compiled, fp8
            in itertools.product(sorted(set(config.batch_sizes)), range(len(rungs)), config.checkpointing,
                                 config.compile, config.fp8)
            if not (rungs[rung].cpu_offload and checking.strip().lower() == "auto")]


def train_argv(config: PlanConfig, candidate: Candidate, folder: Path) -> list[str]:
    flags = ["--batch-size", str(candidate.batch_size), "--checkpointing", candidate.checkpointing,
             *(["--compile"] if candidate.compile else []), *candidate.extras]
    candidate.flags = flags
    cap = ["--gpu-memory-gib", f"{config.gpu_memory_gib:g}"] if config.gpu_memory_gib else []
    return [sys.executable, *(OFFLOAD_LAUNCH if candidate.strategy.cpu_offload else ()), "-m", "laionkit.cli",
            "train", config.latents, *config.train_args, *flags, *cap, "--output", str(folder), "--overwrite",
            "--max-steps", str(MAX_STEPS), "--log-every", str(config.steps), "--checkpoint-every", str(10**9),
            "--log-with", "none", "--validate-every", "0", "--quiet"]


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
    lines = [words for words in (line.strip(" │╭╮╰╯─") for line in text.splitlines()) if words]  # a usage box
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
    """Measure every candidate that ``skip_reason`` does not rule out; OUTPUT/plan.json is rewritten after
    each, so a plan cut short keeps what it measured."""
    if config.steps < 1:
        raise LaionkitError(f"--steps {config.steps}: measure at least one step")
    found = candidates(config)
    config.output.mkdir(parents=True, exist_ok=True)
    for done, candidate in enumerate(found):
        reason = skip_reason(candidate, found[:done])
        if reason is not None:
            candidate.status, candidate.detail = "skipped", reason
        else:
            if not config.quiet:
                print(f"plan: {candidate.name} ...", flush=True)
            measure(config, candidate)
            if not config.quiet:
                print(f"plan: {candidate.name}: {describe(candidate)}", flush=True)
        write_plan(config, found)
        if candidate.status == "failed" and not candidate.extras:  # the train flags themselves fail
            raise LaionkitError(f"plan: {candidate.name} failed: {candidate.detail} "
                                f"(log: {config.output / 'logs' / (candidate.name + '.log')})")
    return found


def command(config: PlanConfig, candidate: Candidate) -> str:
    """The command line that trains ``candidate`` (add --output and --max-steps); CPU offload launches
    FSDP2 over a world of 1. --gpu-memory-gib is left out: it stood in for a smaller GPU."""
    launch = (["accelerate", "launch", "--config_file", "train/fsdp.yaml", "--num_processes", "1", "-m",
               "laionkit.cli"] if candidate.strategy.cpu_offload else ["laionkit"])
    return " ".join([*launch, "train", shlex.quote(config.latents), *map(shlex.quote, config.train_args),
                     *candidate.flags])


def write_plan(config: PlanConfig, found: list[Candidate]) -> None:
    """OUTPUT/plan.json: every candidate so far, the fastest that fits, its train flags and command line."""
    best = fastest(found)
    write_json(str(config.output / "plan.json"), {
        "latents": config.latents, "train_args": list(config.train_args), "steps": config.steps,
        "gpu_memory_gib": config.gpu_memory_gib, "candidates": [asdict(c) for c in found],
        "fastest": best and best.name, "train_flags": best and best.flags,
        "command": best and command(config, best)})


def train_options(ctx, options: dict) -> dict:
    """`laionkit train --plan PLAN`: ``options`` (train's parameters by name) with the plan's latents, train
    flags and its fastest candidate's flags for every parameter the command line did not give, each parsed
    as train parses it (so they override a --config file's)."""
    import click

    path = options.get("plan")
    if path is None:
        return options
    if not Path(path).is_file():
        raise LaionkitError(f"--plan {path}: no such file (`laionkit plan ... --output DIR` writes DIR/plan.json)")
    try:
        recorded = json.loads(Path(path).read_text())
        args = [recorded["latents"], *recorded["train_args"], *recorded["train_flags"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LaionkitError(f"--plan {path}: not a plan.json `laionkit plan` wrote with a candidate that fits "
                            f"({type(error).__name__}: {error})") from None
    try:
        planned = ctx.command.make_context(ctx.info_name, [str(arg) for arg in args], parent=ctx.parent)
    except click.ClickException as error:
        raise LaionkitError(f"--plan {path}: its train flags do not parse: {error.format_message()}") from None
    merged = dict(options)
    for name, value in planned.params.items():
        given = ctx.get_parameter_source(name)
        if name in ("config", "plan") or planned.get_parameter_source(name).name != "COMMANDLINE" \
                or (given is not None and given.name in ("COMMANDLINE", "ENVIRONMENT")):
            continue
        merged[name] = value
    return merged


def describe(candidate: Candidate) -> str:
    if candidate.status != "fits":
        return f"{candidate.status}{': ' + candidate.detail if candidate.detail else ''}"
    memory = f", {candidate.gpu_mem_gib:.1f} GiB" if candidate.gpu_mem_gib else ""
    chosen = f" (auto: {candidate.chosen_checkpointing})" if candidate.chosen_checkpointing else ""
    return f"{candidate.samples_per_s:.3f} samples/s{memory}{chosen}"
