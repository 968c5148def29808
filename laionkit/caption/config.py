"""`laionkit caption`'s options: CaptionConfig, one frozen dataclass whose fields are the command's flags
(laionkit/common/options.py builds the command from them), checked once in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laionkit.common import LaionkitError
from laionkit.common.caption_mix import check_name
from laionkit.common.options import (
    ALLOW_INCOMPLETE_HELP,
    QUIET_HELP,
    RANK_HELP,
    STORAGE_HELP,
    WORLD_SIZE_HELP,
    check_choices,
    option,
)

DEFAULT_PROMPT = "Describe this image in detail."
# A caption's name is a json key and a word of encode's --captions and train's --caption-mix (alt:0.2,vlm:0.8):
# their rule (laionkit.common.caption_mix.check_name), and not "alt" nor "txt", which name the alt-text (the txt member).
RESERVED_NAMES = ("alt", "txt")


@dataclass(frozen=True)
class CaptionConfig:
    shards: tuple[str, ...] = option(
        help="pack's shard folder(s), tar files, globs or {a..b} patterns; img2dataset's parquet and files output "
        "formats too (paths or URLs).", type=list[str], argument=True)
    output: str = option(help="Output folder (a path or URL): one captioned tar per input shard, same name.",
                         flags=("--output", "-o"), group="Input and output")
    model: str = option(
        help="A vision-language model folder or hub id that transformers' AutoProcessor + "
        "AutoModelForImageTextToText load (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Florence-2, BLIP-2, LLaVA, ...).", group="Model")
    name: str = option("vlm", "The caption's name: written to each sample's json as captions[NAME].", group="Captions")
    prompt: str = option(
        DEFAULT_PROMPT, "The instruction, given with the image through the processor's chat template; a "
        "model without one gets this text verbatim (include its image token or task tag, e.g. "
        "<MORE_DETAILED_CAPTION> for Florence-2).", group="Captions")
    max_new_tokens: int = option(128, "Longest caption, in generated tokens.", group="Captions")
    batch_size: int = option(16, "Images per generate() call (--backend vllm: per LLM.generate call, which "
                                 "schedules its own batches: give it hundreds).", group="Performance")
    workers: int = option(4, "DataLoader worker processes reading, decoding and preprocessing (each reads whole "
                             "shards).", group="Performance")
    backend: Literal["transformers", "vllm"] = option(
        "transformers", "transformers (AutoModelForImageTextToText.generate) or vllm (where vllm is installed).", group="Performance")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = option(
        "auto", "Model dtype: auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16.", group="Performance")
    device: str | None = option(None, "torch device (default: cuda:LOCAL_RANK, else cpu).", group="Performance")
    trust_remote_code: bool = option(False, "Let transformers run the model repo's own code (models transformers "
                                            "does not ship).", flags=("--trust-remote-code",), group="Model")
    overwrite: bool = option(
        False, "Write into --output even if it holds another stage's outputs; same names are replaced.",
        flags=("--overwrite",), group="Input and output")
    storage_options: str | None = option(None, STORAGE_HELP, group="Input and output")
    rank: int | None = option(None, RANK_HELP, group="Distribution")
    world_size: int | None = option(None, WORLD_SIZE_HELP, group="Distribution")
    quiet: bool = option(False, QUIET_HELP, flags=("--quiet", "-q"), group="Logging")
    allow_incomplete: bool = option(False, ALLOW_INCOMPLETE_HELP, flags=("--allow-incomplete",), group="Input and output")

    def __post_init__(self) -> None:
        check_choices(self)
        object.__setattr__(self, "shards", tuple([self.shards] if isinstance(self.shards, str) else self.shards or ()))
        for name, flag in (("shards", "SHARDS"), ("output", "--output"), ("model", "--model")):
            if not getattr(self, name):
                raise LaionkitError(f"give {flag}")
        if self.name.lower() in RESERVED_NAMES:
            raise LaionkitError(f"--name {self.name!r}: not {' or '.join(RESERVED_NAMES)}, which name the alt-text")
        check_name(self.name, f"--name {self.name!r}")  # what encode --captions and train --caption-mix take
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.workers < 0:
            raise LaionkitError("--max-new-tokens and --batch-size must be >= 1, --workers >= 0")
