"""File objects over fsspec files: one whose storage errors are one-line LaionkitErrors, and one that
reads blocks ahead on a thread for a single sequential pass."""

from __future__ import annotations

import io
import queue
import threading

from laionkit.common.errors import LaionkitError
from laionkit.common.storage.errors import one_line, one_line_errors

DEFAULT_BLOCK = 8 * 2**20


class GuardedReader(io.RawIOBase):
    """An fsspec file whose storage errors surface as one-line LaionkitErrors naming the URL."""

    def __init__(self, raw, location: object):
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
        with one_line_errors("cannot read", self.location):
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
                    raise LaionkitError(f"cannot read {self.name}: {one_line(block)}")
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
