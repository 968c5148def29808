"""encode's output tar: .npy members, USTAR headers built from a template, and one shard's tar with its counts."""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections import Counter
from contextlib import ExitStack

import numpy as np

from laionkit.common import storage
from laionkit.common.storage import Location


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
        self.upscaled = 0  # samples whose crop is smaller than their size: enlarged, so softer than the others
        self.sizes: Counter = Counter()
        self.skips: list[dict] = []
        self.captions: dict[str, Counter] = {}  # --captions: per name, samples stored / truncated / scored
        self.caption_skips: list[dict] = []  # --captions: a caption a sample lacks (the sample is written)
        self.started = time.perf_counter()

    def write(self, keys: list[str], records: list[dict], moments: np.ndarray,
              stored: dict[str, np.ndarray | list[np.ndarray]] | list[dict[str, np.ndarray]]) -> None:
        """One sample per key: moments, every stored text tensor under its member name (a batch array, or
        one array per sample where their lengths differ; with several captions, one {member: array} per
        sample, laionkit.common.caption_mix), the json."""
        if isinstance(stored, list):
            rows = [{member: npy_bytes(value) for member, value in sample.items()} for sample in stored]
        else:
            by_member = {member: npy_rows(value) if isinstance(value, np.ndarray) else [npy_bytes(row) for row in value]
                         for member, value in stored.items()}
            rows = [{member: row[index] for member, row in by_member.items()} for index in range(len(keys))]
        for key, record, sample_moments, text in zip(keys, records, npy_rows(moments), rows):
            members = {"moments.npy": sample_moments, **text, "json": json.dumps(record, sort_keys=True).encode()}
            self.sink.add_sample(key, members)
            self.samples += 1
            self.truncated += record["truncated"]
            self.empty_captions += not record["caption"].strip()
            self.upscaled += record["crop"][2] < record["size"][0] or record["crop"][3] < record["size"][1]
            self.sizes["x".join(map(str, record["size"]))] += 1
            for name, caption in record.get("captions", {}).items():  # --captions: what each name stored
                counts = self.captions.setdefault(name, Counter())
                counts["stored"] += 1
                counts["truncated"] += caption["truncated"]
                counts["scored"] += "score" in caption

    def finish(self) -> None:
        self.sink.close()
        self.stack.close()
        self.bytes = self.path.size()  # the tar as stored: what a sample costs (trimmed text varies per sample)

    def abort(self, error: BaseException) -> None:
        self.sink.close()
        self.stack.__exit__(type(error), error, error.__traceback__)
