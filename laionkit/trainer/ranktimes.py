"""Per-rank timings in metrics.jsonl and Prometheus, so that a slow node shows: ``rank_forward_s``,
``rank_data_wait_s`` (one entry per rank, seconds per optimizer step over the logging window) and
``straggler_rank`` / ``straggler_ratio``.

Synchronous data parallelism runs every rank at the pace of the slowest: a rank that waits for its
peers in the gradient all-reduce (DDP) or a parameter all-gather (FSDP) shows the same step time as the
rank it waits for, so per-rank step times tell nothing. What does differ is the time a rank spends on
its own: waiting for its DataLoader (a slow disk, a starved CPU) and its forward passes (a throttled or
slower GPU, a noisy neighbour). Under DDP the forward pass holds no collective, so its time is the rank's
own; under FSDP it includes the parameter all-gathers, and the signal is diluted. The straggler is
the rank with the largest sum of the two; ``straggler_ratio`` is that sum over the ranks' median, 1.0 when
all ranks are alike.

On a GPU the forward pass is timed with CUDA events (no host-device sync in the step: they are read at the
log step, whose loss reduce waits for the GPU anyway); on CPU with the host clock.
"""

from __future__ import annotations

import time

import torch


class RankTimes:
    """This rank's forward-pass seconds since the last ``reset``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.host_seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def end(self, began) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append((began, event))
        else:
            self.host_seconds += time.perf_counter() - began

    def forward_seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
            self.host_seconds += sum(start.elapsed_time(end) for start, end in self.events) / 1000
            self.events.clear()
        return self.host_seconds


def gather(accelerator, forward_s: float, data_wait_s: float, steps: int) -> dict:
    """The metrics.jsonl fields from every rank's window (a collective: every rank calls it)."""
    mine = torch.tensor([forward_s / steps, data_wait_s / steps], dtype=torch.float64, device=accelerator.device)
    every = accelerator.gather(mine).reshape(-1, 2).tolist()  # rank order
    forward, waits = [row[0] for row in every], [row[1] for row in every]
    own = [f + w for f, w in zip(forward, waits)]
    straggler = max(range(len(own)), key=own.__getitem__)
    median = sorted(own)[(len(own) - 1) // 2]
    return {"rank_forward_s": forward, "rank_data_wait_s": waits, "straggler_rank": straggler,
            "straggler_ratio": own[straggler] / median if median > 0 else 1.0}


def tracker_scalars(record: dict) -> dict:
    """The per-rank lists as one scalar per rank (``rank_forward_s/3``) for TensorBoard / W&B."""
    scalars = {}
    for key in ("rank_forward_s", "rank_data_wait_s"):
        scalars.update({f"{key}/{rank}": value for rank, value in enumerate(record.get(key, ()))})
    return scalars
