"""PixArt-Σ: a DiT with cross-attention to masked T5 states, DDPM noise prediction with a learned variance.

Text conditioning, as ``PixArtSigmaPipeline.encode_prompt`` builds it (``clean_caption=False``: the
caption lower-cased and stripped): T5-XXL's last hidden states over 300 tokens *with* the tokenizer's
attention mask, and the same mask given to the transformer as ``encoder_attention_mask``. Because the
transformer ignores masked positions, the padding after a caption's last token carries nothing: encode
stores the states trimmed to each caption's length (``FamilySpec.text_mask``) and train pads them back
per micro-batch, which is lossless and ~10x smaller for LAION's short captions.

Objective: DDPM epsilon prediction on PixArt's linear beta schedule (0.0001 to 0.02 over 1000 steps,
the betas of the pipeline's scheduler). The transformer predicts the noise and, in its other half of
output channels (out_channels = 2 x in_channels), the variance (IDDPM's learned sigma). Like diffusers'
and SimpleTuner's PixArt fine-tuning scripts, laionkit trains the epsilon half alone with MSE
(``model_pred.chunk(2, dim=1)[0]``) and no variational-bound term: the variance half gets no gradient
and keeps its pretrained (or initial) values, which the pipeline's samplers (DPM-Solver, DDIM) never read.
The VAE is SDXL's 4-channel one (scaling 0.13025, fp32 in fp16 runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"pixart-sigma-xl": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"}

# PixArt-alpha/PixArt-Sigma-XL-2-1024-MS transformer/config.json (0.61B parameters), as diffusers'
# scripts/convert_pixart_sigma_to_diffusers.py builds it for 1024 px.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": 128, "patch_size": 2, "in_channels": 4, "out_channels": 8, "num_layers": 28,
    "num_attention_heads": 16, "attention_head_dim": 72, "cross_attention_dim": 1152, "caption_channels": 4096,
    "attention_bias": True, "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
    "norm_type": "ada_norm_single", "norm_elementwise_affine": False, "norm_eps": 1e-6,
    "interpolation_scale": 2, "use_additional_conditions": False,
}
T5_MAX_LENGTH = 300  # PixArtSigmaPipeline's max_sequence_length
TINY_T5 = 32
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 8, "num_layers": 2,
    "num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16, "caption_channels": TINY_T5,
    "norm_type": "ada_norm_single", "num_embeds_ada_norm": 1000, "use_additional_conditions": False,
}
# The pipeline's DPMSolverMultistepScheduler (diffusers' defaults, which the conversion script saves):
# its betas are the DDPM training schedule (Objective below); validation grids sample with DDIM on them.
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
    "prediction_type": "epsilon", "algorithm_type": "dpmsolver++", "solver_order": 2,
}


def _caption(text: str) -> str:
    """PixArtSigmaPipeline._text_preprocessing with clean_caption=False."""
    return text.lower().strip()


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = T5_MAX_LENGTH) -> list:
    """T5 token ids [B, T] padded as the pipeline pads them, -1 where the attention mask is 0: one int
    tensor carries ids and mask (encode --text online stores it; a literal ``<pad>`` in a caption keeps
    id 0 and stays unmasked, as in the pipeline)."""
    (tokenizer,) = tokenizers
    found = tokenizer([_caption(text) for text in captions], padding="max_length", max_length=max_sequence_length,
                      truncation=True, add_special_tokens=True, return_tensors="pt")
    return [found.input_ids.masked_fill(found.attention_mask == 0, -1)]


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, T, D] and ``mask`` [B, T] (bool) from ``tokenize``'s ids: T5 runs with the mask."""
    import torch

    (encoder,) = text_encoders
    (found,) = ids
    found = found.to(encoder.device)
    mask = found >= 0
    with torch.no_grad():
        states = encoder(found.clamp(min=0), attention_mask=mask.long())[0]
    return {"states": states, "mask": mask}



def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """PixArtTransformer2DModel keyword arguments besides the latents and timestep: the states, their mask
    (padded positions masked out, per micro-batch) and no micro-conditions, as the pipeline passes them."""
    return {"encoder_hidden_states": batch["states"], "encoder_attention_mask": batch["mask"],
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def denoise(model, noisy, timestep, kwargs: Mapping[str, Any]):
    """The predicted noise: the epsilon half of a learned-variance output (the variance half dropped, as
    the pipeline and diffusers' fine-tuning scripts drop it), the whole output otherwise."""
    out = model(noisy, timestep=timestep, **kwargs, return_dict=False)[0]
    if out.shape[1] == 2 * noisy.shape[1]:
        out = out.chunk(2, dim=1)[0]
    return out


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch PixArt architecture fitted to the latents: channels (learned variance kept when the
    config has it), caption width, the base grid of the sin-cos positions (the largest latent side) and,
    where the config names one, PixArt's position interpolation for that size (sample_size / 64: 1 at
    512 px, 2 at 1024 px). Without micro-conditions, as PixArt-Σ (the pipeline passes none)."""
    learned = arch.get("out_channels", 8) == 2 * arch.get("in_channels", 4)
    arch.update(in_channels=latent_channels, out_channels=(2 if learned else 1) * latent_channels,
                caption_channels=text_dim, sample_size=latent_size)
    if arch.get("interpolation_scale") is not None:
        arch["interpolation_scale"] = latent_size / 64
    arch.setdefault("use_additional_conditions", False)
    return arch


def expects(config) -> tuple:
    """(latent channels, text width, pooled width) a built PixArtTransformer2DModel takes."""
    return config.in_channels, config.caption_channels, None


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init PixArtSigmaPipeline folder in the real diffusers layout.

    vae/ (4 channels, SDXL's scaling factor and force_upcast, as PixArt-Σ's), text_encoder/
    (T5EncoderModel) + tokenizer/ (a T5TokenizerFast trained on the shipped captions), transformer/
    (PixArtTransformer2DModel, learned variance), scheduler/ (PixArt-Σ's DPMSolverMultistepScheduler).
    """
    import torch
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    from laionkit.families.sd3 import tiny_t5, tiny_vae

    output = Path(output)
    torch.manual_seed(seed)
    text_encoder, tokenizer = tiny_t5(output / "tokenizer", TINY_T5, max_length=T5_MAX_LENGTH)
    pipeline = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(scaling_factor=0.13025, latent_channels=4),
        transformer=PixArtTransformer2DModel.from_config(TINY_TRANSFORMER_CONFIG),
        scheduler=DPMSolverMultistepScheduler.from_config(SCHEDULER_CONFIG),
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="pixart",
    pipeline_class="PixArtSigmaPipeline",
    denoiser_class="PixArtTransformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"),),
    stored=("states", "mask"),
    text_mask="mask",
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    conditioning=conditioning,
    objective=Objective(kind="ddpm", prediction="epsilon", beta_schedule="linear", beta_start=0.0001,
                        beta_end=0.02),
    block_classes=("BasicTransformerBlock",),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"pixart-sigma-xl": TRANSFORMER_CONFIG, "tiny": TINY_TRANSFORMER_CONFIG},
    vae_upcast=True,
    patch_size=2,
    max_sequence_length=T5_MAX_LENGTH,
    text_window=T5_MAX_LENGTH,  # not the tokenizer folder's model_max_length (512 for T5's own, or none)
    denoise=denoise,
    fit_config=fit_config,
    expects=expects,
))
