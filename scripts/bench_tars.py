"""Reading local WebDataset tars: laionkit's header reader (laionkit.common.tars) against the bare libraries it
replaces, side by side in one run (not a test; results in docs/BENCHMARKS.md). CPU only.

(a) counting samples, as every stage does for each input shard before it starts: Python's ``tarfile`` over the
    members (the path ``count_samples`` takes for gzipped or remote tars) against ``count_samples``;
(b) reading every sample, as a DataLoader worker does: webdataset's ``tar_file_expander`` + ``group_by_keys``
    (the bare library) against ``tar_files`` + ``group_by_keys``.

The shards are written here in pack's layout (webdataset's TarWriter: jpg, txt and json per sample, pax headers),
each ``--samples`` long with ``--kilobytes`` of image bytes per sample; each side runs ``--repeats`` times over all
of them and the best time counts (the files are in the page cache after the first pass, for both sides). Both
sides must find the same samples, or the script stops.

    python scripts/bench_tars.py --out /tmp/bench-tars --shards 5 --samples 2048 --kilobytes 100
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import webdataset as wds  # noqa: E402

from laionkit.common.tars import count_samples, tar_files  # noqa: E402


def write_shards(out: Path, shards: int, samples: int, kilobytes: int) -> list[Path]:
    paths = []
    for shard in range(shards):
        path = out / f"{shard:05d}.tar"
        paths.append(path)
        if path.exists():
            continue
        partial = path.with_suffix(".tar.partial")  # renamed once whole: a killed run's shard is not reused
        with wds.TarWriter(str(partial)) as sink:
            for index in range(samples):
                key = f"{shard:05d}{index:05d}"
                sink.write({"__key__": key, "jpg": os.urandom(kilobytes * 1024), "txt": f"caption {key}",
                            "json": json.dumps({"key": key, "status": "success"})})
        partial.rename(path)
    return paths


def tarfile_count(path: Path) -> int:
    from webdataset.tariterators import base_plus_ext

    samples, key = 0, None
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isreg():
                prefix, _ = base_plus_ext(member.name)
                if prefix is not None and prefix != key:
                    samples, key = samples + 1, prefix
    return samples


def webdataset_read(path: Path) -> list[str]:
    with open(path, "rb") as handle:
        files = wds.tariterators.tar_file_expander([{"url": str(path), "stream": handle}])
        return [sample["__key__"] for sample in wds.tariterators.group_by_keys(files)]


def laionkit_read(path: Path) -> list[str]:
    return [sample["__key__"] for sample in wds.tariterators.group_by_keys(tar_files(str(path), str(path)))]


def best(function, paths: list[Path], repeats: int) -> tuple[float, list]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = [function(path) for path in paths]
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--kilobytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = write_shards(args.out, args.shards, args.samples, args.kilobytes)
    rows = {}
    for name, bare, ours in (("count", tarfile_count, count_samples), ("read", webdataset_read, laionkit_read)):
        bare_seconds, bare_result = best(bare, paths, args.repeats)
        our_seconds, our_result = best(ours, paths, args.repeats)
        if bare_result != our_result:
            raise SystemExit(f"{name}: laionkit and the bare library disagree")
        rows[name] = {"bare_seconds": round(bare_seconds, 4), "laionkit_seconds": round(our_seconds, 4),
                      "speedup": round(bare_seconds / our_seconds, 2)}
        print(f"{name:5s} {len(paths)} shards x {args.samples} samples: bare {bare_seconds:.3f} s, "
              f"laionkit {our_seconds:.3f} s, {bare_seconds / our_seconds:.1f}x", flush=True)
    (args.out / "bench_tars.json").write_text(json.dumps({"cpus": os.cpu_count(), **vars(args), "out": str(args.out),
                                                          **rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
