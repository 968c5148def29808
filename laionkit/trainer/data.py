"""What a run trains on: a latent folder opened and checked (LatentSet, open_latents), the stream layout key a
checkpoint records, and the stages of a multi-resolution schedule (Schedule, plan_stages)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from laionkit.common import (
    LaionkitError,
)
from laionkit.common.storage import Location
from laionkit.common.tars import count_samples
from laionkit.families import FamilySpec, get_family
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.latent_stream import (
    StreamLayout,
    Unit,
    decode,
    read_unit,
    shard_paths,
)


@dataclass(frozen=True)
class LatentSet:
    """What training needs from an encode output folder (docs/FORMATS.md §3). ``shards`` are the
    non-empty shards with their sample counts in ``shard_samples``; empty ones are listed apart.
    ``buckets`` name the latent shapes a batch may have ("WxH" in pixels, as encode names them), in the
    manifest's order, with their moments shapes in ``bucket_shapes``: one entry without --buckets.
    ``moments_shape`` is the square bucket's, the size validation draws."""

    shards: tuple[str, ...]
    shard_samples: tuple[int, ...]
    empty_shards: tuple[str, ...]
    samples: int
    scaling_factor: float
    shift_factor: float
    vae_source: str | None
    moments_shape: tuple[int, ...]
    text_shape: tuple[int, ...]
    empty_caption: torch.Tensor
    # The model family encode recorded (SD when the manifest names none), its stored text tensors'
    # empty-caption versions by stored key ("states" is empty_caption), and where the models came from.
    family: FamilySpec = field(default_factory=lambda: get_family("sd"))
    empty: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)
    bucketed: bool = False
    buckets: tuple[str, ...] = ()
    bucket_shapes: tuple[tuple[int, ...], ...] = ()
    online: bool = False  # encode --text online: samples hold token ids, train runs the text encoders
    # encode --captions: the caption names stored per sample, in order (alt alone: one caption, as always),
    # and those of them some sample carries a CLIP score for (train --caption-mix clip)
    captions: tuple[str, ...] = ("alt",)
    scored_captions: tuple[str, ...] = ()
    manifest: str = ""  # where the manifest is, for messages
    # The VAE's per-channel statistics where the family's pipeline normalises with them (the manifest's
    # vae.latents_mean / latents_std; Qwen-Image), else None: see normalize.
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents ([..., C, h, w]) as the denoiser sees them: (z - shift_factor) * scaling_factor, and with
        per-channel statistics (z - shift_factor - mean) * scaling_factor / std (Qwen-Image's pipeline:
        (z - mean) / std, scaling 1 and no shift; SDXL's pipeline on a VAE with latents_mean alike)."""
        if self.latents_mean is None:
            return (z - self.shift_factor) * self.scaling_factor
        mean, std = self._stats(z)
        return (z - self.shift_factor - mean) * self.scaling_factor / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of normalize: what the VAE decodes."""
        if self.latents_mean is None:
            return latents / self.scaling_factor + self.shift_factor
        mean, std = self._stats(latents)
        return latents * std / self.scaling_factor + mean + self.shift_factor

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics shaped to ``like`` [..., C, h, w]: one per channel, or, with 4C of them (FLUX.2's,
        of 2x2-patchified channels c*4 + 2 dy + dx), laid over the 2x2 pattern: normalising the latent so is
        patchifying it, normalising per patchified channel and unpatchifying."""
        channels, height, width = like.shape[-3:]

        def shaped(values):
            found = torch.tensor(values, dtype=torch.float32).to(like.device, like.dtype)
            if len(values) == channels:
                return found.view(-1, 1, 1)
            patch = math.isqrt(len(values) // channels)
            if patch * patch * channels != len(values) or height % patch or width % patch:
                raise LaionkitError(f"{self.manifest}: {len(values)} latent statistics fit neither the "
                                    f"{channels} latent channels nor their square patches")
            return found.view(channels, patch, patch).repeat(1, height // patch, width // patch)

        return shaped(self.latents_mean), shaped(self.latents_std)

    # The manifest's vae.deterministic: moments.npy holds the latent itself (C channels; AutoencoderDC), not
    # a posterior's mean and log-variance (2C channels) to draw a latent from.
    deterministic: bool = False

    @property
    def moments_per_channel(self) -> int:
        """Stored channels per latent channel: 2 (mean and log-variance), 1 for a deterministic VAE."""
        return 1 if self.deterministic else 2

    def bucket_of(self, shape) -> int:
        """The index in ``buckets`` of a batch's moments shape (2C, h, w)."""
        try:
            return self.bucket_shapes.index(tuple(shape))
        except ValueError:
            raise LaionkitError(f"latents of shape {tuple(shape)} fit none of the manifest's buckets "
                                f"({', '.join(self.buckets)}): was the folder assembled from several encode "
                                "runs? Re-encode it") from None


def open_latents(latents: Path | str) -> LatentSet:
    import io

    import numpy as np

    latents = Location.parse(latents)
    manifest_path = latents / "manifest.json"
    # A bucket folder other tools uploaded (aws s3 sync) has no done records: all its objects count.
    plain = latents.uploaded_by_other_tools()
    present = Location.exists if plain else Location.is_complete
    if not present(manifest_path) or manifest_path.is_dir():
        raise LaionkitError(f"{manifest_path} not found: is {latents} an encode output folder?")
    from laionkit.encode import RECORD_SUFFIX, latent_status

    if not plain and latents.list("*" + RECORD_SUFFIX):
        manifest = latent_status(latents)  # from the shard records: manifest.json may be a stale merge
    else:
        manifest = _read_record(manifest_path)  # a folder assembled by hand: its manifest is all there is
    try:
        vae = manifest["vae"]
        scaling_factor = float(vae["scaling_factor"])
        empty_path = latents / manifest["empty_caption"]
        records = manifest.get("records") or {}
        # with the caption window encode used (--max-sequence-length): online text and caption dropout use it too
        family = get_family(manifest.get("family") or "sd").with_max_sequence_length(
            (manifest.get("text") or {}).get("max_sequence_length"))
    except (KeyError, TypeError, ValueError) as error:
        raise LaionkitError(f"{manifest_path} has no valid {error} (not a laionkit-latents manifest)") from None
    if not manifest.get("complete"):
        missing = manifest.get("shards", {}).get("missing")
        raise LaionkitError(f"{manifest_path}: encode is not complete (missing shards: {missing}); rerun it")
    shards, counts, empty_shards = [], [], []
    for path in shard_paths(latents, complete_only=None):  # every object where other tools uploaded them
        found = count_samples(path)  # reads every header: a damaged shard is found now, not hours in
        record_file = latents / str(records.get(path.name, ""))
        if path.name in records and present(record_file) and not record_file.is_dir():
            recorded = _read_record(record_file).get("samples_out")
            if recorded != found:
                raise LaionkitError(f"{path} holds {found} samples but its record {record_file.name} says "
                                    f"{recorded}: the shard was damaged or replaced after encode; rerun encode")
        if found:
            shards.append(str(path))
            counts.append(found)
        else:
            empty_shards.append(str(path))
    if not shards:
        raise LaionkitError(f"every latent shard in {latents} is empty: nothing to train on")
    first = decode(next(read_unit(Unit(shards[0]))))
    channels, height, width = first["moments"].shape
    factor = int(vae.get("downsample_factor") or 8)  # SD's, for manifests written before it was recorded
    sizes = manifest.get("buckets") or [[width * factor, height * factor]]
    try:
        bucket_shapes = tuple((channels, int(h) // factor, int(w) // factor) for w, h in sizes)
    except (TypeError, ValueError):
        raise LaionkitError(f"{manifest_path}: buckets {sizes!r} are not a list of [width, height]") from None
    if tuple(first["moments"].shape) not in bucket_shapes:
        raise LaionkitError(f"{manifest_path}: the latents in {shards[0]} have shape {tuple(first['moments'].shape)}, "
                            f"none of the manifest's buckets {sizes} at 1/{factor} scale; rerun encode")
    buckets = tuple(f"{w}x{h}" for w, h in sizes)
    square = [shape for shape in bucket_shapes if shape[1] == shape[2]]
    online = (manifest.get("text") or {}).get("mode") == "online"
    if online:  # token ids per sample: the stored tensors' shapes are the manifest's (its empty caption's)
        missing = [family.ids_member(i) for i in range(len(family.text_encoders))
                   if family.ids_member(i)[:-4] not in first]
        if missing:
            raise LaionkitError(f"{shards[0]}: online-text latents need {', '.join(missing)} per sample; sample "
                                f"{first['key']} lacks them: rerun encode")
        first = {**first, **{key: torch.empty(shape) for key, shape in (
            ("text" if key == "states" else key, tuple(shape)) for key, shape in manifest["text"]["stored"].items())}}
    try:
        empty = torch.from_numpy(np.load(io.BytesIO(empty_path.read_bytes())))
    except (OSError, ValueError, LaionkitError) as error:
        raise LaionkitError(f"{empty_path} (the manifest's empty_caption) cannot be read: {error}") from None
    # Text trimmed to each caption's length (a family with a text mask): shapes agree but for their length.
    trimmed = set((manifest.get("text") or {}).get("trimmed") or ())

    def differ(key: str, found: torch.Tensor, want: torch.Tensor) -> bool:
        return tuple(found.shape)[key in trimmed:] != tuple(want.shape)[key in trimmed:]

    if differ("states", empty, first["text"]):
        raise LaionkitError(f"{empty_path}: shape {tuple(empty.shape)} != text embeddings "
                            f"{tuple(first['text'].shape)} in {shards[0]}")
    empties = {"states": empty}
    for key in family.stored:
        if key == "states":
            continue
        path = latents / str(manifest.get(f"empty_{key}") or family.empty_file(key))
        if key not in first:
            raise LaionkitError(f"{shards[0]}: {family.name} latents need a .{family.member(key)} member per "
                                f"sample; sample {first['key']} has none: rerun encode")
        try:
            empties[key] = torch.from_numpy(np.load(io.BytesIO(path.read_bytes())))
        except (OSError, ValueError) as error:
            raise LaionkitError(f"{path} (the empty caption's {key}) cannot be read: {error}") from None
        if differ(key, empties[key], first[key]):
            raise LaionkitError(f"{path}: shape {tuple(empties[key].shape)} != {key} "
                                f"{tuple(first[key].shape)} in {shards[0]}")
    return LatentSet(
        shards=tuple(shards),
        shard_samples=tuple(counts),
        empty_shards=tuple(empty_shards),
        samples=sum(counts),
        scaling_factor=scaling_factor,
        shift_factor=float(vae.get("shift_factor") or 0.0),
        vae_source=(manifest.get("models") or {}).get("vae", {}).get("source"),
        moments_shape=square[0] if square else tuple(first["moments"].shape),
        text_shape=tuple(manifest["text"]["stored"]["states"] if "states" in trimmed else first["text"].shape),
        empty_caption=empty,
        family=family,
        empty=empties,
        models=manifest.get("models") or {},
        bucketed=bool(manifest.get("buckets")),
        buckets=buckets,
        bucket_shapes=bucket_shapes,
        online=online,
        captions=tuple(manifest.get("captions") or ("alt",)),
        scored_captions=tuple(name for name, counts in (manifest.get("caption_counts") or {}).items()
                              if counts.get("scored")),
        manifest=str(manifest_path),
        latents_mean=tuple(vae["latents_mean"]) if vae.get("latents_mean") is not None else None,
        latents_std=tuple(vae["latents_std"]) if vae.get("latents_std") is not None else None,
        deterministic=bool(vae.get("deterministic")),
    )


def _read_record(path: Location) -> dict:
    try:
        record = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, LaionkitError) as error:
        raise LaionkitError(f"{path} cannot be read as JSON ({error}): rerun encode") from None
    if not isinstance(record, dict):
        raise LaionkitError(f"{path} is not a JSON object: rerun encode")
    return record


@dataclass(frozen=True)
class Schedule:
    """The latent folders a run trains on, in order (LATENTS, then each --stage), with their steps.

    ``ends[i]`` is the step stage i ends at (the last: the run's max_steps). ``buckets`` are every stage's
    buckets in first-seen order, the index of every per-bucket count; ``to_all[i][j]`` is that index of
    stage i's bucket j. ``global_batch`` is the samples of one optimizer step over all ranks."""

    stages: tuple[tuple[Path, LatentSet, int], ...]
    ends: tuple[int, ...]
    buckets: tuple[str, ...]
    to_all: tuple[tuple[int, ...], ...]
    global_batch: int

    @property
    def max_steps(self) -> int:
        return self.ends[-1]

    def stage_at(self, step: int) -> int:
        """The stage that trains step ``step + 1`` (the last one once all are done)."""
        return next((i for i, end in enumerate(self.ends) if step < end), len(self.stages) - 1)

    def start(self, stage: int) -> int:
        return self.ends[stage] - self.stages[stage][2]

    def bucket(self, stage: int, shape) -> int:
        """The index in ``buckets`` of a batch's moments shape in ``stage``."""
        return self.to_all[stage][self.stages[stage][1].bucket_of(shape)]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: shape for _, latents, _ in self.stages
                for key, shape in zip(latents.buckets, latents.bucket_shapes)}


def plan_stages(config: TrainConfig, data: LatentSet, world: int) -> Schedule:
    """--stage: a schedule of latent folders (e.g. low resolution first), each for its number of steps;
    LATENTS (``data``) first, for --max-steps or --epochs of its samples."""
    global_batch = config.batch_size * config.grad_accum * world
    max_steps = config.max_steps or math.ceil((config.epochs or 1) * data.samples / global_batch)  # one epoch by default
    stages = [(config.latents, data, max_steps)]
    for folder, steps in config.later_stages():
        stages.append((folder, same_model_latents(stages[0], folder, open_latents(folder)), steps))
    buckets = tuple(dict.fromkeys(key for _, latents, _ in stages for key in latents.buckets))
    return Schedule(stages=tuple(stages), ends=tuple(itertools.accumulate(steps for _, _, steps in stages)),
                    buckets=buckets, global_batch=global_batch,
                    to_all=tuple(tuple(buckets.index(key) for key in latents.buckets) for _, latents, _ in stages))


def same_model_latents(first: tuple[Path, LatentSet, int], folder: Path, later: LatentSet) -> LatentSet:
    """A --stage folder must feed the same model as LATENTS: latent channels, text embeddings and the
    VAE's scaling (its validation grids decode with LATENTS' VAE)."""
    def facts(data: LatentSet) -> tuple:
        return (data.bucket_shapes[0][0] // data.moments_per_channel, data.text_shape, data.scaling_factor,
                data.shift_factor, data.latents_mean, data.latents_std)

    if facts(later) != facts(first[1]):
        raise LaionkitError(
            f"--stage {folder}: (latent channels, text shape, scaling factor, shift factor, latents mean, latents std) "
            f"{facts(later)} differ "
            f"from {first[0]}'s {facts(first[1])}: stages must come from the same VAE and text encoder")
    return later


def layout_key(layout: StreamLayout, data: LatentSet) -> dict:
    """What exact resume compares: the stream layout with the shards as content (name, samples, bytes),
    not paths, so latents moved, staged on local disk or reached through a symlink still resume."""
    key = asdict(layout)
    del key["bucketed"], key["samples"]  # follow from the shards' content, pinned below (absent from older checkpoints)
    del key["caption_mix"], key["caption_names"]  # the names follow from the shards; the policy only where given
    if layout.caption_mix is not None:
        key["caption_mix"] = layout.caption_mix.spec
    key["shards"] = [[Location.parse(shard).name, samples, Location.parse(shard).size()]
                     for shard, samples in zip(data.shards, data.shard_samples)]
    return key
