"""`laionkit pack`: download the kept URLs with img2dataset into WebDataset tar shards, rank-sharded.

img2dataset does the work (its Downloader, Resizer and WebDatasetSampleWriter); laionkit decides
which rows form which global shard, which rank owns it, and when a shard counts as done:

- Input rows (files sorted by path, rows in order) are cut into global shards of ``shard_size``
  rows that never span two files; shard *i* belongs to rank *i mod W* (``laionkit.common.split``),
  so shard names are globally unique and the ranks together cover the input exactly once.
- img2dataset writes its tar in place, so each shard is downloaded into a hidden staging folder
  ``DIR/.<shard>.partial/`` (for an object-store ``DIR``: a local one, ``$LAIONKIT_STAGING`` or the
  system temp folder); the tar and status parquet are then renamed (uploaded, each with its done
  record) into ``DIR`` and the shard record ``<shard>_stats.json`` is written last, atomically. A shard
  is done iff its record is complete; a rerun after kill -9 redoes only shards without one and never
  sees a half-written tar.
- ``manifest.json`` is a merge of the records on disk, rewritten by each rank when it finishes and
  rebuilt by ``laionkit stats DIR``.
- URLs come from untrusted metadata, so img2dataset's fetch is replaced by ``Fetcher``: http(s) only,
  public addresses only (checked on every redirect hop) unless ``--allow-private-hosts``, one deadline
  per download and a cap on the body; refusals are recorded per sample like any failed download.

This module wires one run (``run``); the pieces live beside it: ``config`` (PackConfig), ``plan`` (the
global shard list), ``rows`` (a shard's rows, JSON-safe), ``fetch`` (URL safety), ``shards`` (the
img2dataset driver) and ``records`` (shard records, manifest, stats). Every public name laionkit.pack had
before the split is still importable from here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from rich.console import Console

from laionkit.common import LaionkitError, resolve_rank, split, storage, versions
from laionkit.common.storage import Location
from laionkit.pack.config import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_IMAGE_AREA,
    ENCODE_FORMATS,
    MIN_SHARD_NAME_WIDTH,
    OPTOUT_DIRECTIVES,
    OUTPUT_SHAPING_OPTIONS,
    RESIZE_MODES,
    URL_LIKE,
    PackConfig,
)
from laionkit.pack.fetch import (
    ALLOWED_SCHEMES,
    READ_CHUNK,
    USER_AGENT,
    Fetcher,
    URLRefused,
    check_scheme,
    non_public_kind,
)
from laionkit.pack.plan import (
    RESERVED_COLUMNS,
    ShardTask,
    carried_columns,
    input_files,
    plan_shards,
    task_input,
)
from laionkit.pack.records import (
    FAILURE_REASONS,
    RECORD_KEYS,
    SIZE_BUCKETS,
    check_done_record,
    failure_reason,
    load_record,
    merge_records,
    size_bucket,
    summarize,
    write_manifest,
)
from laionkit.pack.rows import json_safe_table, read_rows
from laionkit.pack.shards import (
    ShardPacker,
    check_tar_samples,
    make_downloader,
    opencv_pixel_limit,
    pack_shards,
)

__all__ = [  # the public names laionkit.pack had before its split into these modules
    "ALLOWED_SCHEMES", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_IMAGE_AREA", "ENCODE_FORMATS", "FAILURE_REASONS",
    "MIN_SHARD_NAME_WIDTH", "OPTOUT_DIRECTIVES", "OUTPUT_SHAPING_OPTIONS", "READ_CHUNK", "RECORD_KEYS",
    "RESERVED_COLUMNS", "RESIZE_MODES", "SIZE_BUCKETS", "URL_LIKE", "USER_AGENT",
    "Fetcher", "PackConfig", "ShardPacker", "ShardTask", "URLRefused",
    "carried_columns", "check_done_record", "check_scheme", "check_tar_samples", "failure_reason", "input_files",
    "json_safe_table", "load_record", "make_downloader", "make_output_folder", "merge_records", "non_public_kind",
    "opencv_pixel_limit", "pack_shards", "plan_shards", "read_rows", "run", "size_bucket", "summarize",
    "task_input", "write_manifest",
]


def make_output_folder(location: Location) -> None:
    """Create --output, or say in one line why it cannot be (a file, no permission), before any download."""
    if not location.local:
        if location.protocol in storage.READ_ONLY or (location.exists() and not location.is_dir()):
            raise LaionkitError(f"--output {location}: not a writable folder (a file, or a read-only URL)")
        return
    output = Path(location.path)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise LaionkitError(f"--output {output} is a file; give a folder") from None
    except OSError as error:
        raise LaionkitError(f"--output {output}: cannot create the folder ({error.strerror})") from None
    if not os.access(output, os.W_OK | os.X_OK):
        raise LaionkitError(f"--output {output}: the folder is not writable")


def run(config: PackConfig) -> dict:
    """Pack this rank's shards that are not done yet, then rewrite manifest.json; returns the manifest."""
    if config.keep:  # a subset of existing shards, nothing downloaded
        from laionkit.pack.subset import run_subset

        return run_subset(config, lambda line: print(line, file=sys.stderr))
    rank = resolve_rank(config.rank, config.world_size)
    inputs, output = config.locations()
    files = input_files(inputs)
    storage.refuse_overlap(inputs, output, "pack")
    storage.claim_output(output, "pack", config.overwrite)
    tasks = plan_shards(files, config)
    mine = split(tasks, rank)
    make_output_folder(output)
    options = config.options()
    console = Console(stderr=True, quiet=config.quiet, soft_wrap=True, markup=False, emoji=False)  # paths are data
    todo = []
    for task in mine:
        record_path = output / f"{task.name}_stats.json"
        if not record_path.is_complete():
            todo.append(task)
        elif load_record(record_path) is None:  # said even under --quiet: a done shard is being redone
            print(f"pack: {record_path} is unreadable or incomplete: shard {task.name} is redone", file=sys.stderr)
            todo.append(task)
        else:
            check_done_record(record_path, task, options)
    console.print(
        f"pack: rank {rank.rank}/{rank.world_size} ({rank.source}), {len(files)} input files, "
        f"{len(tasks)} shards, {len(mine)} mine, {len(todo)} to do -> {output}", highlight=False
    )
    console.print(f"options: {options}", highlight=False)
    # One staging folder per output and rank, so a rerun after kill -9 clears what the killed run left.
    tag = hashlib.sha256(str(output).encode()).hexdigest()[:12]
    staging = None if output.local else os.path.join(storage.staging_dir(), f"laionkit-pack-{tag}-{rank.rank}")
    packer = ShardPacker(config, output, options, len(tasks), versions(),
                         Fetcher(config.max_bytes, config.allow_private_hosts),
                         storage.parse_storage_options(config.storage_options), staging)
    try:
        failed = pack_shards(packer, todo, config) if todo else []
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    manifest = write_manifest(output)
    if failed:
        names = ", ".join(task.name for task in failed)
        raise LaionkitError(f"{len(failed)} shards failed after a retry ({names}); rerun the same command")
    return manifest
