"""laionkit dedup's options: one frozen ``DedupConfig`` per run, built by the CLI and taken by ``run``."""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = ("exact", "phash", "semantic")  # the order they apply in, whatever order --layers names them
DEFAULT_BUCKET_ROWS = 4_000_000
ROWS_PER_CLUSTER = 10_000  # --clusters 0: ceil(rows / this), SemDeDup's LAION-440M scale (50k clusters)
STATS_NAME = "stats.json"  # written last, after keep.parquet: its presence says dedup finished (common.upstream)


@dataclass(frozen=True)
class DedupConfig:
    inputs: tuple[str, ...]  # SCORES_DIRs: `laionkit score` outputs (scores/*.parquet, img_emb/*.npy)
    output: str
    layers: tuple[str, ...] = LAYERS
    phash_distance: int = 4  # Hamming distance <= this is a perceptual duplicate
    phash_bands: int = 0  # LSH bands of the 64 bits; 0 = distance + 1 (no pair missed, by pigeonhole)
    epsilon: float = 0.05  # semantic / --against: cosine similarity >= 1 - epsilon is a duplicate
    clusters: int = 0  # k-means clusters; 0 = ceil(rows / ROWS_PER_CLUSTER)
    kmeans_iterations: int = 20
    clusters_per_row: int = 1  # semantic: each row joins its N nearest clusters' pair search (N > 1: pairs
    # that k-means split between clusters are found too, at N times the pair search)
    seed: int = 0
    keep_by: str | None = None  # per group keep the row with the highest value (ties: key, shard, input order)
    against: tuple[str, ...] = ()  # reference SCORES_DIRs (an evaluation set): drop rows near any of them
    keep: str | None = None  # a parquet file / folder of keys (filter's output): dedup only those rows
    bucket_rows: int = DEFAULT_BUCKET_ROWS  # rows per hash bucket / cluster partition (one is held in memory)
    wait: float = 3600.0  # seconds a rank waits for the other ranks' outputs of a step
    threads: int | None = None  # DuckDB / faiss threads; None = every CPU this process may use
    overwrite: bool = False  # replace the outputs of a run with other settings
    scratch: str | None = None  # remote inputs / output: the local (or shared) folder they are mirrored and worked in
    rank: int | None = None
    world_size: int | None = None
    quiet: bool = False
    allow_incomplete: bool = False  # use score folders (or a --keep list) their stage has not finished

    def settings(self) -> dict:
        """What decides the outputs (not where they go, nor how many ranks or threads make them)."""
        return {"layers": [layer for layer in LAYERS if layer in self.layers], "phash_distance": self.phash_distance,
                "phash_bands": self.phash_bands or self.phash_distance + 1, "epsilon": self.epsilon,
                "clusters": self.clusters, "kmeans_iterations": self.kmeans_iterations, "seed": self.seed,
                "clusters_per_row": self.clusters_per_row,
                "keep_by": self.keep_by, "bucket_rows": self.bucket_rows}
