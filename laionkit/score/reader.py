"""score's DataLoader side: each worker reads whole input shards through encode's reader (tars, img2dataset
parquet and files formats, local or URL), decodes each image once, and turns it into everything the
device needs (CLIP and watermark pixels as uint8) and everything hashed on the CPU (sha256 of the
bytes, pHash, size). With ``--decode device`` a worker hashes the bytes and reads the header only, and ships
the JPEG itself where the device decodes it; with ``draft-device`` it decodes every file (JPEGs at the draft
scale) and ships the RGB (laionkit.score.pixels makes pixels and pHash on the device in both).

Batches never span shards and follow the shard's sample order, so outputs do not depend on workers or
ranks. A shard's first batches ramp up (batch_size / 8, / 4, / 2, then batch_size: ``batch_sizes``), so the
device gets work once a worker has prepared 1/8 of a batch, not a whole one, at the start of a run when every
worker fills its first batch at once; the ramp is the shard's, never the worker's, so it too is the same for any
workers. Per-sample problems become recorded skips (``ShardDone.skips``); a broken shard is an error.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack

import numpy as np
import torch
import torch.utils.data
from PIL import Image

from laionkit.common import LaionkitError
from laionkit.common.jpeg import joined
from laionkit.common.phash import phash, sha256_hex
from laionkit.common.storage import Location
from laionkit.encode.reader import (
    IMAGE_EXTENSIONS,
    ShardDone,
    caption_of,
    caption_texts,
    shard_stem,
    unit_samples,
    worker_share,
)
from laionkit.score.models import WATERMARK_SIZE
from laionkit.score.pixels import device_decodable, pad_stacks

RAMP = 8  # a shard's first batch holds batch_size / RAMP samples; each next one twice as many, up to batch_size


def batch_sizes(batch_size: int) -> Iterator[int]:
    """The sizes of a shard's batches in order: the ramp, then ``batch_size`` for ever."""
    size = max(1, batch_size // RAMP)
    while size < batch_size:
        yield size
        size *= 2
    while True:
        yield batch_size


def split_clip_transform(preprocess) -> tuple[Callable | None, tuple | None]:
    """open_clip's eval transform as (PIL part, (mean, std)) when it is ``PIL ops, ToTensor, Normalize``:
    workers then ship uint8 pixels and the device divides by 255 and normalises (a quarter of the bytes
    over PCIe). Any other shape: (None, None), and workers run the whole transform."""
    from torchvision import transforms as T

    steps = list(getattr(preprocess, "transforms", []))  # open_clip's MaybeToTensor is a ToTensor
    if len(steps) < 2 or not isinstance(steps[-2], T.ToTensor) or not isinstance(steps[-1], T.Normalize) \
            or any(isinstance(step, (T.ToTensor, T.Normalize)) for step in steps[:-2]):
        return None, None
    return T.Compose(steps[:-2]), (tuple(steps[-1].mean), tuple(steps[-1].std))


class ScoreSamples(torch.utils.data.IterableDataset):
    """Batches of one rank's shards (<= batch_size samples of one shard, in order, ramping up at the shard's
    start: ``batch_sizes``) and a ShardDone after each shard; DataLoader workers each take whole shards."""

    def __init__(self, shards: Sequence[Location], clip_transform: Callable, clip_uint8: bool, watermark: bool,
                 batch_size: int, caption_key: str | None = None, draft_side: int | None = None,
                 captions: Sequence[str] | None = None, device_decode: bool = False,
                 device_jpegs: bool = True, tokenizer: Callable | None = None, stack_pixels: int | None = None) -> None:
        super().__init__()
        # --decode draft-device where the device resamples stacks: workers pad their RGB into the stacks of at most
        # this many pixels (laionkit.score.pixels.pad_stacks), so the device takes each as one view
        self.stack_pixels = stack_pixels
        # CLIP's tokenizer: the workers tokenize each batch's captions (``tokens``, and ``caption_tokens`` per
        # --captions name), which the main thread did per batch beside launching the models (open_clip's BPE and
        # ftfy in Python: tens of ms per batch of 512); None: the main thread tokenizes
        self.tokenizer = tokenizer
        # --decode device / draft-device: workers ship Pillow's RGB (JPEGs at draft_side) and, with device_jpegs
        # (device), the JPEGs the device decodes as bytes; laionkit.score.pixels makes the pixels and pHash there
        self.device_decode = device_decode
        self.device_jpegs = device_jpegs
        self.captions = tuple(captions or ())  # --captions: each named caption's text ("" where the sample lacks it)
        self.draft_side = draft_side  # --decode draft: JPEGs decoded at the smallest DCT scale keeping this side
        self.shards = list(shards)
        self.clip_transform = clip_transform
        self.clip_uint8 = clip_uint8
        self.watermark = watermark
        self.batch_size = batch_size
        self.caption_key = caption_key

    def __iter__(self) -> Iterator[dict | ShardDone]:
        for shard in worker_share(self.shards):
            yield from self.shard_batches(shard)

    def shard_batches(self, shard: Location) -> Iterator[dict | ShardDone]:
        shard = Location.parse(shard)
        done = ShardDone(shard_stem(shard), 0)
        items: list[dict] = []
        sizes = batch_sizes(self.batch_size)
        size = next(sizes)
        stream = ExitStack()
        try:
            for sample in unit_samples(shard, stream):
                done.samples_in += 1
                try:
                    items.append(self.prepare(sample))
                except Exception as error:  # noqa: BLE001 - any decode failure is a recorded skip
                    done.skips.append({"key": sample["__key__"], "reason": getattr(error, "reason", "undecodable"),
                                       "error": f"{type(error).__name__}: {error}"[:500]})
                    continue
                if len(items) == size:
                    yield self.tokenize(self.collate(done.shard, items, self.stack_pixels))
                    items, size = [], next(sizes)
        except (OSError, ValueError, tarfile.TarError) as error:
            raise LaionkitError(f"cannot read shard {shard}: {error}") from error
        finally:
            stream.close()
        if items:
            yield self.tokenize(self.collate(done.shard, items, self.stack_pixels))
        yield done

    def tokenize(self, batch: dict) -> dict:
        """The batch with its captions' CLIP token ids (a caption named by --captions equal to the default one, as
        ``alt`` usually is, shares its ids)."""
        if self.tokenizer is not None:
            batch["tokens"] = self.tokenizer(batch["caption"])
            if "captions" in batch:
                batch["caption_tokens"] = {name: batch["tokens"] if texts == batch["caption"] else self.tokenizer(texts)
                                           for name, texts in batch["captions"].items()}
        return batch

    def prepare(self, sample: dict) -> dict:
        extension = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
        if extension is None:
            error = ValueError(f"no image member ({', '.join(IMAGE_EXTENSIONS)})")
            error.reason = "no_image"
            raise error
        try:
            meta = json.loads(sample["json"]) if "json" in sample else None
        except ValueError as error:
            error.reason = "bad_json"
            raise
        data = sample[extension]
        item = {"key": sample["__key__"], "source": json.dumps(meta, sort_keys=True) if meta is not None else None,
                "caption": caption_of(sample, meta, self.caption_key),
                # img2dataset's compute_hash: sha256 of the image bytes as stored
                "sha256": sha256_hex(data)}
        if self.captions:
            texts, _ = caption_texts(sample, meta, self.captions, self.caption_key)  # encode's resolution, one definition
            item["captions"] = {name: texts.get(name, "") for name in self.captions}
        with Image.open(io.BytesIO(data)) as image:
            item.update(width=image.width, height=image.height)
            if self.device_decode and self.device_jpegs and device_decodable(image, data):  # the JPEG itself: decoded on the device
                item["images"] = data  # bytes: collate puts the batch's files end to end
                return item
            if self.draft_side and image.format == "JPEG":
                image.draft("RGB", (self.draft_side, self.draft_side))
            image.load()
            rgb = image.convert("RGB")
        if self.device_decode:  # decoded here (JPEGs at draft_side's reduced scale), resized on the device
            item["images"] = np.asarray(rgb)
            return item
        clip = self.clip_transform(rgb)
        item.update(phash=phash(rgb), clip=np.asarray(clip) if self.clip_uint8 else clip)
        if self.watermark:  # LAION's T.Resize((256, 256)) on a PIL image: a bilinear (antialiased) squash
            item["watermark"] = np.asarray(rgb.resize((WATERMARK_SIZE, WATERMARK_SIZE), Image.Resampling.BILINEAR))
        return item

    @staticmethod
    def collate(shard: str, items: list[dict], stack_pixels: int | None = None) -> dict:
        batch = {name: [item[name] for item in items]
                 for name in ("key", "source", "caption", "width", "height", "sha256", "phash", "images")
                 if name in items[0]}
        batch["shard"] = shard
        if "captions" in items[0]:
            batch["captions"] = {name: [item["captions"][name] for item in items] for name in items[0]["captions"]}
        for name in ("clip", "watermark"):  # the worker-resize paths; the device-pixel modes ship "images" instead
            if name in items[0]:
                pixels = [item[name] for item in items]
                batch[name] = (joined(pixels).view(len(items), *pixels[0].shape) if isinstance(pixels[0], np.ndarray)
                               else torch.stack(pixels))  # uint8 arrays, or the whole transform's float tensors
        if "images" in batch:  # device-pixel modes: the JPEGs end to end as one tensor and the worker-decoded RGB
            # as another (one shared-memory handle and one pin each per batch, not one per image); a row holds its
            # JPEG's length (an int) or its RGB's (H, W, 3) shape (a tuple)
            rows = batch["images"]
            batch["jpegs"] = joined([image for image in rows if isinstance(image, bytes)])
            if stack_pixels and not any(isinstance(image, bytes) for image in rows):
                batch["rgb"], batch["stacks"] = pad_stacks(rows, stack_pixels)  # the device's stacks, padded here
            else:
                batch["rgb"] = joined([image for image in rows if not isinstance(image, bytes)])
            batch["images"] = [len(image) if isinstance(image, bytes) else image.shape for image in rows]
        return batch
