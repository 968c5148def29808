"""The trained denoiser written as diffusers loads it: RUN/unet (RUN/transformer), its EMA, or the LoRA
adapters (RUN/lora), from the fp32 master weights where there are some."""

from __future__ import annotations

from pathlib import Path

import torch

from laionkit.common import (
    atomic_output,
)
from laionkit.trainer.precision import MasterWeights


def export(accelerator, unet, ema, master: MasterWeights | None, output: Path, subfolder: str = "unet",
           dtype: torch.dtype = torch.float32) -> None:
    """The final denoiser (and its EMA) as diffusers folders that its class's from_pretrained loads, named
    as the family's pipeline names it (RUN/unet, RUN/transformer; EMA: RUN/unet_ema, RUN/transformer_ema).

    The weights go into a fresh, unwrapped UNet of the same config before saving: under FSDP2 the
    prepared module's parameters are DTensor shards, which diffusers' save_pretrained cannot write
    even when handed the gathered state dict (seen on 2 H200s, 2026-11-30). With MasterWeights or
    DeepSpeed the fp32 master weights are written, not their bf16 rounding. ``dtype`` is the weights'
    own: bfloat16 under --full-bf16, where fp32 would double the size (48 GB for Flux-12B) and add
    nothing; the EMA, kept in fp32, is written in fp32."""
    from accelerate.utils import DistributedType

    state_dict = accelerator.get_state_dict(unet)  # gathers FSDP / ZeRO shards; every rank must call it
    fp32 = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO's module weights are its bf16/fp16 copies; the fp32 master lives in the optimizer's partitions.
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in accelerator.unwrap_model(unet).named_parameters():  # collective: every rank, in order
            full = safe_get_full_fp32_param(param)
            if full is not None and accelerator.is_main_process:
                fp32[name] = full.detach().cpu()
    elif master is not None:
        fp32 = dict(zip(master.names, master.master))
    if accelerator.is_main_process:
        from accelerate import init_empty_weights

        model = accelerator.unwrap_model(unet)
        # No random init of a model whose every weight is overwritten next (minutes for Flux-12B on a CPU):
        # parameters are created empty and take the fp32 tensors (master weights where there are) as theirs.
        with init_empty_weights(include_buffers=False):
            plain = type(model).from_config(model.config)
        weights = {name: fp32.get(name, tensor).detach().to("cpu") for name, tensor in state_dict.items()}
        plain.load_state_dict({name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()},
                              assign=True)
        with atomic_output(output / subfolder) as tmp:
            plain.save_pretrained(tmp, safe_serialization=True)
        if ema is not None:
            torch.nn.Module.float(plain)
            ema.copy_to(plain.parameters())
            with atomic_output(output / f"{subfolder}_ema") as tmp:
                plain.save_pretrained(tmp, safe_serialization=True)
    accelerator.wait_for_everyone()
