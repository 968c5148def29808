"""The img2dataset driver: one shard per task on a pool of spawned processes, each downloaded into a
staging folder, promoted, and recorded last.

Invariant: a shard's record is written only after its tar and status parquet are in place and the tar
holds as many samples as img2dataset counted successes.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import shutil
import sys
import tarfile
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from laionkit.common import read_json, storage
from laionkit.common.outputs import partial_path
from laionkit.common.storage import Location
from laionkit.pack.config import MIN_SHARD_NAME_WIDTH, OPTOUT_DIRECTIVES, PackConfig
from laionkit.pack.fetch import Fetcher
from laionkit.pack.plan import ShardTask, task_input
from laionkit.pack.records import failure_reason, size_bucket
from laionkit.pack.rows import read_rows

if TYPE_CHECKING:
    from img2dataset.downloader import Downloader

# albumentations (imported by img2dataset) checks PyPI for updates at import time; never do that here.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


_DOWNLOADERS: dict[PackConfig, Downloader] = {}  # ShardPacker.downloader's per-process cache


@dataclass(frozen=True)
class ShardPacker:
    """Pack one shard in a worker process: img2dataset into staging, then promote, record last.

    The img2dataset Downloader is built in the worker on its first shard (``downloader``): importing
    img2dataset (OpenCV, albumentations, wandb) takes seconds, and the main process never needs it.
    """

    config: PackConfig
    output: Location
    options: dict[str, Any]
    planned_shards: int
    laionkit_versions: dict[str, str]
    fetcher: Fetcher
    storage_options: dict[str, Any] = field(default_factory=dict)
    staging: str | None = None  # local folder for shards bound for an object store; None: in ``output``

    def __call__(self, task: ShardTask) -> tuple[ShardTask, dict | None]:
        try:
            return task, self.pack(task)
        except Exception:  # a shard failing is retried and then reported; other shards go on
            traceback.print_exc()
            print(f"shard {task.name} ({task.input} rows {task.start}-{task.stop}) failed", file=sys.stderr)
            return task, None

    def downloader(self) -> Downloader:
        """This process's img2dataset Downloader, made once (ShardPacker is frozen and pickled to workers)."""
        if self.config not in _DOWNLOADERS:
            _DOWNLOADERS.clear()
            _DOWNLOADERS[self.config] = make_downloader(self.config)
        return _DOWNLOADERS[self.config]

    def pack(self, task: ShardTask) -> dict:
        if self.staging is None:
            staging = partial_path(Path(self.output.path, task.name))
        else:
            staging = Path(self.staging, f".{task.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        arrow_file = staging / "input.arrow"
        table, notes = read_rows(task, self.storage_options)
        with pa.OSFile(str(arrow_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        downloader = copy.copy(self.downloader())
        downloader.output_folder = str(staging)
        downloader.column_list = table.column_names
        downloader.oom_shard_count = len(task.name)
        # img2dataset's Downloader calls its module's download_image for every URL; this worker
        # process is pack's own (spawned), so replacing it here changes nothing else.
        import img2dataset.downloader

        img2dataset.downloader.download_image = self.fetcher
        downloader.download_shard((task.shard_id, str(arrow_file)))
        record = {**self.record(task, staging), **notes}
        check_tar_samples(staging / f"{task.name}.tar", record["successes"])
        for suffix in (".tar", ".parquet"):  # renamed locally; uploaded (done record last) to a store
            with storage.atomic_write(self.output / f"{task.name}{suffix}", staging=staging.parent) as tmp:
                os.replace(staging / f"{task.name}{suffix}", tmp)
        storage.write_json(self.output / f"{task.name}_stats.json", record)
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


def check_tar_samples(tar: Path, successes: int) -> None:
    """A shard is recorded done only if its tar holds as many samples as img2dataset counted successes.

    img2dataset counts a success before writing the sample and only logs a sample it then fails to
    write, so a count taken from its stats alone can claim samples that are not on disk.
    """
    with tarfile.open(tar) as archive:
        keys = {member.name.split(".", 1)[0] for member in archive if member.name.endswith(".json")}
    if len(keys) != successes:
        raise RuntimeError(f"{tar.name}: img2dataset counted {successes} successes but the tar holds "
                           f"{len(keys)} samples; the shard is not recorded as done")


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
