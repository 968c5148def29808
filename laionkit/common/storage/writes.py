"""Writing a location: through a local temporary, then a rename (local) or an upload and its done
record last (object stores)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from laionkit.common.outputs import atomic_output
from laionkit.common.storage.errors import one_line_errors
from laionkit.common.storage.location import Location


def staging_dir(staging: str | os.PathLike[str] | None = None) -> str:
    """The local folder temporaries of remote outputs are written in: ``staging``, else
    ``$LAIONKIT_STAGING``, else the system temp folder (created if missing)."""
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
    location.check_writable()
    fs = location.fs
    with one_line_errors("cannot write", location):
        fs.rm_file(location.done_record.path) if fs.exists(location.done_record.path) else None
    with tempfile.TemporaryDirectory(prefix=".laionkit-", dir=staging_dir(staging)) as scratch:
        tmp = Path(scratch, location.name)
        if folder:
            tmp.mkdir()
        yield tmp
        if folder:
            with one_line_errors("cannot write", location):
                if fs.exists(location.path):  # a rerun replaces the folder whole: no stale objects stay
                    fs.rm(location.path, recursive=True)
        mark_done(location, {"sizes": upload(tmp, location), **(record or {})})


def upload(local: Path, location: Location) -> dict[str, int]:
    """A local file as the object ``location``, or a folder's files as objects under it (no done record:
    callers write it after); returns the sizes uploaded by name (a folder's by relative path)."""
    fs = location.fs
    sizes = {}
    with one_line_errors("cannot write", location):
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
    with one_line_errors("cannot write", location):
        location.fs.pipe_file(location.done_record.path, body)


def write_bytes(location: Location | str, data: bytes, shared: bool = False) -> None:
    with atomic_write(location, shared=shared) as tmp:
        tmp.write_bytes(data)


def write_json(location: Location | str, obj: Any, shared: bool = False) -> None:
    """``laionkit.common.write_json`` for any location."""
    write_bytes(location, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode(), shared)
