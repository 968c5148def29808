"""A bounded local cache of remote objects (train --cache-dir), shared by DataLoader workers and ranks."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

from laionkit.common.errors import LaionkitError
from laionkit.common.outputs import atomic_output
from laionkit.common.storage.errors import one_line, one_line_errors
from laionkit.common.storage.location import Location
from laionkit.common.storage.readers import DEFAULT_BLOCK


class ReadCache:
    """Remote objects copied to a local folder of at most ``max_bytes``, least recently used evicted.

    Several DataLoader workers and ranks may share one folder: fills are atomic (per-process temporary,
    then rename), an entry is keyed by URL and the object's size and ETag so a rewritten object is
    fetched again, and ``open`` returns an open file, which keeps reading even if another process evicts
    the entry meanwhile (POSIX unlink). An object larger than the whole cache is streamed, not cached.
    """

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int):
        if max_bytes <= 0:
            raise LaionkitError(f"--cache-size must be positive, got {max_bytes}")
        self.folder, self.max_bytes = Path(folder), int(max_bytes)
        # Checked here, at the start of a run: a folder that cannot be made or written (a path under a file,
        # a read-only mount) failed later inside a DataLoader worker, on its first fill, as a traceback.
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".probe-"):
                pass
        except OSError as error:
            raise LaionkitError(f"--cache-dir {folder}: cannot create or write a file in it "
                                f"({type(error).__name__}: {one_line(error)}); give a writable local folder") from None
        self.hits = self.misses = 0

    def _entry(self, location: Location) -> tuple[Path, int]:
        with one_line_errors("cannot read", location):
            info = location.fs.info(location.path)
        size = int(info.get("size") or 0)
        tag = str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or "")
        digest = hashlib.sha256(f"{location}\0{size}\0{tag}".encode()).hexdigest()[:24]
        return self.folder / f"{digest}-{location.name}", size

    def open(self, location: Location | str) -> BinaryIO:
        """An open local file with the object's bytes (local locations are opened directly)."""
        location = Location.parse(location)
        if location.local:
            return location.open_read()
        entry, size = self._entry(location)
        try:
            handle = open(entry, "rb")  # noqa: SIM115
        except FileNotFoundError:
            pass
        else:
            try:
                os.utime(entry)  # recency for LRU
            except FileNotFoundError:
                pass  # evicted by another process since: the open file still reads whole
            self.hits += 1
            return handle
        self.misses += 1
        if size > self.max_bytes:
            return location.open_read()
        self._evict(self.max_bytes - size)
        with atomic_output(entry, shared=True) as tmp, one_line_errors("cannot read", location):
            location.fs.get_file(location.path, str(tmp))
        handle = open(entry, "rb")  # noqa: SIM115
        self._evict(self.max_bytes)  # concurrent fills may have pushed the total over
        return handle

    def path(self, location: Location | str) -> Path:
        """The cached file's local path (for readers that want a name; may be evicted later)."""
        with self.open(location) as handle:
            return Path(handle.name)

    def _evict(self, budget: int) -> None:
        entries = []
        for path in self.folder.iterdir():
            if path.name.startswith("."):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= budget:
                break
            path.unlink(missing_ok=True)
            total -= size

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if not p.name.startswith("."))


def open_cached(location: Location | str, cache: ReadCache | None = None, prefetch: int = 0,
                block_size: int = DEFAULT_BLOCK) -> BinaryIO:
    """What train's latent reader calls per shard: through the cache when ``--cache-dir`` is set, else
    streamed with read-ahead."""
    location = Location.parse(location)
    if cache is not None:
        return cache.open(location)
    return location.open_read(block_size=block_size, prefetch=prefetch)
