"""Benchmark `laionkit dedup` (exact, pHash, semantic layers) on synthetic `laionkit score` outputs: seconds per
step, peak RSS, rows removed per layer.

    python scripts/bench_dedup_layers.py                         # 1M rows (10 shards of 100k), 512-d embeddings
    python scripts/bench_dedup_layers.py --rows 100000 --dim 768 --clusters 100

Rows: embeddings drawn around 2,000 centres (so k-means has structure), uniform random pHashes and sha256s;
then ~1% of rows made byte copies of an earlier row (equal sha256, pHash, embedding), ~1% pHash
neighbours of one (1-3 bits flipped), ~1% CLIP neighbours of one (cosine ~0.98), counted as ``planted``
(a layer may remove fewer: a planted row whose source an earlier layer removed, or, for the semantic
layer, a pair k-means split between clusters). The input is cached under
--work; each run is the CLI's ``run`` in this process (one rank), printed as a JSON line. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def make_scores(folder: Path, rows: int, shards: int, dim: int, seed: int = 0) -> Path:
    marker = folder / "done.json"
    if marker.exists() and json.loads(marker.read_text())[:4] == [rows, shards, dim, seed]:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "scores").mkdir(parents=True)
    (folder / "img_emb").mkdir()
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((2000, dim)).astype(np.float32)
    sha = rng.integers(0, 2**63 - 1, rows, dtype=np.int64)  # an id whose hex stands for the sha256
    phash = rng.integers(-2**63, 2**63 - 1, rows, dtype=np.int64)
    emb = np.empty((rows, dim), np.float16)
    for lo in range(0, rows, 100_000):  # centre + noise: within-centre cosine ~0.5
        n = min(100_000, rows - lo)
        part = centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, dim)).astype(np.float32)
        emb[lo:lo + n] = part / np.linalg.norm(part, axis=1, keepdims=True)
    kinds = rng.random(rows)
    source = (rng.random(rows) * np.arange(rows)).astype(np.int64)  # an earlier row
    copy = np.flatnonzero(kinds < 0.01)
    sha[copy], phash[copy], emb[copy] = sha[source[copy]], phash[source[copy]], emb[source[copy]]
    near_phash = np.flatnonzero((kinds >= 0.01) & (kinds < 0.02))
    flips = rng.integers(0, 64, (len(near_phash), 3))
    masks = np.zeros(len(near_phash), np.uint64)
    count = rng.integers(1, 4, len(near_phash))
    for j in range(3):
        masks ^= np.where(j < count, np.uint64(1) << flips[:, j].astype(np.uint64), np.uint64(0))
    phash[near_phash] = (phash[source[near_phash]].view(np.uint64) ^ masks).view(np.int64)
    near_clip = np.flatnonzero((kinds >= 0.02) & (kinds < 0.03))
    noise = rng.standard_normal((len(near_clip), dim)).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    emb[near_clip] = emb[source[near_clip]].astype(np.float32) + 0.2 * noise
    per = -(-rows // shards)
    for s in range(shards):
        lo, hi = s * per, min(rows, (s + 1) * per)
        stem = f"{s:05d}"
        table = pa.table({
            "key": [f"{stem}{i:07d}" for i in range(hi - lo)], "shard": [stem] * (hi - lo),
            "width": np.full(hi - lo, 512), "height": np.full(hi - lo, 512),
            "sha256": [f"{v:064x}" for v in sha[lo:hi]], "phash": phash[lo:hi],
            "similarity": rng.random(hi - lo).astype(np.float32),
            "aesthetic": rng.normal(5, 1, hi - lo).astype(np.float32)})
        pq.write_table(table, folder / "scores" / f"{stem}.parquet")
        np.save(folder / "img_emb" / f"img_emb_{stem}.npy", emb[lo:hi])
    planted = {"exact": len(copy), "phash": len(near_phash), "semantic": len(near_clip)}
    marker.write_text(json.dumps([rows, shards, dim, seed, planted]))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", default="exact,phash,semantic")
    parser.add_argument("--work", type=Path, default=Path("/tmp/laionkit-bench-dedup-layers"))
    parser.add_argument("--keep-by", default="aesthetic")
    parser.add_argument("--clusters", type=int, default=0, help="0: the default, one per 10,000 rows")
    parser.add_argument("--clusters-per-row", type=int, default=1, help="semantic: each row's nearest clusters searched")
    args = parser.parse_args()
    from laionkit.dedup import DedupConfig, run

    started = time.perf_counter()
    scores = make_scores(args.work / f"scores-{args.rows}-{args.dim}", args.rows, args.shards, args.dim)
    made = time.perf_counter() - started
    out = args.work / "out"
    shutil.rmtree(out, ignore_errors=True)
    config = DedupConfig(inputs=(str(scores),), output=str(out), layers=tuple(args.layers.split(",")),
                         keep_by=args.keep_by, clusters=args.clusters, clusters_per_row=args.clusters_per_row,
                         quiet=True)
    cpu0, started = os.times(), time.perf_counter()
    stats = run(config)
    cpu1 = os.times()
    print(json.dumps({
        "rows": args.rows, "dim": args.dim, "input_s": round(made, 1), "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "seconds": {k: round(v, 1) for k, v in stats["seconds"].items()},
        "cpu_seconds": {k: round(v, 1) for k, v in stats["cpu_seconds"].items()}, "removed": stats["removed"],
        "planted": json.loads((scores / "done.json").read_text())[4], "kept": stats["kept"], "clusters": stats["clusters"], "phash_bands": stats["phash_bands"],
        "cpus": len(os.sched_getaffinity(0)), "load_avg_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
