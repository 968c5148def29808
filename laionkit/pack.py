"""`laionkit pack`: download the kept URLs with img2dataset into WebDataset tar shards, rank-sharded.

img2dataset does the work (its Downloader, Resizer and WebDatasetSampleWriter); laionkit decides
which rows form which global shard, which rank owns it, and when a shard counts as done:

- Input rows (files sorted by path, rows in order) are cut into global shards of ``shard_size``
  rows that never span two files; shard *i* belongs to rank *i mod W* (``laionkit.common.split``),
  so shard names are globally unique and the ranks together cover the input exactly once.
- img2dataset writes its tar in place, so each shard is downloaded into a hidden staging folder
  ``DIR/.<shard>.partial/``; the tar and status parquet are then renamed into ``DIR`` and the shard
  record ``<shard>_stats.json`` is written last, atomically. A shard is done iff its record exists;
  a rerun after kill -9 redoes only shards without one and never sees a half-written tar.
- ``manifest.json`` is a merge of the records on disk, rewritten by each rank when it finishes and
  rebuilt by ``laionkit stats DIR``.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console, Group
from rich.table import Table
from tqdm import tqdm

from laionkit.common import (
    LaionkitError,
    available_cpus,
    read_json,
    refuse_other_settings,
    resolve_rank,
    split,
    versions,
    write_json,
)
from laionkit.common.columns import find_column
from laionkit.common.outputs import partial_path

if TYPE_CHECKING:
    from img2dataset.downloader import Downloader

# albumentations (imported by img2dataset) checks PyPI for updates at import time; never do that here.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

RESIZE_MODES = ("center_crop", "keep_ratio", "border", "no")
ENCODE_FORMATS = ("jpg", "webp")
# PIL's decompression-bomb threshold (about 9459 x 9459): more pixels than any training image needs.
DEFAULT_MAX_IMAGE_AREA = 89_478_485
# img2dataset's default: honour X-Robots-Tag opt-outs of AI use and indexing.
OPTOUT_DIRECTIVES = ("noai", "noimageai", "noindex", "noimageindex")
# Columns img2dataset writes itself; an input column with one of these names is carried as source_<name>.
RESERVED_COLUMNS = frozenset({
    "key", "caption", "url", "width", "height", "original_width", "original_height", "status",
    "error_message", "exif", "md5", "sha256", "sha512",
})
MIN_SHARD_NAME_WIDTH = 5
# Options that shape the shards: a resumed run must use the same ones as the shards already done.
OUTPUT_SHAPING_OPTIONS = (
    "image_size", "resize_mode", "min_image_size", "max_aspect_ratio", "max_image_area", "encode_format",
    "encode_quality", "shard_size", "respect_optout",
)
# Shorter side of the original image, for the size histogram: bucket edges in pixels.
SIZE_BUCKETS = (128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class PackConfig:
    inputs: tuple[Path, ...]
    output: Path
    image_size: int = 512
    resize_mode: str = "center_crop"
    min_image_size: int = 0
    max_aspect_ratio: float | None = None  # None: no limit
    max_image_area: int = DEFAULT_MAX_IMAGE_AREA  # 0 turns the guard off
    encode_format: str = "jpg"
    encode_quality: int = 95
    processes: int = field(default_factory=available_cpus)
    threads: int = 64
    timeout: float = 10.0
    retries: int = 0
    shard_size: int = 10_000
    url_column: str | None = None
    caption_column: str | None = None
    respect_optout: bool = True
    rank: int | None = None
    world_size: int | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.resize_mode not in RESIZE_MODES:
            raise LaionkitError(
                f"--resize-mode {self.resize_mode!r}: choose one of {', '.join(RESIZE_MODES)}"
            )
        if self.encode_format not in ENCODE_FORMATS:
            raise LaionkitError(
                f"--encode-format {self.encode_format!r}: choose one of {', '.join(ENCODE_FORMATS)}"
            )
        for name in ("image_size", "processes", "threads", "shard_size"):
            if getattr(self, name) < 1:
                raise LaionkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.timeout <= 0 or self.retries < 0 or self.max_image_area < 0:
            raise LaionkitError("--timeout must be > 0; --retries and --max-image-area must be >= 0")

    def options(self) -> dict[str, Any]:
        """What a shard record keeps: everything but where the data lives and who ran it."""
        skipped = {"inputs", "output", "rank", "world_size", "quiet"}
        return {key: value for key, value in asdict(self).items() if key not in skipped}


@dataclass(frozen=True)
class ShardTask:
    """One global shard: rows [start, stop) of one input file, and how its columns map to img2dataset's."""

    shard_id: int
    name: str
    input: str
    start: int
    stop: int
    url_column: str
    caption_column: str
    extra_columns: tuple[tuple[str, str], ...]  # (input name, name in the sample json)


def input_files(inputs: Sequence[Path]) -> list[Path]:
    """Parquet files named or inside the named folders, sorted by path: the global row order."""
    files = []
    for path in inputs:
        if path.is_dir():
            found = sorted(p for p in path.glob("*.parquet") if not p.name.startswith("."))
            if not found:
                raise LaionkitError(f"{path}: folder holds no .parquet files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise LaionkitError(f"{path}: no such file or folder")
    return sorted({p.resolve() for p in files})


def carried_columns(columns: Sequence[str], url: str, caption: str) -> tuple[tuple[str, str], ...]:
    """Every input column but url/caption and pandas' index, renamed where img2dataset owns the name."""
    carried = []
    for column in columns:
        if column in (url, caption) or re.fullmatch(r"__index_level_\d+__", column):
            continue
        carried.append((column, f"source_{column}" if column in RESERVED_COLUMNS else column))
    return tuple(carried)


def plan_shards(files: Sequence[Path], config: PackConfig) -> list[ShardTask]:
    """The global shard list; deterministic given the sorted files, their row counts and shard_size."""
    per_file = []
    for path in files:
        try:
            metadata = pq.ParquetFile(path)
        except (OSError, pa.ArrowInvalid) as error:
            raise LaionkitError(f"{path}: not a readable parquet file ({error})") from None
        names = metadata.schema_arrow.names
        url = find_column(names, "url", config.url_column, source=str(path))
        caption = find_column(names, "caption", config.caption_column, source=str(path))
        extra = carried_columns(names, url, caption)
        per_file.append((path, metadata.metadata.num_rows, url, caption, extra))
    total = sum(math.ceil(rows / config.shard_size) for _, rows, *_ in per_file)
    width = max(MIN_SHARD_NAME_WIDTH, len(str(max(total - 1, 0))))
    tasks = []
    for path, rows, url, caption, extra in per_file:
        for start in range(0, rows, config.shard_size):
            shard_id = len(tasks)
            tasks.append(ShardTask(
                shard_id, f"{shard_id:0{width}d}", str(path), start, min(start + config.shard_size, rows),
                url, caption, extra,
            ))
    return tasks


def task_input(task: ShardTask) -> dict[str, Any]:
    """Where a shard's rows come from, as recorded (and checked again on resume)."""
    return {
        "file": task.input, "rows": [task.start, task.stop], "url_column": task.url_column,
        "caption_column": task.caption_column,
    }


def read_rows(task: ShardTask) -> pa.Table:
    """The shard's rows, reading only the row groups that hold them, renamed for img2dataset."""
    parquet = pq.ParquetFile(task.input)
    groups, first_row, offset = [], None, 0
    for index in range(parquet.metadata.num_row_groups):
        group_rows = parquet.metadata.row_group(index).num_rows
        if offset < task.stop and offset + group_rows > task.start:
            groups.append(index)
            first_row = offset if first_row is None else first_row
        offset += group_rows
    columns = [name for name, _ in task.extra_columns] + [task.caption_column, task.url_column]
    table = parquet.read_row_groups(groups, columns=columns)
    table = table.slice(task.start - first_row, task.stop - task.start)
    return table.rename_columns([renamed for _, renamed in task.extra_columns] + ["caption", "url"])


# Failure reasons, checked in order against img2dataset's error_message: (pattern, reason).
FAILURE_REASONS: tuple[tuple[str, str], ...] = (
    (r"HTTP Error (\d{3})", "http {0}"),
    (r"timed out", "timeout"),
    (r"X-Robots-Tag", "opt-out header"),
    (r"CV_IO_MAX_IMAGE_PIXELS|image area too large", "image too large"),
    (r"image too small", "image too small"),
    (r"aspect ratio too large", "aspect ratio too large"),
    (r"!buf\.empty\(\)", "empty body"),
    (r"Image decoding error|imdecode", "decode error"),
    (r"IncompleteRead", "truncated transfer"),
    (r"hash mismatch", "hash mismatch"),
    (r"urlopen error|Connection|RemoteDisconnected|Errno|SSL", "connection error"),
)


def failure_reason(error_message: str) -> str:
    """Map one of img2dataset's raw error messages to a stable reason category."""
    for pattern, reason in FAILURE_REASONS:
        match = re.search(pattern, error_message)
        if match:
            return reason.format(*match.groups())
    return "other"


def size_bucket(width: int, height: int) -> str:
    shorter = min(width, height)
    lower = 0
    for edge in SIZE_BUCKETS:
        if shorter < edge:
            return f"{lower}-{edge - 1}"
        lower = edge
    return f">={SIZE_BUCKETS[-1]}"


@dataclass(frozen=True)
class ShardPacker:
    """Pack one shard in a worker process: img2dataset into staging, then promote, record last."""

    downloader: Downloader
    output: Path
    options: dict[str, Any]
    planned_shards: int
    laionkit_versions: dict[str, str]

    def __call__(self, task: ShardTask) -> tuple[ShardTask, dict | None]:
        try:
            return task, self.pack(task)
        except Exception:  # a shard failing is retried and then reported; other shards go on
            traceback.print_exc()
            print(f"shard {task.name} ({task.input} rows {task.start}-{task.stop}) failed", file=sys.stderr)
            return task, None

    def pack(self, task: ShardTask) -> dict:
        staging = partial_path(self.output / task.name)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        arrow_file = staging / "input.arrow"
        table = read_rows(task)
        with pa.OSFile(str(arrow_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        downloader = copy.copy(self.downloader)
        downloader.output_folder = str(staging)
        downloader.column_list = table.column_names
        downloader.oom_shard_count = len(task.name)
        downloader.download_shard((task.shard_id, str(arrow_file)))
        record = self.record(task, staging)
        for suffix in (".tar", ".parquet"):
            os.replace(staging / f"{task.name}{suffix}", self.output / f"{task.name}{suffix}")
        write_json(self.output / f"{task.name}_stats.json", record)
        shutil.rmtree(staging)
        return record

    def record(self, task: ShardTask, staging: Path) -> dict:
        """img2dataset's own shard stats, plus reasons, sizes, input rows, options and versions."""
        stats = read_json(staging / f"{task.name}_stats.json")
        status = pq.read_table(
            staging / f"{task.name}.parquet",
            columns=["status", "error_message", "original_width", "original_height"],
        ).to_pylist()
        failures = Counter(
            failure_reason(row["error_message"]) for row in status if row["status"] != "success"
        )
        sizes = Counter(
            size_bucket(row["original_width"], row["original_height"])
            for row in status if row["status"] == "success"
        )
        return {
            **stats,
            "shard": task.name,
            "tar": f"{task.name}.tar",
            "tar_bytes": (staging / f"{task.name}.tar").stat().st_size,
            "parquet_bytes": (staging / f"{task.name}.parquet").stat().st_size,
            "input": task_input(task),
            "failures": dict(sorted(failures.items())),
            "original_sizes": dict(sorted(sizes.items())),
            "planned_shards": self.planned_shards,
            "options": self.options,
            "versions": self.laionkit_versions,
        }


def make_downloader(config: PackConfig) -> Downloader:
    """img2dataset's Downloader and Resizer with laionkit's options; output folder set per shard.

    Imported here: img2dataset pulls in OpenCV, albumentations and wandb, which `stats` never needs.
    """
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer
    from img2dataset.writer import WebDatasetSampleWriter

    resizer = Resizer(
        image_size=config.image_size, resize_mode=config.resize_mode, resize_only_if_bigger=False,
        encode_quality=config.encode_quality, encode_format=config.encode_format,
        min_image_size=config.min_image_size, max_image_area=config.max_image_area or math.inf,
        max_aspect_ratio=config.max_aspect_ratio or math.inf,
    )
    # output_folder, column_list and oom_shard_count are set per shard by ShardPacker.
    return Downloader(
        sample_writer_class=WebDatasetSampleWriter, resizer=resizer, thread_count=config.threads,
        save_caption=True, extract_exif=False, output_folder=str(config.output),
        column_list=None, timeout=config.timeout, number_sample_per_shard=config.shard_size,
        oom_shard_count=MIN_SHARD_NAME_WIDTH, compute_hash="sha256", verify_hash_type=None,
        encode_format=config.encode_format, retries=config.retries, user_agent_token=None,
        disallowed_header_directives=list(OPTOUT_DIRECTIVES) if config.respect_optout else None,
    )


def check_done_record(record_path: Path, task: ShardTask, options: dict[str, Any]) -> None:
    """A finished shard must come from the same rows and the same output-shaping options."""
    record = read_json(record_path)
    planned = task_input(task)
    if record.get("input") != planned:
        raise LaionkitError(
            f"{record_path} was packed from {record.get('input')}, but this run plans {planned} for that "
            "shard: the input changed; use a new --output"
        )
    shaping = lambda values: {key: values.get(key) for key in OUTPUT_SHAPING_OPTIONS}  # noqa: E731
    refuse_other_settings(record_path, shaping(record.get("options", {})), shaping(options), "packed",
                          "rerun with the same options or a new --output")


@contextmanager
def opencv_pixel_limit(max_area: int) -> Iterator[None]:
    """Make OpenCV refuse images above ``max_area`` pixels from their header, before allocating them.

    img2dataset checks the area only after decoding; OpenCV reads this variable when it loads, so it
    is set for the worker processes, which are spawned fresh.
    """
    name = "OPENCV_IO_MAX_IMAGE_PIXELS"
    previous = os.environ.get(name)
    if max_area:
        os.environ[name] = str(max_area)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def write_manifest(folder: Path) -> dict:
    """Merge the shard records on disk into manifest.json, atomically, safe against concurrent ranks.

    Every rank rewrites it, so the temporary name carries host and pid: two ranks finishing together
    never share (and delete) each other's temporary, and the last rename wins with a full merge.
    """
    manifest = merge_records(folder)
    write_json(folder / "manifest.json", manifest, shared=True)
    return manifest


def merge_records(folder: Path) -> dict:
    records = [read_json(path) for path in sorted(folder.glob("*_stats.json"))]
    failures, sizes, messages = Counter(), Counter(), Counter()
    for record in records:
        failures.update(record["failures"])
        sizes.update(record["original_sizes"])
        messages.update({key: value for key, value in record["status_dict"].items() if key != "success"})
    rows = sum(record["count"] for record in records)
    samples = sum(record["successes"] for record in records)

    def distinct(key: str) -> list:
        return [json.loads(text) for text in sorted({json.dumps(r[key], sort_keys=True) for r in records})]

    planned = max((record["planned_shards"] for record in records), default=0)
    return {
        "stage": "pack",
        "shards": [
            {
                "shard": record["shard"], "tar": record["tar"], "samples": record["successes"],
                "rows": record["count"], "bytes": record["tar_bytes"],
                "success_rate": record["successes"] / record["count"] if record["count"] else 0.0,
                "failures": record["failures"], "input": record["input"],
            }
            for record in records
        ],
        "planned_shards": planned,
        "complete": bool(records) and len(records) == planned,
        "rows": rows,
        "samples": samples,
        "success_rate": samples / rows if rows else 0.0,
        "bytes": sum(record["tar_bytes"] + record["parquet_bytes"] for record in records),
        "failures": dict(failures.most_common()),
        "error_messages": dict(messages.most_common(20)),
        "original_sizes": dict(sorted(sizes.items(), key=lambda item: _bucket_order(item[0]))),
        "inputs": sorted({record["input"]["file"] for record in records}),
        "options": distinct("options"),
        "versions": distinct("versions"),
    }


def _bucket_order(bucket: str) -> int:
    return int(bucket.removeprefix(">=").split("-")[0])


def summarize(folder: Path) -> Group:
    """`laionkit stats DIR` for a shard folder: rebuilds manifest.json, then shows it as tables."""
    manifest = write_manifest(Path(folder))
    overview = Table(title=f"pack: {folder}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    overview.add_row("shards", f"{len(manifest['shards'])} / {manifest['planned_shards']} planned")
    overview.add_row("rows", f"{manifest['rows']:,}")
    overview.add_row("samples", f"{manifest['samples']:,}")
    overview.add_row("success rate", f"{manifest['success_rate']:.1%}")
    overview.add_row("size on disk", f"{manifest['bytes'] / 2**20:,.1f} MiB")
    failures = Table(title="failures by reason")
    failures.add_column("reason")
    failures.add_column("rows", justify="right")
    failures.add_column("share", justify="right")
    for reason, count in manifest["failures"].items():
        failures.add_row(reason, f"{count:,}", f"{count / manifest['rows']:.1%}")
    sizes = Table(title="original image size (shorter side, px)")
    sizes.add_column("size")
    sizes.add_column("samples", justify="right")
    sizes.add_column("")
    most = max(manifest["original_sizes"].values(), default=1)
    for bucket, count in manifest["original_sizes"].items():
        sizes.add_row(bucket, f"{count:,}", "█" * max(1, round(30 * count / most)))
    return Group(overview, failures, sizes)


def run(config: PackConfig) -> dict:
    """Pack this rank's shards that are not done yet, then rewrite manifest.json; returns the manifest."""
    rank = resolve_rank(config.rank, config.world_size)
    files = input_files(config.inputs)
    tasks = plan_shards(files, config)
    mine = split(tasks, rank)
    config.output.mkdir(parents=True, exist_ok=True)
    options = config.options()
    todo = []
    for task in mine:
        record_path = config.output / f"{task.name}_stats.json"
        if record_path.exists():
            check_done_record(record_path, task, options)
        else:
            todo.append(task)
    console = Console(stderr=True, quiet=config.quiet, soft_wrap=True, markup=False, emoji=False)  # paths are data
    console.print(
        f"pack: rank {rank.rank}/{rank.world_size} ({rank.source}), {len(files)} input files, "
        f"{len(tasks)} shards, {len(mine)} mine, {len(todo)} to do -> {config.output}", highlight=False
    )
    console.print(f"options: {options}", highlight=False)
    packer = ShardPacker(make_downloader(config), config.output, options, len(tasks), versions())
    failed = pack_shards(packer, todo, config) if todo else []
    manifest = write_manifest(config.output)
    if failed:
        names = ", ".join(task.name for task in failed)
        raise LaionkitError(f"{len(failed)} shards failed after a retry ({names}); rerun the same command")
    return manifest


def pack_shards(packer: ShardPacker, todo: list[ShardTask], config: PackConfig) -> list[ShardTask]:
    """Run shards on a pool of spawned processes like img2dataset's distributor; retry failures once."""
    context = multiprocessing.get_context("spawn")
    progress = tqdm(total=len(todo), unit="shard", desc="pack", disable=config.quiet)
    rows = samples = 0
    with opencv_pixel_limit(config.max_image_area), context.Pool(
        min(config.processes, len(todo)), maxtasksperchild=5
    ) as pool:
        pending = todo
        for _attempt in range(2):
            failed = []
            for task, record in pool.imap_unordered(packer, pending):
                if record is None:
                    failed.append(task)
                    continue
                rows += record["count"]
                samples += record["successes"]
                progress.update()
                progress.set_postfix(samples=samples, success=f"{samples / max(rows, 1):.0%}")
            pending = failed
            if not pending:
                break
    progress.close()
    return pending
