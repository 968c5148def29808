"""`laionkit doctor`: what this machine has, and whether its GPUs' links and disks can feed training.

Each check returns rows of (check, value, verdict) so the CLI prints one table and a script can read
the same facts as JSON. Verdicts are plain: "ok", "slow: <why and what to check>", or "missing".
Under a launcher (torchrun on every node, a Kubernetes pod's torchrun, srun + torchrun) the all-reduce runs
between the launcher's ranks through its rendezvous, so it measures the links between nodes, and rank 0
reports, with the NCCL variables that decide those links.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys
import time
from contextlib import contextmanager
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


@contextmanager
def stdout_to_stderr():
    """File descriptor 1 goes to 2 for the block: some torch releases' Gloo prints its connection lines ("[Gloo]
    Rank 1 is connected to 1 peer ranks...") from C++ onto stdout, where `doctor --json` writes its report."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _allreduce_worker(rank: int, world: int, port: int, backend: str, numel: int, iters: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with stdout_to_stderr():
        dist.init_process_group(backend, rank=rank, world_size=world)
    seconds = _time_allreduce(rank, backend, numel, iters)
    if rank == 0:
        queue.put(seconds)
    dist.destroy_process_group()


def _time_allreduce(local_rank: int, backend: str, numel: int, iters: int) -> float:
    """Seconds per all-reduce of ``numel`` floats in the initialised process group, the slowest rank's."""
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
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
    seconds = torch.tensor([(time.perf_counter() - start) / iters], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def launched() -> tuple[int, int, int] | None:
    """(rank, world size, nodes) when a launcher started this process as one rank of several (torchrun,
    `accelerate launch`, a Kubernetes pod's torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), so the
    all-reduce runs between the launcher's ranks, on every node it spans; else None (a local check)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "MASTER_ADDR" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return int(os.environ.get("RANK", "0")), world, max(1, world // per_node)


def reporting() -> bool:
    """Whether this process prints the report: rank 0 of a launched check, or the only process."""
    where = launched()
    return where is None or where[0] == 0


def launched_busbw(backend: str, megabytes: int, iters: int = 20) -> float:
    """The all-reduce between the launcher's ranks (every node of the job), through its rendezvous."""
    numel = megabytes * 2**20 // 4
    world = int(os.environ["WORLD_SIZE"])
    try:
        with stdout_to_stderr():
            dist.init_process_group(backend)  # env://: the launcher's MASTER_ADDR / MASTER_PORT, RANK, WORLD_SIZE
    except Exception as error:  # an unreachable MASTER_ADDR, a closed port: say which
        raise LaionkitError(f"--allreduce: cannot join the process group at {os.environ['MASTER_ADDR']}:"
                            f"{os.environ.get('MASTER_PORT')} ({error})") from None
    try:
        seconds = _time_allreduce(int(os.environ.get("LOCAL_RANK", "0")), backend, numel, iters)
    finally:
        dist.destroy_process_group()
    return numel * 4 / seconds * 2 * (world - 1) / world / 1e9


# What each NCCL variable does between nodes, for the verdicts: (name, why it matters, what to do when unset).
NCCL_VARIABLES = (
    ("NCCL_SOCKET_IFNAME", "the interface NCCL's bootstrap and socket transport use",
     "NCCL picks one itself and may take docker0 or a management port; name the node-to-node one "
     "(e.g. NCCL_SOCKET_IFNAME=eth0, or ^docker,lo to exclude)"),
    ("NCCL_IB_HCA", "the InfiniBand / RoCE adapters NCCL uses",
     "NCCL uses every adapter it finds; list the ones on the GPU fabric (e.g. NCCL_IB_HCA=mlx5_0,mlx5_1) "
     "when some serve storage"),
    ("NCCL_DEBUG", "NCCL's log level",
     "set NCCL_DEBUG=INFO once: each rank logs its transport (NET/IB is InfiniBand; NET/Socket between "
     "nodes means TCP, tens of times slower) and the interface it chose"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "what torch does when a collective fails or times out",
     "torchrun sets 1 for its ranks (a failed or timed-out collective aborts NCCL and ends the process, so a "
     "dead node ends the job instead of hanging it); pipelines/ set 1 for any launcher"),
)


def nccl_environment(nodes: int) -> list[Check]:
    """The NCCL variables that decide how ranks on several nodes talk, each with what it does."""
    rows = []
    for name, what, unset in NCCL_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            rows.append(Check(name, value, f"ok: {what}"))
        else:
            rows.append(Check(name, "-", f"unset ({what}): {unset}" if nodes > 1 or name == "NCCL_DEBUG"
                              else f"unset ({what}); matters between nodes"))
    if "NCCL_ASYNC_ERROR_HANDLING" in os.environ:
        rows.append(Check("NCCL_ASYNC_ERROR_HANDLING", os.environ["NCCL_ASYNC_ERROR_HANDLING"],
                          "renamed: torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING now (the old name is deprecated)"))
    return rows


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
        where = launched()
        if where is not None:  # one rank of a launched job: between all its ranks and nodes
            if processes is not None and processes != where[1]:
                raise LaionkitError(f"--processes {processes}: the launcher started {where[1]} ranks; leave "
                                    "--processes out under torchrun / accelerate launch")
            _, processes, nodes = where
            busbw = launched_busbw(backend, megabytes)
        else:
            processes, nodes = processes or max(torch.cuda.device_count(), 2), 1
            busbw = allreduce_busbw(processes, backend, megabytes)
        if backend != "nccl":
            verdict = f"ok ({backend}: CPU transport, not a GPU link)"
        elif busbw >= min_busbw:
            verdict = "ok"
        elif nodes > 1:
            verdict = (f"slow: below {min_busbw:g} GB/s between {nodes} nodes; run with NCCL_DEBUG=INFO: NET/Socket "
                       "means no InfiniBand (check NCCL_IB_HCA, the RDMA devices in the container), and "
                       "NCCL_SOCKET_IFNAME names the interface")
        else:
            verdict = f"slow: below {min_busbw:g} GB/s; check `nvidia-smi topo -m`, NCCL_P2P_DISABLE, NCCL_IB_*"
        spread = f"{processes} proc on {nodes} nodes" if nodes > 1 else f"{processes} proc"
        rows.append(Check(f"all-reduce busbw ({backend}, {spread}, {megabytes} MB)", f"{busbw:.2f} GB/s", verdict))
        rows += nccl_environment(nodes)
    if shards is not None:
        mbps, per_second = shard_read_throughput(shards)
        verdict = "ok" if mbps >= min_read else f"slow: below {min_read:g} MB/s; stage shards on local NVMe"
        rows.append(Check(f"shard read ({shards})", f"{mbps:.0f} MB/s, {per_second:.0f} samples/s", verdict))
    return rows
