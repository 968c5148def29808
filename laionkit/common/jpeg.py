"""JPEG decode on the stage's device, shared by encode's and score's device decode paths (``encode --decode gpu``,
``score --decode device``).

``decode_jpegs`` decodes a batch with torchvision's ``decode_jpeg`` (nvJPEG on CUDA: the hardware decoder of
A100/H100/H200 for baseline JPEGs; libjpeg-turbo on the CPU). One file it refuses fails the whole call, so the
batch is then decoded one by one, and a file the device refuses alone is decoded with Pillow; what Pillow refuses
too comes back as its error text, for the caller to record as a skip.

``joined`` / ``unjoin``: a batch's files travel from the DataLoader workers as one flat uint8 tensor and their
lengths (one shared-memory handle and one pin per batch, not one per file), as encode's and score's collates
ship them.
"""

from __future__ import annotations

import io
import itertools
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.utils.data
from PIL import Image


def decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """(3, H, W) uint8 RGB on ``device`` per 1-D uint8 tensor of JPEG bytes, or the error text of a file that
    neither the device nor Pillow decodes."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not encoded:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision warns of CMYK / corrupt-data fallbacks per file
        try:
            return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            pass
        return [_decode_one(data, device) for data in encoded]


def _decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor | str:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            rgb = np.asarray(image.convert("RGB")).copy()
    except Exception as error:  # noqa: BLE001 - undecodable everywhere: the caller's recorded skip
        return f"{type(error).__name__}: {error}"[:500]
    return torch.from_numpy(rgb).to(device).permute(2, 0, 1)


def joined(parts: Sequence[bytes | np.ndarray]) -> torch.Tensor:
    """``parts`` (bytes or uint8 arrays) end to end in one flat uint8 tensor: one copy each. Inside a DataLoader
    worker the tensor is made in shared memory, as torch's own default_collate makes its batches, so handing it to
    the main process copies nothing more."""
    sizes = [len(part) if isinstance(part, bytes) else part.size for part in parts]
    out = worker_buffer(sum(sizes))
    flat = out.numpy()
    start = 0
    for part, size in zip(parts, sizes):
        flat[start:start + size] = np.frombuffer(part, dtype=np.uint8) if isinstance(part, bytes) else part.reshape(-1)
        start += size
    return out


def unjoin(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """``joined``'s parts back, as views of ``flat``, given their lengths in order."""
    ends = list(itertools.accumulate([0, *sizes]))
    return [flat[start:end] for start, end in zip(ends, ends[1:])]


def worker_buffer(size: int) -> torch.Tensor:
    """A flat uint8 tensor of ``size`` bytes to collate into (not cleared); inside a DataLoader worker in shared
    memory, as torch's own default_collate makes its batches, so handing it over copies nothing more."""
    if torch.utils.data.get_worker_info() is not None and size:
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
    return torch.empty(size, dtype=torch.uint8)
