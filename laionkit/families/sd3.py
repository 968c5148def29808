"""SD3: a joint-attention transformer (MMDiT) trained with flow matching on a 16-channel VAE.

Text conditioning, as ``StableDiffusion3Pipeline.encode_prompt`` builds it: CLIP-L and CLIP-G
penultimate states concatenated on the feature axis (77 x 2048), zero-padded to T5's width (4096) and
concatenated on the sequence axis with T5-XXL's states (no attention mask: T5's padded positions carry
content); pooled = CLIP-L and CLIP-G projections concatenated (2048).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers"}

# stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json (2.0B parameters).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192,
}
T5_MAX_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length
TINY_CLIP = (32, 64)
TINY_T5 = 128  # >= sum(TINY_CLIP): CLIP states are zero-padded to T5's width
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": 8, "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 8,
    "num_attention_heads": 4, "joint_attention_dim": TINY_T5, "caption_projection_dim": 32,
    "pooled_projection_dim": sum(TINY_CLIP), "out_channels": 16, "pos_embed_max_size": 16,
}
# stabilityai/stable-diffusion-3-medium-diffusers scheduler/scheduler_config.json: validation sampling.
SAMPLER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}


def _t5_ids(tokenizer, captions, max_length):
    return tokenizer(captions, padding="max_length", max_length=max_length, truncation=True,
                     add_special_tokens=True, return_tensors="pt").input_ids


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = T5_MAX_LENGTH) -> list:
    """Token ids [B, T_i] for each text encoder, as StableDiffusion3Pipeline.encode_prompt pads them."""
    captions = list(captions)
    clip_l_tok, clip_g_tok, t5_tok = tokenizers
    return [*(tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids for tokenizer in (clip_l_tok, clip_g_tok)),
            _t5_ids(t5_tok, captions, max_sequence_length)]


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, 77 + T, D_t5] and ``pooled`` [B, D_l + D_g] from ``tokenize``'s ids."""
    import torch
    import torch.nn.functional as F

    clip_l, clip_g, t5 = text_encoders
    clip_states, pooled = [], []
    with torch.no_grad():
        for encoder, input_ids in zip((clip_l, clip_g), ids[:2], strict=True):
            output = encoder(input_ids.to(encoder.device), output_hidden_states=True)
            clip_states.append(output.hidden_states[-2])
            pooled.append(output.text_embeds)
        t5_states = t5(ids[2].to(t5.device))[0]
    clip = torch.cat(clip_states, dim=-1)
    clip = F.pad(clip, (0, t5_states.shape[-1] - clip.shape[-1]))
    return {"states": torch.cat([clip, t5_states.to(clip.dtype)], dim=-2), "pooled": torch.cat(pooled, dim=-1)}



def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """SD3Transformer2DModel keyword arguments besides hidden_states and timestep (sigma * 1000)."""
    return {"encoder_hidden_states": batch["states"], "pooled_projections": batch["pooled"]}


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch SD3 architecture fitted to the latents: channels, text and pooled widths, and a
    position-embedding table that covers the largest latent side (in 2x2 patches)."""
    patches = -(-latent_size // arch.get("patch_size", 2))
    arch.update(in_channels=latent_channels, out_channels=latent_channels, sample_size=latent_size,
                joint_attention_dim=text_dim, pooled_projection_dim=pooled_dim,
                pos_embed_max_size=max(arch.get("pos_embed_max_size") or 0, patches))
    return arch


def expects(config) -> tuple:
    """(latent channels, text width, pooled width) a built SD3Transformer2DModel takes."""
    return config.in_channels, config.joint_attention_dim, config.pooled_projection_dim


def tiny_clip_pair(output: Path):
    """Tiny CLIP-L / CLIP-G-shaped text encoders with projections and the real CLIP BPE tokenizers."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW, clip_tokenizer

    encoders = [CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=CLIP_WINDOW, hidden_act=act, projection_dim=hidden,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=1,
    )) for hidden, act in zip(TINY_CLIP, ("quick_gelu", "gelu"), strict=True)]
    tokenizer = clip_tokenizer(output / "tokenizer")
    tokenizer_2 = clip_tokenizer(output / "tokenizer_2")
    tokenizer_2.pad_token = "!"
    return encoders, (tokenizer, tokenizer_2)


def tiny_t5(output: Path, d_model: int, max_length: int = 512):
    """A tiny T5 v1.1-style encoder (gated-gelu) with a T5TokenizerFast trained on the shipped captions
    (its model_max_length ``max_length``)."""
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    from laionkit.families.tokenizers import write_t5

    tokenizer = T5TokenizerFast.from_pretrained(write_t5(output, max_length=max_length))
    encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False,
    ))
    return encoder, tokenizer


def tiny_vae(scaling_factor: float, shift_factor: float | None = None, latent_channels: int = 16):
    """A tiny 8x AutoencoderKL: 16 channels without quant convs, as the SD3 and Flux VAEs are, or 4 with
    them, as SD's and SDXL's (PixArt-Σ's) are."""
    from diffusers import AutoencoderKL

    quant_convs = latent_channels == 4
    return AutoencoderKL(
        block_out_channels=(8, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
        latent_channels=latent_channels, sample_size=64, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=quant_convs, use_post_quant_conv=quant_convs,
    )


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init StableDiffusion3Pipeline folder in the real diffusers layout.

    vae/ (16 channels, SD3's scaling and shift factors), text_encoder/ + text_encoder_2/
    (CLIPTextModelWithProjection), text_encoder_3/ (T5EncoderModel), tokenizer/ + tokenizer_2/ (real CLIP
    BPE), tokenizer_3/ (a T5TokenizerFast trained on the shipped captions), transformer/
    (SD3Transformer2DModel, 2x2 patches), scheduler/ (FlowMatchEulerDiscreteScheduler, shift 3).
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    output = Path(output)
    torch.manual_seed(seed)
    (text_encoder, text_encoder_2), (tokenizer, tokenizer_2) = tiny_clip_pair(output)
    text_encoder_3, tokenizer_3 = tiny_t5(output / "tokenizer_3", TINY_T5)
    transformer = SD3Transformer2DModel.from_config(TINY_TRANSFORMER_CONFIG)
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler.from_config(SAMPLER_CONFIG),
        vae=tiny_vae(scaling_factor=1.5305, shift_factor=0.0609), text_encoder=text_encoder,
        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="sd3",
    pipeline_class="StableDiffusion3Pipeline",
    denoiser_class="SD3Transformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"),
                   ("tokenizer_3", "text_encoder_3")),
    stored=("states", "pooled"),
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    conditioning=conditioning,
    objective=Objective(kind="flow", prediction="velocity", sigma_sampling="logit_normal", shift=3.0),
    block_classes=("JointTransformerBlock",),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"sd3-medium": TRANSFORMER_CONFIG, "tiny": TINY_TRANSFORMER_CONFIG},
    vae_shift=True,
    fit_config=fit_config,
    expects=expects,
    sampler=SAMPLER_CONFIG,
    patch_size=2,  # SD3Transformer2DModel embeds 2x2 latent patches: an odd latent side fails in train's first step
    max_sequence_length=T5_MAX_LENGTH,  # T5's window; the CLIP pair's stays 77
    max_sequence_limit=512,  # StableDiffusion3Pipeline refuses more
    pipeline_cut="laionkit.families.sd3_stages",
))
