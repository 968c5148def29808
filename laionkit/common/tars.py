"""WebDataset tar shards as every stage sees them: one sample per key, counted without reading data."""

from __future__ import annotations

import os
import tarfile

from laionkit.common.errors import LaionkitError


def count_samples(path: str | os.PathLike[str]) -> int:
    """Samples (distinct keys) in a tar, from its headers alone (seeks over the member data)."""
    try:
        with tarfile.open(path, "r:") as tar:
            return len({member.name.split(".", 1)[0] for member in tar
                        if member.isfile() and not member.name.startswith("__")})
    except tarfile.TarError as error:
        raise LaionkitError(f"cannot read shard {path}: {error}") from error
