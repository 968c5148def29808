"""laionkit filter's options: one frozen ``FilterConfig`` per run, built by the CLI and taken by ``run``."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_UNIT_ROWS = 1_000_000


@dataclass(frozen=True)
class FilterConfig:
    inputs: tuple[str, ...]
    output: str
    where: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    top: tuple[str, ...] = ()  # --top FRACTION:COLUMN quantile rules
    rename: tuple[str, ...] = ()
    dedup: str | None = None
    embeddings: tuple[str, ...] = ()
    scores: tuple[str, ...] = ()
    score_tables: tuple[str, ...] = ()  # --scores DIR: laionkit score output joined by key (filter/joins.py)
    clip_model: str = "ViT-L-14"
    clip_pretrained: str = "openai"
    unit_rows: int = DEFAULT_UNIT_ROWS
    threads: int | None = None  # DuckDB threads in all; None = every CPU this process may use
    rank: int | None = None
    world_size: int | None = None
    dedup_wait: float = 3600.0  # --dedup: seconds a rank waits for the other ranks' phase outputs
    dedup_bucket_rows: int = 4_000_000  # --dedup: input rows per bucket (bounds the memory of resolving one)
    skip_bad: bool = False
    overwrite: bool = False
    quiet: bool = False
    allow_incomplete: bool = False  # --scores of a score run not every rank finished (common.upstream)
    storage_options: str | None = None  # --storage-options JSON for s3:// and other URLs
