"""encode's writer: the writer thread, one output tar per input shard, the .npy members."""

from __future__ import annotations

import io
import json
import queue
import tarfile
import threading
import time
from collections import Counter
from contextlib import ExitStack

import numpy as np

from laionkit.common import Rank, storage
from laionkit.common.storage import Location
from laionkit.encode.config import QUEUE_DEPTH
from laionkit.encode.device import Encoders
from laionkit.encode.reader import ShardDone
from laionkit.encode.records import record_path, shard_record


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def npy_rows(batch: np.ndarray) -> list[bytes]:
    """``npy_bytes`` of each row of a batch, with the .npy header (same for all rows) built once."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(batch[0]))
    prefix = header.getvalue()
    return [prefix + np.ascontiguousarray(row).tobytes() for row in batch]


def write_empty_captions(output: Location, encoders: Encoders) -> None:
    """The folder's empty-caption tensors (caption dropout), once: every rank writes the same bytes."""
    for key, empty in encoders.empty_caption().items():
        empty_path = output / encoders.family.empty_file(key)
        if not empty_path.is_complete():
            with storage.atomic_write(empty_path, shared=True) as tmp:
                tmp.write_bytes(npy_bytes(empty))


def _ustar_template() -> tuple[bytes, bytes]:
    """The parts of a USTAR member header around its size field, as tarfile builds them for a regular file
    with mode 0o444, mtime 0, uid / gid 0 and webdataset's user and group names: (after the name, up to
    the size field), (after the size field). The checksum field holds spaces, as the checksum assumes."""
    info = tarfile.TarInfo("x")
    info.mode, info.mtime, info.uname, info.gname = 0o444, 0, "bigdata", "bigdata"
    header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    header = header[:148] + b" " * 8 + header[156:]
    return header[100:124], header[136:]


_HEAD, _TAIL = _ustar_template()


class TarMembers:
    """A tar written member by member, one ``write`` per member: a USTAR header (built here from a fixed
    template: only the name, size and checksum differ) + the bytes + padding to 512. Through tarfile (as
    webdataset's TarWriter writes) each member costs a PAX header check and chunked copies, about half of
    encode's writer thread time (docs/BENCHMARKS.md, `bench_encode.py --writer`); a name that USTAR cannot hold (over 100 bytes, not
    ASCII) still gets tarfile's PAX header. Readers (tarfile, webdataset, GNU tar) see a plain tar."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.offset = 0

    def add(self, name: str, data: bytes) -> None:
        encoded = name.encode("utf-8")
        if len(encoded) <= 100 and encoded.isascii():
            header = bytearray(encoded.ljust(100, b"\0") + _HEAD + b"%011o\0" % len(data) + _TAIL)
            header[148:156] = b"%06o\0 " % sum(header)
        else:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uname, info.gname = len(data), 0o444, 0, "bigdata", "bigdata"
            header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        padding = b"\0" * (-len(data) % 512)
        self.file.write(b"".join((header, data, padding)))
        self.offset += len(header) + len(data) + len(padding)

    def add_sample(self, key: str, members: dict[str, bytes]) -> None:
        """One sample's members as ``KEY.MEMBER``, in webdataset's order (sorted by member name)."""
        for member in sorted(members):
            self.add(f"{key}.{member}", members[member])

    def close(self) -> None:
        if self.file.closed:
            return
        end = self.offset + 2 * 512  # two zero blocks end the archive, padded to tarfile's record size
        self.file.write(b"\0" * (2 * 512 + (-end % tarfile.RECORDSIZE)))
        self.file.close()


class ShardOutput:
    """One output tar, written under a temporary name and renamed (uploaded, done record last) by
    ``finish`` (TarMembers)."""

    def __init__(self, path: Location) -> None:

        self.path = path
        self.stack = ExitStack()
        tmp = self.stack.enter_context(storage.atomic_write(path))
        self.sink = TarMembers(str(tmp))
        self.samples = 0
        self.truncated = 0
        self.empty_captions = 0
        self.sizes: Counter = Counter()
        self.skips: list[dict] = []
        self.started = time.perf_counter()

    def write(self, keys: list[str], records: list[dict], moments: np.ndarray,
              stored: dict[str, np.ndarray | list[np.ndarray]]) -> None:
        """One sample per key: moments, every stored text tensor under its member name (a batch array, or
        one array per sample where their lengths differ), the json."""
        rows = {member: npy_rows(value) if isinstance(value, np.ndarray) else [npy_bytes(row) for row in value]
                for member, value in stored.items()}
        for index, (key, record, sample_moments) in enumerate(zip(keys, records, npy_rows(moments))):
            members = {"moments.npy": sample_moments, **{member: row[index] for member, row in rows.items()},
                       "json": json.dumps(record, sort_keys=True).encode()}
            self.sink.add_sample(key, members)
            self.samples += 1
            self.truncated += record["truncated"]
            self.empty_captions += not record["caption"].strip()
            self.sizes["x".join(map(str, record["size"]))] += 1

    def finish(self) -> None:
        self.sink.close()
        self.stack.close()
        self.bytes = self.path.size()  # the tar as stored: what a sample costs (trimmed text varies per sample)

    def abort(self, error: BaseException) -> None:
        self.sink.close()
        self.stack.__exit__(type(error), error, error.__traceback__)


class _Writer:
    """The writer thread: host copies land, samples go into their shard's tar, finished shards are renamed."""

    def __init__(self, output: Location, settings: dict, models: dict, rank: Rank, progress) -> None:
        self.output = output
        self.settings = settings
        self.models = models
        self.rank = rank
        self.progress = progress
        self.open: dict[str, ShardOutput] = {}
        self.samples_out = 0
        self.skipped = 0
        self.empty_captions = 0
        self.decoded: Counter = Counter()
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="laionkit-writer", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        while self.thread.is_alive():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise self.error or RuntimeError("encode writer thread stopped")

    def close(self) -> None:
        self.put(None)
        self.thread.join()
        if self.error:
            raise self.error

    def abort(self, error: BaseException) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        for shard in self.open.values():
            shard.abort(error)
        self.open.clear()

    def _loop(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if isinstance(item, ShardDone):
                    self._finish(item)
                else:
                    self._write(item)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            self.error = error

    def _shard(self, name: str) -> ShardOutput:
        if name not in self.open:
            self.open[name] = ShardOutput(self.output / name)
        return self.open[name]

    def _write(self, item: dict) -> None:
        shard = self._shard(item["shard"])
        shard.skips += item["skips"]
        self.decoded.update(item["decoded"])
        if item["done"] is not None:
            item["done"].synchronize()
        if item["moments"] is not None:
            stored = {member: value.numpy() for member, value in item["stored"].items()}
            if item["trim"] is not None:  # a family with a text mask: each sample up to its caption's length
                lengths, members = item["trim"]
                stored.update({member: [row[:n] for row, n in zip(stored[member], lengths.tolist())]
                               for member in members})
            shard.write(item["keys"], item["records"], item["moments"].numpy(), stored)
        self.progress.update(len(item["keys"]) + len(item["skips"]))

    def _finish(self, done: ShardDone) -> None:
        shard = self._shard(done.shard)
        skips = sorted(shard.skips + done.skips, key=lambda skip: skip["key"])
        if shard.samples + len(skips) != done.samples_in:
            raise RuntimeError(f"{done.shard}: {shard.samples} written + {len(skips)} skipped "
                               f"!= {done.samples_in} read")
        seconds = time.perf_counter() - shard.started
        shard.finish()
        del self.open[done.shard]
        self.progress.update(len(done.skips))
        record = shard_record(done, shard, skips, seconds, self.rank.rank, self.settings, self.models)
        storage.write_json(record_path(self.output, done.shard), record)
        self.samples_out += shard.samples
        self.skipped += len(skips)
        self.empty_captions += shard.empty_captions
