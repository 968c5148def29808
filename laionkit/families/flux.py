"""Flux: a double/single-stream transformer on 2x2-packed 16-channel latents, flow matching with a
resolution-dependent shift.

Text conditioning, as ``FluxPipeline.encode_prompt`` builds it: T5-XXL's last hidden states (512
tokens, no attention mask) and CLIP-L's pooled output; ``txt_ids`` are zeros and ``img_ids`` the
(row, column) of each packed latent patch, so they depend only on the bucket's latent size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"flux-dev": "black-forest-labs/FLUX.1-dev"}

# black-forest-labs/FLUX.1-dev transformer/config.json (11.9B parameters).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
    "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
}
T5_MAX_LENGTH = 512  # FluxPipeline's default max_sequence_length
TINY_CLIP = 32
TINY_T5 = 64
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": TINY_T5, "pooled_projection_dim": TINY_CLIP,
    "guidance_embeds": True, "axes_dims_rope": [4, 6, 6],
}
# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json: validation sampling with the pipeline's mu.
SAMPLER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}
# The guidance embedding's input while training a guidance-distilled transformer (diffusers'
# train_dreambooth_flux.py --guidance_scale default); used only when the config has guidance_embeds.
TRAIN_GUIDANCE = 3.5


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = T5_MAX_LENGTH) -> list:
    """Token ids [B, T_i] for CLIP and T5, as FluxPipeline.encode_prompt pads them."""
    captions = list(captions)
    clip_tok, t5_tok = tokenizers
    return [clip_tok(captions, padding="max_length", max_length=clip_tok.model_max_length, truncation=True,
                     return_tensors="pt").input_ids,
            t5_tok(captions, padding="max_length", max_length=max_sequence_length, truncation=True,
                   return_tensors="pt").input_ids]


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, T, D_t5] and ``pooled`` [B, D_clip] from ``tokenize``'s ids."""
    import torch

    clip, t5 = text_encoders
    with torch.no_grad():
        pooled = clip(ids[0].to(clip.device), output_hidden_states=False).pooler_output
        states = t5(ids[1].to(t5.device), output_hidden_states=False)[0]
    return {"states": states.to(t5.dtype), "pooled": pooled.to(clip.dtype)}



def pack(latents):
    """[B, C, H, W] -> [B, H/2 * W/2, 4C], FluxPipeline._pack_latents' layout."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed, height: int, width: int):
    """The inverse of pack for a latent of ``height`` x ``width``."""
    b, _, channels = packed.shape
    packed = packed.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return packed.reshape(b, channels // 4, height, width)


def image_ids(height: int, width: int):
    """[H/2 * W/2, 3] positions (0, row, column) of the packed patches of one latent size (bucket)."""
    import torch

    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """FluxTransformer2DModel keyword arguments besides the packed hidden_states and timestep (sigma).

    ``batch`` holds the stored text, ``img_ids`` for its bucket, and ``guidance`` when the transformer
    has guidance embeddings (FLUX.1-dev), else None.
    """
    import torch

    states = batch["states"]
    return {
        "encoder_hidden_states": states, "pooled_projections": batch["pooled"],
        "txt_ids": torch.zeros(states.shape[1], 3, dtype=states.dtype, device=states.device),
        "img_ids": batch.get("img_ids"), "guidance": batch.get("guidance"),
    }


def denoise(model, noisy, timestep, kwargs: Mapping[str, Any]):
    """The transformer on [B, C, h, w] latents: packed 2x2 in, ``img_ids`` of this shape (bucket), the
    velocity unpacked back to [B, C, h, w]. ``timestep`` is sigma, as FluxPipeline passes t / 1000."""
    _, _, height, width = noisy.shape
    kwargs = {**kwargs, "img_ids": image_ids(height, width).to(noisy.device, noisy.dtype)}
    out = model(pack(noisy), timestep=timestep, **kwargs, return_dict=False)[0]
    return unpack(out, height, width)


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch Flux architecture fitted to the latents: 2x2-packed channels, text and pooled widths
    (positions are rotary: no size to fit)."""
    arch.update(in_channels=4 * latent_channels, out_channels=None, joint_attention_dim=text_dim,
                pooled_projection_dim=pooled_dim)
    return arch


def expects(config) -> tuple:
    """(latent channels, text width, pooled width) a built FluxTransformer2DModel takes."""
    return config.in_channels // 4, config.joint_attention_dim, config.pooled_projection_dim


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init FluxPipeline folder in the real diffusers layout.

    vae/ (16 channels, Flux's scaling and shift factors), text_encoder/ (CLIPTextModel) + tokenizer/
    (real CLIP BPE), text_encoder_2/ (T5EncoderModel) + tokenizer_2/ (a T5TokenizerFast trained on the
    shipped captions), transformer/ (FluxTransformer2DModel with guidance embeddings, like FLUX.1-dev),
    scheduler/ (FlowMatchEulerDiscreteScheduler with FLUX.1-dev's dynamic shifting).
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW, clip_tokenizer
    from laionkit.families.sd3 import tiny_t5, tiny_vae

    output = Path(output)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE, hidden_size=TINY_CLIP, intermediate_size=2 * TINY_CLIP, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=CLIP_WINDOW, hidden_act="quick_gelu",
        projection_dim=TINY_CLIP, bos_token_id=49406, eos_token_id=49407, pad_token_id=1,
    ))
    text_encoder_2, tokenizer_2 = tiny_t5(output / "tokenizer_2", TINY_T5)
    transformer = FluxTransformer2DModel.from_config(TINY_TRANSFORMER_CONFIG)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SAMPLER_CONFIG)
    pipeline = FluxPipeline(
        scheduler=scheduler, vae=tiny_vae(scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder, tokenizer=clip_tokenizer(output / "tokenizer"),
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="flux",
    pipeline_class="FluxPipeline",
    denoiser_class="FluxTransformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")),
    stored=("states", "pooled"),
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    conditioning=conditioning,
    objective=Objective(kind="flow", prediction="velocity", sigma_sampling="logit_normal", dynamic_shift=True,
                        timestep_scale=1.0, guidance=TRAIN_GUIDANCE),
    block_classes=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"flux-dev": TRANSFORMER_CONFIG, "tiny": TINY_TRANSFORMER_CONFIG},
    vae_shift=True,
    denoise=denoise,
    fit_config=fit_config,
    expects=expects,
    sampler=SAMPLER_CONFIG,
    pack_latents=pack,
    unpack_latents=unpack,
    embedded_guidance=True,
    patch_size=2,
    max_sequence_length=T5_MAX_LENGTH,
    max_sequence_limit=512,  # FluxPipeline refuses more
    # On an H200 (torch 2.11, cuDNN 9.19) cuDNN's SDPA backward failed on Flux's attention (head dim 128,
    # RoPE'd q/k) in bare diffusers as in train, with or without checkpointing; flash, memory-efficient
    # and math attention ran (in the git history of docs/BENCHMARKS.md, its fifth session).
    cudnn_attention=False,
    pipeline_cut="laionkit.families.flux_stages",
    # T5-XXL's 512 states per sample are 4x the 1024 px latent; run online, they cost the 12B step a few
    # percent (docs/BENCHMARKS.md, "Flux stored vs online text"): online by default.
    default_text="online",
))
