"""Benchmark `laionkit filter --dedup URL` as the input doubles: time per doubling and peak RSS.

    python scripts/bench_dedup.py                              # 5M, 10M, 20M rows (1M-row files, ~2% duplicate URLs)
    python scripts/bench_dedup.py --sizes 1 2 --compare /work/main   # also time another checkout's filter

Sizes are the first N files of one generated set (cached under --work), so each size is a prefix of the
next. Each run is its own subprocess (peak RSS = its ru_maxrss). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
FILE_ROWS = 1_000_000


def make_files(folder: Path, files: int, duplicates: float) -> list[Path]:
    """LAION-like rows: ~90-char URLs, ~1/50 repeating an earlier URL (same or earlier file), scores."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**48, files * FILE_ROWS)
    repeat = np.flatnonzero(rng.random(len(ids)) < duplicates)
    ids[repeat] = ids[(rng.random(len(repeat)) * repeat).astype(np.int64)]  # an earlier row's id
    paths = []
    for index in range(files):
        path = folder / f"laion-{index:05d}.parquet"
        paths.append(path)
        if path.exists():
            continue
        chunk = pa.array(ids[index * FILE_ROWS : (index + 1) * FILE_ROWS])
        text = pc.cast(chunk, pa.string())
        shard = pc.cast(pc.bit_wise_and(chunk, 127), pa.string())
        url = pc.binary_join_element_wise("https://cdn", shard, ".example-shop.com/images/products/", text,
                                          "/large/photo-", text, ".jpg", "")
        table = pa.table({
            "URL": url,
            "TEXT": pc.binary_join_element_wise("a photo of product ", text, " for sale", ""),
            "WIDTH": rng.integers(64, 2048, FILE_ROWS),
            "HEIGHT": rng.integers(64, 2048, FILE_ROWS),
            "punsafe": rng.beta(0.35, 6.0, FILE_ROWS).astype(np.float32),
            "AESTHETIC_SCORE": rng.normal(4.9, 0.75, FILE_ROWS).astype(np.float32),
        })
        pq.write_table(table, path, row_group_size=100_000)
    return paths


def child(out: str, bucket_rows: str, files: list[str]) -> None:
    from laionkit.filter import FilterConfig, run

    extra = {"dedup_bucket_rows": int(bucket_rows)} if bucket_rows != "default" else {}
    started = time.perf_counter()
    stats = run(FilterConfig(inputs=tuple(files), output=out, dedup="URL", quiet=True, overwrite=True, **extra))
    seconds = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rows": stats["rows_in"], "kept": stats["rows_out"], "seconds": seconds,
                      "cpu": usage.ru_utime + usage.ru_stime, "peak_rss": usage.ru_maxrss * 1024}))


def timed(tree: Path, out: Path, files: list[Path], bucket_rows: str) -> dict:
    if out.exists():
        shutil.rmtree(out)
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))  # keep what is there
    result = subprocess.run([sys.executable, __file__, "--child", str(out), bucket_rows, *map(str, files)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    if result.returncode:
        sys.exit(f"filter --dedup on {len(files)} files failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[5, 10, 20], help="Millions of rows per run.")
    parser.add_argument("--duplicates", type=float, default=0.02, help="Share of rows repeating an earlier URL.")
    parser.add_argument("--bucket-rows", default="default", help="--dedup-bucket-rows (default: filter's).")
    parser.add_argument("--compare", type=Path, help="Another checkout whose filter is timed on the same files.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/laionkit-bench-dedup"))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2:])
        return
    print(f"generating {max(args.sizes)} x 1M rows under {args.work} (cached)", flush=True)
    paths = make_files(args.work / "data", max(args.sizes), args.duplicates)
    trees = {"this": REPO, **({"compare": args.compare.resolve()} if args.compare else {})}
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min load average, {os.cpu_count()} CPUs)", flush=True)
    print("| tree | rows | kept | wall s | CPU s | peak RSS GB | wall vs previous size |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, tree in trees.items():
        previous = None
        for size in args.sizes:
            result = timed(tree, args.work / f"out-{name}", paths[:size], args.bucket_rows)
            ratio = f"{result['seconds'] / previous:.2f}x" if previous else "-"
            previous = result["seconds"]
            print(f"| {name} | {result['rows']:,} | {result['kept']:,} | {result['seconds']:.1f} | "
                  f"{result['cpu']:.1f} | {result['peak_rss'] / 1e9:.2f} | {ratio} |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
