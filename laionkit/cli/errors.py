"""How the command ends on an error: a user mistake, an out-of-memory or a peer that stopped answering as one line,
a failed device at once."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

DEVICE_FAILURES = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "illegal memory access", "NCCL error")


def device_failed(error: BaseException) -> bool:
    """Whether ``error`` says the accelerator itself failed (not a user mistake, not an out-of-memory)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in DEVICE_FAILURES)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the accelerator running out of memory (torch.OutOfMemoryError; the CUDA context
    stays usable, so the normal exit runs)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ()))


def collective_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out waiting for another rank (gloo's "Timed out waiting
    ...ms", torch.distributed's DistError): a hung or lost peer, after --pg-timeout-minutes."""
    dist_error = getattr(getattr(sys.modules.get("torch"), "distributed", None), "DistError", ())
    said = str(error)
    return isinstance(error, RuntimeError) and "timed out" in said.lower() and (
        isinstance(error, dist_error) or "gloo" in said or "ProcessGroup" in said)


def timeout_advice(error: BaseException) -> str:
    """One line for a collective that timed out: what torch said and what to do."""
    said = str(error).strip().splitlines()[-1].split("] ", 1)[-1]  # gloo's source location before the message
    return (f"a collective timed out ({said}): another rank stopped answering (a hung or lost node) within "
            "--pg-timeout-minutes; restart the run with --resume latest (its launcher or scheduler can)")


# The allocator's advice after its numbers (expandable segments, a link): the line gives its own.
ALLOCATOR_ADVICE = ("If reserved but unallocated", "See documentation")


def memory_advice(error: BaseException) -> str:
    """One line for an out-of-memory: where in laionkit it happened, what the allocator said (the request, the
    device's capacity and free memory, what other processes and this one hold: another process holding the
    GPU shows here), and the settings that lower memory."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "laionkit" in Path(frame.filename).parts]
    where = f" in {frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    sentences = [" ".join(sentence.split()) for sentence in str(error).split(". ")]
    said = ". ".join(sentence for sentence in sentences
                     if sentence and not sentence.startswith(ALLOCATOR_ADVICE)).strip() or type(error).__name__
    return (f"out of device memory{where}: {said.rstrip('.')}. Lower --batch-size (--grad-accum keeps the global "
            "batch), or add --checkpointing auto, --full-bf16 or --lora-rank, or shard with FSDP (train/fsdp.yaml); "
            "`laionkit plan` measures which settings fit")
