"""Benchmark: bare `img2dataset.download` vs `laionkit pack` on the same input and settings.

A loopback server (a separate process) holds a few thousand generated photo-like JPEGs of mixed
sizes; each tool downloads, resizes and writes them to WebDataset shards, alternating runs so load
drift hits both. Prints images/s per tool and laionkit's overhead ratio (target: <= 5%).

    .venv/bin/python scripts/bench_pack.py --images 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from rich.console import Console
from rich.table import Table

from laionkit.common.imageserver import Response, serve
from laionkit.pack import DEFAULT_MAX_IMAGE_AREA, PackConfig, run

# Mixed sizes as on the web: small thumbnails to camera-sized photos, both orientations.
SIZES = ((256, 256), (320, 240), (480, 640), (640, 480), (800, 600), (1024, 768), (512, 512), (400, 300))
EXTRA_COLUMNS = ("similarity", "punsafe", "pwatermark", "hash")


def photo_like(rng: np.random.Generator, width: int, height: int) -> bytes:
    """Smooth colour fields plus sensor-like noise: JPEG sizes and decode costs close to real photos."""
    coarse = rng.integers(0, 256, size=(rng.integers(3, 9), rng.integers(3, 9), 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    noisy = np.clip(field + rng.integers(-12, 13, size=field.shape, dtype=np.int16), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def serve_until_stopped(routes: dict[str, Response], port_queue, stop_event) -> None:
    with serve(routes) as server:
        port_queue.put(server.base_url)
        stop_event.wait()


@contextlib.contextmanager
def output_to(log: Path):
    """Send both tools' prints (and their worker processes') to a log, so the table stays readable."""
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_img2dataset(parquet: Path, output: Path, args: argparse.Namespace) -> None:
    from img2dataset import download

    download(
        url_list=str(parquet), output_folder=str(output), processes_count=args.processes,
        thread_count=args.threads, image_size=512, resize_mode="center_crop", encode_format="jpg",
        encode_quality=95, output_format="webdataset", input_format="parquet", url_col="URL",
        caption_col="TEXT", save_additional_columns=list(EXTRA_COLUMNS),
        number_sample_per_shard=args.shard_size, extract_exif=False, timeout=10,
        max_image_area=DEFAULT_MAX_IMAGE_AREA,
    )


def run_laionkit(parquet: Path, output: Path, args: argparse.Namespace) -> None:
    run(PackConfig(
        inputs=(parquet,), output=output, processes=args.processes, threads=args.threads,
        shard_size=args.shard_size, allow_private_hosts=True, quiet=True,  # the server is on 127.0.0.1
    ))


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the tools' worker pools), user + system.

    Unlike wall time it barely moves when other work shares the machine, so it shows overhead better.
    """
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def count_samples(output: Path) -> int:
    import tarfile

    total = 0
    for path in output.glob("*.tar"):
        with tarfile.open(path) as tar:
            total += sum(member.name.endswith(".jpg") for member in tar.getmembers())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=500)
    args = parser.parse_args()
    console = Console(width=120)

    rng = np.random.default_rng(0)
    started = time.perf_counter()
    routes = {
        f"{i:06d}.jpg": Response(photo_like(rng, *SIZES[i % len(SIZES)])) for i in range(args.images)
    }
    megabytes = sum(len(r.body) for r in routes.values()) / 2**20
    elapsed = time.perf_counter() - started
    console.print(f"generated {args.images} JPEGs ({megabytes:.0f} MiB) in {elapsed:.0f} s")

    context = multiprocessing.get_context("fork")
    port_queue, stop_event = context.Queue(), context.Event()
    server = context.Process(target=serve_until_stopped, args=(routes, port_queue, stop_event), daemon=True)
    server.start()
    base_url = port_queue.get(timeout=60)
    tools = {"img2dataset.download": run_img2dataset, "laionkit pack": run_laionkit}
    seconds: dict[str, list[float]] = {name: [] for name in tools}
    cpu: dict[str, list[float]] = {name: [] for name in tools}
    samples: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench_pack_") as tmp:
        parquet = Path(tmp) / "urls.parquet"
        names = sorted(routes)
        pq.write_table(pa.table({
            "URL": [f"{base_url}/{name}" for name in names],
            "TEXT": [f"generated photo {name}" for name in names],
            "similarity": rng.uniform(0.2, 0.4, len(names)), "punsafe": rng.uniform(0, 0.1, len(names)),
            "pwatermark": rng.uniform(0, 0.5, len(names)), "hash": [f"{i:016x}" for i in range(len(names))],
        }), parquet)
        order = list(tools)
        for repeat in range(args.repeats):
            for name in order:
                output = Path(tmp) / f"{name.split()[0]}-{repeat}"
                with output_to(Path(tmp) / "tools.log"):
                    begin, cpu_begin = time.perf_counter(), cpu_seconds()
                    tools[name](parquet, output, args)
                    seconds[name].append(time.perf_counter() - begin)
                    cpu[name].append(cpu_seconds() - cpu_begin)
                samples[name] = count_samples(output)
                console.print(f"run {repeat + 1}: {name}: {seconds[name][-1]:.1f} s wall, "
                              f"{cpu[name][-1]:.1f} s CPU, {samples[name]} samples")
            order.reverse()
    stop_event.set()
    server.join(timeout=10)

    table = Table(
        title=f"pack benchmark: {args.images} images, {args.processes} processes x {args.threads} threads, "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    for column in ("tool", "samples", "wall s (median)", "wall s (runs)", "images/s", "CPU s (median)"):
        table.add_column(column, justify="left" if column == "tool" else "right")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    for name, values in seconds.items():
        table.add_row(name, str(samples[name]), f"{medians[name]:.1f}", " ".join(f"{v:.1f}" for v in values),
                      f"{samples[name] / medians[name]:.0f}", f"{cpu_medians[name]:.1f}")
    console.print(table)
    baseline, laionkit = "img2dataset.download", "laionkit pack"
    console.print(f"laionkit overhead: wall {medians[laionkit] / medians[baseline] - 1:+.1%}, "
                  f"CPU {cpu_medians[laionkit] / cpu_medians[baseline] - 1:+.1%} (target <= 5%)")
    if samples["laionkit pack"] != samples["img2dataset.download"]:
        sys.exit("the tools packed different numbers of samples: the comparison is not like for like")


if __name__ == "__main__":
    main()
