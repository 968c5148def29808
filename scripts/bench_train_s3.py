"""Train's data-wait with its latents in a bucket (a local S3 API server) vs on local disk (docs/BENCHMARKS.md).

Writes photo-like JPEG shards, encodes them with `laionkit encode` and the tiny models (`laionkit models
tiny`), uploads the latent folder to a moto server (its own process, on 127.0.0.1) as encode would leave it
(every object with its done record), then runs `laionkit train` (tiny UNet, CPU, --workers N) on

  local          the latent folder on local disk
  s3             the bucket, each shard streamed with read-ahead
  s3, cache cold the bucket through --cache-dir, empty at the start (the first epoch fills it)
  s3, cache warm the same cache again, full (every shard a hit: one HEAD per shard open)

and reports train's own data_wait_pct (metrics.jsonl: share of each log window the loop waited for its
next batch) and samples/s, without the first window (worker start-up, shuffle buffer fill). CPU only.

    python scripts/bench_train_s3.py --out /tmp/bench-train-s3
    python scripts/bench_train_s3.py --workers 4 --steps 300 --out /tmp/bench-train-s3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_encode import make_shards  # noqa: E402
from bench_storage import start_server  # noqa: E402

from laionkit.common import storage  # noqa: E402
from laionkit.common.storage import Location  # noqa: E402


def laionkit(*argv, env: dict | None = None) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "laionkit.cli", *map(str, argv)], check=True, env=env)
    return time.perf_counter() - started


def summarize(run: Path, seconds: float) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    steady = records[1:] or records
    return {"windows": len(steady), "data_wait_pct_mean": statistics.fmean(r["data_wait_pct"] for r in steady),
            "data_wait_pct_median": statistics.median(r["data_wait_pct"] for r in steady),
            "data_wait_pct_max": max(r["data_wait_pct"] for r in steady),
            "data_wait_pct_first_window": records[0]["data_wait_pct"],
            "samples_per_s": statistics.fmean(r["samples_per_s"] for r in steady), "wall_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--resolution", type=int, default=64, help="encode resolution (latents are 1/8 of it)")
    parser.add_argument("--workers", type=int, default=4, help="train's DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--log-every", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-train-s3"))
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    shards = args.images // args.shard_size
    make_shards(out / "images", args.images, args.resolution, 2, args.shard_size)
    laionkit("models", "tiny", "--output", out / "models", env=env)
    encoded = laionkit("encode", out / "images", "--model", out / "models", "--output", out / "latents",
                       "--resolution", args.resolution, "--batch-size", 32, "--workers", 2, "-q", env=env)
    latent_bytes = sum(p.stat().st_size for p in (out / "latents").glob("*.tar"))
    print(f"{args.images} images in {shards} shards encoded in {encoded:.0f} s; latent shards "
          f"{latent_bytes / 2**20:.1f} MiB ({latent_bytes / args.images / 1024:.1f} KiB per sample)", flush=True)

    server, endpoint = start_server()
    s3_env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
              "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(s3_env)
    env.update(s3_env)
    results = {}
    try:
        Location.parse("s3://bench").fs.mkdir("bench")
        for path in sorted((out / "latents").iterdir()):
            if path.is_file():
                storage.write_bytes(Location.parse(f"s3://bench/latents/{path.name}"), path.read_bytes())
        common = ("--unet-config", out / "models" / "unet", "--batch-size", args.batch_size,
                  "--max-steps", args.steps, "--log-every", args.log_every, "--checkpoint-every", 10**6,
                  "--workers", args.workers, "--lr", "1e-4", "--log-with", "none", "-q")
        cache = ("--cache-dir", out / "cache", "--cache-size", 2**30)
        cases = [("local", out / "latents", ()), ("s3", "s3://bench/latents", ()),
                 ("s3, cache cold", "s3://bench/latents", cache), ("s3, cache warm", "s3://bench/latents", cache)]
        for name, latents, extra in cases:
            run = out / "runs" / name.replace(", ", "-").replace(" ", "-")
            seconds = laionkit("train", latents, "--output", run, *common, *extra, env=env)
            results[name] = summarize(run, seconds)
            print(name, json.dumps(results[name]), flush=True)
    finally:
        server.terminate()
        server.wait()

    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
          f"{args.images} samples in {shards} shards, {args.resolution} px -> {args.resolution // 8}x"
          f"{args.resolution // 8} latents, batch {args.batch_size}, {args.steps} steps, {args.workers} workers")
    print("| latents | data_wait_pct mean | median | max | first window | samples/s | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['data_wait_pct_mean']:.2f} | {r['data_wait_pct_median']:.2f} | "
              f"{r['data_wait_pct_max']:.2f} | {r['data_wait_pct_first_window']:.1f} | {r['samples_per_s']:.1f} | "
              f"{r['wall_s']:.0f} |")
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
