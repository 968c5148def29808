"""What the bench scripts share (bench_train.py and bench_encode.py import it; neither imports the other back):
torch.profiler over a few steps, with how busy the GPU was."""

from __future__ import annotations

import torch


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_steps(run_step, steps: int, device) -> str:
    """torch.profiler over a few steps: the ops and kernels that take the time and, on a GPU, how busy it
    was (the union of kernel intervals over the profiled span; near 100 % means the step is GPU-bound)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            run_step()
        _sync(device)
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                      row_limit=30, max_name_column_width=70)
    if not cuda:
        return table
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    merged = _merged(kernels)
    busy, end = sum(finish - begin for begin, finish in merged), merged[-1][1]
    span = end - kernels[0][0]
    # The middle half of the span too: a run() profiled whole starts with set-up and worker start-up and
    # ends with a drain, which the steady state between them does not have.
    low, high = kernels[0][0] + span / 4, kernels[0][0] + 3 * span / 4
    middle = sum(max(0, min(finish, high) - max(begin, low)) for begin, finish in merged)
    return (f"{table}\nGPU busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms over {steps} steps ({100 * busy / span:.1f} %; "
            f"middle half of the span: {100 * middle / (high - low):.1f} %)")


def _merged(intervals: list) -> list:
    """Sorted (start, end) intervals with the overlapping ones merged."""
    merged: list = []
    for begin, finish in intervals:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], finish)
        else:
            merged.append([begin, finish])
    return merged
