"""--cpu-offload: FSDP2's CPUOffloadPolicy, the memory strategy for a full fine-tune larger than the GPUs.

Under it FSDP2 keeps each rank's shard of the parameters, their gradients and the optimizer state in host
memory: a wrap unit (one transformer block) is copied to the GPU and all-gathered just before it runs, its
gradients are reduce-scattered and copied back after its backward, and the optimizer step runs on the CPU.
The GPU holds the activations and a unit or two of whole weights, so a 12-20B model trains on one 80 GB GPU
at the price of the PCIe traffic and a CPU optimizer step (docs/CLUSTER.md, "Offload: when each pays").

It is accelerate's own FSDP2 offload (the ``fsdp_offload_params`` option of an accelerate config, read from
the launcher's ``FSDP_OFFLOAD_PARAMS``): the flag sets that before the Accelerator is built, which is also
when accelerate picks the mixed ``cuda:nccl,cpu:gloo`` process group the CPU-side collectives need. On one
GPU it is FSDP2 over a world of 1: ``accelerate launch --config_file train/fsdp.yaml --num_processes 1``.
"""

from __future__ import annotations

import os

import torch

from laionkit.common import LaionkitError
from laionkit.trainer import fsdp, zero

LAUNCH = "accelerate launch --config_file train/fsdp.yaml --num_processes N (N=1 on one GPU) -m laionkit.cli train"


def request(config) -> None:
    """Before ``Accelerator(...)``: --cpu-offload turns on the FSDP launch's parameter offload; refused in one
    line outside an FSDP launch (DDP and one plain process have nothing to offload with)."""
    if not config.cpu_offload:
        return
    if zero.deepspeed_launch():
        raise LaionkitError("--cpu-offload is FSDP2's CPU offload; under DeepSpeed offload with "
                            "train/deepspeed-zero3-offload.yaml and drop --cpu-offload")
    if not fsdp.fsdp_launch():
        raise LaionkitError(f"--cpu-offload runs under FSDP2 (one GPU or many): {LAUNCH} ... --cpu-offload")
    os.environ["FSDP_OFFLOAD_PARAMS"] = "true"


def offloaded(accelerator) -> bool:
    """Whether the prepared FSDP2 model's shards live on the host (--cpu-offload or the config's
    ``fsdp_offload_params: true``)."""
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    return (accelerator.distributed_type == DistributedType.FSDP
            and isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy))


def build_device(accelerator) -> torch.device:
    """Where build puts the denoiser before FSDP2 shards it (and says so under offload): on the host under
    offload (fully_shard then moves one wrap unit at a time through the GPU, so a model larger than the GPU
    can start), else the accelerator's device."""
    if not offloaded(accelerator):
        return accelerator.device
    accelerator.print("FSDP2 CPU offload: parameters, gradients and optimizer state on the host, the optimizer "
                      "step on the CPU")
    return torch.device("cpu")
