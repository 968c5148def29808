"""metrics.jsonl: the window of steps since the last log (MetricsWindow), its throughput and MFU, written as strict
JSON (no NaN)."""

from __future__ import annotations

import secrets
import time
from dataclasses import fields
from pathlib import Path

import torch

from laionkit.common import LaionkitError, read_json, strict_json, write_json
from laionkit.trainer import ranktimes
from laionkit.trainer.checkpoint import last_good


def throughput(samples: int, flops: float, elapsed: float, data_wait: float, device: torch.device,
               world: int = 1, peak_tflops: float = 989.0) -> dict:
    """A window's samples/s (all ranks) and per GPU, MFU (model FLOPs of all ranks over their peak), the
    share of the time spent waiting for data, and this process's peak GPU memory: the figures of a
    metrics.jsonl record, and what the bench scripts report for the steps they time."""
    samples_per_s = samples / elapsed
    return {
        "samples_per_s": samples_per_s,
        "samples_per_s_per_gpu": samples_per_s / world,
        "mfu": flops / elapsed / world / (peak_tflops * 1e12),
        "data_wait_pct": 100.0 * data_wait / elapsed,
        "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
    }


class MetricsWindow:
    """The steps since the last log step (their summed loss, data wait, model FLOPs and the longest run of
    non-finite losses) and the metrics.jsonl record made from them on every rank; rank 0 writes it.

    Host time measures the window: the loss reduce of each log step waits for the GPU, so a window's
    elapsed time covers its steps' GPU work."""

    def __init__(self, accelerator, global_batch: int, peak_tflops: float, path: Path | None = None,
                 exporter=None) -> None:
        self.accelerator, self.global_batch, self.peak_tflops = accelerator, global_batch, peak_tflops
        self.path, self.exporter = path, exporter
        self.loss = torch.zeros((), device=accelerator.device)
        self.worst_nonfinite = torch.zeros((), device=accelerator.device)
        self.times = ranktimes.RankTimes(accelerator.device)  # this rank's forward passes (ranktimes.py)
        self.reset()

    def reset(self) -> None:
        """A new window from now (the non-finite run is reset by check_finite)."""
        self.loss.zero_()
        self.times.reset()
        self.start, self.steps, self.data_wait, self.flops = time.perf_counter(), 0, 0.0, 0.0

    def add(self, step_loss: torch.Tensor, nonfinite: torch.Tensor) -> None:
        self.loss += step_loss
        self.worst_nonfinite = torch.maximum(self.worst_nonfinite, nonfinite)
        self.steps += 1

    def rates(self, elapsed: float, flops: float) -> dict:
        """throughput of the window's steps over ``elapsed`` seconds, ``flops`` the model FLOPs of all ranks."""
        return throughput(self.steps * self.global_batch, flops, elapsed, self.data_wait, self.accelerator.device,
                          self.accelerator.num_processes, self.peak_tflops)

    def record(self, trainer) -> dict:
        """The window's record, reduced over the ranks (a collective: every rank calls it)."""
        accelerator, t = self.accelerator, trainer
        mean_loss = accelerator.reduce(self.loss, "mean").item() / self.steps
        elapsed = time.perf_counter() - self.start
        totals = accelerator.reduce(torch.tensor([self.flops, *t.bucket_samples], dtype=torch.float64,
                                                 device=accelerator.device), "sum").tolist()
        return {
            "step": t.step, "loss": mean_loss, "lr": t.lr_scheduler.get_last_lr()[0],
            "grad_norm": None if t.grad_norm is None else float(t.grad_norm),
            **self.rates(elapsed, totals[0]),
            # all ranks, since the run began: sums to step x global batch
            "samples_per_bucket": {key: int(n) for key, n in zip(t.schedule.buckets, totals[1:])},
            # per rank, so that a slow node shows (laionkit/trainer/ranktimes.py)
            **ranktimes.gather(accelerator, self.times.forward_seconds(), self.data_wait, self.steps),
        }

    def write(self, record: dict) -> None:
        """Rank 0: a metrics.jsonl line, the trackers' scalars and the Prometheus exporter's values."""
        accelerator = self.accelerator
        if not accelerator.is_main_process:
            return
        with open(self.path, "a") as handle:
            handle.write(strict_json(record) + "\n")
        if accelerator.log_with:
            scalars = {k: v for k, v in record.items() if k not in ("step", "samples_per_bucket")
                       and not isinstance(v, list)}
            scalars.update(ranktimes.tracker_scalars(record))
            scalars.update({f"samples_per_bucket/{k}": v for k, v in record["samples_per_bucket"].items()})
            accelerator.log(scalars, step=record["step"])
        if self.exporter is not None:
            self.exporter.update(record)

    def check_finite(self, step: int, max_nonfinite: int, output: Path) -> None:
        """Stops a diverged run: the longest run of non-finite losses of any rank in this window."""
        worst = self.accelerator.reduce(self.worst_nonfinite, "max").item()
        self.worst_nonfinite.zero_()
        if worst >= max_nonfinite:
            raise LaionkitError(
                f"step {step}: the loss was not finite for {int(worst)} consecutive steps (--max-nonfinite "
                f"{max_nonfinite}); the run diverged. Last good checkpoint: {last_good(output)}; "
                "resume from it with a lower --lr, more --warmup-steps or --max-grad-norm"
            )

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()


WANDB_RECORD = "wandb.json"  # RUN/wandb.json: the W&B run this run folder logs to


def start_trackers(accelerator, config) -> None:
    """Rank 0: the --log-with trackers, the run's options as their config. W&B gets --wandb-project,
    --wandb-entity, --wandb-run-name and --wandb-tags, and the run id of RUN/wandb.json: written by the
    run that started it and read by a resume, which continues that W&B run (resume="allow") instead of
    starting another (a resume keeps the recorded project and entity unless given). W&B's local files go
    to RUN/logs, not the working directory."""
    values = {f.name: str(getattr(config, f.name)) for f in fields(config)}
    if config.log_with != "wandb":
        accelerator.init_trackers("laionkit", config=values)
        return
    record = config.output / WANDB_RECORD
    found = read_json(record) if config.resume is not None and record.is_file() else {}
    run = {"id": found.get("id") or secrets.token_hex(4), "project": config.wandb_project or found.get("project")
           or "laionkit", "entity": config.wandb_entity or found.get("entity")}
    write_json(record, run)
    (config.output / "logs").mkdir(exist_ok=True)
    tags = [tag.strip() for tag in (config.wandb_tags or "").split(",") if tag.strip()]
    accelerator.init_trackers(run["project"], config=values, init_kwargs={"wandb": {
        "id": run["id"], "resume": "allow", "entity": run["entity"], "name": config.wandb_run_name,
        "tags": tags or None, "dir": str(config.output / "logs")}})


def log_images(accelerator, name: str, images: torch.Tensor, step: int) -> None:
    """Rank 0: ``images`` ([N, 3, H, W] in [0, 1]) to the --log-with tracker too, beside the file written: the
    images tab of TensorBoard, the media panel of W&B."""
    pixels = (images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({name: pixels}, step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({name: list(pixels)}, step)
