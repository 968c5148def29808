"""WebDataset tar shards as every stage sees them: one sample per key, counted without reading data."""

from __future__ import annotations

import os
import re
import tarfile

from laionkit.common.errors import LaionkitError


def count_samples(path: str | os.PathLike[str]) -> int:
    """Samples in a tar (plain or gzipped), counted from its headers as webdataset groups them.

    webdataset's own rules, so a count always equals what a reader yields: regular files only, ``__*__``
    meta members skipped, the key is the name up to the first dot of its last component (``./000.jpg``
    is key ``./000``), and a sample is a run of consecutive members with one key.
    """
    from webdataset.tariterators import base_plus_ext

    samples, key = 0, None
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isreg() or re.match(r"__[^/]*__($|/)", member.name):
                    continue
                prefix, _ = base_plus_ext(member.name)
                if prefix is not None and prefix != key:
                    samples, key = samples + 1, prefix
    except (tarfile.TarError, OSError, EOFError) as error:
        raise LaionkitError(f"cannot read shard {path}: {error}") from error
    return samples
