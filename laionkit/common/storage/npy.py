"""``.npy`` arrays read by row range (filter --embeddings): memory-mapped on local disk, one ranged read
per range in an object store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laionkit.common.errors import LaionkitError
from laionkit.common.storage.errors import one_line, one_line_errors
from laionkit.common.storage.location import Location


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
        with one_line_errors("cannot read", self.location):
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
        raise LaionkitError(f"{location}: not a readable .npy file ({one_line(error)})") from None
    if fortran or dtype.hasobject:
        raise LaionkitError(f"{location}: a Fortran-order or object .npy array cannot be read by rows")
    return NpyLayout(location, tuple(shape), dtype, offset)
