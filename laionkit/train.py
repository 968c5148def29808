"""`laionkit train`: one Accelerate loop that trains a UNet on streamed latent shards and resumes exactly.

Reads top to bottom: config → data set → model and objective → checkpoints → validation → the loop,
whose pieces are ``setup`` (make_accelerator, the run folder, plan_stages, ``build``: model, optimizer,
EMA, LR schedule) → ``resume`` → per step ``train_step`` (micro_step: loss, backward, apply_gradients),
``MetricsWindow`` (metrics.jsonl), ``checkpoint``, ``validation_loss`` / ``validation_grid`` → ``finish``
(export); ``_train`` wires them, and the bench scripts time the same build and train_step. Runs as
one process, or under `accelerate launch` / `torchrun` with the configs in `train/` (DDP, FSDP,
DeepSpeed ZeRO-2). Every rank runs exactly ``max_steps`` optimizer steps: the data stream
(laionkit.latents) never runs dry, so no rank waits.

Invariant of a checkpoint folder ``step-N``: it holds the state *after* N optimizer steps, and every
rank's data cursor equals ``N * grad_accum`` batches; its name exists only once all ranks wrote it.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import itertools
import json
import math
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from laionkit import exports, fp8, fsdp, lora, runfolder, runlock, trainchecks, valloss
from laionkit.common import (
    LaionkitError,
    atomic_output,
    read_json,
    refuse_other_settings,
    resolve_rank,
    storage,
    versions,
)
from laionkit.common.models import sha256_file
from laionkit.common.outputs import partial_path
from laionkit.common.storage import Location, ReadCache
from laionkit.common.tars import count_samples
from laionkit.families import FamilySpec, Objective, families, get_family
from laionkit.latents import (
    SIZE_FIELDS,
    STOP_SIGNALS,
    StreamLayout,
    Unit,
    collate,
    decode,
    end_workers,
    latent_loader,
    pad_to,
    read_unit,
    shard_paths,
)

CHECKPOINT_PREFIX = "step-"


@dataclass(frozen=True)
class TrainConfig:
    latents: Path | str  # a folder or a URL (s3://...), streamed
    output: Path | str  # a folder or a URL (s3://...), staged locally (laionkit/runfolder.py)
    unet: str | None = None
    unet_config: str | None = None
    noise_scheduler: str | None = None
    prediction_type: str | None = None
    timestep_sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    # --- flow matching (SD3, Flux): None takes the family's default (laionkit/families, Objective) ---
    sigma_sampling: str | None = None  # logit_normal | uniform | mode
    mode_scale: float = 1.29
    shift: str | None = None  # a number (static shift), "dynamic" (Flux's per-resolution rule) or "none"
    weighting: str | None = None  # none | sigma_sqrt | cosmap
    train_guidance: float | None = None  # the guidance embedding's input (transformers with guidance_embeds)
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    caption_dropout: float = 0.0
    batch_size: int = 32
    grad_accum: int = 1
    max_steps: int | None = None
    epochs: float | None = None
    lr: float = 1e-4
    scale_lr: str = "none"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 1e-2
    max_grad_norm: float = 1.0
    optimizer: str = "adamw"
    mixed_precision: str | None = None
    bf16_weights: bool | None = None  # None: on in eager mode, off with --compile (measured, see MasterWeights)
    full_bf16: bool = False  # weights, gradients and optimizer state all in bf16, no fp32 master (full_bf16_policy)
    ema: bool = False
    ema_decay: float = 0.9999
    checkpointing: str = "none"  # activation checkpointing per family block: blocks, every-N or none
    gradient_checkpointing: bool = False  # deprecated alias of checkpointing="blocks"
    compile: bool = False
    compile_mode: str = "default"
    compile_dynamic: bool = False  # dynamic=True: one graph with symbolic shapes for every bucket (measured: BENCHMARKS)
    channels_last: bool = False
    tf32: bool = True
    seed: int = 0
    workers: int = 2
    shuffle_buffer: int = 1000
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    resume: str | None = None
    overwrite: bool = False
    allow_changed_text_encoder: bool = False  # online text: train with encoders whose files differ from encode's
    max_nonfinite: int = 3
    log_every: int = 10
    log_with: str = "tensorboard"
    validate_every: int = 0
    validation_count: int = 4
    validation_steps: int = 25
    guidance_scale: float = 5.0
    peak_tflops: float = 989.0
    record_keys: bool = False
    metrics_port: int | None = None
    stage: tuple[str, ...] | None = None  # DIR:STEPS, trained after --latents in this order
    rank: int | None = None
    world_size: int | None = None
    quiet: bool = False
    # --- LoRA and the validation loss (laionkit/lora.py, laionkit/valloss.py) ---
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str = "to_q,to_k,to_v,to_out.0"  # lora.DEFAULT_TARGETS
    lora_random_base: bool = False  # --lora-rank on --unet-config (a random base, never saved): benchmarks only
    val_latents: Path | None = None
    val_every: int = 0
    val_samples: int = 64
    cache_dir: Path | None = None  # local copies of latent shards read from a URL, at most cache_size bytes
    cache_size: int = 100 * 2**30
    storage_options: str | None = None  # --storage-options JSON for the latents, --val-latents and --output URLs
    fp8: bool = False  # the blocks' linear layers in float8 (laionkit/fp8.py)
    fp8_recipe: str = "tensorwise"
    export: str = "auto"  # what finish writes besides RUN/unet: auto, pipeline, single-file (laionkit/exports.py)
    export_files: str = "copy"  # the base's files in RUN/pipeline: copy or hardlink

    def __post_init__(self) -> None:
        choices = {
            "timestep_sampling": ("uniform", "logit-normal"), "scale_lr": ("none", "linear", "sqrt"),
            "lr_schedule": ("constant", "cosine"), "optimizer": ("adamw", "adamw8bit"),
            "mixed_precision": (None, "no", "fp16", "bf16"), "log_with": ("tensorboard", "wandb", "none"),
            "prediction_type": (None, "epsilon", "v_prediction"),
            "sigma_sampling": (None, "logit_normal", "logit-normal", "uniform", "mode"),
            "weighting": (None, "none", "sigma_sqrt", "cosmap"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise LaionkitError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: choose from "
                                    f"{', '.join(a for a in allowed if a)}")
        if (self.unet is None) == (self.unet_config is None):
            raise LaionkitError("give exactly one of --unet / --transformer (fine-tune) or --unet-config / "
                                "--transformer-config (from scratch)")
        if (self.max_steps is None) == (self.epochs is None):
            raise LaionkitError("give exactly one of --max-steps or --epochs")
        at_least = {"batch_size": 1, "grad_accum": 1, "log_every": 1, "checkpoint_every": 1, "keep_checkpoints": 1,
                    "max_steps": 1, "max_nonfinite": 1, "workers": 0, "shuffle_buffer": 0, "warmup_steps": 0,
                    "validate_every": 0, "validation_count": 1, "validation_steps": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise LaionkitError(f"--{name.replace('_', '-')} {value}: must be >= {low}")
        for name in ("lr", "epochs"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise LaionkitError(f"--{name} {value}: must be a finite number > 0")
        if self.resume not in (None, "latest") and self.overwrite:
            raise LaionkitError("--overwrite goes with --resume latest only (resume if a checkpoint exists, else "
                                "delete the run and start over); --resume FOLDER continues that checkpoint")
        if not 0 <= self.caption_dropout <= 1:
            raise LaionkitError("--caption-dropout is a probability in [0, 1]")
        if self.shift not in (None, "dynamic", "none"):
            try:
                value = float(self.shift)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise LaionkitError(f"--shift {self.shift!r}: a number > 0 (static shift), dynamic or none")
        if self.full_bf16 and (self.mixed_precision not in (None, "bf16") or self.bf16_weights is False):
            raise LaionkitError("--full-bf16 trains bf16 weights without fp32 master copies: it needs "
                                "--mixed-precision bf16 and cannot be combined with --no-bf16-weights")
        if self.compile_dynamic and not self.compile:
            raise LaionkitError("--compile-dynamic chooses how --compile treats shapes: give it with --compile")
        self.later_stages()
        self.checkpoint_interval()
        lora.check_config(self)
        valloss.check_config(self)
        fp8.check_config(self)
        exports.check_config(self)

    def checkpoint_interval(self) -> int:
        """--checkpointing as a block interval: 0 none, 1 every block (``blocks``), N every N-th block
        (``every-N``). The deprecated --gradient-checkpointing means ``blocks``."""
        value = self.checkpointing.strip().lower()
        if self.gradient_checkpointing:
            if value not in ("none", "blocks"):
                raise LaionkitError(f"--gradient-checkpointing (deprecated) is --checkpointing blocks; it "
                                    f"contradicts --checkpointing {self.checkpointing}: give only --checkpointing")
            return 1
        if value == "none":
            return 0
        if value == "blocks":
            return 1
        prefix, _, count = value.partition("every-")
        if prefix or not count.isdigit() or int(count) < 1:
            raise LaionkitError(f"--checkpointing {self.checkpointing!r}: blocks (every block), every-N (every "
                                "N-th block, N >= 1) or none")
        return int(count)

    def later_stages(self) -> list[tuple[Path, int]]:
        """The --stage folders and their steps, trained after the LATENTS stage."""
        found = []
        for spec in self.stage or ():
            folder, colon, steps = spec.rpartition(":")
            if not colon or not folder or not steps.isdigit() or int(steps) < 1:
                raise LaionkitError(f"--stage {spec!r}: give DIR:STEPS, STEPS a whole number of steps >= 1")
            found.append((Path(folder), int(steps)))
        return found


@dataclass(frozen=True)
class TrainResult:
    step: int
    stopped_by: int | None  # the signal number that ended the run early, else None
    checkpoint: Path | None


# --- the latent set -------------------------------------------------------------------------------

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
    plain = trainchecks.uploaded_without_records(latents)
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
        family = get_family(manifest.get("family") or "sd")
    except (KeyError, TypeError, ValueError) as error:
        raise LaionkitError(f"{manifest_path} has no valid {error} (not a laionkit-latents manifest)") from None
    if not manifest.get("complete"):
        missing = manifest.get("shards", {}).get("missing")
        raise LaionkitError(f"{manifest_path}: encode is not complete (missing shards: {missing}); rerun it")
    shards, counts, empty_shards = [], [], []
    for path in latents.list("*.tar", complete_only=False) or shard_paths(latents) if plain else shard_paths(latents):
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
    )


def _read_record(path: Location) -> dict:
    try:
        record = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, LaionkitError) as error:
        raise LaionkitError(f"{path} cannot be read as JSON ({error}): rerun encode") from None
    if not isinstance(record, dict):
        raise LaionkitError(f"{path} is not a JSON object: rerun encode")
    return record


# --- model and objective --------------------------------------------------------------------------

def build_unet(config: TrainConfig, data: LatentSet):
    """A pretrained denoiser (--unet) or a fresh one of the family's configs / a config file (--unet-config),
    fitted to the data: latent channels, sample size, text width and (SDXL) the pooled width."""
    import diffusers

    from laionkit.common.models import load_unet, load_unet_config

    spec = data.family
    channels, height, _ = data.moments_shape
    latent_channels, text_dim = channels // 2, data.text_shape[-1]
    pooled_dim = data.empty["pooled"].shape[-1] if "pooled" in data.empty else None
    if spec.fit_config is not None:
        return build_transformer(config, data, latent_channels, text_dim, pooled_dim)
    if config.unet is not None:
        trainchecks.check_denoiser_folder(config.unet, spec, "--unet")  # another family's model: one line
        unet = load_unet(spec.presets.get(config.unet, config.unet))
        expects = (unet.config.in_channels, unet.config.cross_attention_dim, _pooled_width(unet.config))
        if expects != (latent_channels, text_dim, pooled_dim):
            raise LaionkitError(
                f"--unet {config.unet}: expects {expects[0]} latent channels, {expects[1]}-dim text and "
                f"{expects[2] or 'no'} pooled text; the {spec.name} latents have {latent_channels}, {text_dim} "
                f"and {pooled_dim or 'no'}"
            )
        return unet
    arch = _architecture(config, spec, "--unet-config", load_unet_config)
    arch.update(in_channels=latent_channels, out_channels=latent_channels, sample_size=height,
                cross_attention_dim=text_dim)
    if arch.get("addition_embed_type") == "text_time" or pooled_dim is not None:
        if arch.get("addition_embed_type") != "text_time" or pooled_dim is None:
            raise LaionkitError(f"--unet-config {config.unet_config}: {spec.name} latents "
                                f"{'carry' if pooled_dim else 'lack'} pooled text, the architecture "
                                f"{'lacks' if pooled_dim else 'needs'} it (addition_embed_type text_time)")
        arch["projection_class_embeddings_input_dim"] = 6 * arch["addition_time_embed_dim"] + pooled_dim
    return getattr(diffusers, spec.denoiser_class).from_config(arch)


def build_transformer(config: TrainConfig, data: LatentSet, latent_channels: int, text_dim: int,
                      pooled_dim: int | None):
    """The transformer families' denoiser: from_pretrained on --transformer (a preset, a pipeline folder
    or hub repo: its transformer/ subfolder), or from_config on a family config / a config file
    (--transformer-config), fitted to the data by the family."""
    import diffusers

    from laionkit.common.models import _from_pretrained, _load_config

    spec = data.family
    cls = getattr(diffusers, spec.denoiser_class)
    if config.unet is not None:
        trainchecks.check_denoiser_folder(config.unet, spec, "--transformer")  # another family's model: one line
        model = _from_pretrained(cls, spec.presets.get(config.unet, config.unet), spec.denoiser_subfolder)
        found = spec.expects(model.config)
        if tuple(found) != (latent_channels, text_dim, pooled_dim):
            raise LaionkitError(
                f"--transformer {config.unet}: expects {found[0]} latent channels, {found[1]}-dim text and "
                f"{found[2]}-dim pooled text; the {spec.name} latents have {latent_channels}, {text_dim} and "
                f"{pooled_dim}")
        return model
    arch = _architecture(config, spec, "--transformer-config",
                         lambda source: _load_config(cls, source, spec.denoiser_subfolder))
    largest = max(max(shape[1:]) for shape in data.bucket_shapes)
    return cls.from_config(spec.fit_config(arch, latent_channels, largest, text_dim, pooled_dim))


def _architecture(config: TrainConfig, spec, flag: str, load) -> dict:
    """The from-scratch architecture: one of the family's named configs, or a config file / folder read
    by ``load``; another family's config name is refused, naming the family of the latents."""
    if config.unet_config in spec.configs:
        return dict(spec.configs[config.unet_config])
    owners = [name for name in families() if config.unet_config in get_family(name).configs]
    if owners:
        raise LaionkitError(f"{flag} {config.unet_config} is a {'/'.join(owners)} architecture; these latents "
                            f"are {spec.name} (from {config.latents}/manifest.json), whose configs are "
                            f"{', '.join(spec.configs)}")
    loaded = load(config.unet_config)
    trainchecks.check_denoiser_class(loaded.get("_class_name"), spec, flag, config.unet_config)
    return {k: v for k, v in loaded.items() if not k.startswith("_")}


def _pooled_width(unet_config) -> int | None:
    """The pooled text width a text_time UNet's add_embedding takes (6 time ids besides it), else None."""
    if unet_config.get("addition_embed_type") != "text_time":
        return None
    return unet_config["projection_class_embeddings_input_dim"] - 6 * unet_config["addition_time_embed_dim"]


class OnlineText:
    """The frozen text encoders of ``encode --text online`` latents, loaded from where encode loaded them
    (the manifest's models), run on each batch's token ids in the training dtype without gradients."""

    def __init__(self, data: LatentSet, device, dtype, allow_changed: bool = False) -> None:
        from laionkit.common.models import load_text_encoder, load_tokenizer

        self.family, self.device, self.dtype = data.family, device, dtype
        trainchecks.check_text_encoders(data.family, data.models, allow_changed)  # the models encode hashed
        try:
            sources = [(data.models[tok]["source"], tok, data.models[enc]["source"], enc)
                       for tok, enc in data.family.text_encoders]
        except KeyError as error:
            raise LaionkitError(f"online-text latents: the manifest names no {error} model to encode with") from None
        self.tokenizers = [load_tokenizer(source, tok) for source, tok, _, _ in sources]
        self.encoders = [load_text_encoder(source, dtype=dtype, component=enc).to(device)
                         for _, _, source, enc in sources]

    def empty(self) -> dict:
        """The empty caption's stored tensors (caption dropout), from these encoders in this dtype."""
        ids = self.family.tokenize(self.tokenizers, [""])
        names = [self.family.ids_member(i)[:-4] for i in range(len(ids))]
        return {key: value[0] for key, value in self(dict(zip(names, ids)), self.device, self.dtype).items()}

    def __call__(self, batch: dict, device, dtype) -> dict:
        """The stored tensors (by stored key) of a batch's ids_<tokenizer> members."""
        ids = [batch[self.family.ids_member(i)[:-4]].to(device, non_blocking=True)
               for i in range(len(self.family.text_encoders))]
        with torch.no_grad():
            found = self.family.encode_tokens(self.encoders, ids)
        return {key: found[key].to(dtype) for key in self.family.stored}


def batch_conditioning(batch: dict, data: LatentSet, device, dtype, online: OnlineText | None = None) -> dict:
    """A batch's stored text tensors by stored key on the device in ``dtype`` (encoded from its token ids
    by ``online`` for online-text latents), plus the size fields."""
    if online is not None:
        cond = online(batch, device, dtype)
    else:
        cond = {key: batch["text" if key == "states" else key].to(device, non_blocking=True).to(dtype)
                for key in data.family.stored}
    cond.update({name: batch[name].to(device, non_blocking=True) for name in SIZE_FIELDS if name in batch})
    return cond


def stored_conditioning(cond: dict, online: OnlineText | None, device, dtype) -> dict:
    """A decoded batch's conditioning by stored key: ``text`` is ``states``; token ids (online text) are
    encoded; the size fields pass through."""
    if online is None:
        return {"states" if k == "text" else k: v for k, v in cond.items()}
    return {**{k: v for k, v in cond.items() if not k.startswith("ids_")}, **online(cond, device, dtype)}


def perturbed(config: TrainConfig, noise: torch.Tensor, generator) -> torch.Tensor:
    """The noise that goes into the noisy input: with --input-perturbation, noise + gamma * fresh noise
    (the loss target stays ``noise``)."""
    if not config.input_perturbation:
        return noise
    return noise + config.input_perturbation * randn(noise.shape, generator, noise)


def dropout_captions(config: TrainConfig, cond: dict, empty: dict, batch: int, generator) -> dict:
    """--caption-dropout: each sample's text replaced by the empty caption's with that probability."""
    if not config.caption_dropout:
        return cond
    device = cond["states"].device
    dropped = torch.rand(batch, generator=generator, device=device) < config.caption_dropout
    return drop_captions(cond, empty, dropped)


def drop_captions(cond: dict, empty: dict, dropped: torch.Tensor) -> dict:
    """Caption dropout: the dropped samples get every stored tensor of the empty caption, together.
    Trimmed text (a family with a text mask) and the empty caption's are zero-padded to the longer first."""
    out = dict(cond)
    for key, value in empty.items():
        current = cond[key]
        if value.shape != current.shape[1:] and value.shape[1:] == current.shape[2:]:
            length = max(value.shape[0], current.shape[1])
            value, current = pad_to(value, length), pad_to(current, length, dim=1)
        mask = dropped.view(-1, *([1] * (value.dim())))
        out[key] = torch.where(mask, value, current)
    return out


def load_noise_scheduler(config: TrainConfig, spec: FamilySpec | None = None):
    """DDPM with the model family's schedule: --noise-scheduler, else --unet's folder (or preset), else the
    family's objective's betas (SD's when no family is given)."""
    from diffusers import DDPMScheduler

    from laionkit.common.models import load_scheduler

    spec = spec or get_family("sd")
    source = config.noise_scheduler or (spec.presets.get(config.unet, config.unet) if config.unet else None)
    if source is not None:
        scheduler = load_scheduler(source)
    else:
        objective = spec.objective
        scheduler = DDPMScheduler(beta_start=objective.beta_start, beta_end=objective.beta_end,
                                  beta_schedule=objective.beta_schedule, num_train_timesteps=1000,
                                  clip_sample=False, steps_offset=1)
    if config.prediction_type is not None:
        scheduler.register_to_config(prediction_type=config.prediction_type)
    return scheduler


def randn(shape, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=like.device, dtype=like.dtype)


def latents_and_noise(moments, config: TrainConfig, data: LatentSet, generator: torch.Generator,
                      channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh latent drawn from the stored moments, shifted and scaled as the VAE's config says, and the
    noise for it (with --noise-offset), both from ``generator`` in that order."""
    mean, logvar = moments.float().chunk(2, dim=1)
    latents = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * randn(mean.shape, generator, mean)
    latents = (latents - data.shift_factor) * data.scaling_factor
    if channels_last:
        latents = latents.contiguous(memory_format=torch.channels_last)
    noise = randn(latents.shape, generator, latents)
    if config.noise_offset:
        noise = noise + config.noise_offset * randn((latents.shape[0], latents.shape[1], 1, 1), generator, latents)
    return latents, noise


def diffusion_loss(model, moments, cond, empty, noise_scheduler, config: TrainConfig,
                   data: LatentSet, generator: torch.Generator) -> torch.Tensor:
    """The DDPM training loss for one batch: fresh latent, noise, timestep, prediction, (min-SNR) MSE."""
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_snr

    latents, noise = latents_and_noise(moments, config, data, generator, config.channels_last)
    batch = latents.shape[0]
    steps = noise_scheduler.config.num_train_timesteps
    if config.timestep_sampling == "uniform":
        timesteps = torch.randint(0, steps, (batch,), generator=generator, device=latents.device)
    else:
        u = compute_density_for_timestep_sampling("logit_normal", batch, config.logit_mean, config.logit_std,
                                                  device=latents.device, generator=generator)
        timesteps = (u * steps).long().clamp(max=steps - 1)
    text = cond["states"]
    noisy = noise_scheduler.add_noise(latents, perturbed(config, noise, generator), timesteps).to(text.dtype)
    cond = dropout_captions(config, cond, empty, batch, generator)
    if noise_scheduler.config.prediction_type == "epsilon":
        target = noise
    else:
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    prediction = data.family.predict(model, noisy, timesteps, cond)
    loss = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if config.snr_gamma:
        snr = compute_snr(noise_scheduler, timesteps)
        weight = snr.clamp(max=config.snr_gamma)
        weight = weight / snr if noise_scheduler.config.prediction_type == "epsilon" else weight / (snr + 1)
        loss = loss * weight
    return loss.mean()


FLOW_FLAGS = ("sigma_sampling", "shift", "weighting", "train_guidance")
DDPM_FLAGS = ("noise_scheduler", "prediction_type", "snr_gamma")


def resolve_objective(config: TrainConfig, spec: FamilySpec) -> Objective:
    """The family's objective with the train flags that override it; flags of the other objective are
    refused (a flow family has no DDPM schedule, a UNet family no sigma shift)."""
    objective = spec.objective
    if objective.kind == "ddpm":
        given = [name for name in FLOW_FLAGS if getattr(config, name) is not None]
        if given:
            raise LaionkitError(f"--{given[0].replace('_', '-')} is a flow-matching option; {spec.name} latents "
                                "train with the DDPM objective (--timestep-sampling, --snr-gamma, --prediction-type)")
        return objective
    given = [name for name in DDPM_FLAGS if getattr(config, name) is not None]
    if config.timestep_sampling != "uniform":
        given.append("timestep_sampling")
    if given:
        raise LaionkitError(f"--{given[0].replace('_', '-')} is a DDPM option; {spec.name} latents train with flow "
                            "matching (--sigma-sampling, --logit-mean/--logit-std, --shift, --weighting)")
    changes = {"logit_mean": config.logit_mean, "logit_std": config.logit_std, "mode_scale": config.mode_scale}
    if config.sigma_sampling is not None:
        changes["sigma_sampling"] = config.sigma_sampling.replace("-", "_")
    if config.weighting is not None:
        changes["weighting"] = config.weighting
    if config.shift == "dynamic":
        changes.update(shift=None, dynamic_shift=True)
    elif config.shift is not None:
        changes.update(shift=None if config.shift == "none" else float(config.shift), dynamic_shift=False)
    if config.train_guidance is not None:
        changes["guidance"] = config.train_guidance
    return replace(objective, **changes)


def guidance_input(objective: Objective, cond: dict, batch: int, device) -> dict:
    """cond with the guidance embedding's input (as FluxPipeline makes it: fp32, one value per sample)."""
    if objective.guidance is None:
        return cond
    return {**cond, "guidance": torch.full((batch,), objective.guidance, device=device, dtype=torch.float32)}


def flow_loss(model, moments, cond, empty, config: TrainConfig, data: LatentSet, generator: torch.Generator,
              objective: Objective) -> torch.Tensor:
    """The flow-matching loss for one batch (laionkit.families.flow): fresh latent and noise, sigma drawn
    and shifted directly (per bucket under a dynamic shift), x_t = (1 - sigma) x0 + sigma noise, the
    weighted MSE of the prediction to noise - x0. The timestep input is sigma x the family's scale."""
    from laionkit.families import flow

    latents, noise = latents_and_noise(moments, config, data, generator)
    batch, _, height, width = latents.shape
    sigmas = flow.sample_sigmas(batch, objective.sigma_sampling, logit_mean=objective.logit_mean,
                                logit_std=objective.logit_std, mode_scale=objective.mode_scale,
                                generator=generator, device=latents.device)
    shift = objective.sigma_shift(height, width)
    if shift != 1.0:
        sigmas = flow.shift_sigmas(sigmas, shift)
    text = cond["states"]
    noisy = flow.interpolate(latents, perturbed(config, noise, generator), sigmas).to(text.dtype)
    cond = dropout_captions(config, cond, empty, batch, generator)
    cond = guidance_input(objective, cond, batch, latents.device)
    prediction = data.family.predict(model, noisy, sigmas * objective.timestep_scale, cond)
    return flow.loss(prediction, latents, noise, sigmas, objective.weighting)


def flops_per_sample(unet, data: LatentSet, device: torch.device, shape: tuple[int, ...],
                     objective: Objective | None = None) -> float:
    """Model FLOPs of one sample's forward + backward at moments ``shape`` (a bucket's: attention grows
    faster than the pixel count, so buckets differ), counted once by torch's flop counter.

    Counted on a weightless copy of the denoiser (meta tensors, the same modules, LoRA layers and
    requires_grad): a real one-sample step at full size runs before the precision policy and activation
    checkpointing apply, and for Flux-12B at 1024 px (fp32 weights, gradients and activations) that needs
    more memory than an H200 has. Where a model cannot run on meta tensors, the count runs on ``device`` as before."""
    try:
        return count_flops(_weightless(unet), data, torch.device("meta"), shape, objective)
    except Exception:  # noqa: BLE001 - a data-dependent forward (.item() and the like) needs real tensors
        flops = count_flops(unet, data, device, shape, objective)
        unet.zero_grad(set_to_none=True)
        return flops


def count_flops(model, data: LatentSet, device: torch.device, shape: tuple[int, ...],
                objective: Objective | None = None) -> float:
    """torch's flop counter over one sample's forward + backward of ``model`` on ``device``."""
    from torch.utils.flop_counter import FlopCounterMode

    channels, height, width = shape
    dtype = next(model.parameters()).dtype  # a LoRA run's frozen base may already be bf16 (lora.attach)
    sample = torch.zeros(1, channels // 2, height, width, device=device, dtype=dtype)
    cond = {key: torch.zeros(1, *value.shape, device=device, dtype=dtype) for key, value in data.empty.items()}
    cond.update({name: torch.tensor([[height * 8, width * 8]], device=device) for name in SIZE_FIELDS})
    if objective is not None:
        cond = guidance_input(objective, cond, 1, device)
    counter = FlopCounterMode(display=False)
    with counter:
        data.family.predict(model, sample, torch.tensor([500], device=device), cond).sum().backward()
    return float(counter.get_total_flops())


def _weightless(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors of the same shapes, dtypes
    and requires_grad: no memory, no copy of the weights."""
    import copy

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, torch.nn.Parameter) else empty)
    return copy.deepcopy(module, memo)


def make_optimizer(config: TrainConfig, params, lr: float, device: torch.device):
    if config.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise LaionkitError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay, fused=device.type == "cuda")


class MasterWeights:
    """bf16 weights for forward and backward, fp32 master copies for the optimizer, clipping, EMA,
    checkpoints and export: FSDP2's and DeepSpeed's policy, here for one device and DDP. Against
    autocast over fp32 weights it drops the per-step weight casts and the fp32 GroupNorms autocast
    inserts: +11% samples/s at 512 px, +12% at 256 px, 18 GiB less memory (SD-1.5 UNet, H200, eager).
    Compiled, the step measured slower this way (578 vs 609 samples/s at 256 px, side by side: inductor's
    fused bf16 GroupNorm kernels and the master round trip cost ~11 ms of GPU time per step), so
    ``--compile`` keeps autocast unless --bf16-weights is given.

    With --grad-accum on one process, gradients leave the bf16 weights after every micro-batch and add
    up in fp32. Under DDP the micro-batches before the last run in ``no_sync``: their gradients exist on
    one rank only until DDP all-reduces the bf16 ``.grad`` sum at the sync micro-batch, so they stay in
    bf16 until then (see apply_gradients). DDP all-reduces in bf16, as FSDP2 reduce-scatters by default."""

    def __init__(self, accelerator, unet) -> None:
        trained = [(name, p) for name, p in unet.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in trained]
        self.weights = [p for _, p in trained]
        # Parameters (requires_grad) as optimizers and diffusers' EMAModel expect; gradients are set by hand.
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.weights]
        bf16_weights_without_autocast(accelerator, unet)

    @staticmethod
    def wanted(config: TrainConfig, accelerator) -> bool:
        """Only where nothing else owns precision: bf16 on one device or DDP (FSDP and DeepSpeed do it)."""
        chosen = (not config.compile) if config.bf16_weights is None else config.bf16_weights
        return chosen and not config.full_bf16 and _owns_precision(accelerator)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """The micro-batch's bf16 gradients into the fp32 master gradients: one foreach call over all
        parameters instead of one copy per parameter (an SD-1.5 UNet has 686)."""
        fresh, summed = ([], []), ([], [])
        for master, weight in zip(self.master, self.weights):
            if weight.grad is None:
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
                fresh[0].append(master.grad)
                fresh[1].append(weight.grad)
            else:
                summed[0].append(master.grad)
                summed[1].append(weight.grad)
            weight.grad = None
        if fresh[0]:
            torch._foreach_copy_(*fresh)
        if summed[0]:
            torch._foreach_add_(*summed)

    @torch.no_grad()
    def publish(self) -> None:
        """The updated master weights, rounded into the bf16 weights the next forward uses."""
        torch._foreach_copy_(self.weights, self.master)

    def state_dict(self) -> dict:
        return {"master": self.master}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.master, [t.to(self.master[0].device) for t in state["master"]])
        self.publish()


def bf16_weights_without_autocast(accelerator, unet) -> None:
    """The model's weights cast to bf16, and no autocast around its forward (``prepare`` must not add it):
    forward and backward run in the weights' own dtype (MasterWeights, --full-bf16)."""
    from accelerate.utils import AutocastKwargs

    accelerator.autocast_handler = AutocastKwargs(enabled=False)
    torch.nn.Module.to(unet, torch.bfloat16)  # not diffusers' .to, which warns to use from_pretrained


def _owns_precision(accelerator) -> bool:
    """bf16 on one device or DDP: laionkit chooses the precision policy (FSDP and DeepSpeed own theirs)."""
    from accelerate.utils import DistributedType

    return accelerator.mixed_precision == "bf16" and accelerator.distributed_type in (
        DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def full_bf16_policy(config: TrainConfig, accelerator, unet) -> bool:
    """--full-bf16 (kohya's --full_bf16): weights, gradients and AdamW state all in bf16, no fp32 master
    copies and no autocast: 8 bytes per trained parameter instead of 20 (a full-parameter Flux-12B fits one
    H200), and the fastest step (what the bench scripts' bare ceiling runs). Numerically weaker: an update
    under half a bf16 ulp of its weight is lost (|update| < ~0.2 % of |w|), so use it with learning rates
    that move weights by more than that, or for memory. Returns whether the policy applies; it is refused
    (one line) where laionkit does not own the precision: FSDP / DeepSpeed, or no bf16."""
    from accelerate.utils import DistributedType

    if not config.full_bf16:
        return False
    if not _owns_precision(accelerator):
        where = ("FSDP / DeepSpeed set their own precision (their mixed-precision config)"
                 if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
                 else f"mixed precision is {accelerator.mixed_precision!r}")
        raise LaionkitError(f"--full-bf16: {where}; it works with bf16 on one device or DDP")
    bf16_weights_without_autocast(accelerator, unet)
    return True


def apply_gradients(accelerator, unet, optimizer, master: MasterWeights | None, max_grad_norm: float):
    """After a micro-batch's backward: clip and step once per optimizer step (accelerate skips both on
    accumulating micro-steps). Returns the gradient norm of a sync step, else None.

    The master gradients take the bf16 gradients only where those are already what every rank agrees
    on: at the sync micro-batch (DDP has just all-reduced the accumulated ``.grad``), or on every
    micro-batch when there is one process. Moving them earlier under DDP would take each rank's
    ``no_sync`` gradients out of DDP's reach and let the ranks' weights drift apart."""
    if master is not None and (accelerator.sync_gradients or accelerator.num_processes == 1):
        master.accumulate_grads()
    grad_norm = None
    if accelerator.sync_gradients:
        params = master.master if master is not None else unet.parameters()
        grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None and accelerator.sync_gradients:
        master.publish()
    return grad_norm


def fsdp_wrap_units(plugin, model, spec: FamilySpec, say=print) -> list[str] | None:
    """FSDP's wrap units for ``model``: the accelerate config's transformer-based wrap classes when the
    model has them all (train/fsdp.yaml names the UNet's down / mid / up blocks), else the family's
    ``block_classes`` (SD3's JointTransformerBlock, Flux's double- and single-stream blocks: one FSDP unit
    per transformer block), instead of accelerate failing on a class the model lacks. Returns the names
    set on the plugin, or None where the policy is not transformer-based (left as configured)."""
    policy = plugin.auto_wrap_policy
    if policy is None or getattr(policy, "__name__", str(policy)).lower() not in (
            "transformer_auto_wrap_policy", "transformer_based_wrap"):
        return None
    present = {type(module).__name__ for module in model.modules()}
    configured = plugin.transformer_cls_names_to_wrap
    if isinstance(configured, str):
        configured = configured.split(",")
    if configured and all(name in present for name in configured):
        return list(configured)
    units = [block for block in spec.block_classes if block in present]
    if not units:
        raise LaionkitError(f"FSDP: {type(model).__name__} has none of the family's blocks "
                            f"({', '.join(spec.block_classes)}) to wrap")
    if configured:
        say(f"FSDP: {type(model).__name__} has no {', '.join(n for n in configured if n not in present)}; "
            f"wrapping each {' / '.join(units)} (the {spec.name} family's blocks) instead")
    plugin.transformer_cls_names_to_wrap = units
    return units


def scaled_lr(config: TrainConfig, global_batch: int) -> float:
    """diffusers' --scale_lr rule: --lr is per sample and grows with the global batch (linearly or by sqrt)."""
    factor = {"none": 1.0, "linear": global_batch, "sqrt": math.sqrt(global_batch)}[config.scale_lr]
    return config.lr * factor


# --- checkpoints ----------------------------------------------------------------------------------

def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def complete_checkpoints(output: Path) -> list[Path]:
    """Finished checkpoints, oldest first. Unfinished ones live under hidden .partial names, never listed."""
    folder = output / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def verify_checkpoint(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from (a file missing, of another size or content than recorded
    when it was saved), or None when it is whole."""
    try:
        files = read_json(folder / "trainer.json")["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"its trainer.json is unreadable or lists no files ({error})"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if sha256_file(path) != want["sha256"]:
            return f"{name} does not hold what was written (sha256 differs)"
    return None


def choose_resume(config: TrainConfig, say) -> Path | None:
    """--resume latest: the newest checkpoint that verifies, saying which ones were passed over;
    an explicit folder must verify."""
    if config.resume is None:
        return None
    if config.resume == "latest":
        found = complete_checkpoints(config.output)
        for folder in reversed(found):
            problem = verify_checkpoint(folder)
            if problem is None:
                return folder
            say(f"warning: checkpoint {folder} is damaged ({problem}); trying an older one")
        if found:  # starting over would replace the run these checkpoints belong to
            raise LaionkitError(f"--resume latest: every checkpoint in {config.output / 'checkpoints'} is damaged "
                                "(above); restore one, or remove checkpoints/ and give --overwrite to start over")
        return None
    path = Path(config.resume)
    if not (path / "trainer.json").is_file():
        raise LaionkitError(f"--resume {path}: not a complete checkpoint folder (no trainer.json)")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise LaionkitError(f"--resume {path}: damaged checkpoint: {problem}")
    return path


def find_resume(config: TrainConfig, accelerator, max_steps: int | None = None) -> Path | None:
    """Rank 0 reads and verifies the checkpoint files (once, not once per rank) and tells the others. A
    checkpoint past ``max_steps`` is refused: the run would export its later weights as if it had stopped
    at ``max_steps``."""
    from accelerate.utils import broadcast_object_list

    answer = [None, None]
    if accelerator.is_main_process:
        try:
            found = choose_resume(config, accelerator.print)
            step = found and read_json(found / "trainer.json").get("step")
            if max_steps is not None and isinstance(step, int) and step > max_steps:
                raise LaionkitError(f"--resume {config.resume}: {found} is at step {step}, past this run's "
                                    f"{max_steps} steps (--max-steps / --epochs / --stage): give at least {step}")
            answer = [None if found is None else str(found), None]
        except LaionkitError as error:
            answer = [None, str(error)]
    if accelerator.num_processes > 1:
        broadcast_object_list(answer)
    if answer[1] is not None:
        raise LaionkitError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def weights_fingerprint(accelerator, unet, master: MasterWeights | None) -> tuple[str, bool] | None:
    """sha256 of the fp32 (master) weights in parameter-name order, and whether all are finite. Ranks
    of DDP / ZeRO-2 hold the same whole weights after every step, so their fingerprints must agree;
    FSDP ranks hold different shards, so it has no fingerprint to compare (None)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return None
    if master is not None:
        named = zip(master.names, master.master)
    else:  # what trains: all weights, or the adapters of a LoRA run (the frozen base cannot drift)
        named = ((n, p) for n, p in accelerator.unwrap_model(unet).named_parameters() if p.requires_grad)
    digest, finite = hashlib.sha256(), True
    with torch.no_grad():
        for name, weight in named:
            values = weight.detach().float()
            finite = finite and bool(torch.isfinite(values).all())
            digest.update(name.encode())
            digest.update(values.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest(), finite


def check_ranks_agree(accelerator, fingerprint: tuple[str, bool] | None, step: int) -> None:
    """Every rank compares all ranks' fingerprints, so all stop together with the same message."""
    from accelerate.utils import gather_object

    if fingerprint is None:
        return
    found = gather_object([fingerprint[0]]) if accelerator.num_processes > 1 else [fingerprint[0]]
    differ = [rank for rank, digest in enumerate(found) if digest != found[0]]
    if differ:
        raise LaionkitError(
            f"step {step}: the weights of rank(s) {', '.join(map(str, differ))} differ from rank 0's "
            f"(sha256 {', '.join(f'rank {r}: {d[:12]}' for r, d in enumerate(found))}); the ranks no "
            "longer train one model, so no checkpoint was written. Please report this with the command line"
        )


def save_checkpoint(accelerator, output: Path, step: int, rank_state: dict, keep: int,
                    config: TrainConfig, extra_states: dict) -> Path:
    """All ranks write into a hidden temporary folder; rank 0 renames it once every rank is done.

    Everything a resume reads is data, never code: accelerate's weights (safetensors) and optimizer /
    scheduler files (loaded with weights_only=True), the rank records as JSON, and the master / EMA
    weights (``extra_states``, written by rank 0: equal on every rank) as plain tensors. trainer.json,
    written last, records the size and sha256 of every file, so a damaged checkpoint is found before
    anything is loaded from it."""
    final = checkpoint_dir(output, step)
    main = accelerator.is_main_process
    space = disk_full_is_one_line(partial_path(final), step, output)
    with (atomic_output(final) if main else nullcontext(None)) as tmp, space:
        accelerator.wait_for_everyone()  # rank 0 has cleared any stale temporary
        folder = tmp if main else partial_path(final)
        accelerator.save_state(str(folder))
        (folder / f"rank-{accelerator.process_index:05d}.json").write_text(json.dumps(rank_state))
        if main:
            for name, state in extra_states.items():
                torch.save(state, folder / f"{name}.pt")
        accelerator.wait_for_everyone()
        if main:
            files = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
                     for path in sorted(folder.rglob("*")) if path.is_file()}
            (folder / "trainer.json").write_text(json.dumps(
                {"step": step, "world_size": accelerator.num_processes, "config": asdict(config),
                 "versions": versions(), "files": files}, indent=2, default=str))
    if main:
        for old in complete_checkpoints(output)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


# How a full disk shows while a checkpoint is written: errno, or only in words (safetensors' Rust I/O error;
# torch.save's zip writer says "unexpected pos", nothing more, which the free space then tells apart).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_WORDS = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded", "os error 122")


@contextmanager
def disk_full_is_one_line(folder: Path, step: int, output: Path) -> Iterator[None]:
    """A full disk while the checkpoint is written into ``folder`` (the temporary that atomic_output then
    removes, so no part of it stays as if complete) becomes one line naming the run folder and what to
    do; any other failure passes as it is. The free space is read before the temporary is removed."""
    try:
        yield
    except Exception as error:
        try:
            usage = shutil.disk_usage(folder if folder.exists() else output)
        except OSError:
            usage = None
        said = getattr(error, "errno", None) in DISK_FULL or any(word in str(error) for word in DISK_FULL_WORDS)
        write_error = isinstance(error, OSError | RuntimeError) or "Safetensor" in type(error).__name__
        if not (said or (write_error and usage is not None and usage.free < 64 * 2**20)):
            raise
        size = f" ({usage.total / 2**20:.0f} MiB in all)" if usage else ""
        raise LaionkitError(
            f"step {step}: the disk of {output}{size} is full: no space for checkpoint step-{step:08d}, "
            "none of it was kept. Free space there (a URL --output stages in LAIONKIT_STAGING, else the temp "
            f"folder), lower --keep-checkpoints or give --output on a larger disk, then --resume latest (last "
            f"good checkpoint: {last_good(output)})") from None


def load_tensors(path: Path):
    """torch.load restricted to tensors and plain containers: a pickle that would run code is refused."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise LaionkitError(f"{path}: not plain tensor data, refused to load it (checkpoints are data, "
                            f"never code): {str(error).splitlines()[0]}") from None


def read_rank_record(accelerator, folder: Path) -> dict:
    """This rank's step, data layout, generator state and weights fingerprint (JSON)."""
    rank_file = folder / f"rank-{accelerator.process_index:05d}.json"
    if not rank_file.is_file():
        raise LaionkitError(f"{folder} has no {rank_file.name}: it was written by fewer ranks than the "
                            f"{accelerator.num_processes} running now; resume with the same number of processes")
    try:
        state = json.loads(rank_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LaionkitError(f"{rank_file} is not JSON ({error})") from None
    return state


def load_checkpoint_state(accelerator, folder: Path, extra_states: dict) -> None:
    """accelerate's state with weights_only=True (its RNG files too), then the master / EMA weights."""
    import pickle

    try:
        accelerator.load_state(str(folder), load_kwargs={"weights_only": True})
    except pickle.UnpicklingError as error:
        raise LaionkitError(f"{folder}: a file of accelerate's state is not plain tensor data, refused to "
                            f"load it (checkpoints are data, never code): {str(error).splitlines()[0]}") from None
    for name, target in extra_states.items():
        target.load_state_dict(load_tensors(folder / f"{name}.pt"))


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop records of steps a killed run made past the checkpoint we resume from (they are redone)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= after_step]
    with atomic_output(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


# --- validation -----------------------------------------------------------------------------------

def validation_conditioning(data: LatentSet, count: int, online: OnlineText | None = None
                            ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Fixed prompts: the captions and stored text tensors (by stored key) of the first samples of the
    first shard, and their size fields."""
    import webdataset as wds

    from laionkit.latents import decode

    opened = [{"url": data.shards[0], "stream": Location.parse(data.shards[0]).open_read()}]  # path or URL
    samples = wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander(opened))
    captions, rows = [], []
    for sample in samples:
        captions.append(json.loads(sample["json"]).get("caption", "") if "json" in sample else sample["__key__"])
        rows.append(decode(sample))
        if len(rows) == count:
            break
    batch = collate(rows)  # trimmed text padded to the longest prompt
    if online is not None:  # token ids, encoded by the run's own text encoders
        return captions, {key: value.cpu() for key, value in online(batch, online.device, online.dtype).items()}
    return captions, {key: batch["text" if key == "states" else key] for key in data.family.stored}


# Pipeline keyword of each stored key (the negative_ version takes the empty caption's).
PIPELINE_KEYWORDS = {"states": "prompt_embeds", "pooled": "pooled_prompt_embeds", "mask": "prompt_attention_mask"}


@torch.no_grad()
def validate(unet, vae, noise_scheduler, texts: dict, empty: dict, data: LatentSet, config: TrainConfig,
             device: torch.device) -> torch.Tensor:
    """Samples for the fixed prompts through the family's diffusers pipeline (the one an export loads
    into), from the stored text tensors, decoded by the manifest's VAE, in [0, 1]: DDIM with
    classifier-free guidance for the UNet families; for flow families the family's
    FlowMatchEulerDiscreteScheduler (Flux: the pipeline computes its resolution-dependent mu itself) with
    classifier-free guidance, or the guidance embedding where the family feeds guidance_scale to it.

    The pipeline gets no text encoders (the prompts are stored embeddings) and returns latents (Flux's
    packed, unpacked here, ``sample_latents``): the decode is ours, in the VAE's own dtype, whatever the
    weights' dtype is."""
    latents = sample_latents(unet, vae, noise_scheduler, texts, empty, data, config, device)
    images = vae.decode(latents.to(vae.dtype) / data.scaling_factor + data.shift_factor).sample
    return (images.float() / 2 + 0.5).clamp(0, 1).cpu()


def validation_sampler(spec: FamilySpec, noise_scheduler):
    """The scheduler validation samples with: the flow family's FlowMatchEulerDiscreteScheduler, or DDIM on
    the model's noise schedule with the settings of sampling in latent space stated, not inherited: no
    clipping of the predicted x0 to [-1, 1] and no dynamic thresholding (both are for pixel-space models;
    scaled latents have unit spread). A scheduler config that does not name them (PixArt-Σ's
    DPMSolverMultistepScheduler; the SDXL config laionkit's tiny models write) took DDIM's default
    clip_sample=True and sampled every grid with x0 cut to [-1, 1], which its pipeline never does."""
    import diffusers

    if spec.sampler is not None:
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(dict(spec.sampler))
    return diffusers.DDIMScheduler.from_config(noise_scheduler.config, clip_sample=False, thresholding=False)


@torch.no_grad()
def sample_latents(unet, vae, noise_scheduler, texts: dict, empty: dict, data: LatentSet, config: TrainConfig,
                   device: torch.device) -> torch.Tensor:
    """validate's sampling: the fixed prompts' final latents (unpacked, scaled as the denoiser sees them)."""
    import inspect

    import diffusers

    spec = data.family
    sampler = validation_sampler(spec, noise_scheduler)
    pipeline_class = getattr(diffusers, spec.pipeline_class)
    parameters = inspect.signature(pipeline_class.__init__).parameters
    components = {name: None for name, parameter in parameters.items()
                  if name != "self" and parameter.default is inspect.Parameter.empty}
    components.update({spec.denoiser_subfolder: unet, "vae": vae, "scheduler": sampler})
    if "requires_safety_checker" in parameters:
        components["requires_safety_checker"] = False
    pipe = pipeline_class(**components)
    pipe.set_progress_bar_config(disable=True)
    dtype = next(unet.parameters()).dtype
    guided_by_embedding = spec.embedded_guidance and getattr(unet.config, "guidance_embeds", False)
    # The empty caption's tensors for every prompt, and the prompts', padded alike (trimmed text).
    texts = {key: value.to(device, dtype) for key, value in texts.items()}
    every = torch.ones(len(texts["states"]), dtype=torch.bool, device=device)
    negatives, texts = drop_captions(texts, empty, every), drop_captions(texts, empty, ~every)
    prompts = {}
    for key, keyword in PIPELINE_KEYWORDS.items():
        if key in texts:
            prompts[keyword] = texts[key]
            if not guided_by_embedding:
                prompts[f"negative_{keyword}"] = negatives[key].to(device, dtype)
    if spec.embedded_guidance and not guided_by_embedding:
        prompts["true_cfg_scale"] = config.guidance_scale  # FluxPipeline's classifier-free guidance
    channels, height, width = data.moments_shape
    scale = pipe.vae_scale_factor
    generator = torch.Generator().manual_seed(config.seed)
    latents = torch.randn(len(texts["states"]), channels // 2, height, width, generator=generator)
    if spec.pack_latents is not None:
        latents = spec.pack_latents(latents)
    call = inspect.signature(pipeline_class.__call__).parameters
    if "use_resolution_binning" in call:  # PixArt: draw at the data's size, not at the nearest of its bins
        prompts["use_resolution_binning"] = False
    if "negative_prompt_embeds" in prompts and "negative_prompt" in call:
        prompts["negative_prompt"] = None  # PixArt defaults it to "", which it refuses beside the embeddings
    # Accelerate's prepared forward returns fp32 outputs, so a scheduler step promotes the latents to fp32;
    # they go back to the weights' dtype before the next step (bf16 master weights have no autocast): as
    # callback_on_step_end returns them, or in place where the pipeline has only the per-step `callback`.
    if "callback_on_step_end" in call:
        each_step = {"callback_on_step_end": lambda _pipe, _i, _t, found: {"latents": found["latents"].to(dtype)},
                     "callback_on_step_end_tensor_inputs": ["latents"]}
    else:
        def cast(_step, _t, found):
            found.data = found.data.to(dtype)

        each_step = {"callback": cast, "callback_steps": 1}
    latents = pipe(height=height * scale, width=width * scale, num_inference_steps=config.validation_steps,
                   guidance_scale=config.guidance_scale, latents=latents.to(device, dtype), output_type="latent",
                   **each_step, **prompts).images
    if spec.unpack_latents is not None:
        latents = spec.unpack_latents(latents, height, width)
    return latents


# --- the loop -------------------------------------------------------------------------------------

class StopFlag:
    """The stop signals (SIGTERM, SIGINT, SIGHUP) turned into a checkpoint at a step boundary that every
    rank agrees on; a second SIGINT stops at once.

    A context manager: handlers are installed by ``install()`` when the loop starts (before it a signal
    keeps its default effect: there is nothing new to save) and the previous ones are restored on exit,
    so a caller training in-process (``laionkit run``, ``laionkit demo``) gets its Ctrl-C back.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        self._pending: torch.Tensor | None = None

    def __enter__(self) -> StopFlag:
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum

    def agreed(self, accelerator) -> int | None:
        """Called once per optimizer step on every rank: the signal to stop on now, the same on all ranks.

        Ranks get a signal at different moments, so they stop on the max of their flags, all-reduced as
        one element per step. Reading the reduced value at once would make the CPU wait for the GPU
        every step (the loop has no other per-step sync), so the value all-reduced at step N is read at
        step N + 1, after that step's work is queued: by then it is long done, and the stop lands one
        step later than it could. The flag lives on the accelerator's device, as NCCL needs, and is
        filled there by a kernel, not copied from the host (a copy would sync too).
        """
        if accelerator.num_processes == 1:
            return self.signal
        previous = self._pending
        flag = torch.full((1,), float(self.signal or 0), device=accelerator.device)
        self._pending = accelerator.reduce(flag, "max")
        return (int(previous.item()) or None) if previous is not None else None


def run(config: TrainConfig) -> TrainResult:
    # Every URL of the run (latents, --val-latents, --output, in this process and its forked DataLoader
    # workers) is parsed with --storage-options.
    with storage.default_options(storage.parse_storage_options(config.storage_options)):
        if config.cache_dir:  # made and written once now, not first in a DataLoader worker hours in
            ReadCache(config.cache_dir, config.cache_size)
        config, remote = runfolder.stage(config)  # --output URL: train writes a local staging folder
        cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()  # setup may turn it off (the family's)
        try:
            with StopFlag() as stop, runlock.session():  # the run folder's lock / lease, released at the end
                return _train(config, stop, remote)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


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
    max_steps = config.max_steps or math.ceil(config.epochs * data.samples / global_batch)
    stages = [(config.latents, data, max_steps)]
    for folder, steps in config.later_stages():
        stages.append((folder, same_model_latents(stages[0], folder, open_latents(folder)), steps))
    buckets = tuple(dict.fromkeys(key for _, latents, _ in stages for key in latents.buckets))
    return Schedule(stages=tuple(stages), ends=tuple(itertools.accumulate(steps for _, _, steps in stages)),
                    buckets=buckets, global_batch=global_batch,
                    to_all=tuple(tuple(buckets.index(key) for key in latents.buckets) for _, latents, _ in stages))


@dataclass
class Trainer:
    """What the loop's pieces share: the accelerator, the data plan, the prepared model with its optimizer
    state, and this rank's counters. ``unet`` is the prepared module (what DDP / FSDP wrap, checkpoints
    and exports hold); ``model`` is what the forward pass calls: ``unet`` or its compiled form.
    ``step``, ``bucket_samples`` and ``generator`` are this rank's part of a checkpoint; ``layouts`` (one
    stream per stage), ``data_key`` (what exact resume compares) and ``remote`` are set by setup for a
    run, left empty by build for a bench."""

    config: TrainConfig
    accelerator: Any
    data: LatentSet  # the first stage's latents: what all stages share (family, VAE scaling, empty caption)
    schedule: Schedule
    objective: Objective
    unet: Any
    model: Any
    master: MasterWeights | None
    trained: list
    optimizer: Any
    lr_scheduler: Any
    ema: Any
    noise_scheduler: Any  # DDPM families; None for flow matching
    online: OnlineText | None
    input_dtype: torch.dtype
    empty: dict  # the empty caption's stored tensors on the device, for caption dropout
    model_flops: list[float]  # per sample, per bucket of the schedule
    generator: torch.Generator  # noise, timesteps and dropout: same init on every rank, different draws
    bucket_samples: list[int]  # this rank's samples per bucket since the run began
    # Consecutive steps with a non-finite loss, counted on the device so that no step waits for the host.
    nonfinite: torch.Tensor
    grad_norm: torch.Tensor | None
    step: int = 0
    layouts: list[StreamLayout] = field(default_factory=list)
    data_key: dict = field(default_factory=dict)
    remote: runfolder.RunFolder | None = None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def extra_states(self) -> dict:
        """Saved by save_checkpoint as plain tensors, not through accelerate, which unpickles these with
        weights_only=False on load."""
        return {name: obj for name, obj in (("master", self.master), ("ema", self.ema)) if obj is not None}


def make_accelerator(config: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        log_with=None if config.log_with == "none" else config.log_with,
        project_config=ProjectConfiguration(project_dir=str(config.output),
                                            logging_dir=str(config.output / "logs")),
        step_scheduler_with_optimizer=False,  # the LR schedule counts optimizer steps, once per step
        cpu=not torch.cuda.is_available(),  # lets torchrun / accelerate start several CPU ranks (gloo)
    )
    fsdp.honor_fsdp_on_cpu(accelerator)  # accelerate would run an FSDP config on CPU ranks as DDP
    return accelerator


def setup(config: TrainConfig, remote: runfolder.RunFolder | None = None) -> Trainer:
    """Everything before the first step: the accelerator and the run folder (claimed, the config logged),
    the latents and their stage schedule, the model as build makes it, and each stage's stream layout."""
    from accelerate.utils import DistributedType

    output = config.output
    accelerator = make_accelerator(config)
    launcher = resolve_rank(config.rank, config.world_size)
    if (launcher.rank, launcher.world_size) != (accelerator.process_index, accelerator.num_processes):
        raise LaionkitError(
            f"--rank/--world-size say {launcher.rank}/{launcher.world_size} but the launcher started "
            f"{accelerator.process_index}/{accelerator.num_processes}: train takes ranks from accelerate/torchrun"
        )
    world = accelerator.num_processes
    if config.ema and accelerator.distributed_type == DistributedType.FSDP:
        raise LaionkitError("--ema needs whole parameters on every rank: use DDP or DeepSpeed ZeRO-2, not FSDP")
    if output.exists() and not output.is_dir():
        raise LaionkitError(f"--output {output} is a file, not a run folder")
    inputs = [config.latents, *(folder for folder, _ in config.later_stages()),
              *([config.val_latents] if config.val_latents else [])]
    storage.refuse_overlap(inputs, output, "train")
    if remote is not None:  # the bucket's run: fresh-run rules there, a resume's checkpoint downloaded
        config = remote.claim(config, accelerator, inputs)
    claim_run_folder(config, accelerator)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        accelerator.print(f"laionkit train: {json.dumps(asdict(config), default=str)}")
    if config.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data = open_latents(config.latents)
    objective = resolve_objective(config, data.family)
    if not data.family.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if data.empty_shards:
        accelerator.print(f"skipping {len(data.empty_shards)} empty latent shard(s): "
                          f"{', '.join(Path(s).name for s in data.empty_shards)}")
    schedule = plan_stages(config, data, world)
    trainer = build(config, accelerator, data, schedule, objective)
    trainer.layouts = [StreamLayout(latents.shards, accelerator.process_index, world, config.workers,
                                    config.batch_size, config.seed, config.shuffle_buffer, bucketed=latents.bucketed)
                       for _, latents, _ in schedule.stages]
    trainer.data_key = layout_key(trainer.layouts[0], data)
    if len(schedule.stages) > 1:  # which data each step trains on: every stage's layout and steps
        trainer.data_key["stages"] = [[steps, layout_key(layout, latents)]
                                      for (_, latents, steps), layout in zip(schedule.stages, trainer.layouts)]
    trainer.remote = remote
    return trainer


def build(config: TrainConfig, accelerator, data: LatentSet, schedule: Schedule, objective: Objective,
          optimizer_factory=make_optimizer) -> Trainer:
    """The denoiser as train trains it (LoRA adapters, activation checkpointing, compile, channels_last),
    its precision policy (MasterWeights), optimizer (``optimizer_factory(config, params, lr, device)``),
    EMA and LR schedule, prepared by ``accelerator``; the bench scripts build their step with it too."""
    from accelerate.utils import DistributedType, set_seed
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    device = accelerator.device
    set_seed(config.seed)  # the same initial weights on every rank
    # From scratch on a GPU, the weights are drawn there: seconds for Flux-12B instead of minutes on the CPU
    # (and no 48 GB fp32 copy in host memory). Seeded alike on every rank; DDP broadcasts rank 0's anyway.
    with torch.device(device) if config.unet is None and device.type == "cuda" else nullcontext():
        unet = build_unet(config, data)
    trainchecks.check_guidance(config, data.family, unet)
    unet = unet.to(device)
    if config.lora_rank is not None:  # LoRA hook: freeze the base, add adapters (laionkit/lora.py)
        lora.attach(unet, config, accelerator)
    if objective.guidance is not None and not getattr(unet.config, "guidance_embeds", False):
        objective = replace(objective, guidance=None)  # no guidance embedding to feed
    noise_scheduler = load_noise_scheduler(config, data.family) if objective.kind == "ddpm" else None
    shapes = schedule.shapes()
    model_flops = [flops_per_sample(unet, data, device, shapes[key], objective) for key in schedule.buckets]
    if config.gradient_checkpointing:
        accelerator.print("warning: --gradient-checkpointing is deprecated; it is --checkpointing blocks now")
    interval = config.checkpoint_interval()
    if interval:  # activation checkpointing on the family's blocks (FamilySpec.blocks)
        checked = data.family.checkpoint_blocks(unet, interval)
        accelerator.print(f"activation checkpointing: {len(checked)} of {len(data.family.blocks(unet))} "
                          f"{'/'.join(data.family.block_classes)} blocks")
    if config.fp8:  # FP8 hook: the blocks' linear layers train in float8 (laionkit/fp8.py)
        fp8.check_device(device)
        converted = fp8.convert(unet, data.family.block_classes, config.fp8_recipe)
        accelerator.print(f"fp8 ({config.fp8_recipe}): {len(converted)} linear layers of the "
                          f"{'/'.join(data.family.block_classes)} blocks")
    if config.compile and data.family.regional_compile:
        # Transformers and SDXL: each block compiled in place, before DDP/FSDP wrap it (FSDP2 renames the
        # classes): compile time independent of depth (SDXL's whole-UNet compile ran past 320 s on an H200).
        # SD 1.x/2.x compile whole below: their glue between blocks (down/up samplers, norms, projections) is
        # a large share of the work at 256-512 px, and whole-model compile is measured there.
        data.family.compile_blocks(unet, dynamic=config.compile_dynamic, mode=config.compile_mode)
    if config.channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    unet.train()
    full_bf16 = full_bf16_policy(config, accelerator, unet)
    master = MasterWeights(accelerator, unet) if MasterWeights.wanted(config, accelerator) else None
    trained = master.master if master is not None else [p for p in unet.parameters() if p.requires_grad]
    lr = scaled_lr(config, schedule.global_batch)
    optimizer = optimizer_factory(config, trained, lr, device)
    ema = None
    if config.ema:  # in fp32 under --full-bf16 too: a 0.9999 decay's updates vanish in bf16
        shadow = [p.detach().float() for p in trained] if full_bf16 else trained
        ema = EMAModel(shadow, decay=config.ema_decay, foreach=True,
                       model_cls=type(unet), model_config=unet.config)
        ema.to(device)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # we prepare no DataLoader to infer these
        deepspeed = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed["train_micro_batch_size_per_gpu"] = config.batch_size
        deepspeed["gradient_clipping"] = config.max_grad_norm
    if accelerator.distributed_type == DistributedType.FSDP:
        fsdp_wrap_units(accelerator.state.fsdp_plugin, unet, data.family, accelerator.print)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    if config.lora_rank is not None:  # LoRA hook: checkpoints hold the adapters, not the frozen base
        lora.register_checkpoint_hooks(accelerator, unet, config, data.family)
    # DeepSpeed and MasterWeights hold the weights in bf16/fp16 (no autocast): inputs must follow them.
    input_dtype = next(unet.parameters()).dtype
    online = OnlineText(data, device, input_dtype, config.allow_changed_text_encoder) if data.online else None
    lr_scheduler = get_scheduler(
        "constant_with_warmup" if config.lr_schedule == "constant" else "cosine",
        optimizer=optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=schedule.max_steps,
    )
    lr_scheduler = accelerator.prepare(lr_scheduler)
    if config.compile:
        # One graph per bucket shape (dynamic=False, the default): each bucket gets dynamo's default allowance
        # (8 graphs per function, 256 in all), else the shapes past the limit would run uncompiled.
        # --compile-dynamic traces symbolic shapes instead; the allowance is the same.
        # Per block, the blocks of one class share one code object whose graphs differ by the block's shapes
        # (SDXL's ResnetBlock2D has a dozen channel / size pairs): at most one graph per block instance.
        dynamo = torch._dynamo.config
        per_bucket = max(8, len(data.family.blocks(unet))) if data.family.regional_compile else 8
        dynamo.recompile_limit = max(dynamo.recompile_limit, per_bucket * len(schedule.buckets))
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 256 * len(schedule.buckets))
    model = unet
    if config.compile and not data.family.regional_compile:  # UNets: the whole denoiser (see compile_blocks)
        model = torch.compile(unet, dynamic=config.compile_dynamic, mode=config.compile_mode)
    return Trainer(
        config=config, accelerator=accelerator, data=data, schedule=schedule, objective=objective, unet=unet,
        model=model, master=master, trained=trained, optimizer=optimizer, lr_scheduler=lr_scheduler, ema=ema,
        noise_scheduler=noise_scheduler, online=online, input_dtype=input_dtype,
        empty={key: value.to(device, input_dtype) for key, value in (online.empty() if online else data.empty).items()},
        model_flops=model_flops,
        generator=torch.Generator(device).manual_seed(config.seed * 1_000_003 + accelerator.process_index),
        bucket_samples=[0] * len(schedule.buckets), nonfinite=torch.zeros((), device=device),
        grad_norm=torch.zeros((), device=device),
    )


def resume(trainer: Trainer) -> Path | None:
    """--resume: the checkpoint find_resume picks, checked against this run's data layout (before the
    model and optimizer load), then loaded: accelerate's state, the master / EMA weights, and this rank's
    generator, step and samples per bucket. None where there is none to resume from."""
    t, config, accelerator = trainer, trainer.config, trainer.accelerator
    folder = find_resume(config, accelerator, t.schedule.max_steps)
    if folder is None:
        return None
    state = read_rank_record(accelerator, folder)
    lora.check_resume(folder, config, t.data.family)
    refuse_other_settings(folder, state.get("layout", {}), t.data_key, "written",
                          "exact resume needs the same latent shards (names, sample counts, sizes), number "
                          "of ranks, --workers, --batch-size, --seed, --shuffle-buffer and --stage schedule")
    load_checkpoint_state(accelerator, folder, t.extra_states)
    t.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state["generator"])), dtype=torch.uint8))
    t.step = state["step"]
    # A checkpoint from before per-bucket counts had one bucket, which took every sample.
    buckets = t.schedule.buckets
    counted = state.get("bucket_samples") or {buckets[0]: t.step * config.batch_size * config.grad_accum}
    t.bucket_samples = [int(counted.get(key, 0)) for key in buckets]
    accelerator.print(f"resumed from {folder} at step {t.step}")
    return folder


def micro_step(trainer: Trainer, moments: torch.Tensor, cond: dict) -> torch.Tensor:
    """One micro-batch inside accelerate's accumulate(): the loss of the family's objective, backward, and
    apply_gradients (clip and optimizer step on the sync micro-batch only). Returns the loss."""
    t = trainer
    with t.accelerator.accumulate(t.unet):
        if t.noise_scheduler is None:
            loss = flow_loss(t.model, moments, cond, t.empty, t.config, t.data, t.generator, t.objective)
        else:
            loss = diffusion_loss(t.model, moments, cond, t.empty, t.noise_scheduler, t.config, t.data, t.generator)
        t.accelerator.backward(loss)
        norm = apply_gradients(t.accelerator, t.unet, t.optimizer, t.master, t.config.max_grad_norm)
        if t.accelerator.sync_gradients:
            t.grad_norm = norm  # None under DeepSpeed, which clips inside its step
    return loss


def train_step(trainer: Trainer, batches, stage: int, window: MetricsWindow) -> list[str]:
    """One optimizer step: --grad-accum micro-batches from ``batches`` (batches of stage ``stage``), then
    the LR schedule and EMA step. Counts the step's loss, data wait and model FLOPs into ``window`` and its
    samples per bucket; returns the step's sample keys."""
    t, config = trainer, trainer.config
    step_keys, step_loss = [], torch.zeros((), device=t.device)
    for _ in range(config.grad_accum):
        waited = time.perf_counter()
        batch = next(batches)
        window.data_wait += time.perf_counter() - waited
        step_keys += batch["key"]
        bucket = t.schedule.bucket(stage, batch["moments"].shape[1:])
        t.bucket_samples[bucket] += len(batch["key"])
        window.flops += t.model_flops[bucket] * len(batch["key"])
        moments = batch["moments"].to(t.device, non_blocking=True)
        cond = batch_conditioning(batch, t.data, t.device, t.input_dtype, t.online)
        loss = micro_step(t, moments, cond)
        step_loss += loss.detach().float() / config.grad_accum
    t.nonfinite = torch.where(torch.isfinite(step_loss), torch.zeros_like(t.nonfinite), t.nonfinite + 1)
    window.add(step_loss, t.nonfinite)
    t.lr_scheduler.step()
    if t.ema is not None:
        t.ema.step(t.trained)
    t.step += 1
    return step_keys


def throughput(samples: int, flops: float, elapsed: float, data_wait: float, device: torch.device,
               world: int = 1, peak_tflops: float = 989.0) -> dict:
    """A window's samples/s (all ranks) and per GPU, MFU (model FLOPs of all ranks over their peak), the
    share of the time spent waiting for data, and this process's peak GPU memory: the figures of a
    metrics.jsonl record, and what the bench scripts report for the steps they time."""
    samples_per_s = samples / elapsed
    return {
        "samples_per_s": samples_per_s,
        "samples_per_s_per_gpu": samples_per_s / world,
        "mfu": flops / elapsed / world / (peak_tflops * 1e12),
        "data_wait_pct": 100.0 * data_wait / elapsed,
        "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
    }


class MetricsWindow:
    """The steps since the last log step (their summed loss, data wait, model FLOPs and the longest run of
    non-finite losses) and the metrics.jsonl record made from them on every rank; rank 0 writes it.

    Host time measures the window: the loss reduce of each log step waits for the GPU, so a window's
    elapsed time covers its steps' GPU work."""

    def __init__(self, accelerator, global_batch: int, peak_tflops: float, path: Path | None = None,
                 exporter=None) -> None:
        self.accelerator, self.global_batch, self.peak_tflops = accelerator, global_batch, peak_tflops
        self.path, self.exporter = path, exporter
        self.loss = torch.zeros((), device=accelerator.device)
        self.worst_nonfinite = torch.zeros((), device=accelerator.device)
        self.reset()

    def reset(self) -> None:
        """A new window from now (the non-finite run is reset by check_finite)."""
        self.loss.zero_()
        self.start, self.steps, self.data_wait, self.flops = time.perf_counter(), 0, 0.0, 0.0

    def add(self, step_loss: torch.Tensor, nonfinite: torch.Tensor) -> None:
        self.loss += step_loss
        self.worst_nonfinite = torch.maximum(self.worst_nonfinite, nonfinite)
        self.steps += 1

    def rates(self, elapsed: float, flops: float) -> dict:
        """throughput of the window's steps over ``elapsed`` seconds, ``flops`` the model FLOPs of all ranks."""
        return throughput(self.steps * self.global_batch, flops, elapsed, self.data_wait, self.accelerator.device,
                          self.accelerator.num_processes, self.peak_tflops)

    def record(self, trainer: Trainer) -> dict:
        """The window's record, reduced over the ranks (a collective: every rank calls it)."""
        accelerator, t = self.accelerator, trainer
        mean_loss = accelerator.reduce(self.loss, "mean").item() / self.steps
        elapsed = time.perf_counter() - self.start
        totals = accelerator.reduce(torch.tensor([self.flops, *t.bucket_samples], dtype=torch.float64,
                                                 device=accelerator.device), "sum").tolist()
        return {
            "step": t.step, "loss": mean_loss, "lr": t.lr_scheduler.get_last_lr()[0],
            "grad_norm": None if t.grad_norm is None else float(t.grad_norm),
            **self.rates(elapsed, totals[0]),
            # all ranks, since the run began: sums to step x global batch
            "samples_per_bucket": {key: int(n) for key, n in zip(t.schedule.buckets, totals[1:])},
        }

    def write(self, record: dict) -> None:
        """Rank 0: a metrics.jsonl line, the trackers' scalars and the Prometheus exporter's values."""
        accelerator = self.accelerator
        if not accelerator.is_main_process:
            return
        with open(self.path, "a") as handle:
            handle.write(strict_json(record) + "\n")
        if accelerator.log_with:
            scalars = {k: v for k, v in record.items() if k not in ("step", "samples_per_bucket")}
            scalars.update({f"samples_per_bucket/{k}": v for k, v in record["samples_per_bucket"].items()})
            accelerator.log(scalars, step=record["step"])
        if self.exporter is not None:
            self.exporter.update(record)

    def check_finite(self, step: int, max_nonfinite: int, output: Path) -> None:
        """Stops a diverged run: the longest run of non-finite losses of any rank in this window."""
        worst = self.accelerator.reduce(self.worst_nonfinite, "max").item()
        self.worst_nonfinite.zero_()
        if worst >= max_nonfinite:
            raise LaionkitError(
                f"step {step}: the loss was not finite for {int(worst)} consecutive steps (--max-nonfinite "
                f"{max_nonfinite}); the run diverged. Last good checkpoint: {last_good(output)}; "
                "resume from it with a lower --lr, more --warmup-steps or --max-grad-norm"
            )

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()


def open_records(trainer: Trainer) -> tuple[Path, Path]:
    """metrics.jsonl and this rank's seen-keys file (--record-keys), without the records of steps a
    killed run made past the checkpoint resumed from (they are redone); the trackers started."""
    config, accelerator, step = trainer.config, trainer.accelerator, trainer.step
    main = accelerator.is_main_process
    metrics_path = config.output / "metrics.jsonl"
    keys_path = config.output / "seen" / f"rank-{accelerator.process_index:05d}.jsonl"
    if config.resume is not None:  # also with no checkpoint yet: a killed run's records are redone
        if main:
            truncate_jsonl(metrics_path, step)
        if config.record_keys:
            truncate_jsonl(keys_path, step)
    if config.record_keys:
        keys_path.parent.mkdir(parents=True, exist_ok=True)
    if main and accelerator.log_with:
        tracker_config = {f.name: str(getattr(config, f.name)) for f in fields(config)}
        accelerator.init_trackers("laionkit", config=tracker_config)
    return metrics_path, keys_path


def checkpoint(trainer: Trainer) -> Path | None:
    """A checkpoint of this step when every rank's weights agree (else an error) and the loss and weights
    are finite on all ranks, uploaded where the run folder is remote; None (a warning) when not finite."""
    t, config, accelerator = trainer, trainer.config, trainer.accelerator
    step, output = t.step, config.output
    fingerprint = weights_fingerprint(accelerator, t.unet, t.master)
    check_ranks_agree(accelerator, fingerprint, step)
    healthy = t.nonfinite.item() == 0 and (fingerprint is None or fingerprint[1])
    if not accelerator.reduce(torch.tensor(float(healthy), device=t.device), "min").item():
        accelerator.print(f"warning: step {step}: loss or weights not finite, no checkpoint written "
                          f"(the last good one stays: {last_good(output)})")
        return None
    rank_state = {"step": step, "layout": t.data_key, "fingerprint": fingerprint and fingerprint[0],
                  "bucket_samples": dict(zip(t.schedule.buckets, t.bucket_samples)),
                  "generator": base64.b64encode(t.generator.get_state().numpy().tobytes()).decode()}
    folder = save_checkpoint(accelerator, output, step, rank_state, config.keep_checkpoints,
                             config, {name: obj.state_dict() for name, obj in t.extra_states.items()})
    if t.remote is not None:  # uploaded, done record last, older ones pruned in the bucket
        t.remote.checkpoint_saved(accelerator, folder, config.keep_checkpoints)
    return folder


def validation_prompts(trainer: Trainer) -> tuple | None:
    """--validate-every: the VAE and the fixed prompts' text tensors (on every rank: under FSDP the
    forward pass needs them all); rank 0 writes the prompts to RUN/samples/prompts.txt."""
    config, data = trainer.config, trainer.data
    if not config.validate_every:
        return None
    from laionkit.common.models import load_vae

    if data.vae_source is None:
        raise LaionkitError(f"{config.latents}/manifest.json names no VAE, needed for --validate-every")
    captions, texts = validation_conditioning(data, config.validation_count, trainer.online)
    if trainer.accelerator.is_main_process:
        (config.output / "samples").mkdir(exist_ok=True)
        (config.output / "samples" / "prompts.txt").write_text("\n".join(captions) + "\n")
    return load_vae(data.vae_source).to(trainer.device), texts


def validation_grid(trainer: Trainer, validation: tuple, latents: LatentSet) -> None:
    """The fixed prompts' samples at this step (validate), at ``latents``' size; rank 0 saves the grid."""
    t = trainer
    vae, texts = validation
    t.unet.eval()
    images = validate(t.accelerator.unwrap_model(t.unet), vae, t.noise_scheduler, texts, t.empty, latents,
                      t.config, t.device)
    t.unet.train()
    if t.accelerator.is_main_process:
        save_grid(images, t.config.output / "samples" / f"step-{t.step:06d}.png")


def validation_loss(trainer: Trainer, valset) -> dict:
    """The deterministic validation loss (laionkit/valloss.py): on every rank (all-reduced), in eval mode,
    through the eager module."""
    t, objective, device, dtype = trainer, trainer.objective, trainer.device, trainer.input_dtype
    t.unet.eval()
    loss = valloss.evaluate(
        t.accelerator, lambda noisy, timesteps, cond: t.data.family.predict(t.unet, noisy, timesteps, guidance_input(
            objective, stored_conditioning(cond, t.online, device, dtype), len(noisy), device)),
        valset, t.config.batch_size, dtype, t.noise_scheduler,
        flow_shift=None if t.noise_scheduler else objective.sigma_shift,  # per bucket (h, w): a dynamic shift
        timestep_scale=objective.timestep_scale)
    t.unet.train()
    return {"val_loss": loss, "val_samples": len(valset.keys)}


def finish(trainer: Trainer) -> None:
    """After the last step: the samples seen per bucket, the export (the denoiser, or the LoRA adapters)
    and, for a remote run folder, its upload and done record."""
    t, accelerator = trainer, trainer.accelerator
    buckets = t.schedule.buckets
    if len(buckets) > 1:
        seen = accelerator.reduce(torch.tensor(t.bucket_samples, dtype=torch.float64, device=t.device), "sum")
        accelerator.print("samples per bucket (all ranks): " + ", ".join(
            f"{key} {int(n)}" for key, n in zip(buckets, seen.tolist())))
    if t.config.lora_rank is not None:  # LoRA hook: RUN/lora in diffusers' load_lora_weights format
        lora.export(accelerator, t.unet, t.ema, t.master, t.config.output)
    else:
        export(accelerator, t.unet, t.ema, t.master, t.config.output, t.data.family.denoiser_subfolder,
               torch.bfloat16 if t.config.full_bf16 else torch.float32)
    exports.after_training(accelerator, t.config, t.data, t.noise_scheduler)  # RUN/pipeline, single files
    if t.remote is not None:
        t.remote.finished(accelerator)


def _train(config: TrainConfig, stop: StopFlag, remote: runfolder.RunFolder | None = None) -> TrainResult:
    from tqdm.auto import tqdm

    t = setup(config, remote)
    config, accelerator, schedule = t.config, t.accelerator, t.schedule
    device, main, max_steps = t.device, accelerator.is_main_process, schedule.max_steps
    resume(t)
    cache = ReadCache(config.cache_dir, config.cache_size) if config.cache_dir else None
    stage = schedule.stage_at(t.step)
    batches = iter(latent_loader(t.layouts[stage], batches_done=(t.step - schedule.start(stage)) * config.grad_accum,
                                 pin_memory=device.type == "cuda", cache=cache))
    try:  # the workers end here on every exit, an exception's included (latents.end_workers says why)
        metrics_path, keys_path = open_records(t)
        validation = validation_prompts(t)
        valset = None  # validation-loss hook (laionkit/valloss.py)
        if config.val_latents is not None:
            valset = valloss.load(config, t.data)
            accelerator.print(f"validation loss: {len(valset.keys)} samples of {config.val_latents}, "
                              f"every {valloss.every(config)} steps")
        exporter = None
        if main and config.metrics_port:
            from laionkit.common.prometheus import MetricsServer

            exporter = MetricsServer(config.metrics_port, device.index if device.type == "cuda" else None)
        stop.install()
        progress = tqdm(total=max_steps, initial=t.step, disable=config.quiet or not main, desc="train", unit="step")
        window = MetricsWindow(accelerator, schedule.global_batch, config.peak_tflops, metrics_path, exporter)
        last_checkpoint, stopped_by = None, None
        while t.step < max_steps:
            lora.seed_dropout(config, accelerator.process_index, t.step)  # LoRA hook: dropout masks as exact as the rest
            if t.step == schedule.ends[stage]:  # the next stage's stream starts at its first batch
                stage += 1
                end_workers(batches)  # the previous stage's
                batches = iter(latent_loader(t.layouts[stage], pin_memory=device.type == "cuda", cache=cache))
                accelerator.print(f"step {t.step}: stage {stage + 1} of {len(schedule.stages)}, {schedule.stages[stage][0]}")
            step_keys = train_step(t, batches, stage, window)
            progress.update()
            if config.record_keys:
                with open(keys_path, "a") as handle:
                    handle.write(json.dumps({"step": t.step, "keys": step_keys}) + "\n")

            val_due = valset is not None and (t.step % valloss.every(config) == 0 or t.step == max_steps)
            if t.step % config.log_every == 0 or t.step == max_steps or val_due:
                record = window.record(t)
                if val_due:  # validation-loss hook
                    record.update(validation_loss(t, valset))
                window.write(record)
                if main:
                    progress.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:.1f}")
                window.reset()
                window.check_finite(t.step, config.max_nonfinite, config.output)

            stopped_by = stop.agreed(accelerator)  # decided together, so every rank checkpoints and stops
            if t.step % config.checkpoint_every == 0 or stopped_by or t.step == max_steps:  # always the last
                last_checkpoint = checkpoint(t) or last_checkpoint
            if validation is not None and (t.step % config.validate_every == 0 or t.step == max_steps):
                validation_grid(t, validation, schedule.stages[stage][1])
            if stopped_by:
                break
        progress.close()
        window.close()
        if not stopped_by:
            finish(t)
        accelerator.end_training()
    finally:
        end_workers(batches)
    return TrainResult(step=t.step, stopped_by=stopped_by, checkpoint=last_checkpoint)


def same_model_latents(first: tuple[Path, LatentSet, int], folder: Path, later: LatentSet) -> LatentSet:
    """A --stage folder must feed the same model as LATENTS: latent channels, text embeddings and the
    VAE's scaling (its validation grids decode with LATENTS' VAE)."""
    def facts(data: LatentSet) -> tuple:
        return (data.bucket_shapes[0][0] // 2, data.text_shape, data.scaling_factor, data.shift_factor)

    if facts(later) != facts(first[1]):
        raise LaionkitError(
            f"--stage {folder}: (latent channels, text shape, scaling factor, shift factor) {facts(later)} differ "
            f"from {first[0]}'s {facts(first[1])}: stages must come from the same VAE and text encoder")
    return later


def layout_key(layout: StreamLayout, data: LatentSet) -> dict:
    """What exact resume compares: the stream layout with the shards as content (name, samples, bytes),
    not paths, so latents moved, staged on local disk or reached through a symlink still resume."""
    key = asdict(layout)
    del key["bucketed"]  # follows from the shards' content, pinned below (and absent from older checkpoints)
    key["shards"] = [[Location.parse(shard).name, samples, Location.parse(shard).size()]
                     for shard, samples in zip(data.shards, data.shard_samples)]
    return key


RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "unet", "unet_ema", "transformer", "transformer_ema", "lora", "lora_ema",
               "pipeline", "single_file", "samples", "seen", "logs")


def claim_run_folder(config: TrainConfig, accelerator) -> None:
    """A fresh run never mixes into another's outputs: the main rank takes the folder's lock first (one
    train per folder, laionkit/runlock.py), then a folder that holds a run is refused unless --resume
    continues it or --overwrite deletes it first (runfolder.start_over: also a --resume latest that has
    no checkpoint to continue from)."""
    answer = [None, False]  # error, start over
    if accelerator.is_main_process:
        try:
            config.output.mkdir(parents=True, exist_ok=True)
            runlock.hold(runlock.LocalLock(config.output))
            found = [name for name in RUN_OUTPUTS if (config.output / name).exists()]
            answer = [None, runfolder.start_over(config, config.output, found, bool(complete_checkpoints(
                config.output)), runfolder.last_logged_step(config.output / "metrics.jsonl"))]
        except (LaionkitError, OSError) as error:
            answer = [str(error), False]
    error, delete = runfolder._broadcast(accelerator, answer)
    if error is not None:
        raise LaionkitError(error)
    if delete:
        accelerator.wait_for_everyone()  # every rank has looked before rank 0 deletes
        if accelerator.is_main_process:
            for name in RUN_OUTPUTS:
                path = config.output / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    accelerator.wait_for_everyone()


def last_good(output: Path) -> str:
    found = complete_checkpoints(output)
    return str(found[-1]) if found else "none"


def strict_json(record: dict) -> str:
    """JSON as the standard has it: a non-finite number (a diverged loss) becomes null, not NaN."""
    clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def save_grid(images: torch.Tensor, path: Path) -> None:
    from torchvision.utils import save_image

    with atomic_output(path) as tmp:
        save_image(images, tmp, nrow=math.ceil(math.sqrt(len(images))), format="png")


def export(accelerator, unet, ema, master: MasterWeights | None, output: Path, subfolder: str = "unet",
           dtype: torch.dtype = torch.float32) -> None:
    """The final denoiser (and its EMA) as diffusers folders that its class's from_pretrained loads, named
    as the family's pipeline names it (RUN/unet, RUN/transformer; EMA: RUN/unet_ema, RUN/transformer_ema).

    The weights go into a fresh, unwrapped UNet of the same config before saving: under FSDP2 the
    prepared module's parameters are DTensor shards, which diffusers' save_pretrained cannot write
    even when handed the gathered state dict (seen on 2 H200s, 2026-11-30). With MasterWeights or
    DeepSpeed the fp32 master weights are written, not their bf16 rounding. ``dtype`` is the weights'
    own: bfloat16 under --full-bf16, where fp32 would double the size (48 GB for Flux-12B) and add
    nothing; the EMA, kept in fp32, is written in fp32."""
    from accelerate.utils import DistributedType

    state_dict = accelerator.get_state_dict(unet)  # gathers FSDP / ZeRO shards; every rank must call it
    fp32 = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO's module weights are its bf16/fp16 copies; the fp32 master lives in the optimizer's partitions.
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in accelerator.unwrap_model(unet).named_parameters():  # collective: every rank, in order
            full = safe_get_full_fp32_param(param)
            if full is not None and accelerator.is_main_process:
                fp32[name] = full.detach().cpu()
    elif master is not None:
        fp32 = dict(zip(master.names, master.master))
    if accelerator.is_main_process:
        from accelerate import init_empty_weights

        model = accelerator.unwrap_model(unet)
        # No random init of a model whose every weight is overwritten next (minutes for Flux-12B on a CPU):
        # parameters are created empty and take the fp32 tensors (master weights where there are) as theirs.
        with init_empty_weights(include_buffers=False):
            plain = type(model).from_config(model.config)
        weights = {name: fp32.get(name, tensor).detach().to("cpu") for name, tensor in state_dict.items()}
        plain.load_state_dict({name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()},
                              assign=True)
        with atomic_output(output / subfolder) as tmp:
            plain.save_pretrained(tmp, safe_serialization=True)
        if ema is not None:
            torch.nn.Module.float(plain)
            ema.copy_to(plain.parameters())
            with atomic_output(output / f"{subfolder}_ema") as tmp:
                plain.save_pretrained(tmp, safe_serialization=True)
    accelerator.wait_for_everyone()

