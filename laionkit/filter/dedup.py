"""``laionkit filter --dedup COLUMN``: exact global first-occurrence dedup, linear in rows, with any number of ranks.

Comparing each unit against the growing set of values already kept costs O(rows²) and holds every kept
value in memory. Instead the column is hash-partitioned into buckets spilled to disk, each bucket is
resolved on its own, and the result is applied when the parts are written. Three phases, each one's
outputs complete-when-renamed (``storage.atomic_write``; in an object store: once the done record is
written) in a scratch folder ``<output>/.dedup-<id>/``:

1. partition: each rank, for each of its units, writes ``keys-<unit>/bucket=<b>/*.parquet``: (value,
   global position) of the rows passing every rule with a non-null value. The global position is the
   row's index in all inputs concatenated in plan order (file order, then file row), so "smallest
   position" is the same "first wins" rule as a one-rank pass in unit order.
2. resolve: once every unit's keys exist, each rank takes buckets ``b % world_size == rank`` and writes
   ``drop-<b>.parquet``: the positions of every row whose value occurs at a smaller position.
3. write: once every bucket is resolved, each rank writes its parts as without --dedup, minus the
   dropped positions of the unit (few: only duplicates), in row order.

Design: one invocation, no coordinator beyond the files. A rank that needs another rank's phase output
polls for it and gives up after ``--dedup-wait`` seconds with a message naming the ranks it waited for;
everything finished stays on disk. Resume is exact after kill -9 in any phase: every phase skips what
exists and the outputs do not depend on which rank or run wrote them (world size can even change). The
scratch folder is named by the plan, the bucket count and DuckDB's version (its ``hash`` decides the
buckets), and removed once every unit's part exists.

Memory: phase 1 holds one unit's keys per worker, phase 2 one bucket (about ``--dedup-bucket-rows`` values;
DuckDB spills past its memory limit), phase 3 is the plain filter. Files: one key file per (unit,
bucket) that holds rows, one drop file per bucket.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import duckdb

from laionkit.common import LaionkitError, Rank, split, storage
from laionkit.common.storage import Location
from laionkit.filter.sql import literal, quote

if TYPE_CHECKING:
    from laionkit.filter.inputs import Unit
    from laionkit.filter.plan import Plan
    from laionkit.filter.units import UnitFilter

T = TypeVar("T")

POLL_SECONDS = 0.2
REMOTE_POLL_SECONDS = 1.0  # one LIST request of the scratch folder per poll
# Drop files are sorted by position in row groups this small, so a unit's lookup reads, of each bucket's
# file, the footer and the row groups its position range overlaps (min/max pruning), not the whole list.
DROP_ROW_GROUP = 16_384


def parquet_list(paths: Sequence[Path]) -> str:
    return f"read_parquet([{', '.join(literal(str(p)) for p in paths)}], hive_partitioning = false)"


class Dedup:
    """The scratch folder of one plan's dedup and the three phases' files in it.

    The folder is a local path or a URL (``--output s3://...``): every phase output is written through
    ``storage.atomic_write`` (rename locally, done record last in an object store) and counts once it
    is complete. DuckDB reads and writes only local files: on a URL, phase 1 writes into a local
    temporary that is uploaded, phase 2 downloads one bucket's key files, and phase 3 reads local
    copies of the (small) drop files, all under ``staging``.
    """

    def __init__(self, plan: Plan, output: Location | Path, column: str, bucket_rows: int,
                 staging: str | None = None):
        self.plan = plan
        self.column = column
        self.buckets = max(1, math.ceil(sum(f.rows for f in plan.files) / bucket_rows))
        tag = f"{plan.plan_id}/{column}/{self.buckets}/{duckdb.__version__}"
        self.folder = Location.parse(output) / f".dedup-{hashlib.sha256(tag.encode()).hexdigest()[:16]}"
        self.staging = staging
        if not self.folder.local:
            if staging is None:
                raise AssertionError("a dedup in an object store needs a local staging folder")
            self.local_drops = Path(staging, "dedup-drops")
        self.bases = [0]  # global position of each file's first row
        for file in plan.files:
            self.bases.append(self.bases[-1] + file.rows)

    @property
    def poll_seconds(self) -> float:
        return POLL_SECONDS if self.folder.local else REMOTE_POLL_SECONDS

    def keys(self, unit: Unit) -> Location:
        return self.folder / f"keys-{unit.index:06d}"

    def drop(self, bucket: int) -> Location:
        return self.folder / f"drop-{bucket:05d}.parquet"

    def local_drop(self, bucket: int) -> Path:
        """Where DuckDB reads bucket's drop file: itself on local disk, a downloaded copy otherwise."""
        return Path(self.drop(bucket).path) if self.folder.local else self.local_drops / f"drop-{bucket:05d}.parquet"

    def bad(self, unit: Unit) -> str | None:
        """--skip-bad: why phase 1 could not read the unit (then it is recorded bad, not written)."""
        marker = self.keys(unit) / "bad.txt"
        return marker.read_bytes().decode() if marker.exists() else None

    def dropped(self, unit: Unit) -> str:
        """SQL: the file rows of ``unit`` that are not a first occurrence."""
        base = self.bases[unit.file] + unit.offset
        drops = parquet_list([self.local_drop(b) for b in range(self.buckets)])
        return f"SELECT pos - {self.bases[unit.file]} FROM {drops} WHERE pos BETWEEN {base} AND {base + unit.rows - 1}"

    def complete(self) -> set[str]:
        """Names of the phase outputs complete in the folder now (one listing, also for object stores)."""
        if self.folder.local:
            try:
                return {name for name in os.listdir(self.folder.path) if not name.startswith(".")}
            except FileNotFoundError:
                return set()
        # Done records, not data objects: a unit with no key leaves an empty folder, which an object
        # store does not list at all (its record is all there is of it).
        with storage.one_line_errors("cannot list", self.folder):
            try:
                names = [str(n).rstrip("/").rsplit("/", 1)[-1]
                         for n in self.folder.fs.ls(self.folder.path, detail=False, refresh=True)]
            except FileNotFoundError:
                return set()
        return {n[1:-len(storage.DONE_SUFFIX)] for n in names if n.startswith(".") and n.endswith(storage.DONE_SUFFIX)}

    # ------------------------------------------------------------------------------------ the phases

    def prepare(self, workers: Sequence[UnitFilter], rank: Rank, wait: float, overwrite: bool,
                skip_bad: bool) -> None:
        """Phases 1 and 2 for this rank, waiting for the other ranks' outputs each needs."""
        units = self.plan.units
        buckets = list(range(self.buckets))
        if overwrite:  # each rank clears what it owns, like its parts
            for unit in split(units, rank):
                self.keys(unit).remove()
            for bucket in split(buckets, rank):
                self.drop(bucket).remove()
        complete = self.complete()
        todo = [unit for unit in split(units, rank) if self.keys(unit).name not in complete]
        database = workers[0].connection
        database.execute("SET threads = 1").fetchall()  # phase 1: units in parallel, one thread each
        in_parallel(todo, workers, lambda worker, unit: self.partition(worker, unit, skip_bad))
        wait_for(self, [self.keys(u) for u in units], "units' partitions (phase 1)", wait, rank,
                 [i % rank.world_size for i in range(len(units))])
        complete = self.complete()
        todo = [bucket for bucket in split(buckets, rank) if self.drop(bucket).name not in complete]
        database.execute(f"SET threads = {len(workers)}").fetchall()
        in_parallel(todo, workers[:1], self.resolve)  # one bucket at a time, on all threads
        wait_for(self, [self.drop(b) for b in buckets], "buckets' duplicate lists (phase 2)", wait, rank,
                 [b % rank.world_size for b in buckets])
        if not self.folder.local:  # phase 3 looks up every bucket's drops per unit: local copies
            self.local_drops.mkdir(parents=True, exist_ok=True)
            for bucket in buckets:
                location = self.drop(bucket)
                location.fs.get_file(location.path, str(self.local_drop(bucket)))

    def partition(self, worker: UnitFilter, unit: Unit, skip_bad: bool) -> None:
        file = self.plan.files[unit.file]
        with storage.atomic_write(self.keys(unit), folder=True, staging=self.staging) as tmp:
            try:
                try:
                    self.write_keys(worker, unit, tmp, via_arrow=False)
                except duckdb.InvalidInputException as error:
                    if "string encoding" not in str(error):
                        raise
                    self.write_keys(worker, unit, tmp, via_arrow=True)
            except duckdb.ProgrammingError:
                raise  # a bug in the SQL built here, not bad data: keep the traceback
            except duckdb.Error as error:
                message = str(error).splitlines()[0]
                if not skip_bad:
                    raise LaionkitError(
                        f"{file.path}: cannot read row groups {unit.start}-{unit.stop - 1}: {message}"
                    ) from None
                tmp.mkdir(exist_ok=True)
                (tmp / "bad.txt").write_text(message)
            tmp.mkdir(exist_ok=True)  # a unit without keys leaves an empty folder: done

    def write_keys(self, worker: UnitFilter, unit: Unit, tmp: Path, via_arrow: bool) -> None:
        file = self.plan.files[unit.file]
        source, _ = worker.source_sql(unit, file, via_arrow)
        _, where = worker.tested_rules(file)
        value = quote(self.column)
        worker.connection.execute(
            f"COPY (SELECT hash({value}) % {self.buckets} AS bucket, {value} AS value, "
            f"__laionkit_row + {self.bases[unit.file]} AS pos FROM ({source}) WHERE {where} AND {value} IS NOT NULL) "
            f"TO {literal(str(tmp))} (FORMAT parquet, PARTITION_BY (bucket), OVERWRITE_OR_IGNORE)"
        ).fetchall()

    def resolve(self, worker: UnitFilter, bucket: int) -> None:
        """Positions in ``bucket`` whose value occurs at a smaller position, sorted."""
        if not self.folder.local:
            self.folder.fs.invalidate_cache(self.folder.path)  # listings cached before other ranks wrote
        found = self.folder.glob(f"keys-*/bucket={bucket}/*.parquet")
        with storage.atomic_write(self.drop(bucket), staging=self.staging) as tmp:
            keys = [Path(key.path) for key in found]
            if not self.folder.local:  # DuckDB reads local files only: this bucket's keys, downloaded
                keys = [tmp.parent / f"keys-{i:06d}.parquet" for i in range(len(found))]
                for key, local in zip(found, keys):
                    key.fs.get_file(key.path, str(local))
            rows = parquet_list(keys) if keys else \
                "(SELECT NULL::VARCHAR AS value, NULL::BIGINT AS pos WHERE false)"
            worker.connection.execute(
                f"COPY (WITH b AS (SELECT value, pos::BIGINT AS pos FROM {rows}) "
                "SELECT b.pos FROM b JOIN (SELECT value, min(pos) AS first FROM b GROUP BY value "
                "HAVING count(*) > 1) d ON b.value = d.value AND b.pos <> d.first ORDER BY b.pos) "
                f"TO {literal(str(tmp))} (FORMAT parquet, ROW_GROUP_SIZE {DROP_ROW_GROUP})"
            ).fetchall()

    def finish(self, done: set[int]) -> None:
        """Once every unit's part exists nothing needs the scratch folder (any rank may remove it)."""
        if all(unit.index in done for unit in self.plan.units):
            try:
                self.folder.remove()
            except (OSError, LaionkitError):
                pass  # another rank removed it meanwhile


def in_parallel(items: Sequence[T], workers: Sequence[UnitFilter], work: Callable[[UnitFilter, T], None]) -> None:
    """Run ``work`` on each item, one item per worker (DuckDB cursor) at a time."""
    if not items:
        return
    if len(workers) == 1:
        for item in items:
            work(workers[0], item)
        return
    chunks = [items[i :: len(workers)] for i in range(len(workers))]

    def run_chunk(index: int) -> None:
        for item in chunks[index]:
            work(workers[index], item)

    with ThreadPoolExecutor(len(workers), thread_name_prefix="laionkit-dedup") as pool:
        try:
            list(pool.map(run_chunk, range(len(workers))))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.connection.interrupt()
            raise


def wait_for(dedup: Dedup, paths: Sequence[Location], what: str, timeout: float, rank: Rank,
             owners: Sequence[int], option: str = "--dedup", wait_option: str = "--dedup-wait") -> None:
    """Wait until every output is complete (other ranks write them), or fail naming the ranks still missing.

    ``dedup``: anything with ``complete()`` (the names complete now) and ``poll_seconds`` (laionkit dedup's
    scratch folder too); ``option`` and ``wait_option``: what the message names, and the flag that raises the limit."""
    deadline = time.monotonic() + timeout
    complete = dedup.complete()
    missing = [i for i, path in enumerate(paths) if path.name not in complete]
    while missing:
        if time.monotonic() > deadline:
            ranks = sorted({owners[i] for i in missing})
            raise LaionkitError(
                f"{option}: rank {rank.rank} waited {timeout:g} s for {len(missing)} {what} that ranks "
                f"{', '.join(map(str, ranks))} of {rank.world_size} write; start every rank with the same "
                f"arguments (finished work is kept), or raise {wait_option}"
            )
        time.sleep(dedup.poll_seconds)
        complete = dedup.complete()
        missing = [i for i in missing if paths[i].name not in complete]
