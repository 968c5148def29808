"""dedup with SCORES_DIRs and ``--output`` in an object store (s3://, gs://, any fsspec URL).

dedup's engines (DuckDB's group-bys and connected components, faiss's k-means and searches, memory-mapped
embeddings) work on local files, so a remote SCORES_DIR is mirrored to local disk first and a remote ``--output``
is written from a local work folder:

* ``mirror``: a remote folder's ``scores/*.parquet`` (and ``img_emb/img_emb_<stem>.npy`` where a layer reads
  embeddings) are downloaded once into ``--scratch``/inputs/<digest of the URL>/, each under a temporary name and
  renamed, stamped with the object's modification time; a rerun reuses every file whose size and time match
  the object's (a kill -9 mid-download leaves only a temporary) and fetches a changed object again. dedup's
  plan (the scratch folder's name, recorded in stats.json) covers each mirrored file's size and time, so a
  changed input starts a new plan as a changed local file does.
* a remote ``--output``: the steps run in ``--scratch``/work/<digest of the URL>/ (where ranks meet, as in a
  local output folder: several nodes need a ``--scratch`` they all see); rank 0 then writes keep.parquet,
  removed.parquet and stats.json last to the bucket as to a folder (storage.atomic_write: each uploaded with
  its done record), so a run killed during the upload is rerun to the same objects and a reader never takes a
  partial output for a finished one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from laionkit.common import LaionkitError
from laionkit.common.storage import Location
from laionkit.common.storage.errors import one_line_errors
from laionkit.common.storage.writes import staging_dir


def is_remote(text: str) -> bool:
    return not Location.parse(text).local


def scratch_root(scratch: str | None) -> Path:
    """``--scratch``, else a laionkit-dedup folder in the staging folder ($LAIONKIT_STAGING or the temp folder)."""
    root = Path(scratch) if scratch else Path(staging_dir()) / "laionkit-dedup"
    if "://" in str(scratch or ""):
        raise LaionkitError(f"--scratch {scratch}: a local or shared folder (DuckDB and faiss work on local files)")
    root.mkdir(parents=True, exist_ok=True)
    return root


def digest(url: str) -> str:
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def _modified_ns(info: dict) -> int:
    """An object's modification time in ns from fsspec's info (s3: LastModified; others: mtime / created)."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
    if hasattr(stamp, "timestamp"):
        stamp = stamp.timestamp()
    return int(float(stamp) * 1e9)


def mirror(folder: str, root: Path, embeddings: bool) -> Path:
    """The local mirror of the remote SCORES_DIR ``folder`` (see the module docstring); a local folder as it is."""
    location = Location.parse(folder)
    if location.local:
        return Path(folder)
    local = root / "inputs" / digest(str(location))
    scores = location / "scores"
    files = [(entry, local / "scores" / entry.name) for entry in scores.list("*.parquet", complete_only=None)]
    if not files:
        raise LaionkitError(f"input {folder}: no scores/*.parquet in it (the layout `laionkit score` writes)")
    if embeddings:
        files += [(location / "img_emb" / f"img_emb_{Path(entry.name).stem}.npy",
                   local / "img_emb" / f"img_emb_{Path(entry.name).stem}.npy") for entry, _ in list(files)]
    fs = location.fs
    for remote, path in files:
        with one_line_errors("cannot read", remote):
            if not fs.exists(remote.path):
                continue  # a missing embeddings file: find_units names it, as for a local folder
            info = fs.info(remote.path)
        size, modified = int(info["size"]), _modified_ns(info)
        if path.is_file() and path.stat().st_size == size and path.stat().st_mtime_ns == modified:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # ranks of one node mirror alike
        with one_line_errors("cannot read", remote):
            fs.get_file(remote.path, str(partial))
        os.utime(partial, ns=(modified, modified))
        partial.replace(path)
    return local


def read_stats(output: Location) -> dict | None:
    """stats.json of a remote output, once its done record says it was written whole; else None."""
    stats = output / "stats.json"
    if not stats.done_record.exists():
        return None
    return stats.read_json()

