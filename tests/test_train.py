"""laionkit train on CPU: tiny UNet, real latent shards (encode's output on the real photos), real CLI."""

from __future__ import annotations

import collections
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli
from fixtures import free_port, metrics

from laionkit.trainer.latent_order import DataProgress
from laionkit.trainer.latent_stream import StreamLayout, latent_loader

# Small and fast: 8x8 latents, tiny UNet, no tensorboard.
TINY = ("--unet-config", "tiny", "--batch-size", "4", "--lr", "1e-3", "--log-with", "none", "--quiet")



def seen(run: Path, rank: int = 0) -> dict[int, list[str]]:
    lines = (run / "seen" / f"rank-{rank:05d}.jsonl").read_text().split("\n")
    return {record["step"]: record["keys"] for record in map(json.loads, filter(None, lines))}


def reshard(latents: Path, sizes: list[int], output: Path) -> Path:
    """The same encoded samples regrouped into shards of the given sizes (uneven on purpose)."""
    files = []
    for shard in sorted(latents.glob("*.tar")):
        with tarfile.open(shard) as tar:
            files += [(member, tar.extractfile(member).read()) for member in tar.getmembers()]
    keys = sorted({member.name.split(".")[0] for member, _ in files})
    assert sum(sizes) <= len(keys)
    output.mkdir()
    starts = [0, *itertools.accumulate(sizes)]
    for index, (start, end) in enumerate(zip(starts, starts[1:])):
        chosen = set(keys[start:end])
        with tarfile.open(output / f"{index:05d}.tar", "w") as tar:
            for member, data in files:
                if member.name.split(".")[0] in chosen:
                    tar.addfile(member, io.BytesIO(data))
    for name in ("manifest.json", "empty_caption.npy"):
        shutil.copy(latents / name, output / name)
    return output


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_resumes_from_what_it_trained_exactly(latent_shards, workers):
    """A loader restarted with the samples the first one's batches held marked as trained (and the number
    of batches taken, which decides the next worker) continues with the same batches."""
    layout = StreamLayout(tuple(map(str, sorted(latent_shards.glob("*.tar")))), 0, 1, workers, 3, 7, 4)
    batches = list(itertools.islice(latent_loader(layout), 9))
    keys = [batch["key"] for batch in batches]
    progress = DataProgress.fresh([4, 4])
    for batch in batches[:5]:
        progress.mark(batch["epoch"], batch["id"])
    resumed = [batch["key"] for batch in itertools.islice(latent_loader(layout, 5, progress=progress), 4)]
    assert resumed == keys[5:9]
    # a new epoch is a new order, of the same 8 samples
    assert len(set(itertools.chain(*keys))) == 8


def test_overfit_validate_export(latent_shards, tmp_path):
    from diffusers import UNet2DConditionModel

    run = tmp_path / "run"
    run_cli("train", latent_shards, "--output", run, *TINY, "--batch-size", "8", "--max-steps", "30",
            "--log-every", "5", "--ema", "--ema-decay", "0.9", "--validate-every", "30",
            "--validation-count", "2", "--validation-steps", "2", "--workers", "0", "--snr-gamma", "5",
            "--caption-dropout", "0.1", "--checkpoint-every", "20", "--no-checkpoint-at-end")
    # the periodic checkpoint is written, the one after the last step is not (the export is the output)
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["step-00000020"]
    losses = [record["loss"] for _, record in sorted(metrics(run).items())]
    assert len(losses) == 6
    assert sum(losses[-2:]) / 2 < 0.6 * sum(losses[:2]) / 2, losses
    last = metrics(run)[30]
    for field in ("lr", "grad_norm", "samples_per_s", "samples_per_s_per_gpu", "mfu", "data_wait_pct",
                  "gpu_mem_gib"):
        assert field in last
    assert last["mfu"] > 0
    assert (run / "samples" / "step-000030.png").stat().st_size > 0
    for folder in ("unet", "unet_ema"):
        unet = UNet2DConditionModel.from_pretrained(run / folder)
        assert unet.config.in_channels == 4 and unet.config.cross_attention_dim == 32


def _safetensors_dtypes(folder: Path, files: str = "*.safetensors") -> set:
    """The dtypes of the tensors in ``folder``'s safetensors files (``files``: a glob, or one file's name)."""
    from safetensors.torch import load_file

    return {tensor.dtype for path in folder.glob(files) for tensor in load_file(path).values()}


def _checkpoint_dtypes(checkpoint: Path) -> set:
    return _safetensors_dtypes(checkpoint, "model.safetensors")


def test_bf16_weights_keep_fp32_master_weights_that_checkpoint_resume_and_export(latent_shards, tmp_path):
    """--mixed-precision bf16: the model trains in bf16 while fp32 master weights (not their bf16
    rounding) resume exactly and are exported; --no-bf16-weights keeps fp32 weights under autocast."""
    import torch
    from diffusers import UNet2DConditionModel

    args = (*TINY, "--batch-size", "4", "--workers", "0", "--mixed-precision", "bf16", "--checkpoint-every", "3",
            "--ema", "--ema-decay", "0.5", "--grad-accum", "2")
    whole = tmp_path / "whole"
    run_cli("train", latent_shards, "--output", whole, *args, "--max-steps", "6", "--log-every", "1",
            "--validate-every", "6", "--validation-count", "2", "--validation-steps", "2")
    assert _checkpoint_dtypes(whole / "checkpoints" / "step-00000003") == {torch.bfloat16}
    assert (whole / "samples" / "step-000006.png").stat().st_size > 0
    ema = [p.detach() for p in UNet2DConditionModel.from_pretrained(whole / "unet_ema").parameters()]
    assert all(w.dtype == torch.float32 for w in ema)
    exported = [p.detach() for p in UNet2DConditionModel.from_pretrained(whole / "unet").parameters()]
    assert all(w.dtype == torch.float32 for w in exported)
    assert any((w != w.bfloat16().float()).any() for w in exported), "exported the bf16 rounding"

    resumed = tmp_path / "resumed"
    run_cli("train", latent_shards, "--output", resumed, *args, "--max-steps", "6", "--log-every", "1",
            "--resume", whole / "checkpoints" / "step-00000003")
    expected, got = metrics(whole), metrics(resumed)
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7), step
    again = [p.detach() for p in UNet2DConditionModel.from_pretrained(resumed / "unet").parameters()]
    assert all(torch.equal(a, b) for a, b in zip(exported, again))

    autocast = tmp_path / "autocast"
    run_cli("train", latent_shards, "--output", autocast, *args, "--max-steps", "3", "--no-bf16-weights")
    assert _checkpoint_dtypes(autocast / "checkpoints" / "step-00000003") == {torch.float32}


def test_full_bf16_trains_bf16_weights_and_optimizer_state_resumes_exactly_and_exports(latent_shards, tmp_path):
    """--full-bf16: weights, gradients and AdamW state in bf16 with no fp32 master copy (the bare bf16
    step's policy, 8 bytes per parameter); the EMA stays fp32; kill-free resume is exact; the export
    loads; and it is refused, one line, without bf16."""
    import torch
    from diffusers import UNet2DConditionModel

    args = (*TINY, "--workers", "0", "--mixed-precision", "bf16", "--full-bf16", "--checkpoint-every", "2",
            "--ema", "--ema-decay", "0.5", "--lr", "1e-2")
    whole = tmp_path / "whole"
    run_cli("train", latent_shards, "--output", whole, *args, "--max-steps", "4", "--log-every", "1")
    checkpoint = whole / "checkpoints" / "step-00000002"
    assert _checkpoint_dtypes(checkpoint) == {torch.bfloat16}
    assert not (checkpoint / "master.pt").exists()
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)["state"]
    assert {t.dtype for state in optimizer.values() for t in state.values() if t.dim()} == {torch.bfloat16}
    # the bf16 weights themselves, in bf16 (fp32 would double the export and add nothing); the EMA in fp32
    exported = [p.detach() for p in UNet2DConditionModel.from_pretrained(whole / "unet").parameters()]
    assert _safetensors_dtypes(whole / "unet") == {torch.bfloat16}
    ema = [p.detach() for p in UNet2DConditionModel.from_pretrained(whole / "unet_ema").parameters()]
    assert _safetensors_dtypes(whole / "unet_ema") == {torch.float32}
    assert any(not torch.equal(w, w.bfloat16().float()) for w in ema), "the EMA was kept in bf16"

    resumed = tmp_path / "resumed"
    run_cli("train", latent_shards, "--output", resumed, *args, "--max-steps", "4", "--log-every", "1",
            "--resume", checkpoint)
    expected, got = metrics(whole), metrics(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step]["loss"] == expected[step]["loss"], step
    again = [p.detach() for p in UNet2DConditionModel.from_pretrained(resumed / "unet").parameters()]
    assert all(torch.equal(a, b) for a, b in zip(exported, again))

    refused = run_cli("train", latent_shards, "--output", tmp_path / "no", *TINY, "--max-steps", "1",
                      "--mixed-precision", "no", "--full-bf16", check=False)
    assert refused.returncode != 0 and "--full-bf16" in refused.stderr and "Traceback" not in refused.stderr


def _torchrun(ranks: int, port: int, *args, script: Path | None = None, timeout: float = 300):
    """`laionkit` under torchrun on CPU (gloo), one thread per rank; ``script`` replaces the entry point."""
    target = [str(script)] if script else ["-m", "laionkit.cli"]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
         str(port), *target, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _rank_records(checkpoint: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(checkpoint.glob("rank-*.json"))]


# --grad-accum 2 (the no_sync micro-batches, where bf16 weights once drifted) under each precision policy;
# one micro-batch per step under the default policy is what every other multi-rank test runs, and train's
# own fingerprint check stops any of them whose ranks drift (test_a_rank_whose_weights_drift_stops...).
@pytest.mark.parametrize(("precision", "accum"), [("bf16-weights", 2), ("autocast", 2), ("full-bf16", 2)])
def test_two_ddp_ranks_hold_identical_weights_at_every_checkpoint(latent_shards, tmp_path, precision, accum):
    """Two real DDP ranks (torchrun, gloo): every checkpoint's weight fingerprints agree. With bf16
    weights and --grad-accum 2 they drifted apart (the master gradients took the no_sync micro-batch's
    local gradients, which DDP never all-reduced). FSDP holds one sharded copy of the weights, nothing to
    drift: tests/test_fsdp.py checks it against DDP instead."""
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "run"
    weights = {"bf16-weights": "--bf16-weights", "autocast": "--no-bf16-weights", "full-bf16": "--full-bf16"}[precision]
    result = _torchrun(2, free_port(), "train", latent_shards, "--output", run,
                       *TINY, "--batch-size", "2", "--max-steps", "4", "--log-every", "2", "--checkpoint-every", "2",
                       "--workers", "0", "--mixed-precision", "bf16", weights, "--grad-accum", accum)
    assert result.returncode == 0, result.stderr[-3000:]
    for step in (2, 4):
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        records = _rank_records(checkpoint)
        assert len(records) == 2 and records[0]["fingerprint"] == records[1]["fingerprint"], step
    # the precision the ranks trained in: bf16 weights with fp32 master copies, or fp32 under autocast
    stored = {t.dtype for t in load_file(checkpoint / "model.safetensors").values()}
    if precision == "bf16-weights":
        assert stored == {torch.bfloat16}
        master = torch.load(checkpoint / "master.pt", weights_only=True)["master"]
        assert {t.dtype for t in master} == {torch.float32}
    elif precision == "full-bf16":
        assert stored == {torch.bfloat16} and not (checkpoint / "master.pt").exists()
    else:
        assert stored == {torch.float32} and not (checkpoint / "master.pt").exists()


DRIFT = """
import os, sys, torch
if os.environ["RANK"] == "1":  # this rank's optimizer nudges one weight after every step
    step = torch.optim.AdamW.step
    def drifting(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1e-3)
        return out
    torch.optim.AdamW.step = drifting
from laionkit.cli import main
sys.argv = ["laionkit", *sys.argv[1:]]
main()
"""


def test_a_rank_whose_weights_drift_stops_the_run_naming_it(latent_shards, tmp_path):
    script = tmp_path / "drift.py"
    script.write_text(DRIFT)
    run = tmp_path / "run"
    result = _torchrun(2, free_port(), "train", latent_shards, "--output", run, *TINY, "--batch-size", "2",
                       "--max-steps", "2", "--checkpoint-every", "2", "--workers", "0", script=script)
    assert result.returncode != 0
    assert "step 2: the weights of rank(s) 1 differ from rank 0's" in result.stderr, result.stderr[-3000:]
    assert not (run / "checkpoints" / "step-00000002").exists()


MODULES_AFTER = """
import sys
from laionkit.cli import main
sys.argv = ["laionkit", *sys.argv[1:]]
try:
    main()
finally:
    print("imported deepspeed:", "deepspeed" in sys.modules)
"""


def test_a_run_without_deepspeed_does_not_import_it(latent_shards, tmp_path):
    """accelerate's unwrap_model and get_state_dict import DeepSpeed (installed here, as the ops extra installs it)
    to test for its wrapper: an import at every training process's start, hundreds of times in this suite.
    A run launched without DeepSpeed exports its pipeline without importing it (laionkit/trainer/wrappers.py)."""
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", MODULES_AFTER, "train", latent_shards, "--output", run, *TINY,
                             "--max-steps", "2", "--checkpoint-every", "2", "--workers", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "imported deepspeed: False", result.stdout[-500:]
    assert (run / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert (run / "checkpoints" / "step-00000002").is_dir()


def test_two_ranks_uneven_shards_finish_and_see_disjoint_samples(latent_shards, tmp_path):
    uneven = reshard(latent_shards, [5, 2, 1], tmp_path / "uneven")
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "laionkit.cli", "train", str(uneven), "--output", str(run), *TINY, "--batch-size", "2",
         "--max-steps", "6", "--log-every", "2", "--checkpoint-every", "3", "--workers", "2", "--record-keys"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(metrics(run)) == 6
    epoch_keys = collections.defaultdict(lambda: ([], []))  # per epoch, each rank's keys
    for rank in (0, 1):
        for line in filter(None, (run / "seen" / f"rank-{rank:05d}.jsonl").read_text().splitlines()):
            record = json.loads(line)
            for key, epoch in zip(record["keys"], record["epochs"]):
                epoch_keys[epoch][rank].append(key)
    assert sorted(epoch_keys) == [0, 1, 2]  # 24 samples: 3 epochs of 8
    for ranks in epoch_keys.values():  # in each epoch the ranks train disjoint halves, each sample once
        assert len(ranks[0]) == len(ranks[1]) == 4 and len(set(ranks[0]) | set(ranks[1])) == 8, ranks
    assert {p.name for p in (run / "checkpoints" / "step-00000006").glob("rank-*.json")} == {
        "rank-00000.json", "rank-00001.json"}


def _train(latents, run, *extra):
    return [sys.executable, "-m", "laionkit.cli", "train", str(latents), "--output", str(run), *TINY,
            "--workers", "2", "--log-every", "1", "--record-keys", *map(str, extra)]


def test_kill9_then_resume_latest_reproduces_the_uninterrupted_run(latent_shards, tmp_path):
    args = ("--max-steps", "10", "--checkpoint-every", "3", "--shuffle-buffer", "3", "--caption-dropout", "0.2")
    reference = tmp_path / "reference"
    run_cli(*_train(latent_shards, reference, *args)[3:])  # in-process; the run that gets killed is a process

    run = tmp_path / "run"
    process = subprocess.Popen(_train(latent_shards, run, *args), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step-00000006").is_dir() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    process.kill()
    process.wait()
    assert not (run / "unet").exists(), "killed too late: the run already finished"
    # leftovers of a crash mid-checkpoint: a hidden temporary and a folder without its completion marker
    (run / "checkpoints" / ".step-00000009.partial").mkdir(exist_ok=True)
    (run / "checkpoints" / "step-00000012").mkdir()

    run_cli(*_train(latent_shards, run, *args, "--resume", "latest")[3:])
    expected, got = metrics(reference), metrics(run)
    assert sorted(got) == list(range(1, 11))
    for step in range(1, 11):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7), step
    assert seen(run) == seen(reference)


def test_resume_with_another_sample_order_is_refused_naming_what_changed(latent_shards, tmp_path):
    """--batch-size, --workers and the number of ranks may change (an elastic resume, tests/test_elastic.py);
    the seed and shuffle buffer, which the order of samples follows, may not."""
    run = tmp_path / "run"
    base = ("train", latent_shards, "--output", run, *TINY, "--workers", "0", "--checkpoint-every", "2")
    run_cli(*base, "--max-steps", "2")
    result = run_cli(*base, "--max-steps", "4", "--shuffle-buffer", "7", "--resume", "latest", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("step-00000002 was written with other shuffle_buffer (shuffle_buffer=1000; this run: shuffle_buffer=7)"
            in result.stderr), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(metrics(run)) == [2]  # nothing trained on the refused run


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("laionkit_")}


def test_sigterm_leaves_a_usable_checkpoint_and_metrics_are_served_meanwhile(latent_shards, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    process = subprocess.Popen(_train(latent_shards, run, "--max-steps", "1000", "--checkpoint-every", "1000",
                                      "--metrics-port", port),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.05)
    scraped = _scrape(port)
    assert scraped["laionkit_train_step"] >= 1 and scraped["laionkit_train_loss"] > 0
    assert scraped["laionkit_train_samples_per_second"] > 0 and "laionkit_train_data_wait_percent" in scraped
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    [checkpoint] = (run / "checkpoints").iterdir()
    stopped_at = int(checkpoint.name.split("-")[1])
    assert 0 < stopped_at < 1000 and f"step {stopped_at}" in out
    run_cli(*_train(latent_shards, run, "--max-steps", stopped_at + 2, "--resume", "latest")[3:])
    assert max(metrics(run)) == stopped_at + 2
    assert (run / "unet" / "config.json").is_file()


def test_deepspeed_zero2_config_parses_and_launches_two_cpu_processes(latent_shards, tmp_path):
    """train/deepspeed-zero2.yaml parses and launches 2 processes that train, checkpoint, resume and
    export. On CPU these are DeepSpeed's own ranks (its CPU accelerator over gloo, laionkit/trainer/zero.py):
    ZeRO-2's partitioned optimizer checkpoint, one file per rank."""
    from diffusers import UNet2DConditionModel

    repo = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(steps: int, *extra: str) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             str(repo / "train" / "deepspeed-zero2.yaml"), "--num_processes", "2", "--mixed_precision", "no",
             "--main_process_port", str(free_port()), "-m", "laionkit.cli", "train", str(latent_shards), "--output",
             str(run), *TINY, "--max-steps", str(steps), "--log-every", "2", "--checkpoint-every", "2",
             "--workers", "0", *extra],
            capture_output=True, text=True, timeout=300, env=env, cwd=repo,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    launch(4)
    first = metrics(run)
    assert sorted(first) == [2, 4]
    assert first[2]["samples_per_s_per_gpu"] == pytest.approx(first[2]["samples_per_s"] / 2)  # 2 ranks
    launch(6, "--resume", "latest")
    assert sorted(metrics(run)) == [2, 4, 6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000004", "step-00000006"]
    assert len(list((run / "checkpoints" / "step-00000006" / "pytorch_model").glob("*optim_states.pt"))) == 2
    assert UNet2DConditionModel.from_pretrained(run / "unet").config.in_channels == 4


class _Exploit:
    """A pickle that, once loaded with weights_only=False, creates the file named in it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(checkpoint: Path, name: str, payload) -> None:
    """Replace a checkpoint file and re-record its size and hash, as someone who can write there could."""
    import hashlib

    import torch

    torch.save(payload, checkpoint / name)
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    data = (checkpoint / name).read_bytes()
    trainer["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "trainer.json").write_text(json.dumps(trainer))


def test_checkpoints_are_verified_data_resumed_by_content_and_runs_never_mix(latent_shards, tmp_path):
    run = tmp_path / "run"
    moved = tmp_path / "moved"
    moved.symlink_to(latent_shards, target_is_directory=True)  # the same shards, reached another way
    args = (*TINY, "--workers", "0", "--checkpoint-every", "2", "--log-every", "1", "--mixed-precision", "bf16",
            "--ema")
    run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "4")
    reference = metrics(run)
    second, fourth = (run / "checkpoints" / f"step-{n:08d}" for n in (2, 4))

    # a fresh run into it is refused: it would mix its metrics and checkpoints into this run's
    fresh = run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "2", check=False)
    assert fresh.returncode == 2 and "already holds a run" in fresh.stderr and "--overwrite" in fresh.stderr
    assert "Traceback" not in fresh.stderr and metrics(run) == reference

    # damaged: an explicit --resume is refused, --resume latest falls back to the newest good one
    model = fourth / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    bad = run_cli("train", moved, "--output", run, *args, "--max-steps", "4", "--resume", fourth, check=False)
    assert bad.returncode == 2 and "damaged checkpoint: model.safetensors has" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    result = run_cli("train", moved, "--output", run, *args, "--max-steps", "4", "--resume", "latest")
    assert f"checkpoint {fourth} is damaged" in result.stdout + result.stderr
    got = metrics(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):  # resumed from step 2 through the symlink: the same run
        assert got[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-7), step

    # a checkpoint file that would run code when unpickled is refused, and no code runs
    for name in ("optimizer.bin", "master.pt", "ema.pt"):
        marker = tmp_path / f"pwned-{name}"
        checkpoint = tmp_path / f"planted-{name}"
        shutil.copytree(second, checkpoint)
        _plant(checkpoint, name, {"state": _Exploit(marker)})
        refused = run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "4", "--resume",
                          checkpoint, check=False)
        assert refused.returncode == 2 and "refused to load it" in refused.stderr, (name, refused.stderr[-2000:])
        assert not marker.exists(), f"{name}: unpickling ran code"

    # --overwrite starts over: nothing of the old run stays
    run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "1", "--overwrite")
    assert sorted(metrics(run)) == [1] and [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]


def test_empty_shard_is_skipped_and_three_ranks_share_the_samples(latent_shards, tmp_path):
    """img2dataset writes an empty tar when every download of a shard fails: train skips it, counts it,
    and three ranks split two shards' samples instead of one rank starving on the empty shard."""
    latents = reshard(latent_shards, [0, 4, 4], tmp_path / "latents")  # 00000.tar is empty, and first
    run = tmp_path / "run"
    result = _torchrun(3, free_port(), "train", latents, "--output", run, *TINY, "--batch-size", "1",
                       "--max-steps", "2", "--log-every", "1", "--checkpoint-every", "2", "--workers", "0",
                       "--record-keys")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping 1 empty latent shard(s): 00000.tar" in result.stdout
    keys = [set(itertools.chain(*seen(run, rank).values())) for rank in range(3)]
    assert all(len(k) == 2 for k in keys) and len(keys[0] | keys[1] | keys[2]) == 6


def test_diverging_run_writes_strict_json_and_stops_keeping_the_last_good_checkpoint(latent_shards, tmp_path):
    run = tmp_path / "run"
    result = run_cli("train", latent_shards, "--output", run, *TINY[:4], "--lr", "1e30", "--log-with", "none",
                     "--quiet", "--workers", "0", "--max-steps", "20", "--log-every", "1", "--checkpoint-every", "1",
                     "--max-nonfinite", "3", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the loss was not finite for 3 consecutive steps" in result.stderr and "Traceback" not in result.stderr

    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    records = [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] is None and records[0]["loss"] is not None
    good = {record["step"] for record in records if record["loss"] is not None}
    saved = {int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir()}
    assert saved and saved <= good, (saved, good)


def _garbage_tar(latents: Path) -> None:
    (latents / "00001.tar").write_bytes(os.urandom(20000))


def _truncated_tar(latents: Path) -> None:
    """Cut inside the last member's data, which only the stream would reach."""
    shard = latents / "00001.tar"
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    shard.write_bytes(shard.read_bytes()[: last.offset_data + last.size - 10])


@pytest.mark.parametrize("options, message", [
    ({"lr": -1.0}, "--lr -1.0: must be a finite number > 0"),
    ({"lr": float("nan")}, "--lr nan: must be a finite number > 0"),
    ({"max_steps": 0}, "--max-steps 0: must be >= 1"),
    ({"max_steps": None, "epochs": -1.0}, "--epochs -1.0: must be a finite number > 0"),
    ({"workers": -1}, "--workers -1: must be >= 0"),
])
def test_bad_options_are_refused_before_anything_runs(tmp_path, options, message):
    """The checks the CLI case above prints as one line, for every option (in process: no launch needed)."""
    from laionkit.common import LaionkitError
    from laionkit.trainer.config import TrainConfig

    with pytest.raises(LaionkitError) as error:
        TrainConfig(latents=tmp_path, output=tmp_path / "run", unet_config="tiny", **{"max_steps": 1, **options})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("damage, args, message", [
    (_garbage_tar, (), "cannot read shard"),
    (_truncated_tar, (), "00001.tar: unexpected end of data"),
    (lambda d: (d / "empty_caption.npy").unlink(), (), "empty_caption.npy (the manifest's empty_caption) cannot be read"),
    (lambda d: (d / "00000.stats.json").write_text("{not json"), (), "00000.stats.json cannot be read as JSON"),
    (lambda d: (d / "00000.stats.json").write_text("{}"), (), "a shard record lacks"),
    (None, ("--lr", "nan"), "--lr nan: must be a finite number > 0"),  # the other option checks: below
    (None, ("--output", "FILE"), "is a file, not a run folder"),
    (None, ("--seed", "-1"), "--seed -1: must be an integer in [0, 2**32)"),
    (None, ("--seed", str(2**64)), f"--seed {2**64}: must be an integer in [0, 2**32)"),
    (None, ("--output", "INSIDE"), "lies inside the input"),
])
def test_bad_input_is_one_clear_line(latent_shards, tmp_path, damage, args, message):
    latents = tmp_path / "latents"
    shutil.copytree(latent_shards, latents)
    if damage:
        damage(latents)
    (tmp_path / "file").write_text("")
    options = {"--output": str(tmp_path / "run"), "--max-steps": "1", "--workers": "0"}
    replace = {"FILE": str(tmp_path / "file"), "INSIDE": str(latents / "run")}
    options.update({k: replace.get(v, v) for k, v in zip(args[::2], args[1::2])})
    flat = [x for k, v in options.items() if v is not None for x in (k, v)]
    result = run_cli("train", latents, *TINY, *flat, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


FAILED_DEVICE = """
import sys, threading, time
from laionkit.trainer import loop as train
def failed(*args, **kwargs):  # what cuBLAS raised on an H200 inside train's first backward
    raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`")
train.flops_per_sample = failed
threading.Thread(target=time.sleep, args=(600,), daemon=False).start()  # teardown that would never end
from laionkit.cli import main
sys.argv = ["laionkit", *sys.argv[1:]]
main()
"""


def test_a_failed_device_exits_at_once_instead_of_hanging_in_teardown(latent_shards, tmp_path):
    """After a sticky CUDA error the traceback went out and the process then hung in interpreter teardown
    until its launcher's limit killed it (H200, Flux-12B). The CLI now exits 1 at once on such errors: here
    a non-daemon thread that would hold a normal exit for 10 minutes does not hold it."""
    script = tmp_path / "failed_device.py"
    script.write_text(FAILED_DEVICE)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script), "train", str(latent_shards), "--output", str(tmp_path / "run"), *TINY,
         "--max-steps", "2", "--workers", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert time.monotonic() - started < 200
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in result.stderr and "the accelerator failed" in result.stderr

    from laionkit.cli import device_failed

    assert not device_failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not device_failed(ValueError("CUDA error in a caption"))


FAILING_STEP = """
import sys, torch
from laionkit.trainer import loop as train
step, calls = train.train_step, []
def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        raise ERROR
    return step(*args, **kwargs)
train.train_step = failing
from laionkit.cli import main
sys.argv = ["laionkit", *sys.argv[1:]]
main()
"""
# What the H200 raised in the third step: the allocator at SDXL batch 16 (its whole message as torch words it,
# here with another process holding part of the card), and inductor compiling a float8 layer.
STEP_ERRORS = {
    "out_of_memory": 'torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 480.00 MiB. GPU 0 has a total '
                     'capacity of 139.80 GiB of which 191.56 MiB is free. Process 4242 has 10.90 GiB memory in use. '
                     'Including non-PyTorch memory, this process has 128.69 GiB memory in use. Of the allocated '
                     'memory 125.01 GiB is allocated by PyTorch, and 2.17 GiB is reserved by PyTorch but '
                     'unallocated. If reserved but unallocated memory is large try setting '
                     'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation '
                     'for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")',
    "compiler": 'RuntimeError("backend=inductor raised: Expected self.size(1) to be divisible by 16")',
}


@pytest.mark.parametrize("error", STEP_ERRORS)
def test_an_error_in_the_loop_ends_the_workers_and_the_process(error, latent_shards, tmp_path):
    """An error in the third step, with loader workers: the process exits at once (an out-of-memory with one
    line saying what to change). Before, it hung after the traceback until its launcher killed it (H200:
    SDXL at batch 16, and an inductor error under --fp8): the traceback kept the loader alive, and
    interpreter exit sent its workers SIGTERM, which they ignore, and waited on them forever."""
    script = tmp_path / "failing_step.py"
    script.write_text(FAILING_STEP.replace("ERROR", STEP_ERRORS[error]))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script), "train", str(latent_shards), "--output", str(tmp_path / "run"), *TINY,
         "--max-steps", "6", "--workers", "2"], capture_output=True, text=True, timeout=240)
    assert time.monotonic() - started < 120
    assert result.returncode == 1, result.stderr[-2000:]
    if error == "out_of_memory":
        line = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(line) == 1 and line[0].startswith("error: out of device memory in _train (loop.py:")
        # the allocator's numbers stay (another process holding 10.90 GiB is the cause here), its advice goes
        assert ("Tried to allocate 480.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 191.56 MiB is free. "
                "Process 4242 has 10.90 GiB memory in use. Including non-PyTorch memory, this process has 128.69 GiB "
                "memory in use. Of the allocated memory 125.01 GiB is allocated by PyTorch, and 2.17 GiB is reserved "
                "by PyTorch but unallocated. Lower --batch-size") in line[0], line[0]
        assert "expandable_segments" not in line[0] and "Traceback" not in result.stderr
    else:
        assert "Traceback" in result.stderr and "divisible by 16" in result.stderr.splitlines()[-1]
