"""dedup's steps: each a list of items (units, hash buckets, cluster partitions, or one global item) whose
outputs are files in the scratch folder, complete when renamed, the same whichever rank or run wrote them.

Ranks take items ``i % world_size == rank`` and wait for the whole step before the next (the wait of
laionkit.filter.dedup). Removed rows are files of one schema (``REMOVED``): a unit's ``against``, a
bucket's ``exact``, the global ``phash``, a partition's ``semantic``; a unit's survivors after some layers
are its rows minus those files' positions in its range.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, atomic_output
from laionkit.common.keys import KeepList
from laionkit.common.phash import BITS, hamming_many
from laionkit.dedup.config import LAYERS, ROWS_PER_CLUSTER, DedupConfig
from laionkit.dedup.inputs import Unit, normalise, read_embeddings
from laionkit.filter.dedup import POLL_SECONDS, parquet_list
from laionkit.filter.sql import literal

REMOVED = pa.schema([("pos", pa.int64()), ("key", pa.string()), ("shard", pa.string()), ("layer", pa.string()),
                     ("duplicate_of", pa.string()), ("duplicate_of_shard", pa.string()), ("distance", pa.float64())])
# Which row of a group is kept: the highest --keep-by value, then the smallest key, shard, input position.
PRIORITY = "score DESC NULLS LAST, key, shard, pos"
SIMILARITY_BLOCK = 4096  # rows of a cluster's similarity matrix computed at once (4096 x cluster floats)
ANTI_JOIN_CHUNK = 1 << 20  # reference pHashes x rows compared at once by --against (64 bytes each)
BEFORE_SEMANTIC = ("against", "exact", "phash")  # the layers whose survivors k-means and SemDeDup see


class Finished(Exception):
    """The run's final outputs appeared while this rank waited: another rank finished everything."""


@dataclass
class References:
    """--against: the reference set's sha256s, pHashes and normalised embeddings, held by every rank."""

    keys: list[tuple[str, str]]
    sha256: pa.Array  # the references' distinct sha256s ...
    sha256_row: np.ndarray  # ... and the first row (index of keys) of each
    phash: np.ndarray  # the references' pHashes (those that have one) ...
    phash_row: np.ndarray  # ... and their rows (indices of keys)
    index: object | None  # faiss.IndexFlatIP over the embeddings


class Work:
    """One run's scratch folder, ``DIR/.work-<plan id>/``, and the steps' items in it."""

    poll_seconds = POLL_SECONDS  # filter.dedup.wait_for's poll of complete()

    def __init__(self, config: DedupConfig, units: list[Unit], folder: Path, done: Callable[[], bool],
                 connection: duckdb.DuckDBPyConnection, references: References | None,
                 keep: KeepList | None = None):
        self.config = config
        self.units = units
        self.folder = folder
        self.done = done
        self.db = connection
        self.references = references
        self.keep = keep  # --keep's samples
        self.rows = units[-1].stop if units else 0
        self.buckets = max(1, math.ceil(self.rows / config.bucket_rows))
        self.layers = [layer for layer in LAYERS if layer in config.layers]
        self.bands = config.phash_bands or config.phash_distance + 1
        self.clusters = config.clusters or max(1, math.ceil(self.rows / ROWS_PER_CLUSTER))

    # ------------------------------------------------------------------ bookkeeping for filter.dedup.wait_for

    def complete(self) -> set[str]:
        try:
            return {name for name in os.listdir(self.folder) if not name.startswith(".")}
        except FileNotFoundError:
            if self.done():
                raise Finished from None
            return set()

    def path(self, name: str) -> Path:
        return self.folder / name

    # ------------------------------------------------------------------ removed rows and survivors

    def removed_files(self, unit: Unit | None, layers: tuple[str, ...]) -> list[Path]:
        files = []
        if "against" in layers:
            files += [self.path(f"unit-{u.index:06d}") / "against.parquet" for u in ([unit] if unit else self.units)]
        if "exact" in layers and "exact" in self.layers:
            files += [self.path(f"exact-{b:05d}.parquet") for b in range(self.buckets)]
        if "phash" in layers and "phash" in self.layers:
            files.append(self.path("phash.parquet"))
        if "semantic" in layers and "semantic" in self.layers:
            files.append(self.path("semantic.parquet"))
        return files

    def survivors(self, unit: Unit, layers: tuple[str, ...]) -> str:
        """SQL: the unit's rows (pos, key, shard, sha256, phash, score) no layer in ``layers`` removed, by pos."""
        rows = f"read_parquet({literal(str(self.path(f'unit-{unit.index:06d}') / 'rows.parquet'))})"
        removed = parquet_list(self.removed_files(unit, layers))
        return (f"SELECT * FROM {rows} WHERE pos NOT IN (SELECT pos FROM {removed} "
                f"WHERE pos BETWEEN {unit.start} AND {unit.stop - 1}) ORDER BY pos")

    def write_removed(self, target: Path, sql: str | None) -> None:
        """``sql`` (rows of REMOVED's columns) sorted by pos into ``target``; None: no rows."""
        table = REMOVED.empty_table() if sql is None else \
            self.db.sql(f"SELECT * FROM ({sql}) ORDER BY pos").to_arrow_table().cast(REMOVED)
        with atomic_output(target) as tmp:
            pq.write_table(table, tmp)

    # ------------------------------------------------------------------ step 1: units (rows, --against, sha keys)

    def unit_step(self, unit: Unit) -> None:
        """Copy the columns dedup needs with their global positions, decide --against, partition sha256s."""
        config = self.config
        wanted = ["key", "shard"] + (["sha256"] if "exact" in self.layers else []) + \
            (["phash"] if "phash" in self.layers else [])
        if config.keep_by and config.keep_by not in wanted:
            wanted.append(config.keep_by)
        table = pq.read_table(unit.scores, columns=wanted)
        columns = {
            "pos": pa.array(np.arange(unit.start, unit.stop, dtype=np.int64)),
            "key": table["key"].cast(pa.string()), "shard": table["shard"].cast(pa.string()),
            "sha256": table["sha256"].cast(pa.string()) if "sha256" in wanted else pa.nulls(unit.rows, pa.string()),
            "phash": phash_column(table["phash"]) if "phash" in wanted else pa.nulls(unit.rows, pa.int64()),
            "score": score_column(table[config.keep_by]) if config.keep_by else pa.nulls(unit.rows, pa.float64()),
        }
        rows = pa.table(columns)
        if self.keep is not None:  # rows outside --keep's list take part in nothing; positions stay global
            rows = rows.filter(self.keep.mask(rows["shard"], rows["key"]))
        with atomic_output(self.path(f"unit-{unit.index:06d}")) as tmp:
            tmp.mkdir()
            pq.write_table(rows, tmp / "rows.parquet")
            against = self.against(unit, rows)
            pq.write_table(against, tmp / "against.parquet")
            if "exact" in self.layers:
                keep = rows.filter(pc.invert(pc.is_in(rows["pos"], value_set=against["pos"])))
                self.db.register("unit_rows", keep)
                self.db.execute(
                    f"COPY (SELECT hash(sha256) % {self.buckets} AS bucket, * FROM unit_rows WHERE sha256 IS NOT NULL) "
                    f"TO {literal(str(tmp / 'sha'))} (FORMAT parquet, PARTITION_BY (bucket))").fetchall()
                self.db.unregister("unit_rows")

    def against(self, unit: Unit, rows: pa.Table) -> pa.Table:
        """The unit's rows within a layer's distance of any reference row (exact, then pHash, then embedding)."""
        refs = self.references
        if refs is None:
            return REMOVED.empty_table()
        n = rows.num_rows
        match = np.full(n, -1, np.int64)
        distance = np.zeros(n, np.float64)
        if "exact" in self.layers and len(refs.sha256):
            found = pc.index_in(rows["sha256"], value_set=refs.sha256).fill_null(-1).to_numpy()
            match[:] = np.where(found >= 0, refs.sha256_row[np.maximum(found, 0)], -1)
        if len(refs.phash):
            ours = rows["phash"].fill_null(0).to_numpy()
            valid = ~is_null(rows["phash"])
            step = max(1, ANTI_JOIN_CHUNK // len(refs.phash))
            for lo in range(0, n, step):
                todo = np.nonzero((match[lo:lo + step] < 0) & valid[lo:lo + step])[0] + lo
                if not len(todo):
                    continue
                dist = hamming_many(ours[todo].astype(np.int64)[:, None], refs.phash[None, :])
                best = dist.argmin(axis=1)
                hit = dist[np.arange(len(todo)), best] <= self.config.phash_distance
                match[todo[hit]] = refs.phash_row[best[hit]]
                distance[todo[hit]] = dist[np.arange(len(todo)), best][hit]
        if refs.index is not None:
            todo = np.nonzero(match < 0)[0]
            if len(todo):
                local = rows["pos"].to_numpy()[todo] - unit.start  # --keep may have dropped rows before them
                similarity, nearest = refs.index.search(finite_embeddings(unit, local), 1)
                hit = similarity[:, 0] >= 1 - self.config.epsilon
                match[todo[hit]] = nearest[hit, 0]
                distance[todo[hit]] = 1 - similarity[hit, 0]
        found = np.nonzero(match >= 0)[0]
        pick = lambda name: rows[name].take(pa.array(found)).cast(pa.string())  # noqa: E731
        return pa.table({"pos": rows["pos"].take(pa.array(found)), "key": pick("key"), "shard": pick("shard"),
                         "layer": pa.array(["against"] * len(found), pa.string()),
                         "duplicate_of": pa.array([refs.keys[m][0] for m in match[found]], pa.string()),
                         "duplicate_of_shard": pa.array([refs.keys[m][1] for m in match[found]], pa.string()),
                         "distance": pa.array(distance[found])}, schema=REMOVED)

    # ------------------------------------------------------------------ step 2: exact, per sha256 bucket

    def exact_step(self, bucket: int) -> None:
        files = sorted(self.folder.glob(f"unit-*/sha/bucket={bucket}/*.parquet"))
        sql = None
        if files:
            sql = (f"SELECT pos, key, shard, 'exact' AS layer, first_value(key) OVER w AS duplicate_of, "
                   f"first_value(shard) OVER w AS duplicate_of_shard, 0.0 AS distance, first_value(pos) OVER w AS first "
                   f"FROM {parquet_list(files)} WINDOW w AS (PARTITION BY sha256 ORDER BY {PRIORITY})")
            sql = f"SELECT * EXCLUDE (first) FROM ({sql}) WHERE pos <> first"
        self.write_removed(self.path(f"exact-{bucket:05d}.parquet"), sql)

    # ------------------------------------------------------------------ step 3-5: pHash bands, pairs, groups

    def band_widths(self) -> list[int]:
        return [BITS // self.bands + (1 if i < BITS % self.bands else 0) for i in range(self.bands)]

    def bands_step(self, unit: Unit) -> None:
        """The unit's survivors' pHashes cut into bands, hash-partitioned by (band, band value)."""
        shifts, widths, top = [], self.band_widths(), BITS
        for width in widths:
            top -= width
            shifts.append(top)
        bands = ", ".join(f"({i}, {s}, {(1 << w) - 1})" for i, (s, w) in enumerate(zip(shifts, widths)))
        survivors = self.survivors(unit, ("against", "exact"))
        with atomic_output(self.path(f"bands-{unit.index:06d}")) as tmp:
            tmp.mkdir()
            self.db.execute(
                f"COPY (SELECT hash(b.band, (s.phash >> b.shift) & b.mask) % {self.buckets} AS bucket, b.band, "
                f"(s.phash >> b.shift) & b.mask AS value, s.pos, s.phash FROM ({survivors}) s, "
                f"(VALUES {bands}) b(band, shift, mask) WHERE s.phash IS NOT NULL) "
                f"TO {literal(str(tmp / 'b'))} (FORMAT parquet, PARTITION_BY (bucket))").fetchall()

    def pairs_step(self, bucket: int) -> None:
        """Pairs (a < b) that share a band value in this bucket and lie within --phash-distance."""
        files = sorted(self.folder.glob(f"bands-*/b/bucket={bucket}/*.parquet"))
        with atomic_output(self.path(f"pairs-{bucket:05d}.parquet")) as tmp:
            if not files:
                pq.write_table(pa.table({"a": pa.array([], pa.int64()), "b": pa.array([], pa.int64())}), tmp)
                return
            self.db.execute(
                f"COPY (WITH t AS (SELECT band, value, pos, phash FROM {parquet_list(files)}) "
                "SELECT DISTINCT x.pos AS a, y.pos AS b FROM t x JOIN t y ON x.band = y.band AND x.value = y.value "
                f"AND x.pos < y.pos WHERE bit_count(xor(x.phash, y.phash)) <= {self.config.phash_distance} "
                f"ORDER BY a, b) TO {literal(str(tmp))} (FORMAT parquet)").fetchall()

    def phash_step(self, _: int = 0) -> None:
        """Connected groups of all buckets' pairs (label propagation with pointer jumping in DuckDB); each
        group keeps its first row by PRIORITY, the rest name it, at their Hamming distance from it."""
        self.components(parquet_list([self.path(f"pairs-{b:05d}.parquet") for b in range(self.buckets)]))
        rows = parquet_list([self.path(f"unit-{u.index:06d}") / "rows.parquet" for u in self.units])
        sql = (f"SELECT r.pos, r.key, r.shard, r.score, r.phash, l.c FROM {rows} r JOIN label l ON l.n = r.pos")
        sql = (f"SELECT pos, key, shard, 'phash' AS layer, first_value(key) OVER w AS duplicate_of, "
               f"first_value(shard) OVER w AS duplicate_of_shard, "
               f"bit_count(xor(phash, first_value(phash) OVER w))::DOUBLE AS distance, first_value(pos) OVER w AS first "
               f"FROM ({sql}) WINDOW w AS (PARTITION BY c ORDER BY {PRIORITY})")
        self.write_removed(self.path("phash.parquet"), f"SELECT * EXCLUDE (first) FROM ({sql}) WHERE pos <> first")
        self.drop_components()

    def components(self, edges: str) -> None:
        """Temp table ``label(n, c)``: each row of an edge (a, b) of ``edges`` (a FROM clause) and its connected
        component, named by its smallest position (label propagation with pointer jumping, in DuckDB)."""
        db = self.db
        db.execute(f"CREATE OR REPLACE TEMP TABLE edges AS SELECT DISTINCT a, b FROM {edges}")
        db.execute("CREATE OR REPLACE TEMP TABLE links AS SELECT a AS n, b AS m FROM edges UNION ALL "
                   "SELECT b, a FROM edges")
        db.execute("CREATE OR REPLACE TEMP TABLE label AS SELECT n, least(n, min(m)) AS c FROM links GROUP BY n")
        while True:
            db.execute("CREATE OR REPLACE TEMP TABLE step AS SELECT l.n, least(any_value(l.c), min(o.c)) AS c "
                       "FROM links k JOIN label l ON l.n = k.n JOIN label o ON o.n = k.m GROUP BY l.n")
            db.execute("CREATE OR REPLACE TEMP TABLE jump AS SELECT s.n, least(s.c, j.c) AS c FROM step s "
                       "JOIN step j ON j.n = s.c")
            [(changed,)] = db.execute("SELECT count(*) FROM jump JOIN label USING (n) "
                                      "WHERE jump.c <> label.c").fetchall()
            db.execute("CREATE OR REPLACE TEMP TABLE label AS SELECT * FROM jump")
            if not changed:
                break

    def drop_components(self) -> None:
        for table in ("edges", "links", "label", "step", "jump"):
            self.db.execute(f"DROP TABLE IF EXISTS {table}")

    # ------------------------------------------------------------------ step 6-8: SemDeDup

    def kmeans_step(self, _: int = 0) -> None:
        """Spherical k-means (faiss) over a strided sample of the survivors' embeddings, seeded."""
        import faiss

        survivors = [np.array(self.db.execute(f"SELECT pos FROM ({self.survivors(u, BEFORE_SEMANTIC)})")
                              .fetchnumpy()["pos"], np.int64) - u.start for u in self.units]
        total = sum(len(s) for s in survivors)
        clusters = max(1, min(self.clusters, total))
        if self.clusters > total:  # said even with --quiet: the layer the user asked for finds nothing
            print(f"dedup: warning: --clusters {self.clusters} is more than the {total} rows the earlier layers "
                  f"left: k-means makes {clusters} clusters of one row each, so the semantic layer finds no "
                  "duplicates; give fewer clusters", file=sys.stderr)
        stride = max(1, total // (clusters * 256))  # faiss's max_points_per_centroid: 256
        sample, seen = [], 0
        for unit, rows in zip(self.units, survivors):
            offset = (-seen) % stride
            picked = rows[offset::stride]
            seen += len(rows)
            if len(picked):
                sample.append(finite_embeddings(unit, picked))
        data = np.ascontiguousarray(np.concatenate(sample)) if sample else np.zeros((1, 1), np.float32)
        kmeans = faiss.Kmeans(data.shape[1], clusters, niter=self.config.kmeans_iterations, seed=self.config.seed,
                              spherical=True, max_points_per_centroid=1 << 30, min_points_per_centroid=1,
                              verbose=False)
        if total:
            kmeans.train(data)
            centroids = kmeans.centroids
        else:
            centroids = data
        with atomic_output(self.path("centroids.npy")) as tmp:
            with open(tmp, "wb") as handle:
                np.save(handle, np.asarray(centroids, np.float32))

    def assign_step(self, unit: Unit) -> None:
        """Each survivor's ``--clusters-per-row`` nearest centroids (one row per survivor and cluster), with its
        embedding, partitioned by cluster % buckets."""
        centroids = np.load(self.path("centroids.npy"))
        rows = self.db.sql(self.survivors(unit, BEFORE_SEMANTIC)).to_arrow_table()
        local = rows["pos"].to_numpy() - unit.start
        with atomic_output(self.path(f"assign-{unit.index:06d}")) as tmp:
            tmp.mkdir()
            if not len(local):
                return
            vectors = finite_embeddings(unit, local)
            near = min(self.config.clusters_per_row, len(centroids))
            cluster = np.empty((len(local), near), np.int64)
            for lo in range(0, len(local), SIMILARITY_BLOCK):
                sims = vectors[lo:lo + SIMILARITY_BLOCK] @ centroids.T  # nearest first, ties by cluster index
                cluster[lo:lo + SIMILARITY_BLOCK] = np.argmax(sims, axis=1)[:, None] if near == 1 else \
                    np.argsort(-sims, axis=1, kind="stable")[:, :near]
            rows = rows.take(pa.array(np.repeat(np.arange(len(local)), near)))  # row i, its clusters in order
            vectors, cluster = np.repeat(vectors, near, axis=0), cluster.reshape(-1)
            half = vectors.astype(np.float16)
            blobs = pa.FixedSizeBinaryArray.from_buffers(pa.binary(half.shape[1] * 2), len(half),
                                                         [None, pa.py_buffer(half.tobytes())])
            table = pa.table({"pos": rows["pos"], "key": rows["key"], "shard": rows["shard"], "score": rows["score"],
                              "cluster": pa.array(cluster), "embedding": blobs})
            part = cluster % self.buckets
            for p in np.unique(part):
                (tmp / f"part={p}").mkdir()
                pq.write_table(table.filter(pa.array(part == p)), tmp / f"part={p}" / "rows.parquet")

    def semantic_step(self, partition: int) -> None:
        """SemDeDup inside each cluster of the partition: pairs with cosine >= 1 - epsilon, their connected groups
        by union-find, written as a spanning forest (each member -> its group's first row by PRIORITY): k - 1
        edges for a group of k however many of its pairs are within epsilon. A row in several clusters
        (``--clusters-per-row``) joins the groups of each; ``semantic_groups_step`` unites them."""
        files = sorted(self.folder.glob(f"assign-*/part={partition}/*.parquet"))
        target = self.path(f"semantic-{partition:05d}.parquet")
        edges_a: list[np.ndarray] = []
        edges_b: list[np.ndarray] = []
        if files:
            table = pa.concat_tables(pq.read_table(path) for path in files)
            order = table.drop(["embedding"]).append_column("i", pa.array(np.arange(table.num_rows)))
            self.db.register("partition_rows", order)
            order = self.db.sql(f"SELECT i FROM partition_rows ORDER BY cluster, {PRIORITY}").fetchnumpy()["i"]
            self.db.unregister("partition_rows")
            table = table.take(pa.array(order))
            cluster = table["cluster"].to_numpy()
            positions = table["pos"].to_numpy()
            width = table.schema.field("embedding").type.byte_width // 2
            half = np.frombuffer(table["embedding"].combine_chunks().buffers()[1], np.float16,
                                 count=table.num_rows * width).reshape(-1, width)  # float32 one cluster at a time
            threshold = np.float32(1 - self.config.epsilon)
            edges = np.nonzero(np.diff(cluster))[0] + 1
            for lo, hi in zip(np.r_[0, edges], np.r_[edges, len(cluster)]):
                parent = np.arange(hi - lo)
                block = normalise(half[lo:hi].astype(np.float32))
                for i0 in range(0, hi - lo, SIMILARITY_BLOCK):
                    sims = block[i0:i0 + SIMILARITY_BLOCK] @ block[i0:].T
                    upper = np.arange(sims.shape[1])[None, :] > np.arange(sims.shape[0])[:, None]
                    for a, b in zip(*np.nonzero((sims >= threshold) & upper)):
                        union(parent, i0 + int(a), i0 + int(b))
                roots = np.array([find(parent, i) for i in range(hi - lo)])
                members = np.nonzero(roots != np.arange(hi - lo))[0]
                edges_a.append(positions[lo + roots[members]])
                edges_b.append(positions[lo + members])
        a = np.concatenate(edges_a) if edges_a else np.zeros(0, np.int64)
        b = np.concatenate(edges_b) if edges_b else np.zeros(0, np.int64)
        with atomic_output(target) as tmp:
            pq.write_table(pa.table({"a": pa.array(a, pa.int64()), "b": pa.array(b, pa.int64())}), tmp)

    def semantic_groups_step(self, _: int = 0) -> None:
        """Connected groups of every cluster's edges (a row in two clusters links their groups); each keeps its
        first row by PRIORITY, the rest name it, at cosine distance 1 - cos from it (embeddings re-read)."""
        self.components(parquet_list([self.path(f"semantic-{p:05d}.parquet") for p in range(self.buckets)]))
        rows = parquet_list([self.path(f"unit-{u.index:06d}") / "rows.parquet" for u in self.units])
        sql = f"SELECT r.pos, r.key, r.shard, r.score, l.c FROM {rows} r JOIN label l ON l.n = r.pos"
        sql = (f"SELECT pos, key, shard, first_value(key) OVER w AS duplicate_of, "
               f"first_value(shard) OVER w AS duplicate_of_shard, first_value(pos) OVER w AS first "
               f"FROM ({sql}) WINDOW w AS (PARTITION BY c ORDER BY {PRIORITY})")
        found = self.db.sql(f"SELECT * FROM ({sql}) WHERE pos <> first ORDER BY pos").to_arrow_table()
        self.drop_components()
        pos, first = found["pos"].to_numpy(), found["first"].to_numpy()
        vectors = self.embeddings_at(np.concatenate([pos, first]))
        distance = 1 - np.einsum("ij,ij->i", vectors[:len(pos)], vectors[len(pos):]).astype(np.float64)
        result = pa.table({"pos": found["pos"], "key": found["key"], "shard": found["shard"],
                           "layer": pa.array(["semantic"] * len(pos), pa.string()),
                           "duplicate_of": found["duplicate_of"], "duplicate_of_shard": found["duplicate_of_shard"],
                           "distance": pa.array(distance, pa.float64())}, schema=REMOVED)
        self.db.register("semantic_removed", result)
        self.write_removed(self.path("semantic.parquet"), "SELECT * FROM semantic_removed")
        self.db.unregister("semantic_removed")

    def embeddings_at(self, positions: np.ndarray) -> np.ndarray:
        """The normalised float32 embeddings of rows at global ``positions`` (any order), as the float16 rows
        the clusters compared (read_embeddings, rounded to float16 as assign stores them, normalised)."""
        out = np.zeros((len(positions), 1), np.float32)
        starts = np.array([u.start for u in self.units])
        owner = np.searchsorted(starts, positions, side="right") - 1
        for index in np.unique(owner):
            unit = self.units[index]
            where = np.nonzero(owner == index)[0]
            local, inverse = np.unique(positions[where] - unit.start, return_inverse=True)
            vectors = normalise(finite_embeddings(unit, local).astype(np.float16).astype(np.float32))
            if out.shape[1] != vectors.shape[1]:
                out = np.zeros((len(positions), vectors.shape[1]), np.float32)
            out[where] = vectors[inverse]
        return out


def finite_embeddings(unit: Unit, rows: np.ndarray) -> np.ndarray:
    """read_embeddings, refusing rows that hold NaN or Inf: faiss asserts on them, and every cosine with one is
    NaN, so the row would silently match nothing."""
    vectors = read_embeddings(unit, rows)
    refuse_non_finite(unit.embeddings, vectors, rows)
    return vectors


def refuse_non_finite(path: Path, vectors: np.ndarray, rows: np.ndarray) -> None:
    """One line naming the file and the first row (of ``rows``, the file's indices of ``vectors``) that is not finite."""
    bad = np.nonzero(~np.isfinite(vectors).all(axis=1))[0]
    if len(bad):
        raise LaionkitError(f"{path}: row {int(rows[bad[0]])} of the embeddings holds NaN or Inf ({len(bad)} such "
                            "rows); rescore that shard, or drop those rows from its scores parquet and embeddings")


def phash_column(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """pHashes as int64 with their 64 bits kept: an unsigned column's values >= 2**63 become the negative int64
    of the same bits (what `laionkit score` writes), which a checked cast refuses."""
    return column.cast(pa.int64(), safe=not pa.types.is_unsigned_integer(column.type))


def score_column(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """--keep-by's values as float64 with NaN made null: PRIORITY puts nulls last (docs/FORMATS.md §7), where
    DuckDB would sort NaN above every number and keep the NaN row."""
    values = column.cast(pa.float64())
    return pc.if_else(pc.is_nan(values), pa.scalar(None, pa.float64()), values)


def find(parent: np.ndarray, i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def union(parent: np.ndarray, a: int, b: int) -> None:
    """Join the groups of a and b under the smaller root: a group's root is its first row by PRIORITY."""
    ra, rb = find(parent, a), find(parent, b)
    if ra != rb:
        parent[max(ra, rb)] = min(ra, rb)


def is_null(column: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(column.is_null().to_numpy(zero_copy_only=False), bool)
