"""Multi-node as written, on one machine: every "node" is a real launcher process (torchrun with --nnodes 2 and
its own --node-rank, meeting at a c10d rendezvous on localhost), ranks talk over gloo on CPU. The recipes in
pipelines/ (Slurm, Kubernetes) are run as their commands, the doctor's all-reduce joins the launcher's
ranks, and metrics.jsonl names the rank that a real pause slows down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_preemption import free_port

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def node(rank: int, port: int, *command: str, nproc: int = 1) -> list[str]:
    """One "node": torchrun with its node rank, joining the others at localhost:PORT (c10d)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", "laionkit-test", *command]


def run_nodes(commands: list[list[str]], env: dict | None = None, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env or ENV, cwd=REPO) for command in commands]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [subprocess.CompletedProcess(command, process.returncode, out, err)
            for command, process, (out, err) in zip(commands, processes, outputs)]


def test_doctor_allreduce_runs_between_the_launchers_nodes():
    """Under torchrun on 2 nodes the all-reduce joins the launcher's ranks (not a local 127.0.0.1 group per
    node): rank 0 reports one row for 2 processes on 2 nodes, with the NCCL variables explained; rank 1
    prints nothing."""
    port = free_port()
    env = {**ENV, "NCCL_SOCKET_IFNAME": "lo"}
    env.pop("NCCL_DEBUG", None)
    doctor = ["-m", "laionkit.cli", "doctor", "--allreduce", "--backend", "gloo", "--megabytes", "1", "--json"]
    first, second = run_nodes([node(0, port, *doctor), node(1, port, *doctor)], env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    assert second.stdout.strip() == ""
    rows = {row["name"]: row for row in json.loads(first.stdout)}
    busbw = rows["all-reduce busbw (gloo, 2 proc on 2 nodes, 1 MB)"]
    assert float(busbw["value"].split()[0]) > 0
    assert rows["NCCL_SOCKET_IFNAME"]["value"] == "lo" and rows["NCCL_SOCKET_IFNAME"]["verdict"].startswith("ok")
    assert "NET/Socket" in rows["NCCL_DEBUG"]["verdict"] and rows["NCCL_DEBUG"]["value"] == "-"
    assert "mlx5_0" in rows["NCCL_IB_HCA"]["verdict"]
    assert rows["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "1"  # torchrun's own setting for its ranks
