"""``laionkit dedup SCORES_DIR... --output DIR``: image deduplication in layers over `laionkit score` outputs.

Layers, each optional, applied in this order to the rows the ones before left (``--against`` first):

* ``against`` (``--against REF_DIR``): rows within a layer's distance of any reference row (an evaluation
  set scored by `laionkit score`): the same sha256, a pHash within ``--phash-distance``, or an embedding
  with cosine >= 1 - ``--epsilon`` (faiss inner-product search over the references, held by every rank).
  First, so that a group whose best row is contaminated keeps its best clean row instead of none.
* ``exact``: equal sha256 of the image bytes; one row kept per group.
* ``phash``: pHash Hamming distance <= ``--phash-distance`` (laionkit.common.phash's definition). The 64
  bits are cut into ``--phash-bands`` bands (default distance + 1: two hashes within the distance then
  share at least one band exactly, by pigeonhole, so no pair is missed; fewer, wider bands give fewer
  candidates and may miss pairs); rows sharing a band value are
  candidate pairs, kept when their full distance is within it; groups are the connected components of all
  pairs (a~b~c keep one even when a and c are further apart).
* ``semantic``: SemDeDup (Abbas et al. 2023): spherical k-means (faiss) over the L2-normalised CLIP
  embeddings, then inside each cluster the pairs with cosine >= 1 - ``--epsilon``, connected groups.
  SemDeDup misses the pairs k-means splits between clusters (measured: up to 9 % of planted pairs,
  docs/BENCHMARKS.md); ``--clusters-per-row N`` puts each row in its N nearest clusters' pair search, and
  the groups of all clusters are then united globally, so a row in two clusters links their groups.

Every group keeps its row with the highest ``--keep-by`` value (ties, and without the flag: the smallest
key, shard, then input position); every other row is written to ``removed.parquet`` naming the kept one.

Where the global steps run, and why: ranks meet through a scratch folder as ``filter --dedup`` does (no
coordinator; ``laionkit.filter.dedup.wait_for``), but nothing global is done by polling many small files:
the group-bys are DuckDB queries (exact: window over each sha256 hash bucket; pHash: a self-join per band
bucket, then connected components by label propagation with pointer jumping over *all* pairs, one query
loop on one rank, spilling to disk), and clustering is faiss. Ray Data was not measured against it: DuckDB
is already a dependency and runs the group-by and the components on one node out of core (at 1M rows they
take seconds, docs/BENCHMARKS.md), while Ray would add a cluster service every rank must reach; the
per-shard and per-bucket work is what ranks split. Each
partition of clusters is searched by the rank that owns it (blockwise similarity, union-find), which writes
its groups as spanning forests (k - 1 edges per group of k, however many pairs it has); one rank then unites
every partition's edges (groups cross clusters only with ``--clusters-per-row`` > 1) and writes each removed
row's cosine distance to its group's kept row. Measurements: docs/BENCHMARKS.md.

Inputs and ``--output`` may be URLs (s3://, gs://, ...): remote SCORES_DIRs are mirrored to local disk and a
remote output is worked in a local folder (laionkit.dedup.remote; ``--scratch``) and its files are uploaded by
the same writer as local ones (laionkit.common.storage.atomic_write: each with its done record, stats.json last).

Steps (laionkit.dedup.steps), each a list of items whose outputs are complete when renamed: units
(rows, --against, sha256 hash partitions) → exact buckets → pHash bands per unit → pair buckets → pHash
groups (one item) → k-means (one item) → cluster assignment per unit → semantic partitions (each cluster's
groups as a spanning forest: k - 1 edges per group of k) → semantic groups (one item: connected components of
every partition's edges in DuckDB, the kept row by priority, distances from the embeddings); then rank 0
writes ``keep.parquet``, ``removed.parquet`` and ``stats.json`` (last) and removes the scratch folder. A
rerun after kill -9 redoes only missing items and writes the same files; the outputs do not depend on the
number of ranks (world size may change between runs).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, available_cpus, read_json, resolve_rank, split
from laionkit.common.keys import read_keep_list
from laionkit.common.runlock import holding, output_lock
from laionkit.common.storage import Location, atomic_write, claim_output, refuse_overlap, write_json
from laionkit.common.upstream import refuse_incomplete
from laionkit.dedup.config import LAYERS, ROWS_PER_CLUSTER, STATS_NAME, DedupConfig
from laionkit.dedup.inputs import Unit, find_units, normalise
from laionkit.dedup.remote import digest, is_remote, mirror, read_stats, scratch_root
from laionkit.dedup.steps import REMOVED, Finished, References, Work, phash_column, refuse_non_finite
from laionkit.filter.dedup import parquet_list, wait_for

__all__ = ["DedupConfig", "LAYERS", "run"]

KEEP_NAME, REMOVED_NAME = "keep.parquet", "removed.parquet"
IDENTITY_COLUMNS = ("key", "shard", "sha256", "phash")  # never a --keep-by score


def needed_columns(config: DedupConfig) -> dict[str, str]:
    columns = {"key": "every row is named by key and shard", "shard": "every row is named by key and shard"}
    if "exact" in config.layers:
        columns["sha256"] = "the exact layer compares it"
    if "phash" in config.layers:
        columns["phash"] = "the phash layer compares it"
    if config.keep_by:
        columns[config.keep_by] = "--keep-by names it"
    return columns


def check(config: DedupConfig) -> None:
    unknown = [layer for layer in config.layers if layer not in LAYERS]
    if unknown or not config.layers:
        raise LaionkitError(f"--layers: unknown {', '.join(unknown) or '(none given)'}; choose among {', '.join(LAYERS)}")
    if not 0 <= config.phash_distance < 64:
        raise LaionkitError(f"--phash-distance {config.phash_distance}: want 0-63 bits")
    if not 0 <= config.phash_bands <= 64:
        raise LaionkitError(f"--phash-bands {config.phash_bands}: want 1-64 (0: --phash-distance + 1)")
    if not 0 <= config.epsilon < 2:
        raise LaionkitError(f"--epsilon {config.epsilon}: want 0 <= epsilon < 2 (cosine >= 1 - epsilon)")
    if config.bucket_rows < 1 or config.clusters < 0:
        raise LaionkitError("--bucket-rows must be >= 1 and --clusters >= 0")
    if config.clusters_per_row < 1:
        raise LaionkitError(f"--clusters-per-row {config.clusters_per_row}: want >= 1 (each row's nearest clusters)")
    if config.keep_by in IDENTITY_COLUMNS:
        raise LaionkitError(f"--keep-by {config.keep_by}: that column names or hashes a row, it is not a score; "
                            "name a score column (aesthetic, similarity, ...)")
    if config.keep and is_remote(config.keep):
        raise LaionkitError(f"--keep {config.keep}: a local parquet file or folder (copy the key list down first)")


def plan_id(config: DedupConfig, units: list[Unit], references: list[Unit], keep: dict | None = None,
            shown: dict[str, str] | None = None) -> str:
    """Names the scratch folder and is recorded in stats.json: the inputs (path, rows, size, mtime; a remote
    input by its URL, with its mirror's size and time, which are the object's), the settings, the --keep list
    (its keys' digest), and the versions of the engines whose hashes and float sums decide the intermediate
    files."""
    shown = shown or {}
    files = [(shown_name(u.scores, shown) if str(u.scores.parent) in shown else str(u.scores.resolve()), u.rows,
              u.scores.stat().st_size, u.scores.stat().st_mtime_ns) for u in [*units, *references]]
    engines = [duckdb.__version__, faiss_module().__version__ if "semantic" in config.layers or references else None]
    text = json.dumps([files, config.settings(), len(units), engines] + ([keep] if keep else []))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def faiss_module():
    try:
        import faiss
    except ImportError:
        raise LaionkitError("the semantic layer and --against need faiss: pip install 'laionkit[dedup]'") from None
    return faiss


def load_references(config: DedupConfig, units: list[Unit]) -> References:
    """Every reference row's sha256 and pHash (for the layers that are on) and normalised embeddings."""
    import numpy as np

    faiss = faiss_module()

    keys, sha256, phashes, vectors = [], {}, [], []  # sha256: value -> its first reference row
    for unit in units:
        columns = [c for c in ("key", "shard", "sha256", "phash") if c in needed_columns(config)]
        table = pq.read_table(unit.scores, columns=columns)
        base = len(keys)
        keys += list(zip(table["key"].cast("string").to_pylist(), table["shard"].cast("string").to_pylist()))
        if "sha256" in columns:
            for i, sha in enumerate(table["sha256"].to_pylist()):
                if sha is not None:
                    sha256.setdefault(sha, base + i)
        if "phash" in columns:  # a reference without a pHash matches nothing by pHash
            for i, value in enumerate(phash_column(table["phash"]).to_pylist()):
                if value is not None:
                    phashes.append((value, base + i))
        if unit.embeddings is not None:
            vectors.append(normalise(np.asarray(np.load(unit.embeddings, mmap_mode="r"), np.float32)))
            refuse_non_finite(unit.embeddings, vectors[-1], np.arange(len(vectors[-1])))
    index = None
    if vectors:
        data = np.ascontiguousarray(np.concatenate(vectors))
        index = faiss.IndexFlatIP(data.shape[1])
        index.add(data)
    return References(keys, pa.array(list(sha256), pa.string()), np.array(list(sha256.values()), np.int64),
                      np.array([v for v, _ in phashes], np.int64),
                      np.array([i for _, i in phashes], np.int64), index)


def run(config: DedupConfig) -> dict:
    """Dedup the inputs into ``config.output``; returns stats.json's content plus this process's wall and CPU
    seconds per step (``seconds``, ``cpu_seconds``: not written anywhere, they differ between runs)."""
    check(config)
    rank = resolve_rank(config.rank, config.world_size)
    target = Location.parse(config.output)
    refuse_overlap([*config.inputs, *config.against, *([config.keep] if config.keep else [])], target, "dedup")
    claim_output(target, "dedup", overwrite=config.overwrite)
    for role, given in [*(("input", f) for f in config.inputs), *(("--against", f) for f in config.against),
                        *([("--keep", config.keep)] if config.keep else [])]:
        refuse_incomplete(given, role, config.allow_incomplete, lambda line: print(line, file=sys.stderr))
    embeddings_why = "the semantic layer reads them" if "semantic" in config.layers else None
    remote = [given for given in (config.output, *config.inputs, *config.against) if is_remote(given)]
    root = scratch_root(config.scratch) if remote else None  # laionkit.dedup.remote: mirrors and the work folder
    inputs = tuple(str(mirror(given, root, embeddings_why is not None)) for given in config.inputs)  # local: as is
    against = tuple(str(mirror(given, root, embeddings_why is not None)) for given in config.against)
    shown = {str(Path(local) / "scores"): str(Location.parse(given) / "scores")  # mirrors by their URLs
             for local, given in zip((*inputs, *against), (*config.inputs, *config.against), strict=True)
             if is_remote(given)}
    units = find_units(inputs, needed_columns(config), embeddings_why)
    rows = units[-1].stop if units else 0
    if "semantic" in config.layers and config.clusters > rows:
        raise LaionkitError(f"--clusters {config.clusters}: more clusters than the {rows} input rows, so every row "
                            "would be alone in its cluster and the semantic layer would find nothing; give at most "
                            f"{rows} (0: one per {ROWS_PER_CLUSTER} rows)")
    reference_columns = {k: v for k, v in needed_columns(config).items() if k != config.keep_by}
    references = find_units(against, reference_columns, "--against with the semantic layer reads them"
                            if embeddings_why else None, role="--against") if against else []
    keep = read_keep_list(config.keep) if config.keep else None
    identity = plan_id(config, units, references, keep.identity() if keep is not None else None, shown)
    work_root = Path(config.output) if target.local else root / "work" / digest(str(target))  # .work-<plan> in it
    stats_path = work_root / STATS_NAME  # a local output's

    def finished() -> dict | None:
        if target.local:
            stats = read_json(stats_path) if stats_path.is_file() else None
        else:
            stats = read_stats(target)
        if stats is None:
            return None
        if stats.get("plan") == identity:
            return stats
        if config.overwrite:
            return None
        raise LaionkitError(f"{target / STATS_NAME} is from another run (other inputs or settings: {stats.get('settings')}); "
                            "choose another --output, or --overwrite to replace it")

    with holding(output_lock(Location("", str(work_root)), "dedup", rank.rank)):  # one process per rank
        return run_steps(config, rank, target, units, references, keep, identity, finished, work_root, shown)


def run_steps(config: DedupConfig, rank, target: Location, units: list[Unit], references: list[Unit],
              keep: frozenset[str] | None, identity: str, finished, work_root: Path, shown: dict[str, str]) -> dict:
    """run's steps in ``work_root/.work-<identity>`` (each item once, resumed), then rank 0's outputs."""
    if (stats := finished()) is not None:
        return stats
    threads = config.threads or available_cpus()
    folder = work_root / f".work-{identity}"
    folder.mkdir(parents=True, exist_ok=True)
    connection = duckdb.connect(config={"threads": threads, "preserve_insertion_order": True,
                                        "temp_directory": str(folder / f".spill-{rank.rank}")})  # dot: not an item
    work = Work(config, units, folder, lambda: finished() is not None, connection,
                load_references(config, references) if references else None, keep)
    openmp_threads = None  # faiss shares the process's OpenMP runtime with torch: its thread count goes back after
    if "semantic" in config.layers or references:
        openmp_threads = faiss_module().omp_get_max_threads()
        faiss_module().omp_set_num_threads(threads)
    seconds: dict[str, float] = {}
    cpu_seconds: dict[str, float] = {}  # every thread of this process
    unit_items = list(range(len(units)))
    buckets = list(range(work.buckets))
    steps = [("units", "unit", unit_items, lambda i: work.unit_step(units[i]))]
    if "exact" in work.layers:
        steps.append(("exact", "exact", buckets, work.exact_step))
    if "phash" in work.layers:
        steps += [("phash bands", "bands", unit_items, lambda i: work.bands_step(units[i])),
                  ("phash pairs", "pairs", buckets, work.pairs_step),
                  ("phash groups", "phash", [0], work.phash_step)]
    if "semantic" in work.layers:
        steps += [("k-means", "centroids", [0], work.kmeans_step),
                  ("cluster assignment", "assign", unit_items, lambda i: work.assign_step(units[i])),
                  ("semantic", "semantic", buckets, work.semantic_step),
                  ("semantic groups", "semgroups", [0], work.semantic_groups_step)]
    try:
        for index, (what, prefix, items, do) in enumerate(steps):
            names = [item_name(prefix, item) for item in items]
            started, cpu = time.perf_counter(), time.process_time()
            complete = work.complete()
            for item in split(items, rank):
                if names[item] not in complete:
                    do(item)
            seconds[what] = time.perf_counter() - started
            cpu_seconds[what] = time.process_time() - cpu
            if index < len(steps) - 1 or rank.is_main:
                wait_for(work, [work.path(n) for n in names], f"{what} outputs", config.wait, rank,
                         [i % rank.world_size for i in range(len(items))], option="dedup", wait_option="--wait")
            if not config.quiet:
                print(f"dedup: rank {rank.rank}: {what}: {len(split(items, rank))} of {len(items)} items here, "
                      f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    except Finished:
        return finished() or {}
    finally:
        if openmp_threads is not None:
            faiss_module().omp_set_num_threads(openmp_threads)
    if not rank.is_main:
        return {"plan": identity, "seconds": seconds, "cpu_seconds": cpu_seconds}
    started, cpu = time.perf_counter(), time.process_time()
    stats = write_outputs(work, target, identity, shown)
    seconds["outputs"] = time.perf_counter() - started
    cpu_seconds["outputs"] = time.process_time() - cpu
    connection.close()
    shutil.rmtree(folder if target.local else work_root, ignore_errors=True)
    return {**stats, "seconds": seconds, "cpu_seconds": cpu_seconds}


def item_name(prefix: str, item: int) -> str:
    if prefix in ("unit", "bands", "assign"):
        return f"{prefix}-{item:06d}"
    if prefix in ("phash", "centroids", "semgroups"):
        return {"phash": "phash.parquet", "centroids": "centroids.npy", "semgroups": "semantic.parquet"}[prefix]
    return f"{prefix}-{item:05d}.parquet"


def shown_name(scores: Path, shown: dict[str, str]) -> str:
    """A scores parquet as stats.json names it: its URL where it is a remote input's mirror."""
    folder = shown.get(str(scores.parent))
    return str(Location.parse(folder) / scores.name) if folder else str(scores)


def input_name(unit: Unit, shown: dict[str, str]) -> str:
    """keep.parquet's ``input`` of a unit's rows: its input folder as given (a remote one by its URL)."""
    given = shown.get(str(unit.scores.parent))
    return str(Location.parse(given).parent) if given else unit.folder


def write_outputs(work: Work, output: Location, identity: str, shown: dict[str, str] | None = None) -> dict:
    """keep.parquet (key, shard, input of every row no layer removed, in input order), removed.parquet (the
    removed rows by input order), then stats.json: the record that the run is complete (a folder: each renamed
    into place; an object store: each uploaded with its done record). ``shown``: the name stats.json gives a
    mirrored input's scores folder (its URL)."""
    shown = shown or {}
    db = work.db
    removed = parquet_list(work.removed_files(None, ("against", *work.layers)))
    rows = parquet_list([work.path(f"unit-{u.index:06d}") / "rows.parquet" for u in work.units])
    db.register("unit_inputs", pa.table({"start": [u.start for u in work.units], "stop": [u.stop for u in work.units],
                                         "input": [input_name(u, shown) for u in work.units]}))
    kept = db.sql(f"SELECT key, shard, input FROM {rows} JOIN unit_inputs ON pos >= start AND pos < stop "
                  f"WHERE pos NOT IN (SELECT pos FROM {removed}) ORDER BY pos").to_arrow_table()
    gone = db.sql(f"SELECT * EXCLUDE (pos) FROM {removed} ORDER BY pos").to_arrow_table()
    with atomic_write(output / KEEP_NAME) as tmp:
        pq.write_table(kept, tmp)
    with atomic_write(output / REMOVED_NAME) as tmp:
        pq.write_table(gone.cast(REMOVED.remove(0)), tmp)
    counts = dict(db.execute(f"SELECT layer, count(*) FROM {removed} GROUP BY layer").fetchall())
    [(considered,)] = db.execute(f"SELECT count(*) FROM {rows}").fetchall()
    layers = (["against"] if work.references is not None else []) + work.layers
    stats = {"plan": identity, "settings": work.config.settings(), "inputs": [shown_name(u.scores, shown) for u in work.units],
             "against": list(work.config.against), "rows_in": work.rows,
             # --keep: the rows of the list (the others are neither kept nor removed: the list had dropped them)
             "keep": work.config.keep, "rows_in_keep": int(considered), "not_in_keep": work.rows - int(considered),
             "removed": {layer: int(counts.get(layer, 0)) for layer in layers},
             "kept": kept.num_rows, "buckets": work.buckets,
             "clusters": work.clusters if "semantic" in work.layers else None,
             "phash_bands": work.bands if "phash" in work.layers else None}
    write_json(output / STATS_NAME, stats)
    return stats
