"""`laionkit train`'s options: TrainConfig (one frozen dataclass, checked once in __post_init__) and TrainResult."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from laionkit.common import (
    LaionkitError,
)
from laionkit.trainer import trainchecks


@dataclass(frozen=True)
class TrainConfig:
    latents: Path | str  # a folder or a URL (s3://...), streamed
    output: Path | str  # a folder or a URL (s3://...), staged locally (laionkit/trainer/runfolder.py)
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
    # --- LoRA and the validation loss (laionkit/trainer/lora.py, laionkit/trainer/valloss.py) ---
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str = "to_q,to_k,to_v,to_out.0"  # trainchecks.DEFAULT_TARGETS
    lora_random_base: bool = False  # --lora-rank on --unet-config (a random base, never saved): benchmarks only
    val_latents: Path | None = None
    val_every: int = 0
    val_samples: int = 64
    val_strata: int = field(default=8, metadata={"help": (  # laionkit/trainer/valloss.py
        "Validation noise levels: every --val-samples sample at each of N fixed timesteps / sigmas u = (k + 0.5) / N "
        "(N forwards per sample), written as val_loss (their mean) and val_loss_strata; 1: the midpoint; 0: one "
        "fixed random level per sample, no strata. E.g. --val-strata 4.")})
    cache_dir: Path | None = None  # local copies of latent shards read from a URL, at most cache_size bytes
    cache_size: int = 100 * 2**30
    storage_options: str | None = None  # --storage-options JSON for the latents, --val-latents and --output URLs
    fp8: bool = False  # the blocks' linear layers in float8 (laionkit/trainer/fp8.py)
    fp8_recipe: str = "tensorwise"
    export: str = "auto"  # what finish writes besides RUN/unet: auto, pipeline, single-file (laionkit/trainer/pipeline.py)
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
        trainchecks.check_lora(self)
        trainchecks.check_val_loss(self)
        trainchecks.check_fp8(self)
        trainchecks.check_export(self)

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
