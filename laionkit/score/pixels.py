"""score ``--decode device`` and ``draft-device``: images resized and hashed on the stage's device instead of in
DataLoader workers (``device``: baseline JPEGs decoded there too).

On a host with few CPU cores per GPU, decoding and resizing in the workers bounds the stage (docs/BENCHMARKS.md,
score). With ``--decode device`` the workers only read the shard, hash the bytes and parse the JPEG header; the
main process then decodes a whole batch with torchvision's ``decode_jpeg`` on the device (nvJPEG on CUDA: the
A100/H100/H200 hardware decoder for baseline JPEGs) and makes every model input there:

* CLIP pixels: the model's own open_clip preprocess (``Resize`` + ``CenterCrop``) applied to the uint8 tensor;
  torchvision's antialiased tensor resize follows Pillow's filters, so pixels differ from the exact path's by a
  few levels at most;
* watermark pixels: the 256x256 antialiased bilinear squash of LAION's ``T.Resize((256, 256))``;
* pHash: Pillow's ``L`` conversion and antialiased Lanczos resize to 32x32 as float matrices (Pillow rounds
  between its passes; this rounds once), then imagehash's DCT and median: a bit may differ from the exact
  pHash where a coefficient sits at the median.

What the device cannot take is decoded by the worker with Pillow and shipped as RGB (JPEGs at the reduced DCT
scale of ``--decode draft``, other files at full size): progressive JPEGs (nvJPEG decodes those on the host, one
at a time), CMYK JPEGs, JPEGs over 16 MP, files that do not end in the JPEG end-of-image marker (truncated
downloads: the worker's decode then fails, a recorded skip as in the exact path) and every other format. A JPEG
the device decoder refuses is decoded alone with Pillow (laionkit.common.jpeg), or skipped ("undecodable") when
Pillow refuses it too. The main process does this one batch ahead in a thread, on its own CUDA stream; on a CPU
device it decodes with libjpeg-turbo (tests, parity).

``--decode draft-device`` sends every file down the worker path above (JPEGs at the draft scale): the decode stays
on the CPU cores and the resizing and pHash, the other half of a ``draft`` worker's time, run here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from PIL import Image

from laionkit.common.jpeg import decode_jpegs, unjoin
from laionkit.common.phash import DCT, HASH_SIZE, IMAGE_SIZE
from laionkit.score.models import WATERMARK_SIZE

JPEG_END = b"\xff\xd9"
# larger images are decoded by the workers: a batch's decoded images are on the device together (512 images of
# 16 MP would be 25 GB), and web crawls without pack's resize hold a few huge files
DEVICE_MAX_PIXELS = 4096 * 4096
LANCZOS_SUPPORT = 3.0
PER_SAMPLE = ("key", "source", "caption", "width", "height", "sha256")
# the 64 pHash bits, most significant first, as a signed int64: the first bit weighs -2**63 (two's complement)
_BIT_WEIGHTS = [-(1 << 63)] + [1 << (63 - bit) for bit in range(1, 64)]


def device_decodable(image: Image.Image, data: bytes) -> bool:
    """Whether the main process decodes this file on the device (else the worker decodes it with Pillow)."""
    return (image.format == "JPEG" and image.mode in ("RGB", "L") and not image.info.get("progressive")
            and data.endswith(JPEG_END) and image.width * image.height <= DEVICE_MAX_PIXELS)


def lanczos_weights(size_in: int, size_out: int, device: torch.device) -> torch.Tensor:
    """(size_out, size_in) float64: Pillow's antialiased Lanczos-3 resampling along one axis (its
    ``precompute_coeffs``: the filter stretched by the scale when reducing, each row normalised)."""
    scale = size_in / size_out
    stretch = max(scale, 1.0)
    support = LANCZOS_SUPPORT * stretch
    center = (torch.arange(size_out, dtype=torch.float64, device=device)[:, None] + 0.5) * scale
    x = torch.arange(size_in, dtype=torch.float64, device=device)[None, :]
    low = torch.floor(center - support + 0.5).clamp(min=0)
    high = torch.floor(center + support + 0.5).clamp(max=size_in)
    t = (x - center + 0.5) / stretch

    def sinc(v: torch.Tensor) -> torch.Tensor:
        safe = torch.where(v == 0, torch.ones_like(v), v) * math.pi
        return torch.where(v == 0, torch.ones_like(v), torch.sin(safe) / safe)

    weights = sinc(t) * sinc(t / LANCZOS_SUPPORT) * ((t >= -LANCZOS_SUPPORT) & (t < LANCZOS_SUPPORT))
    weights = weights * ((x >= low) & (x < high))
    return weights / weights.sum(dim=1, keepdim=True)


def luma(rgb: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) uint8 -> (..., H, W) float64: Pillow's RGB -> L (ITU-R 601-2 luma in 16-bit fixed point,
    rounded)."""
    r, g, b = rgb.to(torch.int32).unbind(-3)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).double()


class DevicePixels:
    """Turns a batch of ``ScoreSamples(device_decode=True)`` (``jpegs``: the batch's JPEG files end to end in one
    uint8 tensor; ``images``: per row the length of its file there, or its worker-decoded (H, W, 3) uint8 RGB)
    into the inputs the models take, on ``device``: ``clip`` and ``watermark`` as (B, H, W, 3) uint8 (the
    layout the worker path ships) and ``phash`` as int64.

    Images of one size are resized together: pack's default ``--resize-mode center_crop`` makes every image of
    a shard the same size, so a batch is then one resize per input instead of one per image."""

    def __init__(self, clip_transform, watermark: bool, device: torch.device) -> None:
        self.clip_transform = clip_transform  # open_clip's PIL-side steps, which take tensors as well
        self.watermark = watermark
        self.device = device
        self._lanczos: dict[int, torch.Tensor] = {}
        # pHash in float64 as imagehash's numpy: a TF32 matmul (where a process allows it) would move coefficients
        self._dct = torch.from_numpy(DCT).to(device)
        self._bits = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=device)

    def __call__(self, batch: dict) -> tuple[dict, list[dict]]:
        """(the batch with clip / watermark / phash and without undecodable samples, their skip records)."""
        images = self.decode(batch.pop("jpegs"), batch.pop("rgb"), batch.pop("images"))
        skips = [{"key": batch["key"][index], "reason": "undecodable", "error": error}
                 for index, error in enumerate(images) if isinstance(error, str)]
        if skips:
            keep = [index for index, image in enumerate(images) if not isinstance(image, str)]
            batch = {**batch, **{name: [batch[name][index] for index in keep] for name in PER_SAMPLE}}
            if "captions" in batch:
                batch["captions"] = {name: [texts[index] for index in keep] for name, texts in batch["captions"].items()}
            images = [images[index] for index in keep]
        if images:
            sizes: dict[tuple[int, ...], list[int]] = {}
            for index, image in enumerate(images):
                sizes.setdefault(tuple(image.shape), []).append(index)
            groups = [torch.stack([images[index] for index in rows]) for rows in sizes.values()]
            order = [index for rows in sizes.values() for index in rows]
            back = torch.argsort(torch.tensor(order, device=self.device))  # the groups' rows -> the batch's order
            batch["clip"] = torch.cat([self.clip_transform(group) for group in groups])[back].permute(0, 2, 3, 1)
            if self.watermark:
                batch["watermark"] = torch.cat([self._squash(group) for group in groups])[back].permute(0, 2, 3, 1)
            batch["phash"] = self.phash(groups)[back]
        return batch, skips

    def decode(self, jpegs: torch.Tensor, rgb: torch.Tensor, rows: list[int | Sequence[int]]
               ) -> list[torch.Tensor | str]:
        """(3, H, W) uint8 RGB on the device per row, or the error text of one that cannot be decoded. A row is
        its JPEG's length in ``jpegs`` (decoded here) or the (H, W, 3) shape of its worker-decoded RGB in ``rgb``."""
        images: list[torch.Tensor | str] = [None] * len(rows)  # type: ignore[list-item]
        files = unjoin(jpegs, [row for row in rows if isinstance(row, int)])
        indices = [index for index, row in enumerate(rows) if isinstance(row, int)]
        for index, image in zip(indices, decode_jpegs(files, self.device)):
            images[index] = image
        decoded = rgb.to(self.device, non_blocking=True)  # one copy for the batch's worker-decoded images
        start = 0
        for index, row in enumerate(rows):
            if not isinstance(row, int):  # a shape (the DataLoader may hand the tuple over as a list)
                end = start + math.prod(row)
                images[index] = decoded[start:end].view(*row).permute(2, 0, 1)
                start = end
        return images

    def _squash(self, images: torch.Tensor) -> torch.Tensor:
        """LAION's watermark input: Pillow's antialiased bilinear resize to 256x256, uint8 (N, 3, 256, 256)."""
        resized = F.interpolate(images.float(), size=(WATERMARK_SIZE, WATERMARK_SIZE), mode="bilinear",
                                antialias=True, align_corners=False)
        return resized.round_().clamp_(0, 255).to(torch.uint8)

    def _weights(self, size: int) -> torch.Tensor:
        if size not in self._lanczos:
            if len(self._lanczos) > 4096:  # web images come in many sizes: bound the cache
                self._lanczos.clear()
            self._lanczos[size] = lanczos_weights(size, IMAGE_SIZE, self.device)
        return self._lanczos[size]

    def phash(self, groups: list[torch.Tensor]) -> torch.Tensor:
        """int64 pHashes (laionkit.common.phash's definition) of groups of same-size (N, 3, H, W) uint8 images,
        in the groups' order, on the device."""
        small = torch.cat([self._weights(group.shape[2]) @ luma(group) @ self._weights(group.shape[3]).T
                           for group in groups]).round_().clamp_(0, 255)  # Pillow's L image is uint8
        low = self._dct @ small @ self._dct.T  # (B, 8, 8): the lowest frequencies, DC included
        flat = low.reshape(len(small), HASH_SIZE * HASH_SIZE)
        # numpy's median of 64 values: the mean of the two middle ones
        middle = flat.sort(dim=1).values[:, HASH_SIZE * HASH_SIZE // 2 - 1: HASH_SIZE * HASH_SIZE // 2 + 1].mean(1)
        return ((flat > middle[:, None]).to(torch.int64) * self._bits).sum(1)
