"""The image fingerprints `laionkit score` writes and `laionkit dedup` compares: one definition for both.

* ``sha256``: hex SHA-256 of the image file's bytes as stored in the shard (img2dataset's ``compute_hash``
  with ``hash_type="sha256"``), so equal files have equal hashes whichever tool computed them.
* ``phash``: the perceptual hash of the ``imagehash`` package (``imagehash.phash``, hash_size 8,
  highfreq_factor 4): grayscale, LANCZOS-resized to 32x32, 2-D DCT-II (scipy.fftpack's unnormalised
  convention), the 8x8 lowest frequencies (DC included), bit = coefficient > their median; the 64 bits
  row-major, the first the most significant, stored as a signed int64 (two's complement of the uint64).
  Computed here with numpy (no scipy, no imagehash at run time); tests check it against imagehash.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
from PIL import Image

HASH_SIZE = 8
IMAGE_SIZE = 32  # hash_size * highfreq_factor, as imagehash.phash
BITS = HASH_SIZE * HASH_SIZE


def _dct_rows(n: int, rows: int) -> np.ndarray:
    """The first ``rows`` rows of the unnormalised DCT-II matrix (scipy.fftpack.dct, type 2, norm=None)."""
    k = np.arange(rows)[:, None]
    i = np.arange(n)[None, :]
    return 2.0 * np.cos(np.pi * k * (2 * i + 1) / (2 * n))


DCT = _dct_rows(IMAGE_SIZE, HASH_SIZE)  # (8, 32): score --decode device runs the same matrix on its device


def phash_bits(image: Image.Image) -> np.ndarray:
    """The 8x8 boolean pHash of ``image`` (imagehash.phash(image).hash)."""
    pixels = np.asarray(image.convert("L").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS),
                        dtype=np.float64)
    low = DCT @ pixels @ DCT.T  # dct(dct(pixels, axis=0), axis=1)[:8, :8]
    return low > np.median(low)


def phash(image: Image.Image) -> int:
    """pHash as a signed 64-bit integer (the ``phash`` column of `laionkit score`)."""
    value = int.from_bytes(np.packbits(phash_bits(image).flatten()).tobytes(), "big")
    return value - (1 << BITS) if value >= 1 << (BITS - 1) else value


def phash_of_bytes(data: bytes) -> int:
    with Image.open(io.BytesIO(data)) as image:
        return phash(image)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hamming(a: int, b: int) -> int:
    """Bits that differ between two pHashes (signed or unsigned 64-bit integers)."""
    return bin((a ^ b) & ((1 << BITS) - 1)).count("1")


def hamming_many(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise (broadcast) Hamming distances of int64 arrays of pHashes."""
    x = np.bitwise_xor(np.asarray(a, np.int64), np.asarray(b, np.int64))
    return np.unpackbits(np.ascontiguousarray(x)[..., None].view(np.uint8), axis=-1).sum(axis=-1)
