"""`laionkit caption`: recaption image shards with a vision-language model (``from laionkit.caption import
CaptionConfig, run``); docs/FORMATS.md section 2a.

Every sample of an input shard is copied into a new shard of the same name, its members unchanged (image,
txt: the alt-text is kept), its json gaining ``captions[NAME]``; the output folder reads as pack's does, so
encode and train take it as they take pack's.

Modules, each importing only ones listed before it (tests/test_imports.py): config (CaptionConfig) → tiny (the
tiny random-init Qwen2-VL of `laionkit models tiny-vlm`) → reader (shards → decoded images → batches, in
DataLoader workers) → backends (the model: transformers' AutoModelForImageTextToText, or vLLM) → records
(plan, per-shard done records, settings, `laionkit stats`) → writer (one output tar per input shard) → stage
(``run``), which wires them.
"""

from laionkit.caption.config import CaptionConfig

__all__ = ["CaptionConfig", "run"]


def __getattr__(name: str):
    """``run`` on first use: the stage imports torch, and the CLI builds `laionkit caption` from CaptionConfig alone."""
    if name == "run":
        from laionkit.caption.stage import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
