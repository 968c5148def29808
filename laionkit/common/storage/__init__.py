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

The package's modules, each importing only the ones listed before it:

* ``errors``: storage failures as one-line LaionkitErrors naming the URL (``one_line_errors``);
* ``options``: ``--storage-options``, credentials and endpoints, one fsspec filesystem per process;
* ``readers``: file objects over fsspec files (errors guarded; ``PrefetchReader`` reads ahead);
* ``location``: ``Location``, a local path or an object, with listings and done records;
* ``writes``: ``atomic_write``, ``upload``, ``mark_done`` and the local ``staging_dir`` of remote outputs;
* ``claims``: which folders a stage may write to (``refuse_overlap``, ``claim_output``, ``refuse_nonempty``);
* ``cache``: ``ReadCache``, a bounded local cache of remote objects;
* ``npy`` and ``duckdb_fs``: ``.npy`` rows by range, DuckDB reading through fsspec.

Import the names below from this package; callers outside it use no underscored name of its modules.
A function patched in a test reaches only the callers that look it up where it was patched:
``storage.mark_done`` those outside the package, ``storage.writes.mark_done`` ``atomic_write``.
"""

from laionkit.common.storage.cache import ReadCache, open_cached
from laionkit.common.storage.claims import claim_output, refuse_nonempty, refuse_overlap
from laionkit.common.storage.duckdb_fs import register_with_duckdb
from laionkit.common.storage.errors import one_line_errors
from laionkit.common.storage.location import DONE_SUFFIX, READ_ONLY, Location
from laionkit.common.storage.npy import NpyLayout, npy_layout
from laionkit.common.storage.options import EXTRAS, default_options, parse_storage_options
from laionkit.common.storage.readers import DEFAULT_BLOCK, PrefetchReader
from laionkit.common.storage.writes import (
           atomic_write,
           mark_done,
           staging_dir,
           upload,
           write_bytes,
           write_json,
)

__all__ = ["DEFAULT_BLOCK", "DONE_SUFFIX", "EXTRAS", "READ_ONLY", "Location", "NpyLayout", "PrefetchReader", "ReadCache",
           "atomic_write", "claim_output", "default_options", "mark_done", "npy_layout", "one_line_errors",
           "open_cached", "parse_storage_options", "refuse_nonempty", "refuse_overlap", "register_with_duckdb",
           "staging_dir", "upload", "write_bytes", "write_json"]
