"""SDXL: two CLIP text encoders, a text_time-conditioned UNet, and a VAE that must run above fp16.

Conditioning per sample, as ``StableDiffusionXLPipeline`` and diffusers' SDXL training script build it:
the penultimate hidden states of CLIP ViT-L and OpenCLIP ViT-bigG concatenated on the feature axis
(77 x 2048), the second encoder's pooled projection (1280), and six ``time_ids``: the image's true
original size, the crop's top-left corner in resized pixels, and the target size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.common.errors import LaionkitError
from laionkit.common.models import PRESETS as MODEL_PRESETS
from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"sdxl": MODEL_PRESETS["sdxl"].repo}
# The per-sample json fields (docs/FORMATS.md section 3) time_ids are made of.
SIZE_FIELDS = ("original_size", "crop_top_left", "target_size")

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json: the real architecture (2.57B parameters),
# for training from scratch with ``--unet-config sdxl``.
UNET_CONFIG: dict[str, Any] = {
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_cond_proj_dim": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "time_embedding_type": "positional",
    "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
}

# SDXL base's scheduler/scheduler_config.json (the noise schedule it was trained with).
SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "interpolation_type": "linear",
    "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0,
    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "timestep_spacing": "leading",
    "trained_betas": None, "use_karras_sigmas": False,
}

TINY_HIDDEN = (32, 64)  # text encoder widths; their sum is the tiny UNet's cross_attention_dim
TINY_TIME_EMBED = 8
# The tiny UNet write_tiny saves, also for ``--unet-config tiny`` on SDXL latents (train fits the
# channels, sample size, cross-attention and pooled widths to the data).
TINY_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8, "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1,
    "attention_head_dim": [2, 4], "transformer_layers_per_block": [1, 2], "use_linear_projection": True,
    "cross_attention_dim": sum(TINY_HIDDEN), "norm_num_groups": 32, "addition_embed_type": "text_time",
    "addition_time_embed_dim": TINY_TIME_EMBED,
    "projection_class_embeddings_input_dim": 6 * TINY_TIME_EMBED + TINY_HIDDEN[1],
}


def encode_text(tokenizers: Sequence, text_encoders: Sequence, captions: Sequence[str]) -> dict[str, Any]:
    """``states`` [B, 77, D1+D2] and ``pooled`` [B, D2], exactly as ``StableDiffusionXLPipeline.encode_prompt``.

    Each tokenizer pads to its own window (SDXL's second tokenizer pads with "!", not end-of-text: the
    padded positions differ and so do the states). The pooled vector is the second encoder's projected
    end-of-text embedding (``text_embeds``), the one the UNet's ``add_embedding`` was trained on.
    """
    import torch

    captions = list(captions)
    states, pooled = [], None
    with torch.no_grad():
        for tokenizer, encoder in zip(tokenizers, text_encoders, strict=True):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            output = encoder(ids.to(encoder.device), output_hidden_states=True)
            states.append(output.hidden_states[-2])
            pooled = getattr(output, "text_embeds", None)
    if pooled is None:
        raise ValueError("the last SDXL text encoder must be a CLIPTextModelWithProjection (pooled text_embeds)")
    return {"states": torch.cat(states, dim=-1), "pooled": pooled}


def time_ids(original_hw, crop_top_left, target_hw):
    """SDXL's micro-conditioning: [orig h, orig w, crop top, crop left, target h, target w] per sample.

    Arguments are (h, w) / (top, left) pairs or [B, 2] arrays (broadcast against each other); sizes are
    the true original image size before any resize, crop coordinates in resized pixels, as diffusers'
    train_text_to_image_sdxl.py computes them.
    """
    import torch

    parts = [torch.as_tensor(p, dtype=torch.float32) for p in (original_hw, crop_top_left, target_hw)]
    parts = torch.broadcast_tensors(*parts)
    return torch.cat(parts, dim=-1)


def center_crop_top_left(original_hw: tuple[int, int], resolution: int) -> tuple[int, int]:
    """The crop corner of resize-shorter-side-to-``resolution`` then center-crop, in resized pixels.

    Same rounding as diffusers' SDXL script and torchvision's Resize / CenterCrop, so time_ids describe
    the pixels the latent was encoded from.
    """
    height, width = original_hw
    short, long = min(height, width), max(height, width)
    resized_long = int(resolution * long / short)
    resized_h, resized_w = (resolution, resized_long) if height <= width else (resized_long, resolution)
    return (int(round((resized_h - resolution) / 2.0)), int(round((resized_w - resolution) / 2.0)))


def batch_time_ids(batch: Mapping[str, Any]):
    """[B, 6] time_ids from the latent json fields of a batch ([w, h] sizes, [top, left] crop, as encode
    records them), in diffusers' (h, w) order."""
    missing = [name for name in SIZE_FIELDS if name not in batch]
    if missing:
        raise LaionkitError(f"SDXL latents need {', '.join(SIZE_FIELDS)} in every sample's json (encode writes "
                            f"them); these lack {', '.join(missing)}: re-encode them")
    return time_ids(batch["original_size"].flip(-1), batch["crop_top_left"], batch["target_size"].flip(-1))


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """UNet keyword arguments for a micro-batch: text states, pooled embeds and time_ids (given, or made
    from the batch's size fields)."""
    ids = batch["time_ids"] if "time_ids" in batch else batch_time_ids(batch)
    return {
        "encoder_hidden_states": batch["states"],
        "added_cond_kwargs": {"text_embeds": batch["pooled"], "time_ids": ids.to(batch["pooled"].device)},
    }


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init StableDiffusionXLPipeline folder in the real diffusers layout.

    vae/ (4 latent channels, 8x, SDXL's scaling factor and force_upcast), text_encoder/ (CLIPTextModel),
    text_encoder_2/ (CLIPTextModelWithProjection), tokenizer/ and tokenizer_2/ (the real CLIP BPE; the
    second pads with "!" as SDXL's does), unet/ (text_time additional conditioning), scheduler/ (SDXL's
    EulerDiscreteScheduler). Everything loads with the from_pretrained calls users make for SDXL base.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW, clip_tokenizer

    output = Path(output)
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=(8, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8, latent_channels=4,
        sample_size=64, scaling_factor=0.13025, force_upcast=True,
    )

    def clip_config(hidden: int, act: str) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=CLIP_WINDOW, hidden_act=act, projection_dim=hidden,
            bos_token_id=49406, eos_token_id=49407, pad_token_id=1,
        )

    text_encoder = CLIPTextModel(clip_config(TINY_HIDDEN[0], "quick_gelu"))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(TINY_HIDDEN[1], "gelu"))
    unet = UNet2DConditionModel.from_config(TINY_UNET_CONFIG)
    scheduler = EulerDiscreteScheduler.from_config(SCHEDULER_CONFIG)
    tokenizer = clip_tokenizer(output / "tokenizer")
    tokenizer_2 = clip_tokenizer(output / "tokenizer_2")
    tokenizer_2.pad_token = "!"
    pipeline = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="sdxl",
    pipeline_class="StableDiffusionXLPipeline",
    denoiser_class="UNet2DConditionModel",
    denoiser_subfolder="unet",
    text_encoders=(("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")),
    stored=("states", "pooled"),
    encode_text=encode_text,
    conditioning=conditioning,
    objective=Objective(kind="ddpm", prediction="epsilon"),
    block_classes=("ResnetBlock2D", "BasicTransformerBlock"),
    regional_compile=True,  # --compile per block: the whole 2.6B UNet took > 320 s to compile (BENCHMARKS)
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"sdxl": UNET_CONFIG, "tiny": TINY_UNET_CONFIG},
    text_layer="penultimate",
    vae_upcast=True,
    pipeline_cut="laionkit.families.unet_stages",
))
