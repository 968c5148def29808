"""WebDataset tar shards as every stage sees them: one sample per key, counted without reading data, and read
without tarfile's per-member cost where the tar is a plain local one."""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Iterator

from laionkit.common.errors import LaionkitError


def count_samples(path: str | os.PathLike[str]) -> int:
    """Samples in a tar (plain or gzipped), counted from its headers as webdataset groups them.

    webdataset's own rules, so a count always equals what a reader yields: regular files only, ``__*__``
    meta members skipped, the key is the name up to the first dot of its last component (``./000.jpg``
    is key ``./000``), and a sample is a run of consecutive members with one key. ``path`` may be a URL
    (s3://...): the tar is then read through its headers, seeking over member data.
    """
    from laionkit.common.storage import Location

    location = Location.parse(path)
    if location.local:
        location.refuse_special()
        try:
            found = _count_local(location.path)
        except OSError as error:
            raise LaionkitError(f"cannot read shard {path}: {error}") from error
        if found is not None:
            return found
    handle = None if location.local else location.open_read(block_size=2**20)
    try:
        with tarfile.open(location.path if handle is None else None, "r:*", fileobj=handle) as tar:
            samples = _count_keys(member.name for member in tar if member.isreg() and not _META.match(member.name))
    except (tarfile.TarError, OSError, EOFError) as error:
        raise LaionkitError(f"cannot read shard {path}: {error}") from error
    finally:
        if handle is not None:
            handle.close()
    return samples


_REGULAR = (b"0", b"\0", b"7")  # tarfile's REGULAR_TYPES but sparse files (those take the tarfile path)
_GNU = (b"L", b"K")  # long name / long link records: the prefix field is not a ustar prefix there
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, fifos: tarfile reads no data after them


def _count_keys(names: Iterator[str]) -> int:
    """Samples among a tar's regular, non-meta member names, in order: runs of one key, as webdataset groups."""
    from webdataset.tariterators import base_plus_ext

    samples, key = 0, None
    for name in names:
        prefix, _ = base_plus_ext(name)
        if prefix is not None and prefix != key:
            samples, key = samples + 1, prefix
    return samples


class _Unusual(Exception):
    """A tar the header reader leaves to tarfile: gzipped, global pax headers, sparse or vendor members, a
    header that does not check out, a file cut short (tarfile then decides, or raises its own error)."""


def _members(handle) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of a plain tar's regular members that are not ``__meta__`` ones, in order, from
    its 512-byte headers alone, seeking over the data: names as tarfile builds them (the ustar prefix, pax
    ``path``, GNU long names) and pax ``size``. Raises _Unusual where tarfile might judge differently."""
    if handle.read(2) == b"\x1f\x8b":
        raise _Unusual("gzip")
    handle.seek(0)
    length = os.fstat(handle.fileno()).st_size
    offset, pending = 0, {}  # pending: what a pax or long-name record sets for the next member
    while True:
        block = handle.read(512)
        if len(block) < 512 or block.count(0) == 512:
            if offset == 0 or 0 < len(block) < 512 or pending:
                raise _Unusual("empty, truncated inside a header, or a record with no member")
            return
        try:
            stored = int(block[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
            size = int(block[124:136].split(b"\0", 1)[0].strip() or b"0", 8) if block[124] < 0x80 else None
        except ValueError:
            raise _Unusual("header") from None
        if size is None or stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise _Unusual("base-256 size or checksum")
        kind = block[156:157]
        if kind == b"\0" and block[:100].split(b"\0", 1)[0].endswith(b"/"):
            kind = b"5"  # tarfile reads an old-style regular file named like a folder as a directory
        data_offset = offset + 512
        if kind not in (b"x", b"L", b"K"):
            size = int(pending.get("size", size))
        skip = 0 if kind in _NO_DATA else size  # whatever a link's or folder's size field says
        offset = data_offset + (skip + 511) // 512 * 512
        if offset > length:  # a member's data cut short: tarfile's "unexpected end of data"
            raise _Unusual("cut")
        if kind in (b"x", b"L"):
            record = handle.read(size)
            pending["record"] = True  # a member must follow
            if kind == b"L":
                pending["path"] = record.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            else:
                pending.update(_pax(record))
        elif kind in _REGULAR or kind in _NO_DATA or kind == b"K":
            if kind != b"K":
                name = pending.pop("path", None)
                if name is None:
                    name = block[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    prefix = block[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    if prefix and kind not in _GNU:
                        name = prefix + "/" + name
                pending.clear()
                if kind in _REGULAR and not _META.match(name):
                    yield name, data_offset, size
        else:
            raise _Unusual("global pax, sparse or vendor member")
        handle.seek(offset)


def _count_local(path: str) -> int | None:
    """count_samples of a plain local tar from its headers (a few times faster than tarfile, which a stage
    would pay once per shard before it starts); None where tarfile must decide."""
    with open(path, "rb") as handle:
        try:
            return _count_keys(name for name, _, _ in _members(handle))
        except _Unusual:
            return None


def tar_files(path: str, url: str) -> Iterator[dict]:
    """webdataset's ``tar_file_expander`` for one local tar: a dict (fname, data, __url__) per regular member
    that is not ``__meta__``, then ``{}`` (its end-of-shard marker), for ``group_by_keys``. Plain tars are read
    from their headers (no tarfile member objects: a third of what reading a shard cost a worker that only hashes
    its JPEGs); anything the header reader leaves to tarfile goes through webdataset, from the member where it
    stopped, so the members and errors are webdataset's own."""
    import webdataset as wds

    done = 0
    with open(path, "rb") as handle:
        try:
            for name, offset, size in _members(handle):
                handle.seek(offset)  # where _members left it; it seeks to the next header itself
                data = handle.read(size)
                yield {"fname": name, "data": data, "__url__": url}
                done += 1
            yield {}
            return
        except _Unusual:
            pass
    with open(path, "rb") as handle:
        for index, item in enumerate(wds.tariterators.tar_file_expander([{"url": url, "stream": handle}])):
            if index >= done:
                yield item


def _pax(record: bytes) -> dict:
    """A pax extended header's ``path`` and ``size`` (the only fields that change the members read); raises
    _Unusual where it holds what the header reader does not follow (sparse maps, another charset) or does not
    parse."""
    found, position = {}, 0
    while position < len(record):
        space = record.find(b" ", position)
        if space < 0:
            if record[position:].strip(b"\0"):
                raise _Unusual("pax record")
            return found
        try:
            length = int(record[position:space])
            field = record[space + 1: position + length - 1]
            name, _, value = field.partition(b"=")
            if length <= 0 or name.startswith(b"GNU.sparse") or name == b"hdrcharset":
                raise _Unusual("pax record")
            if name == b"path":
                found["path"] = value.decode("utf-8", "surrogateescape")
            elif name == b"size":
                found["size"] = int(value)
        except ValueError:
            raise _Unusual("pax record") from None
        position += length
    return found
