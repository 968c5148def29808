"""laionkit encode's options (EncodeConfig) and the constants its stages share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laionkit.common import LaionkitError
from laionkit.common.caption_mix import parse_names
from laionkit.common.models import PRESETS
from laionkit.families import FamilySpec, detect_family

TEXT_LAYERS = ("last", "penultimate")
DECODE_MODES = ("auto", "cpu", "gpu")
COMPUTE_DTYPES = ("auto", "fp32", "fp16", "bf16")
TEXT_MODES = ("stored", "online")
# Samples in flight between stages (in batches); bounds host and GPU memory.
QUEUE_DEPTH = 4


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
    # stored: text-encoder outputs per sample; online: token ids, train runs the encoders; None: the family's
    # default (FamilySpec.default_text)
    text: str | None = None
    # where captions come from: a member (txt, caption, ...) or a json key; None: reader.caption_of's order
    caption_key: str | None = None
    # --captions alt,vlm: every named caption's text tensors per sample (laionkit.common.caption_mix); None: the one
    # caption encode always stored (alt, also when --captions alt is given alone)
    captions: tuple[str, ...] | str | None = None
    overwrite: bool = False  # write into a folder that holds another stage's outputs (storage.claim_output)
    allow_incomplete: bool = False  # use an unfinished input, --keep or --caption-scores folder (common.upstream)
    keep: str | None = None  # --keep PARQUET: encode only these keys (common.keys); the others are counted, not_kept
    # --caption-scores DIR: each --captions name's CLIP score from `laionkit score --captions`'s similarity_NAME
    # columns, joined by shard and key (encode.caption_scores); None: json caption_scores, as before
    caption_scores: str | None = None
    # --max-sequence-length: the caption window (the pipelines' max_sequence_length) where it is not the family's
    # own (FamilySpec.with_max_sequence_length); recorded in the manifest, which train and its exports follow
    max_sequence_length: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "captions", parse_names(self.captions))
        if self.caption_scores is not None and not self.captions:
            raise LaionkitError("--caption-scores: scores are stored per named caption; give --captions too (e.g. "
                                "--captions alt,vlm)")
        choices = {"decode": DECODE_MODES, "dtype": COMPUTE_DTYPES, "text": TEXT_MODES}
        if self.text_layer is not None:
            choices["text_layer"] = TEXT_LAYERS
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed and not (name == "text" and value is None):  # no --text: the family's
                raise LaionkitError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}")
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
        """The model family, from --model (preset or model_index.json): it decides the encoders run; with its
        caption window set to --max-sequence-length where that is given."""
        return detect_family(self.model).with_max_sequence_length(self.max_sequence_length)

    @property
    def text_mode(self) -> str:
        """stored or online: --text, else the family's default."""
        return self.text or self.family.default_text

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
