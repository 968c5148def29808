"""encode's device stage: the encoders, host->device copies, nvjpeg decode, the encode of a batch, warm-up."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from laionkit.common import LaionkitError
from laionkit.common.background import device_tensor
from laionkit.common.jpeg import decode_jpegs, unjoin
from laionkit.common.models import (
    load_family_tokenizers,
    load_text_encoder,
    load_vae,
    load_vae_config,
    text_tokenizer,
    vae_facts,
    vae_is_deterministic,
)
from laionkit.encode.config import EncodeConfig
from laionkit.encode.reader import ShardDone
from laionkit.families import DEFAULT_FAMILY, families, get_family

# --decode auto: nvjpeg only when few CPU workers. On an H200 with 15 workers, worker (PIL) decode beat
# nvjpeg decode, whose per-image resize runs in the main process (docs/BENCHMARKS.md, encode).
GPU_DECODE_BELOW_WORKERS = 4


def _decode_on_gpu(config: EncodeConfig, device) -> bool:
    """Whether JPEGs reach the device undecoded (nvjpeg) or decoded by the DataLoader workers (PIL)."""
    gpu_decode = config.decode == "gpu" or (
        config.decode == "auto" and device.type == "cuda" and config.workers < GPU_DECODE_BELOW_WORKERS)
    if gpu_decode and device.type != "cuda":
        raise LaionkitError("--decode gpu needs a CUDA device")
    return gpu_decode


def _resize_gpu(image, box, size):

    left, top, crop_width, crop_height = box
    crop = image[:, top : top + crop_height, left : left + crop_width].float()
    if (crop_width, crop_height) != size:
        crop = F.interpolate(crop[None], size=(size[1], size[0]), mode="bicubic", antialias=True)[0]
    return crop.clamp_(0, 255).round_()


def _decode_jpegs(batch: dict, device) -> tuple[list, list[dict]]:
    """nvjpeg-decode a batch's JPEGs and resize them to the batch's box (laionkit.common.jpeg: a file nvjpeg
    refuses is decoded with PIL); files nothing decodes become skips."""
    images, skips = [], []
    files = unjoin(batch["jpegs"], batch["jpeg_sizes"])
    for index, (image, box) in enumerate(zip(decode_jpegs(files, device), batch["boxes"])):
        if isinstance(image, str):
            images.append(None)
            skips.append({"key": batch["keys"][batch["gpu_rows"][index]], "reason": "undecodable", "error": image})
        else:
            images.append(_resize_gpu(image, box, batch["size"]))
    return images, skips


def _gpu_batch(batch: dict, device, dtype, channels_last: bool = False) -> dict:
    """Pixels of a batch on the device as (B, 3, H, W) in [-1, 1] in the encoders' memory format; drops
    rows that failed."""
    width, height = batch["size"]
    count = len(batch["keys"])
    pixels = torch.empty((count, 3, height, width), device=device, dtype=torch.float32)
    if batch["pixels"] is not None:
        rows = device_tensor(batch["cpu_rows"], torch.long, device)
        cpu = batch["pixels"].to(device, non_blocking=True).permute(0, 3, 1, 2).float()
        pixels.index_copy_(0, rows, cpu)
    keep = list(range(count))
    batch["decoded"] = Counter(cpu=len(batch["cpu_rows"]))
    if batch["gpu_rows"]:
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
        if "caption_ids" in batch:  # --captions: every name's rows, and the captions skipped of kept samples
            kept = set(batch["keys"])
            batch["caption_ids"] = {name: ids[keep] for name, ids in batch["caption_ids"].items()}
            batch["caption_texts"] = {name: [texts[row] for row in keep]
                                      for name, texts in batch["caption_texts"].items()}
            batch["present"] = [batch["present"][row] for row in keep]
            batch["caption_skips"] = [skip for skip in batch["caption_skips"] if skip["key"] in kept]
    layout = torch.channels_last if channels_last else torch.contiguous_format
    batch["pixels"] = (pixels / 127.5 - 1).to(dtype).contiguous(memory_format=layout)
    batch["input_ids"] = batch["input_ids"].to(device, non_blocking=True)
    if "caption_ids" in batch:
        batch["caption_ids"] = {name: ids.to(device, non_blocking=True) for name, ids in batch["caption_ids"].items()}
    return batch


def _prepared(loader, encoders: Encoders, channels_last: bool) -> Iterator:
    """The loader's batches on the device as (batch, ready event or None); ShardDone markers pass through."""
    device = encoders.device
    prep_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def prepared() -> Iterator:
        """Host->device copies and GPU decode on their own stream, one batch ahead of the encoders.

        Under inference_mode, as the encode loop and its compile warm-up are (the mode is per thread, and
        this runs in the prepare thread): a compiled graph guards on it, and a normal tensor after the
        warm-up's inference tensors recompiled both encoders inside the first run's timed loop."""
        with torch.inference_mode():
            for item in loader:
                if isinstance(item, ShardDone):
                    yield item
                    continue
                if prep_stream is None:
                    yield _gpu_batch(item, device, encoders.vae_dtype, channels_last), None
                    continue
                with torch.cuda.stream(prep_stream):
                    batch = _gpu_batch(item, device, encoders.vae_dtype, channels_last)
                    ready = torch.cuda.Event()
                    ready.record(prep_stream)
                yield batch, ready

    return prepared()


class Encoders:
    """The VAE and the family's text encoders of one run, on one device, and the facts the manifest records."""

    def __init__(self, config: EncodeConfig, device) -> None:
        self.device = device
        self.family = config.family
        self.online = config.text_mode == "online"
        if self.online and self.family.tokenize is None:
            online = [name for name in families() if get_family(name).tokenize is not None]
            raise LaionkitError(f"--text online: family {self.family.name} stores its text-encoder outputs only "
                                f"(online text: {', '.join(online)})")
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
        # AutoencoderDC has no posterior: moments.npy then holds the latent itself (C channels, not 2C)
        self.deterministic = vae_is_deterministic(self.vae)
        self.tokenizers = load_family_tokenizers(self.family, config.source)
        self.text_encoders = [load_text_encoder(config.source(enc), dtype=self.dtype, component=enc).to(device)
                              for _, enc in self.family.text_encoders]
        self.tokenizer = text_tokenizer(self.tokenizers[0])  # the DataLoader workers' (num_tokens, truncated)
        self.text_encoder = self.text_encoders[0]
        self.encode_images = self._encode_images
        self.encode_ids = self._encode_ids
        if config.compile:
            # One graph per batch shape: with --buckets that is one per bucket, more than dynamo's default.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.encode_images = torch.compile(self._encode_images, dynamic=False)
            self.encode_ids = torch.compile(self._encode_ids, dynamic=False)

    def check_sizes(self, resolution: int, buckets: Sequence[tuple[int, int]] | None) -> None:
        """Refuse image sizes the family cannot encode."""
        patch = self.family.patch_size
        # Flux packs 2x2 latent patches, SD3 and PixArt embed them (latent sides are multiples of 2), and Sana's
        # DC-AE downsamples 32x: image sides must be multiples of patch x downsample. Checked where that grid is
        # coarser than the 8 px that bucket sides are rounded to (an 8x VAE without patches takes any size).
        multiple = patch * vae_facts(self.vae.config)["downsample_factor"]
        if multiple > 8:
            odd = [f"{w}x{h}" for w, h in buckets or [(resolution, resolution)] if w % multiple or h % multiple]
            if odd:
                why = (f"takes {patch}x{patch} latent patches" if patch > 1
                       else f"encodes with a {multiple}x downsampling VAE")
                raise LaionkitError(f"--resolution {resolution}{' --buckets' if buckets else ''}: "
                                    f"{self.family.name} {why}, so image sides must be "
                                    f"multiples of {multiple} px; {', '.join(odd)} are not (try a multiple of "
                                    f"{8 * multiple})")

    def _encode_images(self, pixels):
        """What moments.npy stores: the posterior's mean and log-variance (2C channels, AutoencoderKL), or
        the latent of a deterministic VAE (C channels, AutoencoderDC)."""
        if self.deterministic:
            return self.vae.encode(pixels).latent
        if self.family.vae_frames:  # a video VAE: one frame in, its frame axis dropped from the moments
            return self.vae.encode(pixels.unsqueeze(2)).latent_dist.parameters.squeeze(2)
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
        vae, text = self.vae.config, self.text_encoder.config.get_text_config()
        facts = {
            "vae": vae_facts(vae),
            "text": {"hidden_size": text.hidden_size, "sequence_length": self.tokenizer.model_max_length,
                     "layer": self.layer, "pad_token_id": self.tokenizer.pad_token_id},
        }
        if self.deterministic:  # only then: other folders keep the manifest they had (resume)
            facts["vae"]["deterministic"] = True
        if self.family.latent_stats:  # per-channel normalisation, as the family's pipeline does it
            mean, std = self.family.vae_stats(self.vae) if self.family.vae_stats else (vae.latents_mean, vae.latents_std)
            facts["vae"]["latents_mean"] = [float(value) for value in mean]
            facts["vae"]["latents_std"] = [float(value) for value in std]
        if self.vae_dtype != self.dtype:
            facts["vae"]["compute_dtype"] = str(self.vae_dtype).removeprefix("torch.")
        if self.family.name != DEFAULT_FAMILY:  # SD folders keep the settings they always had (resume)
            facts["family"] = self.family.name
            empty = self.empty_caption(trim=False)
            facts["text"]["hidden_size"] = int(empty["states"].shape[-1])
            facts["text"]["sequence_length"] = int(empty["states"].shape[0])  # SD3: 77 CLIP + T5 tokens
            facts["text"]["stored"] = {key: list(value.shape) for key, value in empty.items()}
            if self.family.trimmed:  # per sample, these end at the caption's length (up to the shape above)
                facts["text"]["trimmed"] = list(self.family.trimmed)
            if self.family.given_max_sequence_length is not None:  # --max-sequence-length
                facts["text"]["max_sequence_length"] = self.family.given_max_sequence_length
            if self.online:  # only then: stored folders keep the settings they had (resume)
                facts["text"]["mode"] = "online"
                facts["text"]["ids"] = {self.family.ids_member(i): int(ids.shape[-1]) for i, ids in
                                        enumerate(self.family.tokenize(self.tokenizers, [""]))}
        return facts

    def empty_caption(self, trim: bool = True) -> dict[str, np.ndarray]:
        """Every stored text tensor of the caption "" (caption dropout swaps all of them together), or of the
        family's ``unconditional`` text, trimmed as a sample's are (a family with a text mask) unless ``trim``
        is False."""
        with torch.inference_mode():
            if self.family.unconditional is not None:  # the pipeline's negative prompt is not the caption ""
                found = self.family.encode_tokens(self.text_encoders, self.family.empty_ids(self.tokenizers))
            else:
                window = self.tokenizer.model_max_length
                ids = self.tokenizer([""], padding="max_length", max_length=window, truncation=True,
                                     return_tensors="pt").input_ids
                found = self.text_of(ids.to(self.device), [""], compiled=False)
        empty = {key: _stored(value[0]).cpu().numpy() for key, value in found.items()}
        lengths = self.family.text_lengths(found) if trim else None
        for key in self.family.trimmed if lengths is not None else ():
            empty[key] = empty[key][: int(lengths[0])]
        return empty


def _stored(value: torch.Tensor) -> torch.Tensor:
    """A text tensor as encode stores it: float16 (floats), as it is otherwise (PixArt's bool mask)."""
    return value.to(torch.float16) if value.is_floating_point() else value


def _compute_dtype(name: str, device):
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _warm_up(encoders: Encoders, config: EncodeConfig) -> None:
    """Compile for the one batch shape before the loader starts, so compile time is not encode time."""
    pixels = torch.zeros((config.batch_size, 3, config.resolution, config.resolution), device=encoders.device,
                         dtype=encoders.vae_dtype).contiguous(memory_format=encoders.layout)
    ids = torch.zeros((config.batch_size, encoders.tokenizer.model_max_length), dtype=torch.long,
                      device=encoders.device)
    encoders.encode_images(pixels)
    encoders.text_of(ids, [""] * config.batch_size)


def _encode_batch(encoders: Encoders, batch: dict, config: EncodeConfig, ready=None) -> dict:
    """VAE moments and text hidden states for one batch, copied to host without waiting for the copy;
    ``ready``: the event of the batch's copies and decode on the prepare stream, waited for on the device."""
    if ready is not None:
        torch.cuda.current_stream(encoders.device).wait_event(ready)
        batch["pixels"].record_stream(torch.cuda.current_stream(encoders.device))
        batch["input_ids"].record_stream(torch.cuda.current_stream(encoders.device))
        for ids in batch.get("caption_ids", {}).values():
            ids.record_stream(torch.cuda.current_stream(encoders.device))
    pixels, input_ids = batch["pixels"], batch["input_ids"]
    count = pixels.shape[0]
    pad = config.batch_size - count if config.compile and 0 < count < config.batch_size else 0
    if pad:
        # One shape per compiled graph: pad the shard's last batch and drop the padding after.
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)]).contiguous(
            memory_format=encoders.layout)
        input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad, -1)])
    moments, stored, trim, named = None, {}, None, None
    if count:
        moments = encoders.encode_images(pixels)[:count].to(torch.float16).to("cpu", non_blocking=True)
        if "caption_ids" in batch:  # --captions: each name's text members, every row (writer keeps its own)
            named = {name: _text_members(encoders, torch.cat([ids, ids[-1:].expand(pad, -1)]) if pad else ids,
                                         batch["caption_texts"][name], count)
                     for name, ids in batch["caption_ids"].items()}
        else:
            stored, trim = _text_members(encoders, input_ids, [record["caption"] for record in batch["records"]],
                                         count)
    done = None
    if encoders.device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(encoders.device))
    return {"shard": batch["shard"], "keys": batch["keys"], "records": batch["records"],
            "moments": moments, "stored": stored, "trim": trim, "done": done, "skips": batch.get("skips", []),
            "decoded": batch["decoded"],
            **({"captions": named, "present": batch["present"], "caption_skips": batch["caption_skips"]}
               if named is not None or "caption_ids" in batch else {})}


def _text_members(encoders: Encoders, input_ids, captions: Sequence[str], count: int) -> tuple[dict, tuple | None]:
    """A batch's stored text members ({member: batch tensor on its way to the host}) for ``captions`` (of which
    the first ``count`` are real, the rest compile padding) and what the writer trims them to, or None."""
    if encoders.online:  # token ids only (int32): train runs the text encoders
        return {encoders.family.ids_member(index): ids[:count].to(torch.int32) for index, ids in
                enumerate(encoders.family.tokenize(encoders.tokenizers, captions))}, None
    found = encoders.text_of(input_ids, captions)
    stored = {encoders.family.member(key): _stored(value[:count]).to("cpu", non_blocking=True)
              for key, value in found.items()}
    lengths = encoders.family.text_lengths(found)
    if lengths is None:
        return stored, None
    # the writer cuts these members of each sample to its caption's length
    return stored, (lengths[:count].to("cpu", non_blocking=True),
                    tuple(encoders.family.member(key) for key in encoders.family.trimmed))
