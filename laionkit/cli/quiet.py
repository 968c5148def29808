"""Quiet by default: messages libraries log about their own internals, whatever the command, are kept off
its stderr; each is dropped by its logger and its words, so the same loggers' other messages (and every
warning about what the user asked for) still show."""

from __future__ import annotations

import logging

# (logger, words of the one message dropped). The first four come from importing diffusers' model code (its
# quantizer registry imports torchao and bitsandbytes where installed) or saving through accelerate (which
# imports DeepSpeed where installed), on every command that loads a model.
LIBRARY_NOISE = (
    # torchao registering its enums through a torch API that torch now deprecates (torchao's to change)
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
    # diffusers' safe-globals list for torchao-serialized checkpoints (laionkit never loads one)
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
    # bitsandbytes' optional CPU 4-bit kernel from the hub (laionkit's nf4 base is its own: quantized_base.py)
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # DeepSpeed's accelerator probe on a host without a GPU
    ("DeepSpeed", "Setting accelerator to CPU"),
    # an SD 1.x/2.x pipeline loaded without its safety checker: laionkit's exports (RUN/pipeline) have none
    ("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion", "You have disabled the safety checker"),
)


class DropMessage(logging.Filter):
    """Drops the records whose message contains ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


def drop_library_noise() -> None:
    """Install LIBRARY_NOISE's filters (once per process: a command run again in-process adds none)."""
    for name, words in LIBRARY_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(known, DropMessage) and known.words == words for known in logger.filters):
            logger.addFilter(DropMessage(words))
