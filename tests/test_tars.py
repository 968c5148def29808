"""common.tars.count_samples: the header-only fast path counts exactly what tarfile (and so webdataset) reads."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

from laionkit.common import LaionkitError, tars


def tarfile_count(path) -> int:
    """count_samples through tarfile alone (the path a non-local or unusual tar takes)."""
    fast = tars._count_local
    tars._count_local = lambda _: None
    try:
        return tars.count_samples(path)
    finally:
        tars._count_local = fast


def random_tar(path, fmt: int, rng: random.Random) -> None:
    """Members as tools write them: repeated and consecutive keys, folders and long (pax / GNU) names, a
    non-ASCII one, directories, links, ``__meta__`` members, empty and odd-sized data."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for index in range(rng.randint(1, 25)):
            key = rng.choice(["", "./", "sub/dir/", "a" * rng.choice([10, 120]) + "/", "ü/"]) + f"{rng.randint(0, 6):03d}"
            for extension in rng.sample(["jpg", "txt", "json", "seg.png"], rng.randint(1, 3)):
                info = tarfile.TarInfo(f"{key}.{extension}")
                roll = rng.random()
                if roll < 0.1:
                    info.name = f"__meta{index}__"
                if fmt == tarfile.USTAR_FORMAT and (len(info.name) >= 100 or not info.name.isascii()):
                    continue
                if roll < 0.05:  # a folder, at times with a size field that tarfile ignores
                    info.type = tarfile.DIRTYPE
                elif roll < 0.08:
                    info.type, info.linkname = tarfile.SYMTYPE, "x" * rng.choice([5, 50])
                data = b"" if info.type != tarfile.REGTYPE else rng.randbytes(rng.choice([0, 1, 511, 512, 513, 3000]))
                info.size, info.mtime = len(data), rng.random() * 1e9 if fmt == tarfile.PAX_FORMAT else 0
                if info.type == tarfile.DIRTYPE and rng.random() < 0.5:
                    info.size = 1000  # no data follows: tarfile does not skip any after a folder
                tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_fast_count_equals_tarfiles_on_every_layout_and_cut(fmt, tmp_path):
    rng = random.Random(fmt)
    fast_taken = 0
    for trial in range(25):
        path = tmp_path / f"{trial}.tar"
        random_tar(path, fmt, rng)
        expected = tarfile_count(path)
        assert tars.count_samples(path) == expected
        fast_taken += tars._count_local(str(path)) is not None
        data = path.read_bytes()
        for cut in {512, 1024, 1536, len(data) - 1024, len(data) - 512, rng.randrange(1, len(data))}:
            (tmp_path / "cut.tar").write_bytes(data[:cut])  # a download or copy cut short anywhere
            try:
                expected = tarfile_count(tmp_path / "cut.tar")
            except LaionkitError:
                expected = "error"
            try:
                found = tars.count_samples(tmp_path / "cut.tar")
            except LaionkitError:
                found = "error"
            assert found == expected, cut
    assert fast_taken >= 20  # the fast path is what these tars take, not the fallback


def test_gzipped_tars_are_counted_through_tarfile(tmp_path):
    plain = tmp_path / "plain.tar"
    random_tar(plain, tarfile.PAX_FORMAT, random.Random(1))
    packed = tmp_path / "packed.tar.gz"
    with tarfile.open(plain) as source, tarfile.open(packed, "w:gz") as target:
        for member in source:
            target.addfile(member, source.extractfile(member) if member.isreg() else None)
    assert tars._count_local(str(packed)) is None
    assert tars.count_samples(packed) == tars.count_samples(plain) == tarfile_count(plain)


def samples_or_error(files) -> list | str:
    """group_by_keys over ``files`` as unit_samples reads a shard: the samples, or the error's type."""
    import webdataset as wds

    try:
        return list(wds.tariterators.group_by_keys(files))
    except Exception as error:  # noqa: BLE001 - the comparison is of what each reader raises
        return type(error).__name__


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_header_reader_yields_webdatasets_samples_and_errors(fmt, tmp_path):
    """tar_files (what encode, score and caption read local tars with) against webdataset's tarfile reader on
    the same files: the same samples in the same order, bytes included, or the same error, whole or cut."""
    import webdataset as wds

    rng = random.Random(fmt + 7)
    for trial in range(15):
        path = tmp_path / f"{trial}.tar"
        random_tar(path, fmt, rng)
        data = path.read_bytes()
        for cut in {len(data), 1536, len(data) - 1024, rng.randrange(1, len(data)), rng.randrange(1, len(data))}:
            (tmp_path / "cut.tar").write_bytes(data[:cut])
            with open(tmp_path / "cut.tar", "rb") as handle:
                expected = samples_or_error(wds.tariterators.tar_file_expander([{"url": "u", "stream": handle}]))
            assert samples_or_error(tars.tar_files(str(tmp_path / "cut.tar"), "u")) == expected, (trial, cut)
