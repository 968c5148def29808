"""laionkit encode: pack's image shards -> VAE posterior moments + text hidden states (docs/FORMATS.md section 3).

Data flows one way through four stages, each bounded so memory stays flat:

    DataLoader workers      read tars, decode + resize on CPU (or pass JPEG bytes on), tokenize, batch by size
    -> prepare thread       host->GPU copy, nvjpeg decode + resize on its own CUDA stream
    -> main thread          VAE encode + text encode (bf16/fp16; channels_last only when compiled)
    -> writer thread        GPU->host copy lands, one tar per input shard, renamed when complete

The shard is the unit of work, of resume and of record: each worker owns whole shards, so every batch
belongs to one shard and each output tar is written sequentially. Batch composition depends only on
the shard and the options, never on ranks or workers, so outputs are identical for any split.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import queue
import tarfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image
from tqdm import tqdm

from laionkit.common import (
    LaionkitError,
    Rank,
    refuse_other_settings,
    resolve_rank,
    split,
    storage,
    versions,
)
from laionkit.common.models import (
    PRESETS,
    fingerprint,
    load_text_encoder,
    load_tokenizer,
    load_vae,
    load_vae_config,
)
from laionkit.common.storage import Location
from laionkit.common.tars import count_samples
from laionkit.families import DEFAULT_FAMILY, FamilySpec, detect_family, get_family

IMAGE_EXTENSIONS = ("jpg", "jpeg", "webp", "png")
TEXT_LAYERS = ("last", "penultimate")
DECODE_MODES = ("auto", "cpu", "gpu")
COMPUTE_DTYPES = ("auto", "fp32", "fp16", "bf16")
RECORD_SUFFIX = ".stats.json"
MANIFEST = "manifest.json"
PLAN = "plan.json"
EMPTY_CAPTION = "empty_caption.npy"
FORMAT = "laionkit-latents/1"
RERUN_REMEDY = "write to a new --output or remove the old shards"
# Samples in flight between stages (in batches); bounds host and GPU memory.
QUEUE_DEPTH = 4
# --decode auto: nvjpeg only when few CPU workers. On an H200 with 15 workers, worker (PIL) decode beat
# nvjpeg decode, whose per-image resize runs in the main process (docs/BENCHMARKS.md, encode).
GPU_DECODE_BELOW_WORKERS = 4
TEXT_MODES = ("stored", "online")


@dataclass(frozen=True)
class EncodeConfig:
    shards: tuple[str, ...]
    output: str | Path  # a folder or a URL (s3://...)
    model: str = "sd15"
    vae: str | None = None
    text_encoder: str | None = None
    tokenizer: str | None = None
    text_layer: str | None = None
    resolution: int = 512
    buckets: bool = False
    batch_size: int = 32
    workers: int = 4
    decode: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    device: str | None = None
    rank: int | None = None
    world_size: int | None = None
    quiet: bool = False
    storage_options: str | None = None  # --storage-options JSON for URL paths
    text: str = "stored"  # stored: text-encoder outputs per sample; online: token ids, train runs the encoders

    def __post_init__(self) -> None:
        choices = {"decode": DECODE_MODES, "dtype": COMPUTE_DTYPES, "text": TEXT_MODES}
        if self.text_layer is not None:
            choices["text_layer"] = TEXT_LAYERS
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise LaionkitError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                                    f"got {getattr(self, name)!r}")
        if self.resolution < 8 or self.resolution % 8:
            raise LaionkitError(f"--resolution must be a positive multiple of 8, got {self.resolution}")
        if self.batch_size < 1 or self.workers < 0:
            raise LaionkitError("--batch-size must be >= 1 and --workers >= 0")

    def source(self, component: str) -> str:
        """Where a component loads from: its own flag (--vae, --text-encoder, --tokenizer), else --model."""
        given = getattr(self, component, None)
        if given:
            return given
        if self.model in PRESETS:  # laionkit's own presets (sd15, sd2, sdxl) resolve in common.models
            return self.model
        return self.family.presets.get(self.model, self.model)  # a family's preset: its hub repo

    @property
    def family(self) -> FamilySpec:
        """The model family, from --model (preset or model_index.json): it decides the encoders run."""
        return detect_family(self.model)

    @property
    def layer(self) -> str:
        fixed = self.family.text_layer
        if fixed is not None:
            if self.text_layer not in (None, fixed):
                raise LaionkitError(f"--text-layer {self.text_layer}: family {self.family.name} (from --model "
                                    f"{self.model}) is conditioned on the {fixed} layer only")
            return fixed
        if self.text_layer:
            return self.text_layer
        return PRESETS[self.model].text_layer if self.model in PRESETS else "last"


# --- geometry: pure functions ------------------------------------------------------------------

def bucket_sizes(resolution: int, max_ratio: float = 2.0) -> list[tuple[int, int]]:
    """Aspect-ratio buckets of (about) resolution**2 pixels: sides step by resolution/8, rounded to 8 px.

    Each width gets the tallest height that keeps the area within resolution**2, as in NovelAI's
    bucketing; the square bucket is always present. Sorted by aspect ratio (w/h).
    """
    step = max(8, resolution // 8 // 8 * 8)
    area = resolution * resolution
    sizes = {(resolution, resolution)}
    for width in range(step, int(resolution * math.sqrt(max_ratio)) + 1, step):
        height = area // width // step * step
        if height >= step and 1 / max_ratio <= width / height <= max_ratio:
            sizes.add((width, height))
    return sorted(sizes, key=lambda size: (size[0] / size[1], size[0]))


def target_size(width: int, height: int, resolution: int, buckets: Sequence[tuple[int, int]] | None
                ) -> tuple[int, int]:
    """Square resolution, or the bucket nearest in log aspect ratio (ties go to the first)."""
    if not buckets:
        return resolution, resolution
    ratio = math.log(width / height)
    return min(buckets, key=lambda size: abs(math.log(size[0] / size[1]) - ratio))


def center_crop_box(width: int, height: int, out_width: int, out_height: int) -> tuple[int, int, int, int]:
    """The centred (left, top, width, height) region of the original with the output's aspect ratio,
    the largest that fits: resizing it to the output size is "resize the short side, centre-crop"."""
    scale = max(out_width / width, out_height / height)
    crop_width = min(width, round(out_width / scale))
    crop_height = min(height, round(out_height / scale))
    return (width - crop_width) // 2, (height - crop_height) // 2, crop_width, crop_height


# --- input shards ------------------------------------------------------------------------------

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # what webdataset reads (gzip through tarfile's r|*)
PACK_RECORD_SUFFIX = "_stats.json"  # pack's and img2dataset's per-shard done record


def shard_stem(path: Path | Location) -> str:
    return next(path.name[: -len(suffix)] for suffix in SHARD_SUFFIXES + ("",) if path.name.endswith(suffix))


def output_name(path: Path | Location) -> str:
    """The output tar of an input shard: its name, as a plain .tar (lineage by name)."""
    return shard_stem(path) + ".tar"


def _pack_count(record: Location) -> int:
    try:
        return int(record.read_json()["successes"])
    except (OSError, ValueError, KeyError, TypeError, LaionkitError) as error:
        raise LaionkitError(f"{record}: not a pack / img2dataset shard record (no 'successes': {error})") from None


def find_shards(specs: Sequence[str], log: Callable[[str], None] = print,
                storage_options: dict | None = None) -> dict[Location, int | None]:
    """Finished input shards from folders, files, globs and brace patterns, sorted, each with the sample
    count its done record gives (None for a plain webdataset folder, which has no records).

    pack renames a shard's tar into place before it writes ``<shard>_stats.json`` (img2dataset writes the
    same record), so in a folder with records a tar without one is unfinished and is left out (said once);
    a folder with no record at all is plain webdataset, whose tars are taken as complete (said once).
    In an object store, only objects with their done record are seen at all (laionkit.common.storage).
    """
    found: list[Location] = []
    for spec in specs:
        path = Location.parse(spec, storage_options)
        if path.is_dir():
            entries = path.list(complete_only=None)
            tars = [p for p in entries if p.name.endswith(SHARD_SUFFIXES)]
            if not tars:
                raise LaionkitError(f"no tar shards ({', '.join('*' + s for s in SHARD_SUFFIXES)}) in {path}")
            for record in (p for p in entries if p.name.endswith(PACK_RECORD_SUFFIX)):
                stem = record.name.removesuffix(PACK_RECORD_SUFFIX)
                if not any(shard_stem(tar) == stem for tar in tars):
                    raise LaionkitError(f"{record} marks shard {stem} done but its tar is missing from {path}")
            found += tars
            continue
        if path.local:
            matches = [Location("", name) for pattern in braceexpand(spec) for name in sorted(glob.glob(pattern))]
        else:
            matches = [match for pattern in braceexpand(spec)
                       for match in ([Location.parse(pattern, storage_options)] if not glob.has_magic(pattern)
                                     else Location.parse(pattern, storage_options).parent.glob(
                                         Location.parse(pattern).name))
                       if match.exists()]
        if not matches:
            raise LaionkitError(f"input shard {spec} does not exist")
        found += matches
    found = sorted(set(found), key=str)
    names = Counter(output_name(path) for path in found)
    clashes = [name for name, count in names.items() if count > 1]
    if clashes:
        raise LaionkitError(f"input shards share the name {clashes[0]} (outputs are named after inputs)")
    shards: dict[Location, int | None] = {}
    unfinished: list[Location] = []
    plain: set[Location] = set()
    with_records = {folder for folder in {path.parent for path in found}
                    if folder.list("*" + PACK_RECORD_SUFFIX, complete_only=None)}
    for path in found:
        record = path.parent / (shard_stem(path) + PACK_RECORD_SUFFIX)
        if record.is_complete() and not record.is_dir():
            shards[path] = _pack_count(record)
        elif path.parent in with_records:
            unfinished.append(path)
        else:
            shards[path] = None
            plain.add(path.parent)
    if unfinished:
        log(f"laionkit encode: left out {len(unfinished)} shard(s) without a done record <shard>"
            f"{PACK_RECORD_SUFFIX} (unfinished pack?): {', '.join(str(p) for p in unfinished[:5])}"
            + (" ..." if len(unfinished) > 5 else ""))
    for folder in sorted(plain, key=str):
        log(f"laionkit encode: {folder} has no shard records (*{PACK_RECORD_SUFFIX}): taking its tars as "
            "complete (plain webdataset)")
    if not shards:
        raise LaionkitError(f"no finished shards in {', '.join(specs)}: every tar lacks its done record "
                            f"<shard>{PACK_RECORD_SUFFIX}")
    return shards


def check_count(shard: Location, expected: int | None, found: int) -> None:
    """A tar cut at a member boundary reads as a valid, shorter tar: only the done record tells."""
    if expected is not None and found != expected:
        raise LaionkitError(f"{shard} holds {found} samples but its done record "
                            f"{shard_stem(shard)}{PACK_RECORD_SUFFIX} says {expected}: truncated or changed "
                            "since pack; repack it")


# --- DataLoader side: decode, resize, tokenize, batch --------------------------------------------

@dataclass
class ShardDone:
    """End-of-shard marker: travels behind the shard's last batch through every stage."""

    shard: str
    samples_in: int
    skips: list[dict] = field(default_factory=list)


def original_size(meta: dict | None, width: int, height: int) -> tuple[int, int]:
    """The photo's size before pack resized it (img2dataset's original_width/height), for SDXL-style
    size conditioning; the shard image's own size when the json does not say."""
    try:
        found = int(meta["original_width"]), int(meta["original_height"])
    except (TypeError, KeyError, ValueError):
        return width, height
    return found if min(found) > 0 else (width, height)


def crop_top_left(box: tuple[int, int, int, int], size: tuple[int, int]) -> list[int]:
    """[top, left] of the crop in pixels of the image resized so the crop becomes ``size``: what
    diffusers' SDXL script records as crop_top_left (resize the short side, then centre-crop)."""
    left, top, crop_width, crop_height = box
    return [round(top * size[1] / crop_height), round(left * size[0] / crop_width)]


def caption_of(sample: dict, meta: dict | None) -> str:
    if "txt" in sample:
        return sample["txt"].decode("utf-8", errors="replace")
    return str((meta or {}).get("caption") or "")


def drafted_box(box: tuple[int, int, int, int], scale: tuple[float, float]) -> tuple[float, float, float, float]:
    """The crop ``box`` (left, top, width, height in original pixels) as a PIL resize box in an image
    decoded at ``scale`` (x, y). JPEG's reduced-size decode rounds the drafted size up (257 px at 1/2 is
    129 px), so the scale must be the DCT factor PIL reports, not drafted size / original size: the
    latter overshoots and puts the box past the decoded image's edge."""
    left, top, crop_width, crop_height = box
    return (left * scale[0], top * scale[1], (left + crop_width) * scale[0], (top + crop_height) * scale[1])


def resize_rgb(data: bytes, size: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray:
    """Decode on CPU (JPEG at a reduced DCT scale when the crop is >= 2x the output) -> (H, W, 3) uint8."""

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        _, _, crop_width, crop_height = box
        drafted = image.draft("RGB", (math.ceil(width * size[0] / crop_width),
                                      math.ceil(height * size[1] / crop_height)))
        # draft returns the original's extent in drafted pixels (e.g. 128.5 for 257 px at 1/2).
        scale = (drafted[1][2] / width, drafted[1][3] / height) if drafted else (1.0, 1.0)
        image = image.convert("RGB")
        if image.size == size and (crop_width, crop_height) == size:
            return np.asarray(image)
        return np.asarray(image.resize(size, Image.Resampling.BICUBIC, box=drafted_box(box, scale)))


class ShardBatches(torch.utils.data.IterableDataset):
    """Iterable over batches of one rank's shards; DataLoader workers each take whole shards.

    Yields dicts (one size, one shard, <= batch_size samples) and a ShardDone after each shard.
    Per-sample problems (no image, undecodable) become recorded skips; a broken tar is an error.
    """

    def __init__(self, shards: Sequence[Location], tokenizer, resolution: int,
                 buckets: Sequence[tuple[int, int]] | None, batch_size: int, gpu_decode: bool) -> None:
        super().__init__()
        self.shards = list(shards)
        self.tokenizer = tokenizer
        self.resolution = resolution
        self.buckets = list(buckets) if buckets else None
        self.batch_size = batch_size
        self.gpu_decode = gpu_decode

    def __iter__(self) -> Iterator[dict | ShardDone]:
        worker = torch.utils.data.get_worker_info()
        mine = self.shards if worker is None else self.shards[worker.id :: worker.num_workers]
        for shard in mine:
            yield from self.shard_batches(shard)

    def shard_batches(self, shard: Location | Path) -> Iterator[dict | ShardDone]:
        shard = Location.parse(shard)
        pending: dict[tuple[int, int], list[dict]] = {}
        done = ShardDone(output_name(shard), 0)
        try:
            # One sequential pass: a remote tar is streamed with read-ahead, so downloads overlap decoding.
            stream = ExitStack()
            handle = stream.enter_context(shard.open_read(prefetch=0 if shard.local else 4))
            files = wds.tariterators.tar_file_expander([{"url": str(shard), "stream": handle}])
            for sample in wds.tariterators.group_by_keys(files):
                done.samples_in += 1
                try:
                    item = self.prepare(sample)
                except Exception as error:  # noqa: BLE001 - any decode failure is a recorded skip
                    done.skips.append({"key": sample["__key__"], "reason": getattr(error, "reason", "undecodable"),
                                       "error": f"{type(error).__name__}: {error}"})
                    continue
                group = pending.setdefault(item["size"], [])
                group.append(item)
                if len(group) == self.batch_size:
                    yield self.collate(done.shard, pending.pop(item["size"]))
        except (OSError, ValueError, tarfile.TarError) as error:
            raise LaionkitError(f"cannot read shard {shard}: {error}") from error
        finally:
            stream.close()
        for size in sorted(pending):
            yield self.collate(done.shard, pending[size])
        yield done

    def prepare(self, sample: dict) -> dict:

        extension = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
        try:
            meta = json.loads(sample["json"]) if "json" in sample else None
        except ValueError as error:
            error.reason = "bad_json"
            raise
        if extension is None:
            error = ValueError(f"no image member ({', '.join(IMAGE_EXTENSIONS)})")
            error.reason = "no_image"
            raise error
        data = sample[extension]
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            on_gpu = self.gpu_decode and image.format == "JPEG" and image.mode in ("RGB", "L")
        size = target_size(width, height, self.resolution, self.buckets)
        box = center_crop_box(width, height, *size)
        item = {
            "key": sample["__key__"], "size": size, "box": box, "image_size": (width, height),
            "original_size": original_size(meta, width, height),
            "caption": caption_of(sample, meta), "source": meta,
        }
        if on_gpu:
            item["jpeg"] = data
        else:
            item["pixels"] = resize_rgb(data, size, box)
        return item

    def collate(self, shard: str, items: list[dict]) -> dict:
        captions = [item["caption"] for item in items]
        window = self.tokenizer.model_max_length
        ids = self.tokenizer(captions, truncation=False, padding=False, verbose=False).input_ids
        input_ids = torch.full((len(items), window), self.tokenizer.pad_token_id, dtype=torch.long)
        records = []
        for row, (item, tokens) in enumerate(zip(items, ids)):
            truncated = len(tokens) > window
            if truncated:
                tokens = tokens[: window - 1] + [self.tokenizer.eos_token_id]
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            records.append({
                "caption": item["caption"], "num_tokens": len(tokens), "truncated": truncated,
                "original_size": list(item["original_size"]), "image_size": list(item["image_size"]),
                "crop": list(item["box"]), "crop_top_left": crop_top_left(item["box"], item["size"]),
                "size": list(item["size"]), "target_size": list(item["size"]),
                "bucket": list(item["size"]) if self.buckets else None,
                "source": item["source"],
            })
        cpu_rows = [row for row, item in enumerate(items) if "pixels" in item]
        gpu_rows = [row for row, item in enumerate(items) if "jpeg" in item]
        return {
            "shard": shard, "size": items[0]["size"], "keys": [item["key"] for item in items],
            "records": records, "input_ids": input_ids,
            "cpu_rows": cpu_rows,
            "pixels": torch.from_numpy(np.stack([items[row]["pixels"] for row in cpu_rows])) if cpu_rows else None,
            "gpu_rows": gpu_rows,
            "jpegs": [torch.frombuffer(bytearray(items[row]["jpeg"]), dtype=torch.uint8) for row in gpu_rows],
            "boxes": [items[row]["box"] for row in gpu_rows],
        }


# --- GPU side ----------------------------------------------------------------------------------

def _resize_gpu(image, box, size):

    left, top, crop_width, crop_height = box
    crop = image[:, top : top + crop_height, left : left + crop_width].float()
    if (crop_width, crop_height) != size:
        crop = F.interpolate(crop[None], size=(size[1], size[0]), mode="bicubic", antialias=True)[0]
    return crop.clamp_(0, 255).round_()


def _decode_jpegs(batch: dict, device) -> tuple[list, list[dict]]:
    """nvjpeg-decode a batch's JPEGs; ones nvjpeg refuses fall back to PIL, and failures become skips."""
    from torchvision.io import ImageReadMode, decode_jpeg

    images: list = [None] * len(batch["jpegs"])
    skips = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            decoded = decode_jpeg(batch["jpegs"], mode=ImageReadMode.RGB, device=device)
            return [_resize_gpu(img, box, batch["size"]) for img, box in zip(decoded, batch["boxes"])], skips
        except RuntimeError:
            pass
        for index, (data, box) in enumerate(zip(batch["jpegs"], batch["boxes"])):
            try:
                images[index] = _resize_gpu(decode_jpeg(data, mode=ImageReadMode.RGB, device=device), box,
                                            batch["size"])
            except RuntimeError:
                try:
                    pixels = resize_rgb(data.numpy().tobytes(), batch["size"], box)
                    images[index] = torch.from_numpy(pixels).to(device).permute(2, 0, 1).float()
                except Exception as error:  # noqa: BLE001 - undecodable everywhere: a recorded skip
                    row = batch["gpu_rows"][index]
                    skips.append({"key": batch["keys"][row], "reason": "undecodable",
                                  "error": f"{type(error).__name__}: {error}"})
    return images, skips


def _gpu_batch(batch: dict, device, dtype, channels_last: bool = False) -> dict:
    """Pixels of a batch on the device as (B, 3, H, W) in [-1, 1] in the encoders' memory format; drops
    rows that failed."""
    width, height = batch["size"]
    count = len(batch["keys"])
    pixels = torch.empty((count, 3, height, width), device=device, dtype=torch.float32)
    if batch["pixels"] is not None:
        rows = torch.tensor(batch["cpu_rows"], device=device)
        cpu = batch["pixels"].to(device, non_blocking=True).permute(0, 3, 1, 2).float()
        pixels.index_copy_(0, rows, cpu)
    keep = list(range(count))
    batch["decoded"] = Counter(cpu=len(batch["cpu_rows"]))
    if batch["jpegs"]:
        images, skips = _decode_jpegs(batch, device)
        batch["decoded"]["gpu"] += len(images) - len(skips)
        for row, image in zip(batch["gpu_rows"], images):
            if image is not None:
                pixels[row] = image
        failed = {batch["keys"].index(skip["key"]) for skip in skips}
        keep = [row for row in keep if row not in failed]
        batch["skips"] = skips
    if len(keep) != count:
        pixels = pixels[keep]
        batch["keys"] = [batch["keys"][row] for row in keep]
        batch["records"] = [batch["records"][row] for row in keep]
        batch["input_ids"] = batch["input_ids"][keep]
    layout = torch.channels_last if channels_last else torch.contiguous_format
    batch["pixels"] = (pixels / 127.5 - 1).to(dtype).contiguous(memory_format=layout)
    batch["input_ids"] = batch["input_ids"].to(device, non_blocking=True)
    return batch


class Encoders:
    """The VAE and the family's text encoders of one run, on one device, and the facts the manifest records."""

    def __init__(self, config: EncodeConfig, device) -> None:
        self.device = device
        self.family = config.family
        self.online = config.text == "online"
        if self.online and self.family.tokenize is None:
            raise LaionkitError(f"--text online: family {self.family.name} stores its text-encoder outputs only "
                                "(online text: sd3, flux)")
        self.dtype = _compute_dtype(config.dtype, device)
        self.layer = config.layer
        # Eager, the SD VAE encoder measured slower channels_last than contiguous on an H200 (eager GroupNorm
        # on channels_last tensors costs more than it saves); compiled, channels_last is kept.
        # scripts/bench_encode.py measures both layouts.
        self.layout = torch.channels_last if config.compile else torch.contiguous_format
        vae_source = config.source("vae")
        self.vae_dtype = self.dtype
        # SDXL's VAE overflows to inf/NaN in fp16; its config says force_upcast, which its pipeline obeys.
        if self.family.vae_upcast and self.dtype == torch.float16 and load_vae_config(vae_source).get(
                "force_upcast", True):
            self.vae_dtype = torch.float32
        self.vae = load_vae(vae_source, dtype=self.vae_dtype).to(device, memory_format=self.layout)
        self.tokenizers = [load_tokenizer(config.source(tok), tok) for tok, _ in self.family.text_encoders]
        self.text_encoders = [load_text_encoder(config.source(enc), dtype=self.dtype, component=enc).to(device)
                              for _, enc in self.family.text_encoders]
        self.tokenizer = self.tokenizers[0]  # the DataLoader workers' (num_tokens, truncated)
        self.text_encoder = self.text_encoders[0]
        self.encode_images = self._encode_images
        self.encode_ids = self._encode_ids
        if config.compile:
            # One graph per batch shape: with --buckets that is one per bucket, more than dynamo's default.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.encode_images = torch.compile(self._encode_images, dynamic=False)
            self.encode_ids = torch.compile(self._encode_ids, dynamic=False)

    def _encode_images(self, pixels):
        return self.vae.encode(pixels).latent_dist.parameters

    def _encode_ids(self, input_ids):
        return self.family.encode_ids(self.text_encoders, input_ids, self.layer)

    def text_of(self, input_ids, captions: Sequence[str], compiled: bool = True) -> dict:
        """The family's stored text tensors of a batch: from the workers' ids where the family encodes ids
        (SD), else from the captions through its own tokenizers (SDXL's two windows differ in padding)."""
        if self.family.encode_ids is not None:
            return (self.encode_ids if compiled else self._encode_ids)(input_ids)
        return self.family.encode_text(self.tokenizers, self.text_encoders, captions)

    def facts(self) -> dict:
        vae, text = self.vae.config, self.text_encoder.config
        facts = {
            "vae": {"scaling_factor": vae.scaling_factor, "shift_factor": vae.get("shift_factor"),
                    "latent_channels": vae.latent_channels,
                    "downsample_factor": 2 ** (len(vae.block_out_channels) - 1)},
            "text": {"hidden_size": text.hidden_size, "sequence_length": self.tokenizer.model_max_length,
                     "layer": self.layer, "pad_token_id": self.tokenizer.pad_token_id},
        }
        if self.vae_dtype != self.dtype:
            facts["vae"]["compute_dtype"] = str(self.vae_dtype).removeprefix("torch.")
        if self.family.name != DEFAULT_FAMILY:  # SD folders keep the settings they always had (resume)
            facts["family"] = self.family.name
            empty = self.empty_caption()
            facts["text"]["hidden_size"] = int(empty["states"].shape[-1])
            facts["text"]["sequence_length"] = int(empty["states"].shape[0])  # SD3: 77 CLIP + T5 tokens
            facts["text"]["stored"] = {key: list(value.shape) for key, value in empty.items()}
            if self.online:  # only then: stored folders keep the settings they had (resume)
                facts["text"]["mode"] = "online"
                facts["text"]["ids"] = {self.family.ids_member(i): int(ids.shape[-1]) for i, ids in
                                        enumerate(self.family.tokenize(self.tokenizers, [""]))}
        return facts

    def empty_caption(self) -> dict[str, np.ndarray]:
        """Every stored text tensor of the caption "" (caption dropout swaps all of them together)."""
        window = self.tokenizer.model_max_length
        ids = self.tokenizer([""], padding="max_length", max_length=window, truncation=True,
                             return_tensors="pt").input_ids
        with torch.inference_mode():
            found = self.text_of(ids.to(self.device), [""], compiled=False)
        return {key: value[0].to(torch.float16).cpu().numpy() for key, value in found.items()}


def _compute_dtype(name: str, device):
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _background(items: Iterator, depth: int, name: str) -> Iterator:
    """Run an iterator in a thread, ``depth`` items ahead; its exceptions re-raise in the consumer."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    end = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        box.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            box.put(end)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer thread
            box.put(error)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := box.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


# --- output side -------------------------------------------------------------------------------

def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def npy_rows(batch: np.ndarray) -> list[bytes]:
    """``npy_bytes`` of each row of a batch, with the .npy header (same for all rows) built once."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(batch[0]))
    prefix = header.getvalue()
    return [prefix + np.ascontiguousarray(row).tobytes() for row in batch]


class ShardOutput:
    """One output tar, written under a temporary name and renamed (uploaded, done record last) by
    ``finish`` (webdataset.TarWriter)."""

    def __init__(self, path: Location) -> None:

        self.path = path
        self.stack = ExitStack()
        tmp = self.stack.enter_context(storage.atomic_write(path))
        # An int mtime: a float one makes tarfile add a pax header to every member (2x the CPU).
        self.sink = wds.TarWriter(str(tmp), encoder=False, mtime=0)
        self.samples = 0
        self.truncated = 0
        self.sizes: Counter = Counter()
        self.skips: list[dict] = []
        self.started = time.perf_counter()

    def write(self, keys: list[str], records: list[dict], moments: np.ndarray, stored: dict[str, np.ndarray]
              ) -> None:
        """One sample per key: moments, every stored text tensor under its member name, the json."""
        rows = {member: npy_rows(value) for member, value in stored.items()}
        for index, (key, record, sample_moments) in enumerate(zip(keys, records, npy_rows(moments))):
            self.sink.write({
                "__key__": key,
                "moments.npy": sample_moments,
                **{member: row[index] for member, row in rows.items()},
                "json": json.dumps(record, sort_keys=True).encode(),
            })
            self.samples += 1
            self.truncated += record["truncated"]
            self.sizes["x".join(map(str, record["size"]))] += 1

    def finish(self) -> None:
        self.sink.close()
        self.stack.close()

    def abort(self, error: BaseException) -> None:
        self.sink.close()
        self.stack.__exit__(type(error), error, error.__traceback__)


def latent_family(settings: dict) -> FamilySpec:
    """The family of a latent folder from its settings (manifest): SD when none is named."""
    return get_family(settings.get("family", DEFAULT_FAMILY))


def record_path(output: Location, shard: str) -> Location:
    return output / (shard.removesuffix(".tar") + RECORD_SUFFIX)


def shard_complete(output: Location, shard: Location, settings: dict, samples: int) -> bool:
    """Output tar and record exist, the record matches this run's settings and the input's sample count."""
    record_file = record_path(output, output_name(shard))
    if not (output / output_name(shard)).is_complete() or not record_file.is_complete():
        return False
    record = record_file.read_json()
    refuse_other_settings(record_file, record["settings"], settings, "encoded", RERUN_REMEDY)
    return record["samples_in"] == samples


def write_plan(output: Location, shards: Sequence[Location]) -> None:
    """The run's full list of output shards; every rank writes the same list, so any rename wins whole."""
    storage.write_json(output / PLAN, {"shards": sorted(output_name(shard) for shard in shards)}, shared=True)


def latent_status(output: Path | Location) -> dict:
    """The folder's manifest, derived from what is on disk: the plan and the per-shard records.

    manifest.json is only a cache of this: ranks rewrite it concurrently, and a rank that merged before
    another's last record landed can rename its stale merge last. Readers that decide anything (train's
    "is the encode complete") call this instead.
    """
    output = Location.parse(output)
    plan = output / PLAN
    if plan.is_complete() and not plan.is_dir():
        expected = _read_folder_json(plan).get("shards")
    else:  # written before plan.json existed: its manifest said whether every planned shard was done
        manifest = output / MANIFEST
        cached = _read_folder_json(manifest) if manifest.is_complete() and not manifest.is_dir() else {}
        expected = [_read_folder_json(r).get("shard") for r in output.list("*" + RECORD_SUFFIX)] \
            if cached.get("complete") else None
    try:
        return merge_records(output, expected)
    except (KeyError, TypeError) as error:
        raise LaionkitError(f"{output}: a shard record lacks {error} (not a laionkit encode record); "
                            "rerun encode") from None


def _read_folder_json(path: Location) -> dict:
    """A record, plan or manifest of a latent folder, or a one-line error naming the damaged file."""
    try:
        found = path.read_json()
    except (OSError, UnicodeDecodeError, ValueError, LaionkitError) as error:
        raise LaionkitError(f"{path} cannot be read as JSON ({error}): rerun encode") from None
    if not isinstance(found, dict):
        raise LaionkitError(f"{path} is not a JSON object: rerun encode")
    return found


def update_manifest(output: Location) -> dict:
    manifest = latent_status(output)
    storage.write_json(output / MANIFEST, manifest, shared=True)
    return manifest


def merge_records(output: Path | Location, expected: Sequence[str] | None = None) -> dict:
    """The folder manifest as the merge of every shard record present (no coordinator needed)."""
    output = Location.parse(output)
    records = [_read_folder_json(path) for path in output.list("*" + RECORD_SUFFIX)]
    if not records:
        raise LaionkitError(f"no encode records (*{RECORD_SUFFIX}) in {output}: is it an encode output folder?")
    settings = records[0]["settings"]
    skips: Counter = Counter()
    sizes: Counter = Counter()
    for record in records:
        skips.update(record["skipped"])
        sizes.update(record["sizes"])
    done = sorted(record["shard"] for record in records
                  if (output / record["shard"]).is_complete() and not (output / record["shard"]).is_dir())
    manifest = {
        "format": FORMAT,
        **settings,
        # Where the models were loaded from (settings keep only their content, the file hashes).
        "models": records[-1].get("models", settings["models"]),
        "stored_dtype": "float16",
        "family": latent_family(settings).name,
        "empty_caption": EMPTY_CAPTION,
        **{f"empty_{key}": latent_family(settings).empty_file(key) for key in latent_family(settings).stored
           if key != "states"},
        "shards": {"done": len(done), "expected": len(expected) if expected is not None else None,
                   "missing": sorted(set(expected or ()) - set(done))},
        "counts": {"samples_in": sum(r["samples_in"] for r in records),
                   "samples_out": sum(r["samples_out"] for r in records),
                   "skipped": sum(skips.values()), "truncated_captions": sum(r["truncated"] for r in records)},
        "skips": dict(sorted(skips.items())),
        "sizes": dict(sorted(sizes.items())),
        "records": {record["shard"]: record_path(output, record["shard"]).name for record in records},
        "versions": versions(),
    }
    manifest["complete"] = expected is not None and not manifest["shards"]["missing"]
    return manifest


def summarize(folder: Path | Location):
    """`laionkit stats DIR` for a latent folder: the merged records as tables."""
    from rich.console import Group
    from rich.table import Table

    manifest = latent_status(folder)
    overview = Table(title=f"encode: {folder}", show_header=False)
    overview.add_row("shards", str(manifest["shards"]["done"]))
    counts = manifest["counts"]
    overview.add_row("samples", f"{counts['samples_out']:,} of {counts['samples_in']:,}")
    overview.add_row("truncated captions", f"{counts['truncated_captions']:,}")
    overview.add_row("resolution", str(manifest["resolution"]) + (" (buckets)" if manifest["buckets"] else ""))
    overview.add_row("latent", f"{manifest['vae']['latent_channels']} channels, /{manifest['vae']['downsample_factor']}, "
                               f"scaling {manifest['vae']['scaling_factor']}")
    overview.add_row("text", f"{manifest['text']['sequence_length']} x {manifest['text']['hidden_size']} "
                             f"({manifest['text']['layer']} layer)"
                     + (", online: token ids stored, train encodes" if manifest["text"].get("mode") == "online"
                        else ""))
    for component, model in manifest["models"].items():
        overview.add_row(component, f"{model['source']} ({model['subfolder']})")
    size = sum(p.size() for p in Location.parse(folder).list("*.tar"))
    overview.add_row("size on disk", f"{size / 2**20:,.1f} MiB")
    if counts["samples_out"]:  # what --text stored vs online costs at web scale
        per_sample = size / counts["samples_out"]
        overview.add_row("per sample", f"{per_sample / 2**10:,.1f} KiB ({per_sample * 1e9 / 2**50:,.2f} PiB "
                                       "per billion samples)")
    tables = [overview]
    for title, counter in (("skips by reason", manifest["skips"]), ("encoded sizes", manifest["sizes"])):
        if counter:
            table = Table("", "samples", title=title)
            for name, count in counter.items():
                table.add_row(name, f"{count:,}")
            tables.append(table)
    return Group(*tables)


# --- the stage ---------------------------------------------------------------------------------

def _device(config: EncodeConfig, rank: Rank):
    if config.device:
        return torch.device(config.device)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank.rank % torch.cuda.device_count()))
        return torch.device("cuda", local)
    return torch.device("cpu")


def _models(config: EncodeConfig, family: FamilySpec) -> dict:
    components = ["vae"] + [name for pair in family.text_encoders for name in reversed(pair)]
    return {component: fingerprint(config.source(component), component) for component in components}


def _settings(config: EncodeConfig, models: dict, encoders: Encoders, buckets) -> dict:
    """What every shard of one folder must share; a rerun with other settings is refused.

    Models count by content (their files' sha256), not by the path they were reached through: the same
    folder via a symlink, a copy or a hub cache is the same model. Without hashes (a hub id not in the
    cache), the source string is all there is to compare.
    """
    return {
        "models": {component: {"files": model["files"]} if model.get("files") else {"source": model["source"]}
                   for component, model in models.items()},
        **encoders.facts(),
        "resolution": config.resolution,
        "buckets": [list(size) for size in buckets] if buckets else None,
        "compute_dtype": str(encoders.dtype).removeprefix("torch."),
    }


def run(config: EncodeConfig, log: Callable[[str], None] = print, encoders: Encoders | None = None) -> dict:
    """Encode this rank's shards that are not complete yet; rewrite the manifest; return this rank's counts.

    ``encoders`` lets a caller that already loaded (and compiled) the models for this config reuse them.
    """

    rank = resolve_rank(config.rank, config.world_size)
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(str(config.output), options)
    inputs = find_shards(config.shards, log if rank.rank == 0 else (lambda _: None), options)
    shards = list(inputs)
    storage.refuse_overlap([*(Location.parse(spec, options) for spec in config.shards), *shards], output, "encode")
    if config.quiet:
        import diffusers.utils.logging
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
    if output.local:
        Path(output.path).mkdir(parents=True, exist_ok=True)
    encoders = encoders or Encoders(config, _device(config, rank))
    device = encoders.device
    gpu_decode = config.decode == "gpu" or (
        config.decode == "auto" and device.type == "cuda" and config.workers < GPU_DECODE_BELOW_WORKERS)
    if gpu_decode and device.type != "cuda":
        raise LaionkitError("--decode gpu needs a CUDA device")
    buckets = bucket_sizes(config.resolution) if config.buckets else None
    if encoders.family.pack_latents is not None:  # Flux packs 2x2 latent patches: even latent sides
        multiple = 2 * 2 ** (len(encoders.vae.config.block_out_channels) - 1)
        odd = [f"{w}x{h}" for w, h in buckets or [(config.resolution, config.resolution)] if w % multiple or h % multiple]
        if odd:
            raise LaionkitError(f"--resolution {config.resolution}{' --buckets' if buckets else ''}: "
                                f"{encoders.family.name} packs 2x2 latent patches, so image sides must be multiples "
                                f"of {multiple} px; {', '.join(odd)} are not (try a multiple of {8 * multiple})")
    models = _models(config, encoders.family)
    settings = _settings(config, models, encoders, buckets)
    for record_file in output.list("*" + RECORD_SUFFIX):
        refuse_other_settings(record_file, record_file.read_json()["settings"], settings, "encoded", RERUN_REMEDY)
    write_plan(output, shards)
    for key, empty in encoders.empty_caption().items():
        empty_path = output / encoders.family.empty_file(key)
        if not empty_path.is_complete():
            with storage.atomic_write(empty_path, shared=True) as tmp:
                tmp.write_bytes(npy_bytes(empty))

    mine = split(shards, rank)
    counts = {shard: count_samples(shard) for shard in mine}
    for shard in mine:
        check_count(shard, inputs[shard], counts[shard])
    todo = [shard for shard in mine if not shard_complete(output, shard, settings, counts[shard])]
    if not config.quiet:
        log(f"laionkit encode: rank {rank.rank}/{rank.world_size}, {len(todo)} of {len(mine)} shards to do, "
            f"device {device}, decode {'gpu' if gpu_decode else 'cpu'}, dtype {settings['compute_dtype']}, "
            f"config {json.dumps(asdict(config), default=str)}")
    summary = {"rank": rank.rank, "shards": len(todo), "samples_out": 0, "skipped": 0, "seconds": 0.0,
               "decoded": {}, "decode": "gpu" if gpu_decode else "cpu", "workers": min(config.workers, len(todo))}
    if todo:
        progress = tqdm(total=sum(counts[shard] for shard in todo), desc=f"encode rank {rank.rank}", unit="img",
                        disable=config.quiet)
        with progress:
            summary.update(_encode_shards(config, encoders, todo, buckets, gpu_decode, settings, models, rank,
                                          progress))
    manifest = update_manifest(output)
    if manifest["complete"] and not manifest["counts"]["samples_out"]:
        raise LaionkitError(f"encode wrote no sample: {manifest['counts']['samples_in']} read from "
                            f"{len(shards)} shard(s), all skipped ({_reasons(manifest['skips'])}); "
                            "are these image shards?")
    return summary


def _reasons(skips: dict) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in skips.items()) or "no samples in the tars"


def _encode_shards(config, encoders, todo, buckets, gpu_decode, settings, models, rank, progress) -> dict:
    device = encoders.device
    on_cuda = device.type == "cuda"
    batches = ShardBatches(todo, encoders.tokenizer, config.resolution, buckets, config.batch_size, gpu_decode)
    workers = min(config.workers, len(todo))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loader = torch.utils.data.DataLoader(
        batches, batch_size=None, num_workers=workers, pin_memory=on_cuda,
        prefetch_factor=QUEUE_DEPTH if workers else None,
        # Batches carry their shard, and each worker's own batches stay in order, so outputs do not
        # depend on which worker answers first; a slow worker then never stalls the others.
        in_order=False,
    )
    prep_stream = torch.cuda.Stream(device) if on_cuda else None

    def prepared() -> Iterator:
        """Host->device copies and GPU decode on their own stream, one batch ahead of the encoders."""
        for item in loader:
            if isinstance(item, ShardDone):
                yield item
                continue
            if prep_stream is None:
                yield _gpu_batch(item, device, encoders.vae_dtype, config.compile), None
                continue
            with torch.cuda.stream(prep_stream):
                batch = _gpu_batch(item, device, encoders.vae_dtype, config.compile)
                ready = torch.cuda.Event()
                ready.record(prep_stream)
            yield batch, ready

    output = Location.parse(str(config.output), storage.parse_storage_options(config.storage_options))
    writer = _Writer(output, settings, models, rank, progress)
    started = None
    try:
        with torch.inference_mode():
            if config.compile and not buckets:
                _warm_up(encoders, config)
            for item in _background(prepared(), QUEUE_DEPTH, "laionkit-prepare"):
                started = started or time.perf_counter()
                if isinstance(item, ShardDone):
                    writer.put(item)
                    continue
                batch, ready = item
                if ready is not None:
                    torch.cuda.current_stream(device).wait_event(ready)
                    batch["pixels"].record_stream(torch.cuda.current_stream(device))
                    batch["input_ids"].record_stream(torch.cuda.current_stream(device))
                writer.put(_encode_batch(encoders, batch, config))
        writer.close()
    except BaseException as error:
        writer.abort(error)
        raise
    return {"samples_out": writer.samples_out, "skipped": writer.skipped, "decoded": dict(writer.decoded),
            "seconds": time.perf_counter() - started if started else 0.0}


def _warm_up(encoders: Encoders, config: EncodeConfig) -> None:
    """Compile for the one batch shape before the loader starts, so compile time is not encode time."""
    pixels = torch.zeros((config.batch_size, 3, config.resolution, config.resolution), device=encoders.device,
                         dtype=encoders.vae_dtype).contiguous(memory_format=encoders.layout)
    ids = torch.zeros((config.batch_size, encoders.tokenizer.model_max_length), dtype=torch.long,
                      device=encoders.device)
    encoders.encode_images(pixels)
    encoders.text_of(ids, [""] * config.batch_size)


def _encode_batch(encoders: Encoders, batch: dict, config: EncodeConfig) -> dict:
    """VAE moments and text hidden states for one batch, copied to host without waiting for the copy."""
    pixels, input_ids = batch["pixels"], batch["input_ids"]
    count = pixels.shape[0]
    if config.compile and 0 < count < config.batch_size:
        # One shape per compiled graph: pad the shard's last batch and drop the padding after.
        pad = config.batch_size - count
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)]).contiguous(
            memory_format=encoders.layout)
        input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad, -1)])
    moments, stored = None, {}
    if count:
        moments = encoders.encode_images(pixels)[:count].to(torch.float16).to("cpu", non_blocking=True)
        captions = [record["caption"] for record in batch["records"]]
        if encoders.online:  # token ids only (int32): train runs the text encoders
            stored = {encoders.family.ids_member(index): ids[:count].to(torch.int32) for index, ids in
                      enumerate(encoders.family.tokenize(encoders.tokenizers, captions))}
        else:
            stored = {encoders.family.member(key): value[:count].to(torch.float16).to("cpu", non_blocking=True)
                      for key, value in encoders.text_of(input_ids, captions).items()}
    done = None
    if encoders.device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(encoders.device))
    return {"shard": batch["shard"], "keys": batch["keys"], "records": batch["records"],
            "moments": moments, "stored": stored, "done": done, "skips": batch.get("skips", []),
            "decoded": batch["decoded"]}


class _Writer:
    """The writer thread: host copies land, samples go into their shard's tar, finished shards are renamed."""

    def __init__(self, output: Location, settings: dict, models: dict, rank: Rank, progress) -> None:
        self.output = output
        self.settings = settings
        self.models = models
        self.rank = rank
        self.progress = progress
        self.open: dict[str, ShardOutput] = {}
        self.samples_out = 0
        self.skipped = 0
        self.decoded: Counter = Counter()
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="laionkit-writer", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        while self.thread.is_alive():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise self.error or RuntimeError("encode writer thread stopped")

    def close(self) -> None:
        self.put(None)
        self.thread.join()
        if self.error:
            raise self.error

    def abort(self, error: BaseException) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        for shard in self.open.values():
            shard.abort(error)
        self.open.clear()

    def _loop(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if isinstance(item, ShardDone):
                    self._finish(item)
                else:
                    self._write(item)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            self.error = error

    def _shard(self, name: str) -> ShardOutput:
        if name not in self.open:
            self.open[name] = ShardOutput(self.output / name)
        return self.open[name]

    def _write(self, item: dict) -> None:
        shard = self._shard(item["shard"])
        shard.skips += item["skips"]
        self.decoded.update(item["decoded"])
        if item["done"] is not None:
            item["done"].synchronize()
        if item["moments"] is not None:
            shard.write(item["keys"], item["records"], item["moments"].numpy(),
                        {member: value.numpy() for member, value in item["stored"].items()})
        self.progress.update(len(item["keys"]) + len(item["skips"]))

    def _finish(self, done: ShardDone) -> None:
        shard = self._shard(done.shard)
        skips = sorted(shard.skips + done.skips, key=lambda skip: skip["key"])
        if shard.samples + len(skips) != done.samples_in:
            raise RuntimeError(f"{done.shard}: {shard.samples} written + {len(skips)} skipped "
                               f"!= {done.samples_in} read")
        seconds = time.perf_counter() - shard.started
        shard.finish()
        del self.open[done.shard]
        self.progress.update(len(done.skips))
        record = {
            "shard": done.shard, "rank": self.rank.rank, "samples_in": done.samples_in,
            "samples_out": shard.samples, "truncated": shard.truncated,
            "skipped": dict(Counter(skip["reason"] for skip in skips)), "skips": skips,
            "sizes": dict(shard.sizes), "seconds": round(seconds, 3), "settings": self.settings,
            "models": self.models,
        }
        storage.write_json(record_path(self.output, done.shard), record)
        self.samples_out += shard.samples
        self.skipped += len(skips)
