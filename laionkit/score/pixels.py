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
on the CPU cores and the resizing and pHash, the other half of a ``draft`` worker's time, run here. Where the
device resamples stacks (below), the workers also pad their images into those stacks (``pad_stacks``), so the
device takes each stack as one view of the batch's copied tensor.

Web images come in many sizes, so a batch is resampled as a few padded stacks, not image by image (which would be
some 25 small kernels per image, launched from Python: a bound of its own beside the model). Antialiased
resampling along an axis is a matrix (Pillow's ``precompute_coeffs``, which torchvision's antialiased resize
follows): each image's rows of that matrix, zero past its own size, turn a stack of images padded to the largest
one into the stack of outputs with two batched matrix products. Resize + CenterCrop is one such matrix (the
crop's rows of the resize's). Each image then costs one copy into its stack; a stack holds at most
``PAD_PIXELS`` padded pixels, so a few huge files do not pad a whole batch to their size. A CLIP preprocess of
another shape than ``Resize`` (+ ``CenterCrop``) with bicubic or bilinear antialiasing is applied per group of
same-size images, as torchvision runs it; so is every batch on a CPU device, where the matrices' zeros cost more
than the launches they save.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from laionkit.common.background import device_tensor
from laionkit.common.jpeg import decode_jpegs, unjoin, worker_buffer
from laionkit.common.phash import DCT, HASH_SIZE, IMAGE_SIZE
from laionkit.score.models import WATERMARK_SIZE

JPEG_END = b"\xff\xd9"
# larger images are decoded by the workers: a batch's decoded images are on the device together (512 images of
# 16 MP would be 25 GB), and web crawls without pack's resize hold a few huge files
DEVICE_MAX_PIXELS = 4096 * 4096
LANCZOS_SUPPORT = 3.0
PAD_PIXELS = 1 << 25  # padded pixels (images x largest height x largest width) in one resampled stack
PER_SAMPLE = ("key", "source", "caption", "width", "height", "sha256")
# the 64 pHash bits, most significant first, as a signed int64: the first bit weighs -2**63 (two's complement)
_BIT_WEIGHTS = [-(1 << 63)] + [1 << (63 - bit) for bit in range(1, 64)]


def device_decodable(image: Image.Image, data: bytes) -> bool:
    """Whether the main process decodes this file on the device (else the worker decodes it with Pillow)."""
    return (image.format == "JPEG" and image.mode in ("RGB", "L") and not image.info.get("progressive")
            and data.endswith(JPEG_END) and image.width * image.height <= DEVICE_MAX_PIXELS)


def _sinc(v: torch.Tensor) -> torch.Tensor:
    safe = torch.where(v == 0, torch.ones_like(v), v) * math.pi
    return torch.where(v == 0, torch.ones_like(v), torch.sin(safe) / safe)


def _bicubic(t: torch.Tensor) -> torch.Tensor:  # Pillow's (and torchvision's antialiased) cubic, a = -0.5
    t, a = t.abs(), -0.5
    return torch.where(t < 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                       torch.where(t < 2, (((t - 5) * t + 8) * t - 4) * a, torch.zeros_like(t)))


def _bilinear(t: torch.Tensor) -> torch.Tensor:
    return (1 - t.abs()).clamp(min=0)


def _lanczos(t: torch.Tensor) -> torch.Tensor:
    return _sinc(t) * _sinc(t / LANCZOS_SUPPORT) * ((t >= -LANCZOS_SUPPORT) & (t < LANCZOS_SUPPORT))


FILTERS = {"bicubic": (2.0, _bicubic), "bilinear": (1.0, _bilinear), "lanczos": (LANCZOS_SUPPORT, _lanczos)}


def resample_weights(size_in: torch.Tensor, resized: torch.Tensor, offset: torch.Tensor, out: int, length: int,
                     kind: str, max_scale: float | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(B, out, length) of ``dtype``: per image, rows ``offset`` .. ``offset + out`` of the antialiased resampling
    matrix from ``size_in`` to ``resized`` pixels along one axis (Pillow's ``precompute_coeffs``: the filter
    stretched by the scale when reducing, each row normalised), zero from ``size_in`` to ``length`` (the padding
    of a stack). ``size_in``, ``resized``, ``offset``: (B,) tensors on the device.

    Each row's weights are computed in float64 over its own window of input pixels only (Pillow's ``xmin`` ..
    ``xmax``) and put into the zero matrix: ``max_scale``, the largest ``size_in / resized`` of the batch (known on
    the host), bounds the window at ``2 * support * scale + 1`` pixels, some 10-50x fewer than ``length`` when
    reducing web images to CLIP's side, where the float64 elementwise work over whole padded axes was a large share
    of the pixels' device time (BENCHMARKS, score). None: a window as long as the axis."""
    support, kernel = FILTERS[kind]
    size_in, resized, offset = (value.to(torch.float64)[:, None, None] for value in (size_in, resized, offset))
    scale = size_in / resized
    stretch = scale.clamp(min=1.0)
    reach = support * stretch
    center = (torch.arange(out, dtype=torch.float64, device=scale.device)[None, :, None] + offset + 0.5) * scale
    low = torch.floor(center - reach + 0.5).clamp(min=0)
    high = torch.minimum(torch.floor(center + reach + 0.5), size_in)
    taps = length if max_scale is None else min(length, math.ceil(2 * support * max(max_scale, 1.0)) + 2)
    x = low + torch.arange(taps, dtype=torch.float64, device=scale.device)[None, None, :]  # (B, out, taps)
    weights = kernel((x - center + 0.5) / stretch) * (x < high)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)
    matrix = torch.zeros((*weights.shape[:2], length), dtype=dtype, device=scale.device)
    # taps past the window weigh 0 (added, so one that lands on a real tap's column changes nothing)
    return matrix.scatter_add_(2, x.long().clamp_(max=length - 1), weights)


def lanczos_weights(size_in: int, size_out: int, device: torch.device) -> torch.Tensor:
    """(size_out, size_in) float64: Pillow's antialiased Lanczos-3 resampling along one axis."""
    one = torch.ones(1, dtype=torch.float64, device=device)
    return resample_weights(one * size_in, one * size_out, one * 0, size_out, size_in, "lanczos")[0]


@dataclass(frozen=True)
class Resample:
    """A CLIP preprocess that is torchvision's antialiased ``Resize`` (+ ``CenterCrop``), as stacked matrices."""

    size: tuple[int, ...]  # Resize's: (short side,) or (height, width)
    max_size: int | None
    kind: str  # "bicubic" or "bilinear"
    crop: tuple[int, int] | None

    def geometry(self, height: int, width: int) -> tuple[int, int, int, int, int, int] | None:
        """(resized height, width, crop top, left, output height, width) of one image, as torchvision computes
        them; None where the crop would pad (torchvision pads with zeros: left to its own code)."""
        if len(self.size) == 2:
            new_h, new_w = self.size
        else:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.size[0], int(self.size[0] * long / short)
            if self.max_size is not None and new_long > self.max_size:
                new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        if self.crop is None:
            return new_h, new_w, 0, 0, new_h, new_w
        crop_h, crop_w = self.crop
        if crop_h > new_h or crop_w > new_w:
            return None
        return new_h, new_w, int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0)), crop_h, crop_w


PASS_THROUGH = ("MaybeConvertMode", "_convert_to_rgb")  # open_clip's steps that return tensors as they are


def plan_resample(transform) -> Resample | None:
    """``transform`` (open_clip's PIL-side steps) as a ``Resample``, or None where it is anything else."""
    from torchvision import transforms as T

    resize = crop = None
    for step in getattr(transform, "transforms", [transform]):
        if isinstance(step, T.Resize) and resize is None and crop is None:
            mode = step.interpolation
            if mode not in (T.InterpolationMode.BICUBIC, T.InterpolationMode.BILINEAR) or step.antialias is False:
                return None
            resize = step
        elif isinstance(step, T.CenterCrop) and resize is not None and crop is None:
            crop = tuple(step.size) if len(step.size) == 2 else (step.size[0], step.size[0])
        elif type(step).__name__ not in PASS_THROUGH and getattr(step, "__name__", "") not in PASS_THROUGH:
            return None
    if resize is None:
        return None
    size = (resize.size,) if isinstance(resize.size, int) else tuple(resize.size)
    if len(size) == 1 and crop is None:  # outputs of several sizes: no stack to return
        return None
    return Resample(size, resize.max_size, resize.interpolation.value, crop)


def stacks(shapes: list[tuple[int, int]], budget: int) -> list[list[int]]:
    """Indices of ``shapes`` (height, width) grouped into stacks of at most ``budget`` padded pixels (a larger
    image alone), largest images first, so each stack pads to sizes near its own."""
    order = sorted(range(len(shapes)), key=lambda index: (-shapes[index][0] * shapes[index][1], index))
    groups: list[list[int]] = []
    height = width = 0
    for index in order:
        h, w = shapes[index]
        if groups and (len(groups[-1]) + 1) * max(height, h) * max(width, w) <= budget:
            groups[-1].append(index)
            height, width = max(height, h), max(width, w)
        else:
            groups.append([index])
            height, width = h, w
    return groups


def stack_layout(shapes: list[tuple[int, int]], budget: int) -> list[tuple[list[int], int, int]]:
    """``stacks`` with each stack's padded (height, width): (indices, height, width) per stack."""
    return [(rows, max(shapes[row][0] for row in rows), max(shapes[row][1] for row in rows))
            for rows in stacks(shapes, budget)]


def pad_stacks(images: Sequence[np.ndarray], budget: int) -> tuple[torch.Tensor, list[tuple[list[int], int, int]]]:
    """A DataLoader worker's side of the stacked path (``--decode draft-device``): its decoded (H, W, 3) uint8
    images already padded into the stacks the device resamples (``stacks``: at most ``budget`` padded pixels
    each), end to end in one flat tensor, each stack (images, height, width, 3) with zeros past an image's own
    size; and per stack (its images' rows in ``images``, height, width). The device then takes a stack as one
    view of the copied tensor, where it copied each image into place itself: ~5 Python-launched ops an image
    (~2,500 a batch of 512) in a thread beside the models' launches."""
    shapes = [(int(image.shape[0]), int(image.shape[1])) for image in images]
    layout = stack_layout(shapes, budget)
    out = worker_buffer(sum(len(rows) * height * width * 3 for rows, height, width in layout))
    for rows, stack in stack_views(out, layout):
        stack = stack.numpy()
        stack.fill(0)
        for slot, row in enumerate(rows):
            stack[slot, : shapes[row][0], : shapes[row][1]] = images[row]
    return out, layout


def stack_views(flat: torch.Tensor, layout: list[tuple[list[int], int, int]]) -> Iterator[tuple[list[int], torch.Tensor]]:
    """``pad_stacks``' stacks in ``flat`` (or a copy of it): (rows, (images, height, width, 3) view) each."""
    start = 0
    for rows, height, width in layout:
        size = len(rows) * height * width * 3
        yield rows, flat[start:start + size].view(len(rows), height, width, 3)
        start += size


def luma(rgb: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) uint8, or those values as float32 -> (..., H, W) float64: Pillow's RGB -> L (ITU-R 601-2 luma
    in 16-bit fixed point, rounded). Computed in float32, where every term and sum is an integer below 2**24 (at
    most 255 * 65536 + 32768), so exactly: the stacks' float32 pixels serve as they are, and each channel is a
    contiguous plane (the uint8 stacks are channels-last views)."""
    r, g, b = rgb.to(torch.float32).unbind(-3)
    return torch.floor((r * 19595 + g * 38470 + b * 7471 + 0x8000) / 65536).double()


class DevicePixels:
    """Turns a batch of ``ScoreSamples(device_decode=True)`` (``jpegs``: the batch's JPEG files end to end in one
    uint8 tensor; ``images``: per row the length of its file there, or its worker-decoded (H, W, 3) uint8 RGB)
    into the inputs the models take, on ``device``: ``clip`` and ``watermark`` as (B, H, W, 3) uint8 (the
    layout the worker path ships) and ``phash`` as int64.

    On an accelerator the batch's images are resampled in padded stacks (``stacked``, the module docstring);
    otherwise images of one size are resized together (pack's default ``--resize-mode center_crop`` makes every
    image of a shard the same size, so a batch is then one resize per input instead of one per image)."""

    def __init__(self, clip_transform, watermark: bool, device: torch.device, stacked: bool | None = None) -> None:
        self.clip_transform = clip_transform  # open_clip's PIL-side steps, which take tensors as well
        # stacked (padded stacks through resampling matrices): the default on accelerators, where per-image kernels
        # are launch-bound; a CPU computes the dense matrices' zeros, so it resamples per group of same-size images
        stacked = device.type != "cpu" if stacked is None else stacked
        self.resample = plan_resample(clip_transform) if stacked else None  # None: per group
        self.watermark = watermark
        self.device = device
        self._lanczos: dict[int, torch.Tensor] = {}
        # pHash in float64 as imagehash's numpy: a TF32 matmul (where a process allows it) would move coefficients
        self._dct = torch.from_numpy(DCT).to(device)
        self._bits = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=device)

    def __call__(self, batch: dict) -> tuple[dict, list[dict]]:
        """(the batch with clip / watermark / phash and without undecodable samples, their skip records)."""
        layout = batch.pop("stacks", None)
        if layout is not None and self.resample is not None:  # padded by the workers (pad_stacks): nothing to skip
            batch.pop("jpegs")
            made = self._from_stacks(batch.pop("rgb"), layout, [tuple(shape[:2]) for shape in batch.pop("images")])
            if made is not None:
                return self._with(batch, *made), []
            layout = None  # a crop that would pad: per group, as below, from the same tensor
        images = self.decode(batch.pop("jpegs"), batch.pop("rgb"), batch.pop("images"), layout)
        skips = [{"key": batch["key"][index], "reason": "undecodable", "error": error}
                 for index, error in enumerate(images) if isinstance(error, str)]
        if skips:
            keep = [index for index, image in enumerate(images) if not isinstance(image, str)]
            batch = {**batch, **{name: [batch[name][index] for index in keep] for name in PER_SAMPLE}}
            if "captions" in batch:
                batch["captions"] = {name: [texts[index] for index in keep] for name, texts in batch["captions"].items()}
            rows = torch.tensor(keep, dtype=torch.long)
            if "tokens" in batch:  # the workers' token ids (laionkit.score.reader.ScoreSamples.tokenize)
                batch["tokens"] = batch["tokens"][rows]
            if "caption_tokens" in batch:
                batch["caption_tokens"] = {name: ids[rows] for name, ids in batch["caption_tokens"].items()}
            images = [images[index] for index in keep]
        if images:
            made = self._stacked(images) if self.resample is not None else None
            batch = self._with(batch, *(made or self._grouped(images)))
        return batch, skips

    def _with(self, batch: dict, clip: torch.Tensor, watermark: torch.Tensor | None, hashes: torch.Tensor) -> dict:
        batch["clip"] = clip.permute(0, 2, 3, 1)
        if self.watermark:
            batch["watermark"] = watermark.permute(0, 2, 3, 1)
        batch["phash"] = hashes
        return batch

    def _grouped(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(clip, watermark, phash) with the CLIP preprocess run as torchvision runs it, per group of same-size
        images (any preprocess of PIL-side steps that takes tensors)."""
        sizes: dict[tuple[int, ...], list[int]] = {}
        for index, image in enumerate(images):
            sizes.setdefault(tuple(image.shape), []).append(index)
        groups = [torch.stack([images[index] for index in rows]) for rows in sizes.values()]
        order = [index for rows in sizes.values() for index in rows]
        back = torch.argsort(device_tensor(order, torch.long, self.device))  # the groups' rows -> the batch's order
        clip = torch.cat([self.clip_transform(group) for group in groups])[back]
        watermark = torch.cat([self._squash(group) for group in groups])[back] if self.watermark else None
        return clip, watermark, self.phash(groups)[back]

    def _stacked(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """(clip, watermark, phash) as uint8 (B, 3, H, W), uint8 (B, 3, 256, 256) and int64 (B,): the images
        padded into stacks and each output made by two batched matrix products per stack (module docstring);
        None where the CLIP crop would pad an image (then ``_grouped``)."""
        shapes = [(int(image.shape[1]), int(image.shape[2])) for image in images]
        geometry = self._geometry(shapes)
        if geometry is None:
            return None

        def padded(rows: list[int], height: int, width: int) -> torch.Tensor:
            stack = torch.zeros((len(rows), 3, height, width), dtype=torch.uint8, device=self.device)
            for slot, index in enumerate(rows):
                stack[slot, :, : shapes[index][0], : shapes[index][1]].copy_(images[index])
            return stack

        return self._resampled_stacks(shapes, geometry, ((rows, padded(rows, height, width))
                                                         for rows, height, width in stack_layout(shapes, PAD_PIXELS)))

    def _from_stacks(self, rgb: torch.Tensor, layout: list[tuple[list[int], int, int]], shapes: list[tuple[int, int]]
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """``_stacked``'s outputs from the stacks the workers padded (``pad_stacks``: ``rgb`` holds them end to
        end, ``layout`` says which images each holds): one copy to the device for the batch, a view per stack."""
        geometry = self._geometry(shapes)
        if geometry is None:
            return None
        views = stack_views(rgb.to(self.device, non_blocking=True), layout)
        return self._resampled_stacks(shapes, geometry, ((rows, stack.permute(0, 3, 1, 2)) for rows, stack in views))

    def _geometry(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int, int, int, int, int]] | None:
        """``Resample.geometry`` of each (height, width), or None where the stacks cannot take them (a CLIP crop
        would pad, or the outputs differ in size)."""
        geometry = [self.resample.geometry(*shape) for shape in shapes]
        if any(found is None for found in geometry) or len({found[4:] for found in geometry}) != 1:
            return None
        return geometry

    def _resampled_stacks(self, shapes: list[tuple[int, int]], geometry: list[tuple[int, int, int, int, int, int]],
                          padded_stacks) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The outputs of ``_stacked`` from (rows, (n, 3, H, W) uint8 padded stack) pairs covering ``shapes``
        (``geometry``: theirs, from ``_geometry``)."""
        out_h, out_w = geometry[0][4:]
        count = len(shapes)
        clip = torch.empty((count, 3, out_h, out_w), dtype=torch.uint8, device=self.device)
        watermark = (torch.empty((count, 3, WATERMARK_SIZE, WATERMARK_SIZE), dtype=torch.uint8, device=self.device)
                     if self.watermark else None)
        small = torch.empty((count, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.float64, device=self.device)
        for rows, padded in padded_stacks:
            height, width = padded.shape[2:]
            # per image: height, width, then the CLIP resize's height, width, crop top, left (host -> device once)
            params = [[*shapes[index], *geometry[index][:4]] for index in rows]
            h, w, new_h, new_w, top, left = device_tensor(params, torch.float64, self.device).unbind(1)
            zero, where = torch.zeros_like(h), device_tensor(rows, torch.long, self.device)
            # the largest reduction along each axis (host numbers): the weights' windows (resample_weights); for the
            # fixed-size squashes, the stack's own height and width (those of its tallest and widest images)
            scale_h, scale_w = (max(param[axis] / param[axis + 2] for param in params) for axis in (0, 1))
            pixels = padded.to(torch.float32, memory_format=torch.contiguous_format)
            kind = self.resample.kind
            clip[where] = _resampled(pixels, resample_weights(h, new_h, top, out_h, height, kind, scale_h, torch.float32),
                                     resample_weights(w, new_w, left, out_w, width, kind, scale_w, torch.float32))
            if watermark is not None:  # LAION's T.Resize((256, 256)): an antialiased bilinear squash
                side = torch.full_like(h, WATERMARK_SIZE)
                watermark[where] = _resampled(
                    pixels, resample_weights(h, side, zero, WATERMARK_SIZE, height, "bilinear", height / WATERMARK_SIZE,
                                             torch.float32),
                    resample_weights(w, side, zero, WATERMARK_SIZE, width, "bilinear", width / WATERMARK_SIZE, torch.float32))
            side = torch.full_like(h, IMAGE_SIZE)
            small[where] = (resample_weights(h, side, zero, IMAGE_SIZE, height, "lanczos", height / IMAGE_SIZE) @ luma(pixels)
                            @ resample_weights(w, side, zero, IMAGE_SIZE, width, "lanczos", width / IMAGE_SIZE).transpose(1, 2))
        return clip, watermark, self._hash(small.round_().clamp_(0, 255))  # Pillow's L image is uint8

    def decode(self, jpegs: torch.Tensor, rgb: torch.Tensor, rows: list[int | Sequence[int]],
               layout: list[tuple[list[int], int, int]] | None = None) -> list[torch.Tensor | str]:
        """(3, H, W) uint8 RGB on the device per row, or the error text of one that cannot be decoded. A row is
        its JPEG's length in ``jpegs`` (decoded here) or the (H, W, 3) shape of its worker-decoded RGB in ``rgb``
        (end to end, or padded into the stacks of ``layout``: ``pad_stacks``)."""
        images: list[torch.Tensor | str] = [None] * len(rows)  # type: ignore[list-item]
        if layout is not None:
            for stack_rows, stack in stack_views(rgb.to(self.device, non_blocking=True), layout):
                for slot, row in enumerate(stack_rows):
                    images[row] = stack[slot, : rows[row][0], : rows[row][1]].permute(2, 0, 1)
            return images
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
        return self._hash(small)

    def _hash(self, small: torch.Tensor) -> torch.Tensor:
        """int64 pHashes of (B, 32, 32) float64 grey images: imagehash's DCT and median."""
        low = self._dct @ small @ self._dct.T  # (B, 8, 8): the lowest frequencies, DC included
        flat = low.reshape(len(small), HASH_SIZE * HASH_SIZE)
        # numpy's median of 64 values: the mean of the two middle ones
        middle = flat.sort(dim=1).values[:, HASH_SIZE * HASH_SIZE // 2 - 1: HASH_SIZE * HASH_SIZE // 2 + 1].mean(1)
        return ((flat > middle[:, None]).to(torch.int64) * self._bits).sum(1)


def _resampled(pixels: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, out_h, out_w): each image of a padded float stack (B, C, H, W) through its own (B, out_h, H)
    row and (B, out_w, W) column weights (rounded once, where Pillow rounds between its two passes)."""
    dtype = pixels.dtype
    out = rows.to(dtype)[:, None] @ pixels @ columns.to(dtype).transpose(1, 2)[:, None]
    return out.round_().clamp_(0, 255).to(torch.uint8)
