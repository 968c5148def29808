"""DeepSpeed ZeRO under `laionkit train`: its ranks on a machine without GPUs, and what ZeRO-3 refuses.

accelerate hands a DeepSpeed launch's ranks to DeepSpeed only when the Accelerator is not built with ``cpu=True``
(state.py: ``if not cpu and self.backend != "xla"`` guards ``deepspeed.comm.init_distributed``); train builds it so
on a machine without GPUs (to start several gloo ranks), and a ``deepspeed-zero*.yaml`` launch there silently
became plain multi-process training. DeepSpeed itself runs on CPU: its CPU accelerator, picked when it finds no
GPU, talks gloo and partitions, offloads and checkpoints as on GPUs. So under a DeepSpeed launch train leaves
``cpu`` off and the ranks are DeepSpeed ranks everywhere: what runs in the tests is DeepSpeed's own ZeRO-2 /
ZeRO-3 path (tests/test_offload.py).

ZeRO-3 (train/deepspeed-zero3*.yaml) partitions the parameters themselves: outside a module's forward each rank
holds an empty tensor per parameter and its partition lives in the optimizer (on the host under offload).
What needs whole parameters between steps is refused in one line: --ema (an average of empty tensors) and
--lora-rank (lora.attach refuses every DeepSpeed launch). The export gathers the fp32 master weights
(export.py, ``safe_get_full_fp32_param``); checkpoints are DeepSpeed's partitions, resumed on the same ranks.
"""

from __future__ import annotations

import os

import torch

from laionkit.common import LaionkitError


def deepspeed_launch() -> bool:
    """Whether accelerate launched this process with a DeepSpeed config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def cpu_ranks() -> bool:
    """What make_accelerator passes as ``cpu``: true on a machine without GPUs, except under a DeepSpeed
    launch (see the module docstring)."""
    return not torch.cuda.is_available() and not deepspeed_launch()


def process_group() -> dict:
    """A DeepSpeed launch's part of make_accelerator's InitProcessGroupKwargs: gloo without GPUs (accelerate
    knows no backend for a CPU device it was not told is a CPU, and would count a world of 1 while DeepSpeed
    runs all ranks), else accelerate's own choice. Refused in one line where DeepSpeed is not installed."""
    if not deepspeed_launch():
        return {}
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise LaionkitError("a train/deepspeed-*.yaml launch needs DeepSpeed: pip install deepspeed")
    return {} if torch.cuda.is_available() else {"backend": "gloo"}


def stage(accelerator) -> int | None:
    """The ZeRO stage of a DeepSpeed run, else None."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return accelerator.state.deepspeed_plugin.zero_stage


def check(config, accelerator) -> None:
    """ZeRO-3's one-line refusals, at setup (the stage is known once the Accelerator exists)."""
    if stage(accelerator) == 3 and config.ema:
        raise LaionkitError("--ema under DeepSpeed ZeRO-3: each rank holds a partition of every weight and EMA "
                            "needs whole ones; use train/deepspeed-zero2.yaml (or DDP) for --ema, or drop it")
