"""`laionkit pack`: download the kept URLs with img2dataset into WebDataset tar shards, rank-sharded.

img2dataset does the work (its Downloader, Resizer and WebDatasetSampleWriter); laionkit decides
which rows form which global shard, which rank owns it, and when a shard counts as done:

- Input rows (files sorted by path, rows in order) are cut into global shards of ``shard_size``
  rows that never span two files; shard *i* belongs to rank *i mod W* (``laionkit.common.split``),
  so shard names are globally unique and the ranks together cover the input exactly once.
- img2dataset writes its tar in place, so each shard is downloaded into a hidden staging folder
  ``DIR/.<shard>.partial/`` (for an object-store ``DIR``: a local one, ``$LAIONKIT_STAGING`` or the
  system temp folder); the tar and status parquet are then renamed (uploaded, each with its done
  record) into ``DIR`` and the shard record ``<shard>_stats.json`` is written last, atomically. A shard
  is done iff its record is complete; a rerun after kill -9 redoes only shards without one and never
  sees a half-written tar.
- ``manifest.json`` is a merge of the records on disk, rewritten by each rank when it finishes and
  rebuilt by ``laionkit stats DIR``.
- URLs come from untrusted metadata, so img2dataset's fetch is replaced by ``Fetcher``: http(s) only,
  public addresses only (checked on every redirect hop) unless ``--allow-private-hosts``, one deadline
  per download and a cap on the body; refusals are recorded per sample like any failed download.
"""

from __future__ import annotations

import base64
import copy
import datetime
import decimal
import hashlib
import http.client
import io
import ipaddress
import json
import math
import multiprocessing
import os
import re
import shutil
import socket
import sys
import tarfile
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console, Group
from rich.table import Table
from tqdm import tqdm

from laionkit.common import (
    LaionkitError,
    available_cpus,
    read_json,
    refuse_other_settings,
    resolve_rank,
    split,
    storage,
    versions,
)
from laionkit.common.columns import find_column
from laionkit.common.outputs import partial_path
from laionkit.common.storage import Location

if TYPE_CHECKING:
    from img2dataset.downloader import Downloader

# albumentations (imported by img2dataset) checks PyPI for updates at import time; never do that here.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

RESIZE_MODES = ("center_crop", "keep_ratio", "border", "no")
ENCODE_FORMATS = ("jpg", "webp")
# PIL's decompression-bomb threshold (about 9459 x 9459): more pixels than any training image needs.
DEFAULT_MAX_IMAGE_AREA = 89_478_485
# img2dataset's default: honour X-Robots-Tag opt-outs of AI use and indexing.
OPTOUT_DIRECTIVES = ("noai", "noimageai", "noindex", "noimageindex")
# Columns img2dataset writes itself; an input column with one of these names is carried as source_<name>.
RESERVED_COLUMNS = frozenset({
    "key", "caption", "url", "width", "height", "original_width", "original_height", "status",
    "error_message", "exif", "md5", "sha256", "sha512",
})
MIN_SHARD_NAME_WIDTH = 5
# Options that shape the shards: a resumed run must use the same ones as the shards already done.
OUTPUT_SHAPING_OPTIONS = (
    "image_size", "resize_mode", "min_image_size", "max_aspect_ratio", "max_image_area", "encode_format",
    "encode_quality", "shard_size", "respect_optout",
)
# A body larger than this is refused while it downloads (the rest is never read).
DEFAULT_MAX_BYTES = 64 * 2**20
# Only these are fetched; file://, data:, ftp:// and the like are refused.
ALLOWED_SCHEMES = ("http", "https")
# A URL that went through pathlib (s3://bucket/x became s3:/bucket/x) would name a local "s3:" folder.
URL_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")
# Shorter side of the original image, for the size histogram: bucket edges in pixels.
SIZE_BUCKETS = (128, 256, 512, 1024, 2048)


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
        skipped = {"inputs", "output", "rank", "world_size", "quiet", "storage_options", "overwrite"}
        return {key: value for key, value in asdict(self).items() if key not in skipped}


@dataclass(frozen=True)
class ShardTask:
    """One global shard: rows [start, stop) of one input file, and how its columns map to img2dataset's."""

    shard_id: int
    name: str
    input: str
    start: int
    stop: int
    url_column: str
    caption_column: str
    extra_columns: tuple[tuple[str, str], ...]  # (input name, name in the sample json)


def input_files(inputs: Sequence[Path | Location]) -> list[Location]:
    """Parquet files named or inside the named folders, sorted by path: the global row order.

    In an object-store folder written by laionkit (it holds done records) only complete objects count,
    so a killed filter's leftovers are never packed; a folder uploaded by other tools has no records."""
    files = []
    for given in inputs:
        path = Location.parse(given)
        if path.is_dir():
            # Hidden and underscore names are sidecars or temporaries (an older filter folder's _filter-plan.json,
            # .x.partial); filter's _laionkit/ sidecar folder is not listed (files of this folder only).
            found = [p for p in path.list("*.parquet", complete_only=None) if not p.name.startswith("_")]
            if not found:
                raise LaionkitError(f"{path}: folder holds no .parquet files")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise LaionkitError(f"{path}: no such file or folder")
    return sorted({Location("", str(Path(p.path).resolve())) if p.local else p for p in files}, key=str)


def carried_columns(columns: Sequence[str], url: str, caption: str) -> tuple[tuple[str, str], ...]:
    """Every input column but url/caption and pandas' index, renamed where img2dataset owns the name."""
    carried = []
    for column in columns:
        if column in (url, caption) or re.fullmatch(r"__index_level_\d+__", column):
            continue
        carried.append((column, f"source_{column}" if column in RESERVED_COLUMNS else column))
    return tuple(carried)


def plan_shards(files: Sequence[Location | Path], config: PackConfig) -> list[ShardTask]:
    """The global shard list; deterministic given the sorted files, their row counts and shard_size."""
    per_file = []
    for path in map(Location.parse, files):
        try:
            with path.open_read(block_size=2**20) as handle:
                metadata = pq.ParquetFile(handle)
        except (OSError, pa.ArrowInvalid) as error:
            raise LaionkitError(f"{path}: not a readable parquet file ({error})") from None
        names = metadata.schema_arrow.names
        url = find_column(names, "url", config.url_column, source=str(path))
        caption = find_column(names, "caption", config.caption_column, source=str(path))
        extra = carried_columns(names, url, caption)
        per_file.append((path, metadata.metadata.num_rows, url, caption, extra))
    total = sum(math.ceil(rows / config.shard_size) for _, rows, *_ in per_file)
    width = max(MIN_SHARD_NAME_WIDTH, len(str(max(total - 1, 0))))
    tasks = []
    for path, rows, url, caption, extra in per_file:
        for start in range(0, rows, config.shard_size):
            shard_id = len(tasks)
            tasks.append(ShardTask(
                shard_id, f"{shard_id:0{width}d}", str(path), start, min(start + config.shard_size, rows),
                url, caption, extra,
            ))
    return tasks


def task_input(task: ShardTask) -> dict[str, Any]:
    """Where a shard's rows come from, as recorded (and checked again on resume)."""
    return {
        "file": task.input, "rows": [task.start, task.stop], "url_column": task.url_column,
        "caption_column": task.caption_column,
    }


def read_rows(task: ShardTask, storage_options: dict | None = None) -> pa.Table:
    """The shard's rows, reading only the row groups that hold them, renamed for img2dataset."""
    parquet = pq.ParquetFile(Location.parse(task.input, storage_options).open_read())
    groups, first_row, offset = [], None, 0
    for index in range(parquet.metadata.num_row_groups):
        group_rows = parquet.metadata.row_group(index).num_rows
        if offset < task.stop and offset + group_rows > task.start:
            groups.append(index)
            first_row = offset if first_row is None else first_row
        offset += group_rows
    columns = [name for name, _ in task.extra_columns] + [task.caption_column, task.url_column]
    table = parquet.read_row_groups(groups, columns=columns)
    table = table.slice(task.start - first_row, task.stop - task.start)
    table = table.rename_columns([renamed for _, renamed in task.extra_columns] + ["caption", "url"])
    return json_safe_table(table)


def json_safe_table(table: pa.Table) -> tuple[pa.Table, dict[str, dict[str, Any]]]:
    """Make every column something img2dataset can put in a sample's json, and say what was changed.

    img2dataset serialises each sample's json only after counting it a success, and drops the sample
    if that fails: a timestamp column used to empty whole tars while their records claimed success.
    Text with invalid UTF-8 (which parquet writers do not always check) used to fail the whole shard on
    every rerun; it is decoded with U+FFFD replacement and the values are counted. Returns the table
    and ``{"invalid_utf8": {column: values repaired}, "converted_columns": {column: original type}}``.
    """
    repaired, converted = {}, {}
    for index, name in enumerate(table.column_names):
        column = table.column(index)
        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            try:
                column.validate(full=True)
                continue
            except pa.ArrowInvalid:
                values, bad = _decode_utf8(column.cast(pa.large_binary()).to_pylist())
                repaired[name] = bad
                column = pa.array(values, kind)
        elif name in ("caption", "url") and _is_binary(kind):
            values, bad = _decode_utf8(column.to_pylist())
            repaired.update({name: bad} if bad else {})
            converted[name] = str(kind)
            column = pa.array(values, pa.string())
        elif _json_unsafe(kind):
            converted[name] = str(kind)
            column = pa.array([_json_safe(value) for value in column.to_pylist()])
        else:
            continue
        table = table.set_column(index, name, column)
    return table, {"invalid_utf8": repaired, "converted_columns": converted}


def _decode_utf8(values: list[bytes | None]) -> tuple[list[str | None], int]:
    decoded, bad = [], 0
    for value in values:
        if value is None:
            decoded.append(None)
            continue
        try:
            decoded.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            decoded.append(value.decode("utf-8", errors="replace"))
            bad += 1
    return decoded, bad


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def _json_unsafe(kind: pa.DataType) -> bool:
    """Types whose Python values json.dumps refuses (times, decimals, bytes), also inside lists/structs."""
    if pa.types.is_temporal(kind) or pa.types.is_decimal(kind) or _is_binary(kind):
        return True
    if pa.types.is_dictionary(kind):
        return _json_unsafe(kind.value_type)
    if pa.types.is_map(kind):
        return _json_unsafe(kind.key_type) or _json_unsafe(kind.item_type)
    if pa.types.is_struct(kind):
        return any(_json_unsafe(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _json_unsafe(kind.value_type)
    return False


def _json_safe(value: Any) -> Any:
    """ISO 8601 for times, a string for decimals (no float rounding), base64 for bytes, seconds for durations."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if value is not None and not isinstance(value, (str, int, float, bool)):
        return str(value)  # e.g. an interval: readable rather than a lost sample
    return value


# Failure reasons, checked in order against img2dataset's error_message: (pattern, reason).
FAILURE_REASONS: tuple[tuple[str, str], ...] = (
    (r"URL refused: scheme", "refused scheme"),
    (r"URL refused: .* address", "refused address"),
    (r"--max-bytes", "body too large"),
    (r"HTTP Error (\d{3})", "http {0}"),
    (r"timed out", "timeout"),
    (r"X-Robots-Tag", "opt-out header"),
    (r"CV_IO_MAX_IMAGE_PIXELS|image area too large", "image too large"),
    (r"image too small", "image too small"),
    (r"aspect ratio too large", "aspect ratio too large"),
    (r"!buf\.empty\(\)", "empty body"),
    (r"Image decoding error|imdecode", "decode error"),
    (r"IncompleteRead", "truncated transfer"),
    (r"hash mismatch", "hash mismatch"),
    (r"urlopen error|Connection|RemoteDisconnected|Errno|SSL", "connection error"),
)


def failure_reason(error_message: str) -> str:
    """Map one of img2dataset's raw error messages to a stable reason category."""
    for pattern, reason in FAILURE_REASONS:
        match = re.search(pattern, error_message)
        if match:
            return reason.format(*match.groups())
    return "other"


class URLRefused(Exception):
    """A URL or redirect hop pack will not fetch (scheme, or a non-public address)."""


class _Download:
    """One download's deadline and socket, shared by its connections (one per redirect hop)."""

    def __init__(self, timeout: float, allow_private_hosts: bool) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.allow_private_hosts = allow_private_hosts
        self.sock: socket.socket | None = None

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"download timed out: over the --timeout total deadline of {self.timeout:g} s")
        return left

    def connect(self, address: tuple[str, int], timeout: float, source_address: Any = None) -> socket.socket:
        """Resolve the host, refuse non-public addresses, and connect to the checked address itself, so a
        second DNS answer cannot swap in another one."""
        host, port = address
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not self.allow_private_hosts:
            for *_, sockaddr in infos:
                kind = non_public_kind(sockaddr[0])
                if kind:
                    raise URLRefused(f"URL refused: {host} resolves to {sockaddr[0]}, a {kind} address "
                                     "(--allow-private-hosts fetches it)")
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(min(timeout, self.remaining()))
                sock.connect(sockaddr)
                return sock
            except OSError as failed:
                sock.close()
                error = failed
        raise error or OSError(f"{host}: no address")


def non_public_kind(address: str) -> str | None:
    """'loopback', 'private', 'link-local' ... for an address pack must not reach by default, else None."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-public"


def _connection_class(base: type, download: _Download) -> Any:
    class Connection(base):
        def __init__(self, host: str, **kwargs: Any) -> None:
            kwargs["timeout"] = min(kwargs.get("timeout") or download.timeout, download.remaining())
            super().__init__(host, **kwargs)
            self._create_connection = download.connect

        def connect(self) -> None:
            super().connect()
            download.sock = self.sock  # the TLS socket for https: the one reads go through

    return Connection


def _opener(download: _Download) -> urllib.request.OpenerDirector:
    """http(s) only, no proxies from the environment, every redirect hop checked like the first URL."""

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(_connection_class(http.client.HTTPConnection, download), req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(_connection_class(http.client.HTTPSConnection, download), req,
                                context=self._context)

    class RedirectHandler(urllib.request.HTTPRedirectHandler):
        def http_error_302(self, req, fp, code, msg, headers):  # noqa: ANN001, ANN201
            location = headers.get("location") or headers.get("uri")
            if location:
                try:
                    check_scheme(urljoin(req.full_url, location))
                except URLRefused:
                    fp.close()
                    raise
            return super().http_error_302(req, fp, code, msg, headers)

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    opener = urllib.request.OpenerDirector()
    for handler in (HTTPHandler(), HTTPSHandler(), RedirectHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def check_scheme(url: Any) -> None:
    scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if scheme not in ALLOWED_SCHEMES:
        shown = f"{scheme}:" if scheme else repr(url)[:100]
        raise URLRefused(f"URL refused: scheme {shown} (only http and https are fetched)")


@dataclass(frozen=True)
class Fetcher:
    """img2dataset's ``download_image``, made safe for hostile input.

    urllib would fetch file:// and data: URLs and follow redirects anywhere, a socket timeout bounds only
    each read (a server trickling a byte a second never trips it), and the whole body was read into
    memory whatever its size. Here: http(s) only, every hop's resolved address must be public unless
    ``allow_private_hosts``, ``timeout`` bounds the whole download, and a body over ``max_bytes`` is
    refused as soon as it is known to be (Content-Length, else while reading). Failures come back as
    img2dataset's error messages, so they are recorded per sample and counted by reason.
    """

    max_bytes: int
    allow_private_hosts: bool

    def __call__(self, row: tuple[int, str], timeout: float, user_agent_token: str | None,
                 disallowed_header_directives: set[str] | None) -> tuple[int, io.BytesIO | None, str | None]:
        key, url = row
        try:
            check_scheme(url)
            download = _Download(timeout, self.allow_private_hosts)
            request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
            with _opener(download).open(request, timeout=download.remaining()) as response:
                if disallowed_header_directives and _is_disallowed(
                    response.headers, user_agent_token, disallowed_header_directives
                ):
                    return key, None, "Use of image disallowed by X-Robots-Tag directive"
                return key, io.BytesIO(self.read_body(response, download)), None
        except Exception as error:  # noqa: BLE001 (each failure is this sample's recorded error)
            return key, None, str(error)

    def read_body(self, response: http.client.HTTPResponse, download: _Download) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise ValueError(f"body of {int(declared):,} bytes is over --max-bytes {self.max_bytes:,}")
        chunks, size = [], 0
        while True:
            download.sock.settimeout(download.remaining())  # read1: one receive, so no read outlasts it
            chunk = response.read1(min(READ_CHUNK, self.max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_bytes:
                raise ValueError(f"body is over --max-bytes {self.max_bytes:,}")
        if response.length:  # the server closed before sending the length it declared
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return b"".join(chunks)


def _is_disallowed(*args: Any) -> bool:
    """img2dataset's X-Robots-Tag check (imported late: img2dataset is slow to import)."""
    from img2dataset.downloader import is_disallowed

    return is_disallowed(*args)


# img2dataset's user agent, so sites treat pack like img2dataset.
USER_AGENT = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"
READ_CHUNK = 1 << 16


def size_bucket(width: int, height: int) -> str:
    shorter = min(width, height)
    lower = 0
    for edge in SIZE_BUCKETS:
        if shorter < edge:
            return f"{lower}-{edge - 1}"
        lower = edge
    return f">={SIZE_BUCKETS[-1]}"


_DOWNLOADERS: dict[PackConfig, Downloader] = {}  # ShardPacker.downloader's per-process cache


@dataclass(frozen=True)
class ShardPacker:
    """Pack one shard in a worker process: img2dataset into staging, then promote, record last.

    The img2dataset Downloader is built in the worker on its first shard (``downloader``): importing
    img2dataset (OpenCV, albumentations, wandb) takes seconds, and the main process never needs it.
    """

    config: PackConfig
    output: Location
    options: dict[str, Any]
    planned_shards: int
    laionkit_versions: dict[str, str]
    fetcher: Fetcher
    storage_options: dict[str, Any] = field(default_factory=dict)
    staging: str | None = None  # local folder for shards bound for an object store; None: in ``output``

    def __call__(self, task: ShardTask) -> tuple[ShardTask, dict | None]:
        try:
            return task, self.pack(task)
        except Exception:  # a shard failing is retried and then reported; other shards go on
            traceback.print_exc()
            print(f"shard {task.name} ({task.input} rows {task.start}-{task.stop}) failed", file=sys.stderr)
            return task, None

    def downloader(self) -> Downloader:
        """This process's img2dataset Downloader, made once (ShardPacker is frozen and pickled to workers)."""
        if self.config not in _DOWNLOADERS:
            _DOWNLOADERS.clear()
            _DOWNLOADERS[self.config] = make_downloader(self.config)
        return _DOWNLOADERS[self.config]

    def pack(self, task: ShardTask) -> dict:
        if self.staging is None:
            staging = partial_path(Path(self.output.path, task.name))
        else:
            staging = Path(self.staging, f".{task.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        arrow_file = staging / "input.arrow"
        table, notes = read_rows(task, self.storage_options)
        with pa.OSFile(str(arrow_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        downloader = copy.copy(self.downloader())
        downloader.output_folder = str(staging)
        downloader.column_list = table.column_names
        downloader.oom_shard_count = len(task.name)
        # img2dataset's Downloader calls its module's download_image for every URL; this worker
        # process is pack's own (spawned), so replacing it here changes nothing else.
        import img2dataset.downloader

        img2dataset.downloader.download_image = self.fetcher
        downloader.download_shard((task.shard_id, str(arrow_file)))
        record = {**self.record(task, staging), **notes}
        check_tar_samples(staging / f"{task.name}.tar", record["successes"])
        for suffix in (".tar", ".parquet"):  # renamed locally; uploaded (done record last) to a store
            with storage.atomic_write(self.output / f"{task.name}{suffix}", staging=staging.parent) as tmp:
                os.replace(staging / f"{task.name}{suffix}", tmp)
        storage.write_json(self.output / f"{task.name}_stats.json", record)
        shutil.rmtree(staging)
        return record

    def record(self, task: ShardTask, staging: Path) -> dict:
        """img2dataset's own shard stats, plus reasons, sizes, input rows, options and versions."""
        stats = read_json(staging / f"{task.name}_stats.json")
        status = pq.read_table(
            staging / f"{task.name}.parquet",
            columns=["status", "error_message", "original_width", "original_height"],
        ).to_pylist()
        failures = Counter(
            failure_reason(row["error_message"]) for row in status if row["status"] != "success"
        )
        sizes = Counter(
            size_bucket(row["original_width"], row["original_height"])
            for row in status if row["status"] == "success"
        )
        return {
            **stats,
            "shard": task.name,
            "tar": f"{task.name}.tar",
            "tar_bytes": (staging / f"{task.name}.tar").stat().st_size,
            "parquet_bytes": (staging / f"{task.name}.parquet").stat().st_size,
            "input": task_input(task),
            "failures": dict(sorted(failures.items())),
            "original_sizes": dict(sorted(sizes.items())),
            "planned_shards": self.planned_shards,
            "options": self.options,
            "versions": self.laionkit_versions,
        }


def check_tar_samples(tar: Path, successes: int) -> None:
    """A shard is recorded done only if its tar holds as many samples as img2dataset counted successes.

    img2dataset counts a success before writing the sample and only logs a sample it then fails to
    write, so a count taken from its stats alone can claim samples that are not on disk.
    """
    with tarfile.open(tar) as archive:
        keys = {member.name.split(".", 1)[0] for member in archive if member.name.endswith(".json")}
    if len(keys) != successes:
        raise RuntimeError(f"{tar.name}: img2dataset counted {successes} successes but the tar holds "
                           f"{len(keys)} samples; the shard is not recorded as done")


def make_downloader(config: PackConfig) -> Downloader:
    """img2dataset's Downloader and Resizer with laionkit's options; output folder set per shard.

    Imported here: img2dataset pulls in OpenCV, albumentations and wandb, which `stats` never needs.
    """
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer
    from img2dataset.writer import WebDatasetSampleWriter

    resizer = Resizer(
        image_size=config.image_size, resize_mode=config.resize_mode, resize_only_if_bigger=False,
        encode_quality=config.encode_quality, encode_format=config.encode_format,
        min_image_size=config.min_image_size, max_image_area=config.max_image_area or math.inf,
        max_aspect_ratio=config.max_aspect_ratio or math.inf,
    )
    # output_folder, column_list and oom_shard_count are set per shard by ShardPacker.
    return Downloader(
        sample_writer_class=WebDatasetSampleWriter, resizer=resizer, thread_count=config.threads,
        save_caption=True, extract_exif=False, output_folder=str(config.output),
        column_list=None, timeout=config.timeout, number_sample_per_shard=config.shard_size,
        oom_shard_count=MIN_SHARD_NAME_WIDTH, compute_hash="sha256", verify_hash_type=None,
        encode_format=config.encode_format, retries=config.retries, user_agent_token=None,
        disallowed_header_directives=list(OPTOUT_DIRECTIVES) if config.respect_optout else None,
    )


def make_output_folder(location: Location) -> None:
    """Create --output, or say in one line why it cannot be (a file, no permission), before any download."""
    if not location.local:
        if location.protocol in storage.READ_ONLY or (location.exists() and not location.is_dir()):
            raise LaionkitError(f"--output {location}: not a writable folder (a file, or a read-only URL)")
        return
    output = Path(location.path)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise LaionkitError(f"--output {output} is a file; give a folder") from None
    except OSError as error:
        raise LaionkitError(f"--output {output}: cannot create the folder ({error.strerror})") from None
    if not os.access(output, os.W_OK | os.X_OK):
        raise LaionkitError(f"--output {output}: the folder is not writable")


# Keys every shard record has; a record without them (or not JSON) marks no shard done.
RECORD_KEYS = ("count", "successes", "failures", "original_sizes", "status_dict", "shard", "tar", "tar_bytes",
               "parquet_bytes", "input", "planned_shards", "options", "versions")


def load_record(path: Location) -> dict | None:
    """A shard record, or None if it is not valid JSON with every key (a damaged file, not a done shard)."""
    try:
        record = path.read_json()
    except (OSError, ValueError, LaionkitError):
        return None
    if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
        return None
    return record


def check_done_record(record_path: Location, task: ShardTask, options: dict[str, Any]) -> None:
    """A finished shard must come from the same rows and the same output-shaping options."""
    record = record_path.read_json()
    planned = task_input(task)
    if record.get("input") != planned:
        raise LaionkitError(
            f"{record_path} was packed from {record.get('input')}, but this run plans {planned} for that "
            "shard: the input changed; use a new --output"
        )
    shaping = lambda values: {key: values.get(key) for key in OUTPUT_SHAPING_OPTIONS}  # noqa: E731
    refuse_other_settings(record_path, shaping(record.get("options", {})), shaping(options), "packed",
                          "rerun with the same options or a new --output")


@contextmanager
def opencv_pixel_limit(max_area: int) -> Iterator[None]:
    """Make OpenCV refuse images above ``max_area`` pixels from their header, before allocating them.

    img2dataset checks the area only after decoding; OpenCV reads this variable when it loads, so it
    is set for the worker processes, which are spawned fresh.
    """
    name = "OPENCV_IO_MAX_IMAGE_PIXELS"
    previous = os.environ.get(name)
    if max_area:
        os.environ[name] = str(max_area)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def write_manifest(folder: Location) -> dict:
    """Merge the shard records on disk into manifest.json, atomically, safe against concurrent ranks.

    Every rank rewrites it, so the temporary name carries host and pid: two ranks finishing together
    never share (and delete) each other's temporary, and the last rename wins with a full merge.
    """
    manifest = merge_records(folder)
    storage.write_json(folder / "manifest.json", manifest, shared=True)
    return manifest


def merge_records(folder: Path | Location) -> dict:
    """The manifest: totals over readable records; damaged ones are listed under ``unreadable_records``
    (their shards count as not done, and a pack rerun redoes them)."""
    paths = Location.parse(folder).list("*_stats.json")
    loaded = {path.name: load_record(path) for path in paths}
    records = [record for record in loaded.values() if record is not None]
    failures, sizes, messages, invalid_utf8 = Counter(), Counter(), Counter(), Counter()
    for record in records:
        failures.update(record["failures"])
        sizes.update(record["original_sizes"])
        messages.update({key: value for key, value in record["status_dict"].items() if key != "success"})
        invalid_utf8.update(record.get("invalid_utf8", {}))
    rows = sum(record["count"] for record in records)
    samples = sum(record["successes"] for record in records)

    def distinct(key: str) -> list:
        return [json.loads(text) for text in sorted({json.dumps(r[key], sort_keys=True) for r in records})]

    planned = max((record["planned_shards"] for record in records), default=0)
    return {
        "stage": "pack",
        "shards": [
            {
                "shard": record["shard"], "tar": record["tar"], "samples": record["successes"],
                "rows": record["count"], "bytes": record["tar_bytes"],
                "success_rate": record["successes"] / record["count"] if record["count"] else 0.0,
                "failures": record["failures"], "input": record["input"],
            }
            for record in records
        ],
        "planned_shards": planned,
        "complete": bool(records) and len(records) == planned,
        "unreadable_records": sorted(name for name, record in loaded.items() if record is None),
        "invalid_utf8": dict(sorted(invalid_utf8.items())),
        "rows": rows,
        "samples": samples,
        "success_rate": samples / rows if rows else 0.0,
        "bytes": sum(record["tar_bytes"] + record["parquet_bytes"] for record in records),
        "failures": dict(failures.most_common()),
        "error_messages": dict(messages.most_common(20)),
        "original_sizes": dict(sorted(sizes.items(), key=lambda item: _bucket_order(item[0]))),
        "inputs": sorted({record["input"]["file"] for record in records}),
        "options": distinct("options"),
        "versions": distinct("versions"),
    }


def _bucket_order(bucket: str) -> int:
    return int(bucket.removeprefix(">=").split("-")[0])


def summarize(folder: Path | Location) -> Group:
    """`laionkit stats DIR` for a shard folder: the merged records as tables (read-only: writes nothing)."""
    manifest = merge_records(folder)
    overview = Table(title=f"pack: {folder}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    overview.add_row("shards", f"{len(manifest['shards'])} / {manifest['planned_shards']} planned")
    overview.add_row("rows", f"{manifest['rows']:,}")
    overview.add_row("samples", f"{manifest['samples']:,}")
    overview.add_row("success rate", f"{manifest['success_rate']:.1%}")
    overview.add_row("size on disk", f"{manifest['bytes'] / 2**20:,.1f} MiB")
    if manifest["invalid_utf8"]:
        overview.add_row("invalid UTF-8 repaired", ", ".join(f"{k}: {v:,}" for k, v in manifest["invalid_utf8"].items()))
    if manifest["unreadable_records"]:
        overview.add_row("unreadable records (rerun pack)", ", ".join(manifest["unreadable_records"]))
    failures = Table(title="failures by reason")
    failures.add_column("reason")
    failures.add_column("rows", justify="right")
    failures.add_column("share", justify="right")
    for reason, count in manifest["failures"].items():
        failures.add_row(reason, f"{count:,}", f"{count / manifest['rows']:.1%}")
    sizes = Table(title="original image size (shorter side, px)")
    sizes.add_column("size")
    sizes.add_column("samples", justify="right")
    sizes.add_column("")
    most = max(manifest["original_sizes"].values(), default=1)
    for bucket, count in manifest["original_sizes"].items():
        sizes.add_row(bucket, f"{count:,}", "█" * max(1, round(30 * count / most)))
    return Group(overview, failures, sizes)


def run(config: PackConfig) -> dict:
    """Pack this rank's shards that are not done yet, then rewrite manifest.json; returns the manifest."""
    rank = resolve_rank(config.rank, config.world_size)
    inputs, output = config.locations()
    files = input_files(inputs)
    storage.refuse_overlap(inputs, output, "pack")
    storage.claim_output(output, "pack", config.overwrite)
    tasks = plan_shards(files, config)
    mine = split(tasks, rank)
    make_output_folder(output)
    options = config.options()
    console = Console(stderr=True, quiet=config.quiet, soft_wrap=True, markup=False, emoji=False)  # paths are data
    todo = []
    for task in mine:
        record_path = output / f"{task.name}_stats.json"
        if not record_path.is_complete():
            todo.append(task)
        elif load_record(record_path) is None:  # said even under --quiet: a done shard is being redone
            print(f"pack: {record_path} is unreadable or incomplete: shard {task.name} is redone", file=sys.stderr)
            todo.append(task)
        else:
            check_done_record(record_path, task, options)
    console.print(
        f"pack: rank {rank.rank}/{rank.world_size} ({rank.source}), {len(files)} input files, "
        f"{len(tasks)} shards, {len(mine)} mine, {len(todo)} to do -> {output}", highlight=False
    )
    console.print(f"options: {options}", highlight=False)
    # One staging folder per output and rank, so a rerun after kill -9 clears what the killed run left.
    tag = hashlib.sha256(str(output).encode()).hexdigest()[:12]
    staging = None if output.local else os.path.join(storage._staging(None), f"laionkit-pack-{tag}-{rank.rank}")
    packer = ShardPacker(config, output, options, len(tasks), versions(),
                         Fetcher(config.max_bytes, config.allow_private_hosts),
                         storage.parse_storage_options(config.storage_options), staging)
    try:
        failed = pack_shards(packer, todo, config) if todo else []
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    manifest = write_manifest(output)
    if failed:
        names = ", ".join(task.name for task in failed)
        raise LaionkitError(f"{len(failed)} shards failed after a retry ({names}); rerun the same command")
    return manifest


def pack_shards(packer: ShardPacker, todo: list[ShardTask], config: PackConfig) -> list[ShardTask]:
    """Run shards on a pool of spawned processes like img2dataset's distributor; retry failures once."""
    context = multiprocessing.get_context("spawn")
    progress = tqdm(total=len(todo), unit="shard", desc="pack", disable=config.quiet)
    rows = samples = 0
    with opencv_pixel_limit(config.max_image_area), context.Pool(
        min(config.processes, len(todo)), maxtasksperchild=5
    ) as pool:
        pending = todo
        for _attempt in range(2):
            failed = []
            for task, record in pool.imap_unordered(packer, pending):
                if record is None:
                    failed.append(task)
                    continue
                rows += record["count"]
                samples += record["successes"]
                progress.update()
                progress.set_postfix(samples=samples, success=f"{samples / max(rows, 1):.0%}")
            pending = failed
            if not pending:
                break
    progress.close()
    return pending
