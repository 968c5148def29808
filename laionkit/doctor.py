"""`laionkit doctor`: what this machine has, and whether its GPUs' links and disks can feed training.

Each check returns rows of (check, value, verdict) so the CLI prints one table and a script can read
the same facts as JSON. Verdicts are plain: "ok", "slow: <why and what to check>", or "missing".
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from laionkit.common import LaionkitError, available_cpus

PACKAGES = ("laionkit", "torch", "torchvision", "diffusers", "transformers", "accelerate", "webdataset",
            "img2dataset", "open_clip_torch", "pyarrow", "duckdb", "deepspeed", "nvidia-ml-py")


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    verdict: str


def environment() -> list[Check]:
    rows = [Check("python", platform.python_version(), "ok"), Check("platform", platform.platform(), "ok")]
    for name in PACKAGES:
        try:
            rows.append(Check(name, importlib.metadata.version(name), "ok"))
        except importlib.metadata.PackageNotFoundError:
            rows.append(Check(name, "-", "missing"))
    cuda = torch.version.cuda or "-"
    rows.append(Check("torch CUDA build", cuda, "ok" if torch.version.cuda else "missing"))
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "-"
        rows.append(Check("NCCL", nccl, "ok"))
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            rows.append(Check(f"GPU {index}", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
                                              f"sm_{props.major}{props.minor}", "ok"))
    else:
        rows.append(Check("GPUs", "0 visible", "missing: training and encode run on CPU (slow)"))
    rows.append(Check("CPU cores", f"{available_cpus()} usable of {os.cpu_count()}", "ok"))
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _allreduce_worker(rank: int, world: int, port: int, backend: str, numel: int, iters: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    if rank == 0:
        queue.put(seconds)
    dist.destroy_process_group()


def allreduce_busbw(processes: int, backend: str, megabytes: int, iters: int = 20) -> float:
    """NCCL-tests' bus bandwidth for all-reduce: size / time * 2 (n - 1) / n, in GB/s."""
    if processes < 2:
        raise LaionkitError("the all-reduce check needs at least 2 processes (GPUs)")
    if backend == "nccl" and torch.cuda.device_count() < processes:
        raise LaionkitError(f"--processes {processes} but only {torch.cuda.device_count()} GPUs are visible")
    numel = megabytes * 2**20 // 4
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_allreduce_worker, args=(processes, _free_port(), backend, numel, iters, queue),
                       nprocs=processes, start_method="spawn")
    seconds = queue.get()
    return numel * 4 / seconds * 2 * (processes - 1) / processes / 1e9


def shard_read_throughput(folder: Path, max_seconds: float = 10.0) -> tuple[float, float]:
    """Read the folder's tar shards as training would (webdataset, no decode): MB/s and samples/s."""
    import webdataset as wds

    shards = sorted(str(path) for path in folder.glob("*.tar"))
    if not shards:
        raise LaionkitError(f"no .tar shards in {folder}")
    nbytes = samples = 0
    start = time.perf_counter()
    for sample in wds.WebDataset(shards, shardshuffle=False):
        samples += 1
        nbytes += sum(len(value) for value in sample.values() if isinstance(value, bytes))
        if time.perf_counter() - start > max_seconds:
            break
    seconds = time.perf_counter() - start
    return nbytes / seconds / 1e6, samples / seconds


def run(allreduce: bool, processes: int | None, backend: str | None, megabytes: int,
        shards: Path | None, min_busbw: float, min_read: float) -> list[Check]:
    """min_busbw / min_read: below these the link or disk, not the GPU, bounds multi-GPU training."""
    rows = environment()
    if allreduce:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        processes = processes or max(torch.cuda.device_count(), 2)
        busbw = allreduce_busbw(processes, backend, megabytes)
        if backend != "nccl":
            verdict = f"ok ({backend}: CPU transport, not a GPU link)"
        elif busbw >= min_busbw:
            verdict = "ok"
        else:
            verdict = f"slow: below {min_busbw:g} GB/s; check `nvidia-smi topo -m`, NCCL_P2P_DISABLE, NCCL_IB_*"
        rows.append(Check(f"all-reduce busbw ({backend}, {processes} proc, {megabytes} MB)",
                          f"{busbw:.2f} GB/s", verdict))
    if shards is not None:
        mbps, per_second = shard_read_throughput(shards)
        verdict = "ok" if mbps >= min_read else f"slow: below {min_read:g} MB/s; stage shards on local NVMe"
        rows.append(Check(f"shard read ({shards})", f"{mbps:.0f} MB/s, {per_second:.0f} samples/s", verdict))
    return rows
