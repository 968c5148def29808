"""A 64-bit perceptual hash (DCT pHash) of a decoded image, for near-duplicate search by Hamming distance.

The algorithm is imagehash's ``phash`` (hash_size 8, highfreq_factor 4), reimplemented with scipy so the
hash needs no extra package: the image to grayscale ("L"), resized to 32x32 with Lanczos, a type-II DCT
(unnormalised) over rows then columns, the top-left 8x8 low frequencies compared with their median (DC
included). Bits are read row-major into a big-endian 64-bit integer (imagehash's hex string read as a
number), stored as int64 (two's complement: the same 64 bits), so Hamming distance is
``bin((a ^ b) & (2**64 - 1)).count("1")``. Deterministic: Pillow's resize and scipy's DCT are exact
functions of the pixels.
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from scipy.fft import dct

HASH_SIZE = 8
HIGHFREQ_FACTOR = 4
_WEIGHTS = (1 << np.arange(63, -1, -1, dtype=np.uint64)).astype(np.uint64)


def phash_bits(image: Image.Image) -> np.ndarray:
    """The 64 hash bits (8x8 bool, row-major) of a PIL image."""
    side = HASH_SIZE * HIGHFREQ_FACTOR
    pixels = np.asarray(image.convert("L").resize((side, side), Image.Resampling.LANCZOS), dtype=np.float64)
    low = dct(dct(pixels, axis=0), axis=1)[:HASH_SIZE, :HASH_SIZE]
    return low > np.median(low)


def phash(image: Image.Image) -> int:
    """The pHash as a signed 64-bit integer (the parquet ``phash`` column)."""
    bits = phash_bits(image).reshape(-1).astype(np.uint64)
    return int(np.sum(bits * _WEIGHTS, dtype=np.uint64).astype(np.int64))


def hamming(a: int, b: int) -> int:
    """Bits that differ between two int64 pHashes."""
    return bin((int(a) ^ int(b)) & (2**64 - 1)).count("1")
