"""Which of PyTorch's SDPA backends run Flux's attention forward and backward on this GPU, with and without
activation checkpointing per block (not a test; results in docs/BENCHMARKS.md, train).

Each variant runs in its own process (a failed CUDA kernel poisons its process), under
CUDA_LAUNCH_BLOCKING=1 so an error names the op that raised it. The transformer is FLUX.1-dev's width
(3072, head dim 128) at a reduced depth (2 double + 4 single blocks, random init, bf16), one step at
1024 px (batch 1) then 512 px (batch 4), with 512 text tokens.

    python scripts/probe_attention.py      # GPU machine, about 3 minutes
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

VARIANTS = [("none", "default"), ("blocks", "default"), ("blocks", "flash"), ("blocks", "efficient"),
            ("blocks", "cudnn"), ("blocks", "math"), ("none", "cudnn"), ("none", "flash")]


def child(checkpointing: str, backend: str) -> None:
    from diffusers import FluxTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from laionkit.families import get_family
    from laionkit.families.flux import TRANSFORMER_CONFIG, image_ids

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel.from_config({**TRANSFORMER_CONFIG, "num_layers": 2,
                                                    "num_single_layers": 4}).to(torch.bfloat16)
    model.train()
    if checkpointing == "blocks":
        get_family("flux").checkpoint_blocks(model, 1)
    if backend != "default":
        sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                     "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]).__enter__()
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    for px, batch in ((1024, 1), (512, 4)):
        latent = px // 8
        out = model(hidden_states=torch.randn(batch, (latent // 2) ** 2, 64, **bf16),
                    encoder_hidden_states=torch.randn(batch, 512, 4096, **bf16),
                    pooled_projections=torch.randn(batch, 768, **bf16), timestep=torch.full((batch,), 0.5, **bf16),
                    guidance=torch.full((batch,), 3.5, device="cuda"), txt_ids=torch.zeros(512, 3, **bf16),
                    img_ids=image_ids(latent, latent).to(**bf16), return_dict=False)[0]
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        print(f"  {px}px batch {batch}: forward and backward ran", flush=True)


def main() -> None:
    if len(sys.argv) == 3:
        child(*sys.argv[1:])
        return
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for checkpointing, backend in VARIANTS:
        started = time.time()
        done = subprocess.run([sys.executable, __file__, checkpointing, backend], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        ran = [line.strip() for line in lines if "ran" in line]
        errors = [line for line in lines if "Error" in line][:1]
        print(f"checkpointing {checkpointing}, SDPA {backend}: exit {done.returncode} in "
              f"{time.time() - started:.0f} s; {ran} {errors}", flush=True)


if __name__ == "__main__":
    main()
