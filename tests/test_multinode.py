"""Multi-node as written, on one machine: every "node" is a real launcher process (torchrun with --nnodes 2 and
its own --node-rank, meeting at a c10d rendezvous on localhost), ranks talk over gloo on CPU. The recipes in
pipelines/ (Slurm, Kubernetes) are run as their commands, the doctor's all-reduce joins the launcher's
ranks, and metrics.jsonl names the rank that a real pause slows down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import run_cli
from fixtures import process_tree, signal_all
from test_preemption import free_port
from torch.distributed.checkpoint import FileSystemReader

from laionkit.trainer.checkpoint_async import is_dcp

REPO = Path(__file__).resolve().parents[1]
# The recipes call `torchrun` / `accelerate` by name, as on a cluster node where the environment is
# activated: this interpreter's bin folder comes first on PATH (CI runs .venv/bin/python without activating).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
       "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


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


TINY = ["--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "0", "--shuffle-buffer", "3"]


def ranks_of(pid: int) -> list[int]:
    """The training ranks a launcher process started (its descendants running laionkit.cli)."""
    found = []
    for each in process_tree(pid)[1:]:
        try:
            if b"laionkit.cli" in Path(f"/proc/{each}/cmdline").read_bytes():
                found.append(each)
        except OSError:
            pass
    return found


class Pause(threading.Thread):
    """A real slow node: SIGSTOP / SIGCONT the given processes, stopped ``stopped`` of every ``period`` seconds
    (a rank preempted by a noisy neighbour, a throttled CPU), until ``done`` is set."""

    def __init__(self, pids: list[int], stopped: float = 0.04, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids, self.stopped, self.period, self.done = pids, stopped, period, threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                signal_all(self.pids, signal.SIGSTOP)
                time.sleep(self.stopped)
                signal_all(self.pids, signal.SIGCONT)
                time.sleep(self.period - self.stopped)
        finally:
            signal_all(self.pids, signal.SIGCONT)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("laionkit_")}


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_kubernetes_train_job_validates_and_its_pods_train_as_two_nodes(latent_shards, tmp_path):
    """pipelines/k8s/train-job.yaml passes the Kubernetes 1.37 OpenAPI schema (strict: no unknown field), its
    Service gives the pods the names its rendezvous uses, and the pods' own command, run as 2 local processes
    (JOB_COMPLETION_INDEX 0 and 1, the rendezvous host as localhost, the data and model swapped for the
    test's), trains one run across the 2 "nodes". Pod 1's rank is paused most of the time while it trains:
    metrics.jsonl and the Prometheus endpoint name it as the straggler."""
    documents = list(yaml.safe_load_all((REPO / "pipelines/k8s/train-job.yaml").read_text()))
    for document in documents:
        kubernetes_validate.validate(document, "1.37", strict=True)
    broken = json.loads(json.dumps(documents[1]))
    broken["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 600  # a typo the strict check catches
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37", strict=True)
    service, job = documents
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    nodes = int(env["NNODES"])
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert env["MAIN_HOST"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's DNS name
    assert pod["terminationGracePeriodSeconds"] >= int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "preStop" in container["lifecycle"]
    assert any("spot" in toleration["key"] for toleration in pod["tolerations"])

    run, rendezvous, metrics_port = tmp_path / "run", free_port(), free_port()
    script = container["args"][2]
    for pod_value, here in [("/data/latents", str(latent_shards)), ("/data/runs/sd15", str(run)),
                            ("--unet stable-diffusion-v1-5/stable-diffusion-v1-5 --epochs 10 --batch-size 64",
                             " ".join([*TINY, "--max-steps", "24", "--log-every", "4"])),
                            ("29500", str(rendezvous)), ("9400", str(metrics_port))]:
        assert pod_value in script
        script = script.replace(pod_value, here)
    assert "--pg-timeout-minutes" in script
    pods = [subprocess.Popen(container["args"][:2] + [script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, start_new_session=True,
                             env={**ENV, **env, "JOB_COMPLETION_INDEX": str(index), "MAIN_HOST": "localhost",
                                  "GPUS_PER_NODE": "1", "NCCL_SOCKET_IFNAME": "lo"})
            for index in range(nodes)]
    pause, scraped = None, {}
    try:
        deadline = time.monotonic() + 240
        while not records(run):  # the first log step: both ranks train
            assert all(each.poll() is None for each in pods), pods[0].communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no log step in 240 s"
            time.sleep(0.05)
        paused_from = len(records(run))
        pause = Pause(ranks_of(pods[1].pid), stopped=0.09, period=0.1)  # 90%: clear even on a loaded CI host
        assert pause.pids
        pause.start()
        while len(records(run)) < paused_from + 2 and pods[0].poll() is None:
            time.sleep(0.05)
        if pods[0].poll() is None:
            scraped = scrape(metrics_port)
        results = [each.communicate(timeout=300) for each in pods]
    finally:
        if pause is not None:
            pause.done.set()
            pause.join()
        for each in pods:
            if each.poll() is None:
                signal_all(process_tree(each.pid), signal.SIGKILL)
                each.wait()
    assert [each.returncode for each in pods] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    written = records(run)
    assert [record["step"] for record in written] == [4, 8, 12, 16, 20, 24]
    assert all(len(record["rank_forward_s"]) == len(record["rank_data_wait_s"]) == 2 for record in written)
    slowed = written[paused_from + 1:]  # windows that began after the pauses did
    # Most windows name rank 1: a window whose few forward passes fell between its stops while the other test
    # worker starved rank 0 of the 2 cores may name rank 0 (CI saw 2 of 4, stopped 80% of 0.05 s); the sums below
    # weigh them all.
    named = [record["straggler_rank"] == 1 and record["straggler_ratio"] > 1 for record in slowed]
    assert slowed and sum(named) > len(slowed) / 2, slowed
    paused = [record["rank_forward_s"][1] + record["rank_data_wait_s"][1] for record in slowed]
    other = [record["rank_forward_s"][0] + record["rank_data_wait_s"][0] for record in slowed]
    assert sum(paused) > 1.5 * sum(other), slowed
    assert (run / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert is_dcp(sorted((run / "checkpoints").glob("step-*"))[-1])  # --checkpoint-writer auto: async DCP
    if scraped:  # the run may end before a scrape; the endpoint's content is checked when it did not
        # the gauge holds the window last logged before the scrape (most name rank 1, as above)
        assert scraped["laionkit_train_straggler_rank"] in {record["straggler_rank"] for record in written[paused_from:]}
        assert {'laionkit_train_rank_forward_seconds{rank="0"}', 'laionkit_train_rank_forward_seconds{rank="1"}',
                'laionkit_train_rank_data_wait_seconds{rank="1"}'} <= set(scraped)


# Stand-ins for the Slurm commands train.sbatch calls, on one machine: srun starts the step's command once per
# "node" (what --ntasks-per-node=1 does) and passes SIGTERM on, as srun does; scontrol resolves the node list
# and logs a requeue. What they start (accelerate launch on 2 "nodes", the ranks) is real.
SRUN = r"""#!/bin/bash
while [[ $1 == -* ]]; do echo "$1" >> "$SLURM_TEST_LOG"; shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
status=0
for pid in "${pids[@]}"; do
  while :; do code=0; wait "$pid" || code=$?; kill -0 "$pid" 2>/dev/null || break; done
  [ "$code" = 0 ] || status=$code
done
exit $status
"""
SCONTROL = r"""#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo localhost; else echo "scontrol $*" >> "$SLURM_TEST_LOG"; fi
"""
APPTAINER = r"""#!/bin/bash
echo "apptainer $1 $2 $3 $4 $5" >> "$SLURM_TEST_LOG"
shift 5
exec "$@"
"""


def test_slurm_train_sbatch_checkpoints_and_requeues_before_the_time_limit(latent_shards, tmp_path):
    """pipelines/slurm/train.sbatch as the batch step of a 2-node job (accelerate launch on each "node", under
    apptainer when APPTAINER_IMAGE is set): Slurm's --signal=B:USR1 reaches the script alone; its trap forwards
    SIGTERM through srun to both nodes' launchers and ranks, which checkpoint the same step, and the script
    then requeues the job (its --requeue allows it) and exits 0, so the requeued job resumes."""
    script = (REPO / "pipelines/slurm/train.sbatch").read_text()
    for directive in ("--requeue", "--signal=B:USR1@", "--open-mode=append", "--output=logs/"):
        assert f"#SBATCH {directive}" in script
    assert "mkdir -p logs" in script  # Slurm does not create the --output folder
    bin_dir, log, run = tmp_path / "bin", tmp_path / "slurm.log", tmp_path / "run"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("apptainer", APPTAINER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", "SLURM_TEST_LOG": str(log), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1",
           "MAIN_PORT": str(free_port()), "APPTAINER_IMAGE": "laionkit.sif"}
    batch = subprocess.Popen(["bash", str(REPO / "pipelines/slurm/train.sbatch"), str(latent_shards), str(run),
                              "train/ddp.yaml", *TINY, "--max-steps", "1000", "--log-every", "1",
                              "--mixed-precision", "no", "--record-keys"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not records(run):
            assert batch.poll() is None, batch.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step in 300 s"
            time.sleep(0.05)
        os.kill(batch.pid, signal.SIGUSR1)  # --signal=B:USR1@300: the batch shell only
        out, err = batch.communicate(timeout=240)
    finally:
        if batch.poll() is None:
            signal_all(process_tree(batch.pid), signal.SIGKILL)
            batch.wait()
    assert batch.returncode == 0, err[-4000:]
    assert "requeueing job 4242" in out
    calls = log.read_text().splitlines()
    assert "scontrol requeue 4242" in calls
    assert calls.count("apptainer exec --nv --bind " + str(REPO) + " laionkit.sif") == 2  # each node's task
    [checkpoint] = sorted((run / "checkpoints").iterdir())
    stopped_at = int(checkpoint.name.split("-")[1])
    assert 0 < stopped_at < 1000 and (checkpoint / "trainer.json").is_file()
    assert is_dcp(checkpoint)  # the recipe's --checkpoint-writer auto: DCP, the stop's checkpoint written whole
    assert err.count(f"stopped by signal 15 at step {stopped_at}") + out.count(f"stopped by signal 15 at step {stopped_at}") >= 1
    assert not (run / "unet").exists()


def test_pg_timeout_minutes_ends_a_run_whose_peer_stopped_responding(latent_shards, tmp_path):
    """A rank that stops answering (SIGSTOP: a hung node) makes the others' next collective fail after
    --pg-timeout-minutes (here 0.1: 6 s) instead of torch's default (30 min for gloo, 10 for NCCL): the run ends
    with a timeout error, and its scheduler can restart it. Once the live rank has failed, the hung one is let
    go on (SIGCONT) so that the launcher's SIGTERM ends it: torchrun waits 30 s before it kills a rank that
    ignores SIGTERM on this path (its TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not read there), which would only
    slow the test."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "laionkit.cli", "train", str(latent_shards), "--output", str(run), *TINY,
               "--max-steps", "1000", "--log-every", "1", "--pg-timeout-minutes", "0.1"]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env=ENV, start_new_session=True)
    lines, armed, timed_out = [], threading.Event(), threading.Event()

    def read() -> None:  # a timeout reported once the rank is stopped
        for line in launcher.stderr:
            lines.append(line)
            if armed.is_set() and ("timed out" in line.lower() or "timeout" in line.lower()):
                timed_out.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not records(run):
            assert launcher.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "no step in 240 s"
            time.sleep(0.05)
        [first, second] = sorted(ranks_of(launcher.pid))
        hung = [second] if b"LOCAL_RANK=1" in Path(f"/proc/{second}/environ").read_bytes() else [first]
        armed.set()
        signal_all(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        assert timed_out.wait(timeout=120), "".join(lines)[-3000:]  # the default would wait 30 minutes here
        waited = time.monotonic() - stopped
        signal_all(hung, signal.SIGCONT)
        launcher.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        if launcher.poll() is None:
            signal_all(process_tree(launcher.pid), signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode != 0, "".join(lines)[-3000:]
    assert waited < 100, waited
    said = "".join(lines)
    assert "error: a collective timed out (Timed out waiting 6000ms" in said, said[-3000:]  # one line, no traceback
    assert "--pg-timeout-minutes; restart the run with --resume latest" in said and "[rank0]: Traceback" not in said


def test_hsdp_shards_inside_a_node_and_replicates_across_nodes(latent_shards, tmp_path):
    """train/hsdp.yaml on 2 "nodes" (accelerate launch each, 2 CPU ranks per node, gloo): the UNet is sharded
    over the 2 ranks of a node and replicated across the nodes, so every tensor of the sharded checkpoint is
    in 2 shards, not in 4 as 4-way FSDP would cut it; it trains the same losses and gradient
    norms as DDP on the same 4 ranks (fp32)."""
    args = ["--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--max-steps", "2", "--checkpoint-every", "2",
            "--log-with", "none", "--quiet", "--workers", "0", "--log-every", "1", "--max-grad-norm", "0.05"]
    hsdp, ddp, port = tmp_path / "hsdp", tmp_path / "ddp", free_port()
    nodes = [[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "train/hsdp.yaml"),
              "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "4",
              "--parallelism_config_dp_shard_size", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--mixed_precision", "no",
              "-m", "laionkit.cli", "train", str(latent_shards), "--output", str(hsdp), *args] for rank in (0, 1)]
    first, second = run_nodes(nodes, timeout=400)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    assert "HSDP on CPU ranks (gloo): 2 replicas x 2 shards" in first.stdout
    reference = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                                "--master_port", str(free_port()), "-m", "laionkit.cli", "train", str(latent_shards),
                                "--output", str(ddp), *args], capture_output=True, text=True, env=ENV, cwd=REPO,
                               timeout=400)
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, expected = records(hsdp), records(ddp)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2]
    for mine, theirs in zip(got, expected):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4), (mine["step"], key)
    # torch's own reader of the sharded checkpoint: every tensor in 2 shards (one node's ranks), not 4
    chunks = {name: len(meta.chunks) for name, meta in FileSystemReader(
        str(hsdp / "checkpoints" / "step-00000002" / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata.items()
        if hasattr(meta, "chunks")}
    assert chunks and set(chunks.values()) == {2}, chunks


def test_slurm_scripts_say_to_make_their_log_folder_and_use_the_current_nccl_variable():
    """Slurm opens --output before the script runs and does not create its folder (the job fails with no log):
    each script that writes into logs/ says `mkdir -p logs` in its usage line. The recipes set
    TORCH_NCCL_ASYNC_ERROR_HANDLING, never the deprecated NCCL_ASYNC_ERROR_HANDLING."""
    for script in sorted((REPO / "pipelines").rglob("*")):
        if not script.is_file():
            continue
        text = script.read_text()
        if "#SBATCH --output=logs/" in text:
            assert "mkdir -p logs && sbatch" in text, script.name
        assert "NCCL_ASYNC_ERROR_HANDLING=" not in text.replace("TORCH_NCCL_ASYNC_ERROR_HANDLING=", ""), script.name
    for recipe in ("slurm/train.sbatch", "torchrun/train-multinode.sh", "k8s/train-job.yaml"):
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in (REPO / "pipelines" / recipe).read_text(), recipe


def test_pg_timeout_minutes_must_be_positive(latent_shards, tmp_path):
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "1",
                     "--pg-timeout-minutes", "0", check=False)
    assert result.returncode == 2 and "--pg-timeout-minutes 0.0: must be a finite number > 0" in result.stderr
    assert "Traceback" not in result.stderr
