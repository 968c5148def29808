"""``Location``: a local path or an object in an fsspec filesystem, and what stages ask of one (list,
read, remove, done records)."""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from laionkit.common.errors import LaionkitError
from laionkit.common.storage.errors import one_line, one_line_errors
from laionkit.common.storage.options import filesystem, options_for
from laionkit.common.storage.readers import DEFAULT_BLOCK, GuardedReader, PrefetchReader

DONE_SUFFIX = ".done"
READ_ONLY = {"http", "https"}
_SPECIAL = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
            (stat.S_ISBLK, "block device"))


@dataclass(frozen=True)
class Location:
    """A file or folder: a local path (``path`` as given, unresolved) or an object in an fsspec filesystem.

    ``path`` is what the filesystem calls it (``bucket/key`` for s3). Build one with ``Location.parse``;
    ``str()`` gives back a URL that parses to the same place.
    """

    protocol: str  # "" for local
    path: str
    options: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def parse(cls, text: str | os.PathLike[str] | Location, storage_options: dict[str, Any] | None = None
              ) -> Location:
        if isinstance(text, Location):
            return text
        if isinstance(text, os.PathLike):
            return cls("", os.fspath(text))
        text = str(text)
        if not text:
            raise LaionkitError("empty path")
        if "://" not in text:
            return cls("", text)
        protocol, rest = text.split("://", 1)
        protocol = protocol.lower()
        if protocol == "file":
            return cls("", rest or "/")
        if not protocol.isascii() or not protocol.replace("+", "").replace("-", "").isalnum():
            raise LaionkitError(f"not a URL or path: {text!r}")
        if protocol in ("s3", "s3a", "gs", "gcs") and not rest.split("/", 1)[0]:
            raise LaionkitError(f"{text}: no bucket name after {protocol}://")
        options = options_for(protocol, storage_options)
        if protocol == "s3a":
            protocol = "s3"
        # http(s) keeps its scheme in the path: that is what fsspec's HTTPFileSystem expects.
        path = text if protocol in READ_ONLY else rest.rstrip("/")
        return cls(protocol, path, options)

    # ---- naming -------------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        return not self.protocol

    @property
    def fs(self):
        if self.local:
            raise AssertionError("local locations use pathlib, not fsspec")
        return filesystem(self.protocol, self.options)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1] if not self.local else Path(self.path).name

    @property
    def parent(self) -> Location:
        if self.local:
            return Location("", str(Path(self.path).parent))
        return Location(self.protocol, self.path.rstrip("/").rsplit("/", 1)[0], self.options)

    def join(self, *parts: str) -> Location:
        if self.local:
            return Location("", str(Path(self.path, *parts)))
        return Location(self.protocol, "/".join([self.path.rstrip("/"), *(p.strip("/") for p in parts)]),
                        self.options)

    def __truediv__(self, part: str) -> Location:
        return self.join(part)

    def __str__(self) -> str:
        if self.local or self.protocol in READ_ONLY:
            return self.path
        return f"{self.protocol}://{self.path}"

    def __fspath__(self) -> str:
        """Local locations are path-like, so ``open(loc)`` and ``Path(loc)`` keep working for them."""
        if not self.local:
            raise TypeError(f"{self} is not a local path; use laionkit.common.storage to read or write it")
        return self.path

    def check_writable(self) -> None:
        """Refuse a read-only store (http(s)://) before anything is written to it."""
        if self.protocol in READ_ONLY:
            raise LaionkitError(f"{self}: {self.protocol}:// URLs are read-only; write to a folder or s3://…")

    def refuse_special(self) -> None:
        """Refuse a local path that is neither a regular file nor a folder (a FIFO, socket or device named like
        a shard or a parquet): opening a FIFO to read waits for a writer, so a stage would hang on it. An
        object in a bucket is always a file; a missing path is left to whoever reads it."""
        if not self.local:
            return
        try:
            mode = os.stat(self.path).st_mode
        except OSError:
            return
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = next((name for test, name in _SPECIAL if test(mode)), "special file")
            raise LaionkitError(f"{self}: a {kind}, not a regular file; refused (reading it could wait for ever)")

    # ---- queries --------------------------------------------------------------------------------
    def exists(self) -> bool:
        if self.local:
            return os.path.exists(self.path)
        with one_line_errors("cannot check", self):
            return self.fs.exists(self.path)

    def is_dir(self) -> bool:
        if self.local:
            return os.path.isdir(self.path)
        with one_line_errors("cannot check", self):
            return self.fs.isdir(self.path)

    def size(self) -> int:
        if self.local:
            with one_line_errors("cannot read", self):
                return os.path.getsize(self.path)
        with one_line_errors("cannot read", self):
            return int(self.fs.size(self.path))

    def list(self, pattern: str = "*", complete_only: bool | None = True) -> list[Location]:
        """Entries of this folder whose name matches ``pattern`` (fnmatch on the name only, sorted).

        The folder's own name is literal: a ``[`` or ``*`` in a user's path is never expanded (use
        ``glob`` for that). Dot-names (temporaries, done records) are left out, and in an object store
        so is every object whose done record is missing (``complete_only``): a killed writer's leftovers.
        ``complete_only=None``: only if the folder holds any done record (a laionkit output), else every
        object (a folder other tools uploaded, which has none).
        """
        if self.local:
            try:
                names = sorted(os.listdir(self.path))
            except FileNotFoundError:
                return []
            except OSError as error:
                raise LaionkitError(f"cannot list {self}: {one_line(error)}") from None
            return [self.join(n) for n in names if not n.startswith(".") and fnmatch.fnmatchcase(n, pattern)]
        names, done = self._listing()
        if complete_only is None:
            complete_only = bool(done)
        return [self.join(n) for n in names if not n.startswith(".") and fnmatch.fnmatchcase(n, pattern)
                and (not complete_only or n in done)]

    def uploaded_by_other_tools(self) -> bool:
        """An object-store folder with objects but no done record: uploaded by other tools (aws s3 sync), so
        every object counts (docs/FORMATS.md §5). A local folder never is: there a name means complete."""
        if self.local:
            return False
        names, done = self._listing()
        return bool(names) and not done

    def _listing(self) -> tuple[list[str], set[str]]:
        """An object-store folder's names (sorted) and the names its done records mark complete."""
        with one_line_errors("cannot list", self):
            try:
                entries = self.fs.ls(self.path, detail=False, refresh=True)
            except FileNotFoundError:
                if self.protocol in ("s3", "gs", "gcs") and not self.fs.exists(self.path.split("/", 1)[0]):
                    raise LaionkitError(f"cannot list {self}: bucket {self.path.split('/', 1)[0]} "
                                        "does not exist (or is not visible with these credentials)") from None
                return [], set()
        names = sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})
        return names, {n[1:-len(DONE_SUFFIX)] for n in names if n.startswith(".") and n.endswith(DONE_SUFFIX)}

    def glob(self, pattern: str) -> list[Location]:
        """Explicit glob expansion of ``pattern`` below this location, for the options that ask for it."""
        if self.local:
            return [Location("", str(p)) for p in sorted(Path(self.path).glob(pattern))]
        with one_line_errors("cannot list", self):
            found = self.fs.glob(f"{self.path.rstrip('/')}/{pattern}")
        return [Location(self.protocol, str(p), self.options) for p in sorted(found)]

    # ---- reading --------------------------------------------------------------------------------
    def open_read(self, block_size: int = DEFAULT_BLOCK, prefetch: int = 0) -> BinaryIO:
        """A binary file object to read from. ``prefetch=N`` reads up to N blocks ahead on a thread, for
        one sequential pass (a tar streamed into a DataLoader): the network then overlaps the decoding.
        Without it the file is seekable (``tarfile.open(fileobj=..., mode="r:")``)."""
        if self.local:
            with one_line_errors("cannot read", self):
                return open(self.path, "rb")  # noqa: SIM115 -- the caller owns it
        with one_line_errors("cannot read", self):
            raw = self.fs.open(self.path, "rb", block_size=block_size, cache_type="readahead")
        return PrefetchReader(raw, block_size, prefetch, str(self)) if prefetch > 0 else GuardedReader(raw, self)

    def read_bytes(self) -> bytes:
        if self.local:
            with one_line_errors("cannot read", self):
                return Path(self.path).read_bytes()
        with one_line_errors("cannot read", self):
            return self.fs.cat_file(self.path)

    def read_json(self) -> Any:
        try:
            return json.loads(self.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise LaionkitError(f"{self} is not valid JSON: {error}") from None

    # ---- done records ---------------------------------------------------------------------------
    @property
    def done_record(self) -> Location:
        """Where the record that marks this object (or folder of objects) complete lives."""
        return self.parent.join(f".{self.name}{DONE_SUFFIX}")

    def is_complete(self) -> bool:
        """"Exists means complete": on local disk the name itself (written by rename), elsewhere the done
        record, which is written only after every data object is in place."""
        if self.local:
            return self.exists()
        return self.done_record.exists()

    def remove(self) -> None:
        """Remove the object or folder, its done record first (so it is never complete-but-partial)."""
        if self.local:
            path = Path(self.path)
            if path.is_dir() and not path.is_symlink():
                import shutil

                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
            return
        self.check_writable()
        with one_line_errors("cannot remove", self):
            if self.fs.exists(self.done_record.path):
                self.fs.rm(self.done_record.path)
            if self.fs.exists(self.path):
                self.fs.rm(self.path, recursive=True)
