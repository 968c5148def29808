"""FP8 for `laionkit train --fp8`: the denoiser blocks' linear layers train in float8 (torchao), bf16 elsewhere.

torchao's float8 training (``torchao.float8.convert_to_float8_training``) swaps ``nn.Linear`` for
``Float8Linear``: the weight stays a bf16 (or fp32 master) parameter, and each matmul of the forward and
backward casts its inputs to float8 with dynamic scales (``tensorwise``: one scale per tensor, the fastest;
``rowwise``: one per row, closer to bf16) and runs ``torch._scaled_mm``. The state dict keeps nn.Linear's
keys, so checkpoints, exact resume, EMA and the export are unchanged: an FP8 run exports the same diffusers
folder a bf16 run does.

What converts: the ``nn.Linear`` layers inside the family's repeated blocks (``FamilySpec.block_classes``:
the transformer blocks of SD3 / Flux / PixArt, the UNet's attention blocks) whose both sides are multiples
of 16 (the float8 GEMM's alignment); embedders, norms and the final projection stay bf16, as torchtitan's
float8 recipe leaves the output layer out. The float8 GEMM also needs the token count (batch x sequence, the
inner dimension of the weight gradient's GEMM) to be a multiple of 16: SD3's 333 text tokens at batch 8 are
2664 rows, on which the compiled step failed on an H200. A converted layer whose input has such a row count
runs that call as the plain high-precision linear (``_float8_or_plain``); image tokens ((H/16)·(W/16) for an
8x VAE and 2x2 patches) are a multiple of 16 at every size that is a multiple of 64. Float8 matmuls are fast
on GPUs of compute capability 8.9 and newer (Ada, Hopper, Blackwell) and with ``--compile`` (the casts
fuse); eager float8 spends the saving on separate cast kernels. Whether it pays, and whether the loss stays
within noise of bf16, is measured per model in docs/BENCHMARKS.md ("FP8"), which is why it is opt-in.
"""

from __future__ import annotations

import functools

import torch

from laionkit.common import LaionkitError


def check_device(device: torch.device) -> None:
    """Float8 GEMMs need compute capability 8.9+ on CUDA; on CPU they run (slowly: for tests and checks)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise LaionkitError(f"--fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {name} is "
                            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def convert(model: torch.nn.Module, block_classes, recipe: str = "tensorwise") -> list[str]:
    """Swap the blocks' float8-eligible nn.Linear layers for Float8Linear in place; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    blocks = tuple(f"{name}." for name, module in model.named_modules() if type(module).__name__ in block_classes)

    def wanted(module: torch.nn.Module, name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and name.startswith(blocks)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    converted = [name for name, module in model.named_modules() if wanted(module, name)]
    if not converted:
        raise LaionkitError(f"--fp8: no linear layer of the {'/'.join(block_classes)} blocks has both sides a "
                            "multiple of 16; nothing would train in float8")
    convert_to_float8_training(model, module_filter_fn=wanted,
                               config=Float8LinearConfig.from_recipe_name(recipe))
    fallback = _float8_or_plain()
    for name in converted:
        model.get_submodule(name).__class__ = fallback
    return converted


@functools.cache
def _float8_or_plain() -> type:
    """torchao's Float8Linear, except that an input whose rows (all but the last dimension, flattened) are not
    a multiple of 16 goes through the plain linear: torch._scaled_mm refuses the weight gradient's GEMM then.
    Under --compile the row count is static per graph, so the choice costs nothing in the step."""
    from torchao.float8.float8_linear import Float8Linear

    class Float8OrPlainLinear(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if (input.numel() // input.shape[-1]) % 16:
                return torch.nn.functional.linear(input, self.weight, self.bias)
            return super().forward(input)

    return Float8OrPlainLinear
