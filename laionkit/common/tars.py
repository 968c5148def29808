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
    is key ``./000``), and a sample is a run of consecutive members with one key. ``path`` may be a URL
    (s3://...): the tar is then read through its headers, seeking over member data.
    """
    from webdataset.tariterators import base_plus_ext

    from laionkit.common.storage import Location

    samples, key = 0, None
    location = Location.parse(path)
    handle = None if location.local else location.open_read(block_size=2**20)
    try:
        with tarfile.open(location.path if handle is None else None, "r:*", fileobj=handle) as tar:
            for member in tar:
                if not member.isreg() or re.match(r"__[^/]*__($|/)", member.name):
                    continue
                prefix, _ = base_plus_ext(member.name)
                if prefix is not None and prefix != key:
                    samples, key = samples + 1, prefix
    except (tarfile.TarError, OSError, EOFError) as error:
        raise LaionkitError(f"cannot read shard {path}: {error}") from error
    finally:
        if handle is not None:
            handle.close()
    return samples
