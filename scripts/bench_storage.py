"""Shard read throughput: a local S3 API server (moto, in its own process) vs local disk.

Reads every shard whole in 1 MiB reads, as a tar stream is consumed, through laionkit.common.storage:
sequentially (no read-ahead, and with ``prefetch`` blocks read ahead on a thread), with N parallel
reader processes (DataLoader workers are processes), and through the bounded local cache (cold: fills
it; warm: every shard a hit). Prints a table; CPU only.

    python scripts/bench_storage.py --shards 20 --megabytes 50 --readers 4 --out /tmp/bench-storage
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from laionkit.common import storage  # noqa: E402
from laionkit.common.storage import Location, ReadCache  # noqa: E402

CHUNK = 2**20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return server, endpoint


def read_whole(url: str, prefetch: int = 0, cache_dir: str | None = None, cache_bytes: int = 0,
               block_size: int = storage.DEFAULT_BLOCK) -> int:
    cache = ReadCache(cache_dir, cache_bytes) if cache_dir else None
    total = 0
    with storage.open_cached(url, cache, prefetch=prefetch, block_size=block_size) as handle:
        while block := handle.read(CHUNK):
            total += len(block)
    return total


def timed(urls: list[str], readers: int, **kwargs) -> tuple[float, int]:
    if readers == 1:
        start = time.perf_counter()
        total = sum(read_whole(url, **kwargs) for url in urls)
        return time.perf_counter() - start, total
    context = multiprocessing.get_context("spawn")  # s3fs sessions do not survive a fork
    with concurrent.futures.ProcessPoolExecutor(readers, mp_context=context) as pool:
        list(pool.map(_warm, [urls[0]] * readers))  # process start and imports are not reading time
        start = time.perf_counter()
        total = sum(pool.map(_read, [(url, kwargs) for url in urls]))
        return time.perf_counter() - start, total


def _warm(url: str) -> None:
    Location.parse(url).exists()
    time.sleep(0.5)  # so that every worker takes one


def _read(job) -> int:
    url, kwargs = job
    return read_whole(url, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--megabytes", type=int, default=50, help="size of each shard")
    parser.add_argument("--readers", type=int, default=4, help="parallel reader processes")
    parser.add_argument("--prefetch", type=int, default=4, help="blocks read ahead")
    parser.add_argument("--block-mib", type=int, default=storage.DEFAULT_BLOCK // 2**20,
                        help="size of each ranged GET (read-ahead block)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-storage"))
    args = parser.parse_args()

    server, endpoint = start_server()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                       "AWS_EC2_METADATA_DISABLED": "true"})
    try:
        shutil.rmtree(args.out, ignore_errors=True)
        (args.out / "shards").mkdir(parents=True)
        bucket = Location.parse("s3://bench")
        bucket.fs.mkdir("bench")
        local, remote = [], []
        start = time.perf_counter()
        for i in range(args.shards):
            path = args.out / "shards" / f"{i:05d}.tar"
            path.write_bytes(os.urandom(args.megabytes * 2**20))
            storage.write_bytes(bucket / path.name, path.read_bytes())
            local.append(str(path))
            remote.append(str(bucket / path.name))
        upload = time.perf_counter() - start
        cache_bytes = 2 * args.shards * args.megabytes * 2**20  # holds everything: the warm pass is all hits
        cache_dir = str(args.out / "cache")
        rows = [
            ("local disk", 1, {}, local),
            (f"local disk, {args.readers} readers", args.readers, {}, local),
            ("s3, no read-ahead", 1, {}, remote),
            (f"s3, prefetch {args.prefetch}", 1, {"prefetch": args.prefetch}, remote),
            (f"s3, {args.readers} readers", args.readers, {}, remote),
            (f"s3, {args.readers} readers, prefetch {args.prefetch}", args.readers, {"prefetch": args.prefetch},
             remote),
            ("s3 via cache, cold (fills)", 1, {"cache_dir": cache_dir, "cache_bytes": cache_bytes}, remote),
            ("s3 via cache, warm (hits)", 1, {"cache_dir": cache_dir, "cache_bytes": cache_bytes}, remote),
        ]
        print(f"{args.shards} shards x {args.megabytes} MiB, upload {upload:.1f} s (incl. generating)")
        print("| read path | readers | seconds | MiB/s |\n| --- | --- | --- | --- |")
        print(f"read blocks of {args.block_mib} MiB")
        for label, readers, kwargs, urls in rows:
            seconds, total = timed(urls, readers, block_size=args.block_mib * 2**20, **kwargs)
            assert total == args.shards * args.megabytes * 2**20, (label, total)
            print(f"| {label} | {readers} | {seconds:.2f} | {total / 2**20 / seconds:,.0f} |", flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
