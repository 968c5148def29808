"""Sana: a linear-attention DiT on a deterministic 32x DC-AE, conditioned on masked Gemma-2 states behind
an instruction prefix, trained with flow matching.

Text conditioning, as ``SanaPipeline.encode_prompt`` builds it (``clean_caption=False``: the caption
lower-cased and stripped): the pipeline's complex human instruction (CHI, ``COMPLEX_HUMAN_INSTRUCTION``)
joined by newlines and followed directly by the caption, tokenized with Gemma's tokenizer (``<bos>`` first,
right padding) to ``n_chi + 300 - 2`` tokens, where ``n_chi`` is the instruction's own token count; Gemma-2's
last hidden states with the attention mask; then ``select_index = [0] + range(-299, 0)``: the ``<bos>``
position and the last 299 positions (the instruction's last token(s), the caption, the padding), 300 states
and their mask. The transformer takes the mask as ``encoder_attention_mask``, so, as for PixArt
(``FamilySpec.text_mask``), encode stores each caption's states trimmed after its last unmasked position
(lossless; the selected mask is ones then zeros) and train pads them back per micro-batch.

The unconditional text (``FamilySpec.unconditional``: the empty-caption files that caption dropout and
validation's negative use) is the pipeline's negative prompt ``""``: no instruction and no ``select_index``,
300 tokens (``<bos>`` and padding); Sana's own trainer drops captions to the same null embedding (Gemma on
``""`` padded to 300 tokens). A sample whose caption is empty is encoded as the pipeline encodes the prompt
``""``: behind the instruction, like every caption. ``unconditional`` pads its ids to the instruction width
with masked positions (-1, as PixArt's ids), so one int array carries ids and mask and one width serves both
(``--text online``), and ``encode_tokens`` tells the two kinds of row apart by their unmasked count: the
unconditional one's is 1 (``<bos>``), an instructed caption's at least n_chi. Gemma-2 is causal with the
padding masked, so the extra masked positions change none of the first 300.

VAE: AutoencoderDC is deterministic, ``encode(x).latent`` with no posterior: encode stores the latent itself
(``vae.deterministic`` in the manifest, docs/FORMATS.md) and train uses it as it is; the pipeline decodes
``latents / scaling_factor`` (no shift factor).

Objective: flow matching as Sana trains it (its configs' ``flow_shift: 3.0``, ``weighting_scheme:
logit_normal``, ``logit_mean 0``, ``logit_std 1``, the converted pipelines' ``flow_shift`` 3.0 below 4K):
sigma = shift(sigmoid(N(0, 1)), 3), x_t = (1 - sigma) x0 + sigma noise, the plain MSE to noise - x0 (no loss
weighting, as diffusers' train_dreambooth_lora_sana.py's default). The transformer's timestep input is
sigma x 1000 x its config's ``timestep_scale`` (1 for Sana; SanaPipeline multiplies the scheduler's
timesteps, sigma x 1000, by it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"sana-1600m": "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
           "sana-600m": "Efficient-Large-Model/Sana_600M_1024px_diffusers"}

# transformer/config.json of the 1024 px checkpoints, as diffusers' scripts/convert_sana_to_diffusers.py
# builds them (SanaMS_1600M_P1_D20 and SanaMS_600M_P1_D28 at --image_size 1024: sample_size 1024 // 32, no
# positional interpolation, i.e. no positional embedding).
_COMMON: dict[str, Any] = {
    "in_channels": 32, "out_channels": 32, "caption_channels": 2304, "mlp_ratio": 2.5, "attention_bias": False,
    "sample_size": 32, "patch_size": 1, "norm_elementwise_affine": False, "norm_eps": 1e-6,
    "interpolation_scale": None,
}
TRANSFORMER_CONFIG_1600M: dict[str, Any] = {
    **_COMMON, "num_attention_heads": 70, "attention_head_dim": 32, "num_cross_attention_heads": 20,
    "cross_attention_head_dim": 112, "cross_attention_dim": 2240, "num_layers": 20,
}
TRANSFORMER_CONFIG_600M: dict[str, Any] = {
    **_COMMON, "num_attention_heads": 36, "attention_head_dim": 32, "num_cross_attention_heads": 16,
    "cross_attention_head_dim": 72, "cross_attention_dim": 1152, "num_layers": 28,
}
MAX_SEQUENCE_LENGTH = 300  # SanaPipeline's max_sequence_length
# SanaPipeline.__call__'s default complex_human_instruction (diffusers 0.42), joined with "\n" before the caption.
COMPLEX_HUMAN_INSTRUCTION = (
    "Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions suitable for "
    "image generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without "
    "overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
    "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street "
    "lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass "
    "skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
)
FLOW_SHIFT = 3.0  # Sana's training and sampling shift below 4K px (convert_sana_to_diffusers.py: 6.0 at 4K)
TINY_GEMMA = 32
TINY_LATENT = 32  # DC-AE's 32 latent channels
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_channels": TINY_LATENT, "out_channels": TINY_LATENT, "num_attention_heads": 2, "attention_head_dim": 8,
    "num_layers": 2, "num_cross_attention_heads": 2, "cross_attention_head_dim": 8, "cross_attention_dim": 16,
    "caption_channels": TINY_GEMMA, "mlp_ratio": 2.5, "sample_size": 8, "patch_size": 1,
    "norm_elementwise_affine": False, "norm_eps": 1e-6, "interpolation_scale": None,
}
# Sana's pipelines ship a flow DPM-Solver (convert_sana_to_diffusers.py's default scheduler_type).
SCHEDULER_CONFIG: dict[str, Any] = {"flow_shift": FLOW_SHIFT, "use_flow_sigmas": True,
                                    "prediction_type": "flow_prediction"}
# Validation grids (and a from-scratch export without a base) sample with the Euler flow sampler at Sana's shift.
SAMPLER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": FLOW_SHIFT}


def _caption(text: str) -> str:
    """SanaPipeline._text_preprocessing with clean_caption=False."""
    return text.lower().strip()


def instruction_length(tokenizer) -> int:
    """n_chi: the token count of the joined instruction, ``<bos>`` included (the pipeline's num_chi_prompt_tokens)."""
    return len(tokenizer.encode("\n".join(COMPLEX_HUMAN_INSTRUCTION), verbose=False))


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list:
    """Gemma token ids [B, n_chi + max_sequence_length - 2] of the instructed captions, as
    ``_get_gemma_prompt_embeds`` tokenizes them, -1 where the attention mask is 0."""
    (tokenizer,) = tokenizers
    tokenizer.padding_side = "right"  # as the pipeline sets it
    chi = "\n".join(COMPLEX_HUMAN_INSTRUCTION)
    found = tokenizer([chi + _caption(text) for text in captions], padding="max_length",
                      max_length=instruction_length(tokenizer) + max_sequence_length - 2, truncation=True,
                      add_special_tokens=True, return_tensors="pt")
    return [found.input_ids.masked_fill(found.attention_mask == 0, -1)]


def unconditional(tokenizers: Sequence, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list:
    """The ids [1, n_chi + max_sequence_length - 2] of the pipeline's negative prompt "": no instruction,
    ``max_sequence_length`` tokens as it pads them, then -1 (masked) to the instructed captions' width."""
    import torch

    (tokenizer,) = tokenizers
    tokenizer.padding_side = "right"
    found = tokenizer([""], padding="max_length", max_length=max_sequence_length, truncation=True,
                      add_special_tokens=True, return_tensors="pt")
    ids = torch.full((1, instruction_length(tokenizer) + max_sequence_length - 2), -1, dtype=torch.long)
    ids[:, :max_sequence_length] = found.input_ids.masked_fill(found.attention_mask == 0, -1)
    return [ids]


def encode_tokens(text_encoders: Sequence, ids: Sequence, max_sequence_length: int = MAX_SEQUENCE_LENGTH
                  ) -> dict[str, Any]:
    """``states`` [B, 300, D] and ``mask`` [B, 300] (bool) from ``tokenize``'s (or ``unconditional``'s) ids:
    Gemma-2 runs with the mask, then each instructed row keeps the pipeline's select_index positions, the
    unconditional row its first 300 (the negative prompt's)."""
    import torch

    (encoder,) = text_encoders
    (found,) = ids
    found = found.to(encoder.device)
    mask = found >= 0
    with torch.no_grad():
        states = encoder(found.clamp(min=0), attention_mask=mask.long())[0]
    width = found.shape[1]
    # made on the device (a tensor from a list would be a blocking copy, waiting for the step's queued work)
    select = torch.arange(width - max_sequence_length, width, device=found.device)
    select[0] = 0
    first = torch.arange(max_sequence_length, device=found.device)
    index = torch.where((mask.sum(dim=1) <= 1)[:, None], first, select)  # [B, 300]
    states = torch.gather(states, 1, index[..., None].expand(-1, -1, states.shape[-1]))
    return {"states": states, "mask": torch.gather(mask, 1, index)}


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """SanaTransformer2DModel keyword arguments besides the latents and timestep: the states and their mask
    (padded positions masked out, per micro-batch), as the pipeline passes them."""
    return {"encoder_hidden_states": batch["states"], "encoder_attention_mask": batch["mask"]}


def _config(model):
    """A denoiser's diffusers config through the wrappers train may put around it (DDP's .module)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)


def denoise(model, noisy, timestep, kwargs: Mapping[str, Any]):
    """The velocity: the transformer on [B, C, h, w], its timestep input times its config's timestep_scale,
    as SanaPipeline passes it (sigma x 1000 x timestep_scale)."""
    config = _config(model)
    scale = float(config.get("timestep_scale", 1.0)) if config is not None else 1.0
    return model(noisy, timestep=timestep * scale if scale != 1.0 else timestep, **kwargs, return_dict=False)[0]


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch Sana architecture fitted to the latents: channels, caption width and sample size (the
    largest latent side; it matters only with a positional embedding, which the 1024 px configs have not)."""
    arch.update(in_channels=latent_channels, out_channels=latent_channels, caption_channels=text_dim,
                sample_size=latent_size)
    return arch


def expects(config) -> tuple:
    """(latent channels, text width, pooled width) a built SanaTransformer2DModel takes."""
    return config.in_channels, config.caption_channels, None


def tiny_gemma(output: Path, hidden: int = TINY_GEMMA):
    """A tiny Gemma2Model (the decoder Sana's text_encoder/ is) and the GemmaTokenizerFast of write_gemma."""
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizerFast

    from laionkit.families.tokenizers import write_gemma

    tokenizer = GemmaTokenizerFast.from_pretrained(write_gemma(output, max_length=MAX_SEQUENCE_LENGTH))
    encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=2048,
        sliding_window=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ))
    return encoder, tokenizer


def tiny_dc_ae(scaling_factor: float = 0.41407):
    """A tiny AutoencoderDC: DC-AE's 32 latent channels, ResBlock then EfficientViT stages, but 4 stages
    (8x, so 64 px test images give 8 x 8 latents) where Sana's has 6 (32x). Sana's scaling factor."""
    from diffusers import AutoencoderDC

    return AutoencoderDC(
        in_channels=3, latent_channels=TINY_LATENT, attention_head_dim=8,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(8, 16, 32, 32),
        encoder_layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,), (5,)), decoder_qkv_multiscales=((), (), (5,), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
        decoder_act_fns="silu", scaling_factor=scaling_factor,
    )


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init SanaPipeline folder in the real diffusers layout.

    vae/ (AutoencoderDC, 32 channels, 8x), text_encoder/ (Gemma2Model) + tokenizer/ (a GemmaTokenizerFast
    trained on the shipped captions), transformer/ (SanaTransformer2DModel), scheduler/ (Sana's flow
    DPMSolverMultistepScheduler, shift 3).
    """
    import torch
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    output = Path(output)
    torch.manual_seed(seed)
    text_encoder, tokenizer = tiny_gemma(output / "tokenizer")
    pipeline = SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_dc_ae(),
        transformer=SanaTransformer2DModel.from_config(TINY_TRANSFORMER_CONFIG),
        scheduler=DPMSolverMultistepScheduler.from_config(SCHEDULER_CONFIG),
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="sana",
    text_window=MAX_SEQUENCE_LENGTH,  # Gemma's tokenizer_config.json names no window (model_max_length 1e30)
    max_sequence_length=MAX_SEQUENCE_LENGTH,
    pipeline_class="SanaPipeline",
    denoiser_class="SanaTransformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"),),
    stored=("states", "mask"),
    text_mask="mask",
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    unconditional=unconditional,
    conditioning=conditioning,
    objective=Objective(kind="flow", prediction="velocity", sigma_sampling="logit_normal", shift=FLOW_SHIFT,
                        weighting="none"),
    block_classes=("SanaTransformerBlock",),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"sana-1600m": TRANSFORMER_CONFIG_1600M, "sana-600m": TRANSFORMER_CONFIG_600M,
             "tiny": TINY_TRANSFORMER_CONFIG},
    denoise=denoise,
    fit_config=fit_config,
    expects=expects,
    sampler=SAMPLER_CONFIG,
))
