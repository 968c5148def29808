"""The model inside what accelerate wrapped it in, without importing what could not have wrapped it.

``accelerator.unwrap_model`` (and ``get_state_dict``, through it) imports DeepSpeed on every call, to test whether
the model is in a DeepSpeed engine: a DeepSpeed import in every training process where DeepSpeed is installed
and the run does not use it (the CPU tests start hundreds of such processes). A model can only be in a
DeepSpeed engine or an FSDP module if the run was launched so, and those launches keep accelerate's own calls, as
a compiled model does.
"""

from __future__ import annotations

import torch


def unwrap(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``accelerator.unwrap_model(model)``: the same module, DDP unwrapped here; DeepSpeed and FSDP launches and
    compiled models go to accelerate."""
    # "_orig_mod": torch.compile's wrapper, inside which accelerate unwraps and puts the result back
    if _accelerate_wraps(accelerator) or "_orig_mod" in model.__dict__:
        return accelerator.unwrap_model(model)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def state_dict_of(accelerator, model: torch.nn.Module) -> dict:
    """``accelerator.get_state_dict(model)`` (whole weights; a collective under FSDP and ZeRO-3), by way of unwrap."""
    if _accelerate_wraps(accelerator):
        return accelerator.get_state_dict(model)
    return unwrap(accelerator, model).state_dict()


def _accelerate_wraps(accelerator) -> bool:
    """Whether the run was launched under DeepSpeed or FSDP, whose wrappers and gathers accelerate handles."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
