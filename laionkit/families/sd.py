"""SD 1.x / 2.x: one CLIP text encoder, a cross-attention UNet, a 4-channel VAE, DDPM noise prediction.

The family laionkit started with: its latent format (``text.npy`` = ``states``, ``empty_caption.npy``)
is the one every other family extends, and a latent folder whose manifest names no family is read as SD.
Its captions are tokenized in encode's DataLoader workers (they record truncation there), so the text
encoder runs on those ids (``encode_ids``): one fixed shape per batch, which ``--compile`` needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from laionkit.common.models import PRESETS as MODEL_PRESETS
from laionkit.common.models import write_tiny_models
from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {name: MODEL_PRESETS[name].repo for name in ("sd15", "sd2")}

# Architectures for --unet-config (random init). Values not listed are UNet2DConditionModel's defaults,
# which are SD 1.5's. in/out channels, sample size and cross_attention_dim always come from the data.
UNET_CONFIGS: dict[str, dict] = {
    "sd15": {"attention_head_dim": 8},
    "sd2-base": {"attention_head_dim": [5, 10, 20, 20], "use_linear_projection": True},
    "tiny": {
        "block_out_channels": [32, 64],
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "layers_per_block": 1,
        "attention_head_dim": 8,
    },
}


def encode_ids(text_encoders: Sequence, input_ids, layer: str = "last") -> dict[str, Any]:
    """``states`` [B, T, D] from token ids: the last hidden state, or the penultimate one through the
    final layer norm (``--text-layer penultimate``, what StableDiffusionPipeline's clip_skip=1 takes)."""
    (encoder,) = text_encoders
    if layer == "last":
        return {"states": encoder(input_ids).last_hidden_state}
    hidden = encoder(input_ids, output_hidden_states=True).hidden_states[-2]
    # transformers 5 dropped CLIPTextModel's text_model wrapper (and diffusers' clip_skip path with it).
    return {"states": getattr(encoder, "text_model", encoder).final_layer_norm(hidden)}


def encode_text(tokenizers: Sequence, text_encoders: Sequence, captions: Sequence[str],
                layer: str = "last") -> dict[str, Any]:
    """``states`` for captions, padded to the tokenizer's window, as StableDiffusionPipeline.encode_prompt."""
    import torch

    (tokenizer,) = tokenizers
    ids = tokenizer(list(captions), padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        return encode_ids(text_encoders, ids.to(text_encoders[0].device), layer)


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {"encoder_hidden_states": batch["states"]}


SPEC = register_family(FamilySpec(
    name="sd",
    pipeline_class="StableDiffusionPipeline",
    denoiser_class="UNet2DConditionModel",
    denoiser_subfolder="unet",
    text_encoders=(("tokenizer", "text_encoder"),),
    stored=("states",),
    encode_text=encode_text,
    conditioning=conditioning,
    objective=Objective(kind="ddpm", prediction="epsilon"),
    block_classes=("ResnetBlock2D", "BasicTransformerBlock"),
    write_tiny=write_tiny_models,
    presets=PRESETS,
    configs=UNET_CONFIGS,
    encode_ids=encode_ids,
    pipeline_cut="laionkit.families.unet_stages",
))
