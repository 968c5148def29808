"""Where stage inputs and outputs live: a local folder or any fsspec URL (s3://, gs://, hf://, http(s)://).

Local paths take the plain ``pathlib`` / ``os`` route with no fsspec in between, so nothing changes for
them and their hot path costs nothing extra. Every other URL goes through one fsspec filesystem per
protocol and options.

Object stores have no rename, so "a file with its final name is complete" (laionkit.common.outputs) does
not carry over to a *set* of objects, and not to stores whose uploads are not all-or-nothing. On them
"complete" means "the done record exists": a small ``.NAME.done`` object written after the data objects
and removed before they are rewritten. A run killed anywhere therefore leaves data objects without a
record, which listings skip and a rerun overwrites; it never leaves a record whose data is half written.
Dot-names never match a stage's glob, like the ``.partial`` temporaries of local outputs.

Credentials and endpoints come from where each filesystem's users already keep them (``AWS_*``
variables, ``~/.aws``, fsspec's config files and ``FSSPEC_<PROTOCOL>_*`` variables), plus the JSON of
``--storage-options``; nothing is read from the command line's URLs themselves.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from laionkit.common.errors import LaionkitError
from laionkit.common.outputs import atomic_output, describe_holdings, folder_holds, refuse_other_stage
from laionkit.common.outputs import refuse_overlap as refuse_local_overlap

DONE_SUFFIX = ".done"
READ_ONLY = {"http", "https"}
# Protocols users name and the extra that installs each one, for the "cannot open" message.
EXTRAS = {"s3": "s3fs (pip install 'laionkit[s3]')", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub",
          "az": "adlfs", "abfs": "adlfs", "http": "aiohttp", "https": "aiohttp"}
DEFAULT_BLOCK = 8 * 2**20


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """The JSON of ``--storage-options``: one object, either flat (for every remote URL of the run) or
    keyed by protocol (``{"s3": {...}, "hf": {...}}``) when inputs and outputs live in different stores."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise LaionkitError(f"--storage-options is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise LaionkitError(f"--storage-options must be a JSON object, got {type(options).__name__}")
    return options


# What Location.parse uses when its caller passes no storage options: set for the length of a train run
# (``default_options``), whose latents, run folder and DataLoader workers (forked, so they inherit it)
# parse paths in many places.
_DEFAULT_OPTIONS: dict[str, Any] = {}


@contextmanager
def default_options(options: dict[str, Any]) -> Iterator[None]:
    """``--storage-options`` for every path parsed without options of its own, until the block ends."""
    global _DEFAULT_OPTIONS
    previous, _DEFAULT_OPTIONS = _DEFAULT_OPTIONS, dict(options)
    try:
        yield
    finally:
        _DEFAULT_OPTIONS = previous


def _options_for(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    from fsspec.registry import known_implementations

    known = set(known_implementations) | {"s3", "gs", "hf"}
    if options and all(key in known and isinstance(value, dict) for key, value in options.items()):
        return dict(options.get(protocol, {}))
    return dict(options)


def _s3_environment(options: dict[str, Any]) -> dict[str, Any]:
    """Credentials must exist unless ``anon`` is asked for: s3fs otherwise falls back to anonymous
    requests, and a private bucket then answers with a puzzling 403 or "not found". An
    ``AWS_ENDPOINT_URL(_S3)`` from the environment is passed on for s3fs/aiobotocore versions that
    ignore it (MinIO, Ceph and moto users set only that)."""
    if not options.get("anon") and not (options.get("key") or options.get("token") or options.get("profile")):
        import botocore.session

        if botocore.session.Session().get_credentials() is None:
            raise LaionkitError("s3:// needs credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                "AWS_PROFILE, or --storage-options '{\"anon\": true}' for a public bucket")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
        options = {**options, "endpoint_url": endpoint}
    return options


_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}
_FS_LOCK = threading.Lock()


def _filesystem(protocol: str, options: dict[str, Any]):
    if protocol == "s3":
        options = _s3_environment(options)
    # Per process: a forked DataLoader worker must not reuse its parent's instance, whose event loop
    # thread does not exist in the child (every request would wait forever).
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=str))
    with _FS_LOCK:
        if key not in _FILESYSTEMS:
            import fsspec

            try:
                _FILESYSTEMS[key] = fsspec.filesystem(protocol, **options)
            except ImportError as error:
                need = EXTRAS.get(protocol, f"the fsspec implementation of {protocol}://")
                raise LaionkitError(f"{protocol}:// URLs need {need}: {error}") from None
            except ValueError as error:
                raise LaionkitError(f"unknown storage protocol {protocol}:// ({error})") from None
            except TypeError as error:
                raise LaionkitError(f"--storage-options do not fit {protocol}://: {error}") from None
    return _FILESYSTEMS[key]


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:400]


@contextmanager
def _errors(what: str, location: Location) -> Iterator[None]:
    """Storage failures as one-line LaionkitErrors naming the URL (missing bucket, credentials, object)."""
    try:
        yield
    except LaionkitError:
        raise
    except FileNotFoundError as error:
        raise LaionkitError(f"{what} {location}: not found ({_one_line(error)})") from None
    except PermissionError as error:
        raise LaionkitError(f"{what} {location}: permission denied; check credentials "
                            f"(AWS_* variables, ~/.aws, --storage-options) ({_one_line(error)})") from None
    except Exception as error:  # botocore/aiohttp/gcsfs each have their own exception trees
        name = type(error).__name__
        if "Credential" in name or "credential" in str(error).lower():
            raise LaionkitError(f"{what} {location}: no usable credentials; set AWS_ACCESS_KEY_ID / "
                                f"AWS_SECRET_ACCESS_KEY, a profile, or --storage-options ({name})") from None
        if isinstance(error, OSError | ValueError) or "botocore" in type(error).__module__ \
                or "aiohttp" in type(error).__module__:
            raise LaionkitError(f"{what} {location}: {name}: {_one_line(error)}") from None
        raise


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
        options = _options_for(protocol, _DEFAULT_OPTIONS if storage_options is None else storage_options)
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
        return _filesystem(self.protocol, self.options)

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

    def _writable(self) -> None:
        if self.protocol in READ_ONLY:
            raise LaionkitError(f"{self}: {self.protocol}:// URLs are read-only; write to a folder or s3://…")

    # ---- queries --------------------------------------------------------------------------------
    def exists(self) -> bool:
        if self.local:
            return os.path.exists(self.path)
        with _errors("cannot check", self):
            return self.fs.exists(self.path)

    def is_dir(self) -> bool:
        if self.local:
            return os.path.isdir(self.path)
        with _errors("cannot check", self):
            return self.fs.isdir(self.path)

    def size(self) -> int:
        if self.local:
            with _errors("cannot read", self):
                return os.path.getsize(self.path)
        with _errors("cannot read", self):
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
                raise LaionkitError(f"cannot list {self}: {_one_line(error)}") from None
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
        with _errors("cannot list", self):
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
        with _errors("cannot list", self):
            found = self.fs.glob(f"{self.path.rstrip('/')}/{pattern}")
        return [Location(self.protocol, str(p), self.options) for p in sorted(found)]

    # ---- reading --------------------------------------------------------------------------------
    def open_read(self, block_size: int = DEFAULT_BLOCK, prefetch: int = 0) -> BinaryIO:
        """A binary file object to read from. ``prefetch=N`` reads up to N blocks ahead on a thread, for
        one sequential pass (a tar streamed into a DataLoader): the network then overlaps the decoding.
        Without it the file is seekable (``tarfile.open(fileobj=..., mode="r:")``)."""
        if self.local:
            with _errors("cannot read", self):
                return open(self.path, "rb")  # noqa: SIM115 -- the caller owns it
        with _errors("cannot read", self):
            raw = self.fs.open(self.path, "rb", block_size=block_size, cache_type="readahead")
        return PrefetchReader(raw, block_size, prefetch, str(self)) if prefetch > 0 else _Guarded(raw, self)

    def read_bytes(self) -> bytes:
        if self.local:
            with _errors("cannot read", self):
                return Path(self.path).read_bytes()
        with _errors("cannot read", self):
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
        self._writable()
        with _errors("cannot remove", self):
            if self.fs.exists(self.done_record.path):
                self.fs.rm(self.done_record.path)
            if self.fs.exists(self.path):
                self.fs.rm(self.path, recursive=True)


class _Guarded(io.RawIOBase):
    """An fsspec file whose storage errors surface as one-line LaionkitErrors naming the URL."""

    def __init__(self, raw, location: Location):
        self.raw, self.location = raw, location

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int = -1) -> bytes:
        with _errors("cannot read", self.location):
            return self.raw.read(size)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.raw.close()
        super().close()


class PrefetchReader(io.RawIOBase):
    """Sequential reads of a remote file with ``depth`` blocks fetched ahead on a background thread."""

    def __init__(self, raw, block_size: int, depth: int, name: str):
        self.name, self._raw, self._buffer, self._offset = name, raw, b"", 0
        self._blocks: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(block_size,), daemon=True)
        self._thread.start()

    def _fill(self, block_size: int) -> None:
        try:
            while not self._stop.is_set():
                block = self._raw.read(block_size)
                self._put(block)
                if not block:
                    return
        except BaseException as error:  # handed to the reader, raised there
            self._put(error)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._blocks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        # Slices of the current block by offset: re-slicing the remainder on every small read would
        # copy a whole block per read.
        parts, wanted = [], size
        while wanted != 0:
            if self._offset >= len(self._buffer):
                block = self._blocks.get()
                if isinstance(block, BaseException):
                    raise LaionkitError(f"cannot read {self.name}: {_one_line(block)}")
                if not block:
                    self._blocks.put(block)  # end of file stays visible to the next read
                    break
                self._buffer, self._offset = block, 0
            end = len(self._buffer) if wanted < 0 else min(len(self._buffer), self._offset + wanted)
            parts.append(self._buffer[self._offset:end])
            if wanted > 0:
                wanted -= end - self._offset
            self._offset = end
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._raw.close()
        super().close()


# ---- writing ---------------------------------------------------------------------------------------
def _staging(staging: str | os.PathLike[str] | None) -> str:
    folder = staging or os.environ.get("LAIONKIT_STAGING") or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    return os.fspath(folder)


@contextmanager
def atomic_write(location: Location | str, folder: bool = False, shared: bool = False,
                 staging: str | os.PathLike[str] | None = None, record: dict | None = None) -> Iterator[Path]:
    """Yield a local temporary path to write one file (or, with ``folder=True``, a folder) into.

    Local: exactly ``laionkit.common.atomic_output`` (temp + rename). Remote: the done record is
    removed first, the temporary is uploaded object by object when the block ends, and the done record
    is written last (with the sizes uploaded and any ``record`` fields), so a kill at any point leaves
    at most data objects without a record, which ``list`` skips and the next run overwrites. The
    temporary lives in ``staging`` (``$LAIONKIT_STAGING`` or the system temp folder).
    """
    location = Location.parse(location)
    if location.local:
        with atomic_output(location.path, shared=shared) as tmp:
            yield tmp
        return
    location._writable()
    fs = location.fs
    with _errors("cannot write", location):
        fs.rm_file(location.done_record.path) if fs.exists(location.done_record.path) else None
    with tempfile.TemporaryDirectory(prefix=".laionkit-", dir=_staging(staging)) as scratch:
        tmp = Path(scratch, location.name)
        if folder:
            tmp.mkdir()
        yield tmp
        if folder:
            with _errors("cannot write", location):
                if fs.exists(location.path):  # a rerun replaces the folder whole: no stale objects stay
                    fs.rm(location.path, recursive=True)
        mark_done(location, {"sizes": upload(tmp, location), **(record or {})})


def upload(local: Path, location: Location) -> dict[str, int]:
    """A local file as the object ``location``, or a folder's files as objects under it (no done record:
    callers write it after); returns the sizes uploaded by name (a folder's by relative path)."""
    fs = location.fs
    sizes = {}
    with _errors("cannot write", location):
        if local.is_dir():
            for file in sorted(p for p in local.rglob("*") if p.is_file()):
                rel = file.relative_to(local).as_posix()
                fs.put_file(str(file), location.join(rel).path)
                sizes[rel] = file.stat().st_size
        else:
            fs.put_file(str(local), location.path)
            sizes[location.name] = local.stat().st_size
    return sizes


def mark_done(location: Location, record: dict | None = None) -> None:
    """Write the done record of ``location``: call it only after every data object is written."""
    body = json.dumps({"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(record or {})},
                      sort_keys=True, default=str).encode()
    with _errors("cannot write", location):
        location.fs.pipe_file(location.done_record.path, body)


def write_bytes(location: Location | str, data: bytes, shared: bool = False) -> None:
    with atomic_write(location, shared=shared) as tmp:
        tmp.write_bytes(data)


def write_json(location: Location | str, obj: Any, shared: bool = False) -> None:
    """``laionkit.common.write_json`` for any location."""
    write_bytes(location, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode(), shared)


def refuse_overlap(inputs, output: Location | str, stage: str) -> None:
    """``laionkit.common.refuse_overlap`` for URLs too: an output that is, contains or lies inside an
    input (same store, same bucket, key prefix on ``/`` boundaries) is refused. Stores differ → no overlap."""
    output = Location.parse(output)
    inputs = [Location.parse(given) for given in inputs]
    if output.local:
        refuse_local_overlap([i.path for i in inputs if i.local], output.path, stage)
        return
    out = output.path.rstrip("/") + "/"
    for given in inputs:
        if given.protocol != output.protocol:
            continue
        source = given.path.rstrip("/") + "/"
        if out.startswith(source) or source.startswith(out):
            relation = "is" if out == source else ("lies inside" if out.startswith(source) else "contains")
            raise LaionkitError(f"{stage}: --output {output} {relation} the input {given}; "
                                "outputs never overwrite inputs, choose another folder")


def claim_output(output: Location | str, stage: str, overwrite: bool = False) -> None:
    """Refuse an ``output`` folder that holds another stage's outputs (``outputs.refuse_other_stage``),
    unless ``overwrite``. A rerun of the same stage into its own folder (resume) passes."""
    output = Location.parse(output)
    if overwrite or not output.is_dir():
        return
    names = [entry.name for entry in output.list(complete_only=False)]
    refuse_other_stage(names, str(output), stage)


def refuse_nonempty(output: Location | str, stage: str) -> None:
    """For outputs replaced whole (a model folder): refuse any folder that holds anything."""
    output = Location.parse(output)
    if not output.is_dir():
        return
    names = sorted(os.listdir(output.path)) if output.local else [e.name for e in output.list(complete_only=False)]
    if names:
        held = describe_holdings(folder_holds(names)) or ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        raise LaionkitError(f"{stage}: --output {output} is not empty (it holds {held}); "
                            "choose a new folder, or --overwrite to replace it")


# ---- a bounded local cache for streamed reads -----------------------------------------------------------
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
                                f"({type(error).__name__}: {_one_line(error)}); give a writable local folder") from None
        self.hits = self.misses = 0

    def _entry(self, location: Location) -> tuple[Path, int]:
        with _errors("cannot read", location):
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
        with atomic_output(entry, shared=True) as tmp, _errors("cannot read", location):
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


# ---- .npy arrays read by row range (filter --embeddings) -------------------------------------------------
@dataclass(frozen=True)
class NpyLayout:
    """Where a C-order ``.npy`` array's rows lie in its file: read a row range with one ranged GET."""

    location: Location
    shape: tuple[int, ...]
    dtype: Any
    offset: int  # bytes before the first row (magic + header)

    def rows(self, start: int, stop: int):
        """Rows [start, stop) as an array: memory-mapped on local disk, one ranged read elsewhere."""
        import numpy as np

        if self.location.local:
            return np.load(self.location.path, mmap_mode="r")[start:stop]
        row_bytes = self.dtype.itemsize * (int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1)
        with _errors("cannot read", self.location):
            data = self.location.fs.cat_file(self.location.path, start=self.offset + start * row_bytes,
                                             end=self.offset + stop * row_bytes)
        if len(data) != (stop - start) * row_bytes:
            raise LaionkitError(f"{self.location}: truncated .npy file (rows {start}-{stop - 1} not all there)")
        return np.frombuffer(data, self.dtype).reshape(stop - start, *self.shape[1:])


def npy_layout(location: Location | str) -> NpyLayout:
    """Shape, dtype and data offset of a ``.npy`` file from its header (the first few hundred bytes)."""
    import numpy as np

    location = Location.parse(location)
    try:
        with location.open_read(block_size=2**16) as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
            else:  # 3.0: a UTF-8 header, no public reader
                shape, fortran, dtype = np.lib.format._read_array_header(handle, version)
            offset = handle.tell()
    except (ValueError, OSError, EOFError) as error:
        raise LaionkitError(f"{location}: not a readable .npy file ({_one_line(error)})") from None
    if fortran or dtype.hasobject:
        raise LaionkitError(f"{location}: a Fortran-order or object .npy array cannot be read by rows")
    return NpyLayout(location, tuple(shape), dtype, offset)


def register_with_duckdb(connection, location: Location) -> str:
    """Let DuckDB read ``location`` through fsspec (no httpfs download on offline clusters); returns
    the string to put in ``read_parquet(...)``."""
    if location.local:
        return location.path
    connection.register_filesystem(location.fs)
    return str(location)
