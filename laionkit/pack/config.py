"""laionkit pack's options: one frozen ``PackConfig`` per run, checked when it is built (one-line errors)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laionkit.common import LaionkitError, available_cpus, storage
from laionkit.common.storage import Location

RESIZE_MODES = ("center_crop", "keep_ratio", "border", "no")
ENCODE_FORMATS = ("jpg", "webp")
# PIL's decompression-bomb threshold (about 9459 x 9459): more pixels than any training image needs.
DEFAULT_MAX_IMAGE_AREA = 89_478_485
# img2dataset's default: honour X-Robots-Tag opt-outs of AI use and indexing.
OPTOUT_DIRECTIVES = ("noai", "noimageai", "noindex", "noimageindex")


MIN_SHARD_NAME_WIDTH = 5
# Options that shape the shards: a resumed run must use the same ones as the shards already done.
OUTPUT_SHAPING_OPTIONS = (
    "image_size", "resize_mode", "min_image_size", "max_aspect_ratio", "max_image_area", "encode_format",
    "encode_quality", "shard_size", "respect_optout",
)
# A body larger than this is refused while it downloads (the rest is never read).
DEFAULT_MAX_BYTES = 64 * 2**20


# A URL that went through pathlib (s3://bucket/x became s3:/bucket/x) would name a local "s3:" folder.
URL_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


@dataclass(frozen=True)
class PackConfig:
    inputs: tuple[str | Path, ...]  # paths or URLs (s3://, gs://, ...)
    output: str | Path
    image_size: int = 512
    resize_mode: str = "center_crop"
    min_image_size: int = 0
    max_aspect_ratio: float | None = None  # None: no limit
    max_image_area: int = DEFAULT_MAX_IMAGE_AREA  # 0 turns the guard off
    encode_format: str = "jpg"
    encode_quality: int = 95
    processes: int = field(default_factory=available_cpus)
    threads: int = 64
    timeout: float = 10.0  # a total deadline per download, redirects and body included
    max_bytes: int = DEFAULT_MAX_BYTES
    allow_private_hosts: bool = False
    retries: int = 0
    shard_size: int = 10_000
    url_column: str | None = None
    caption_column: str | None = None
    respect_optout: bool = True
    rank: int | None = None
    world_size: int | None = None
    quiet: bool = False
    storage_options: str | None = None  # --storage-options JSON for URL paths
    overwrite: bool = False  # write into a folder that holds another stage's outputs (same names replaced)
    allow_incomplete: bool = False  # --keep: an unfinished input folder or keep list's stage (common.upstream)
    keep: str | None = None  # --keep PARQUET: inputs are existing shards; keep only these keys (pack/subset.py)

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
        if self.max_bytes < 1:
            raise LaionkitError(f"--max-bytes must be >= 1, got {self.max_bytes}")
        for flag, path in [*(("input", path) for path in self.inputs), ("--output", self.output)]:
            match = URL_LIKE.match(str(path))
            if match:
                shown = URL_LIKE.sub(r"\1://", str(path))
                raise LaionkitError(f"{flag} {path}: a URL that lost a slash (a pathlib.Path?); pass {shown} "
                                    "as a string")

    def locations(self) -> tuple[list[Location], Location]:
        options = storage.parse_storage_options(self.storage_options)
        return [Location.parse(str(p), options) for p in self.inputs], Location.parse(str(self.output), options)

    def options(self) -> dict[str, Any]:
        """What a shard record keeps: everything but where the data lives and who ran it."""
        skipped = {"inputs", "output", "rank", "world_size", "quiet", "storage_options", "overwrite", "keep",
                   "allow_incomplete"}
        return {key: value for key, value in asdict(self).items() if key not in skipped}
