"""The model inside what accelerate wrapped it in, without importing what could not have wrapped it.

``accelerator.unwrap_model`` imports DeepSpeed and FSDP's first version on every call, to test whether the model
is one of their wrappers: about a second of every training process's start on a machine where both are installed,
when the run uses neither (the CPU tests start hundreds of such processes). A model can only be in a DeepSpeed
engine or an FSDP1 module if the run was launched so; a compiled model keeps accelerate's own handling.
"""

from __future__ import annotations

import torch


def unwrap(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``accelerator.unwrap_model(model)``: the same module, with DeepSpeed and FSDP imported only under their
    launches (and compiled models left to accelerate)."""
    from accelerate.utils import DistributedType

    if (accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
            or "_orig_mod" in model.__dict__):  # torch.compile's wrapper: accelerate unwraps what is inside it
        return accelerator.unwrap_model(model)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def state_dict_of(accelerator, model: torch.nn.Module) -> dict:
    """``accelerator.get_state_dict(model)`` (whole weights; a collective under FSDP and ZeRO-3), by way of unwrap."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return accelerator.get_state_dict(model)
    return unwrap(accelerator, model).state_dict()
