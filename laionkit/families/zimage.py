"""Z-Image: a single-stream DiT (S3-DiT) over Qwen3 text states and 2x2 patches of Flux's 16-channel latents,
trained with flow matching, whose transformer takes lists of per-sample tensors.

Text conditioning, as ``ZImagePipeline.encode_prompt`` builds it: each caption rendered with the tokenizer's
chat template (one user turn, ``add_generation_prompt=True``, ``enable_thinking=True``), tokenized to 512
tokens with padding, Qwen3 run with the attention mask and its *second to last* hidden states
(``hidden_states[-2]``) taken, and of those only the unmasked positions: the pipeline hands the transformer a
list of [T_i, 2560] tensors, one per caption, of different lengths. encode stores exactly those rows, trimmed
(``FamilySpec.text_mask``: the states packed to the front and the mask), and ``conditioning`` turns a
padded batch back into the list.

Objective and units (what ``ZImagePipeline.__call__`` and diffusers' train_dreambooth_lora_z_image.py do):
x_t = (1 - sigma) x0 + sigma noise as for SD3 / Flux, but the transformer's timestep input is
t = 1 - sigma (0 at pure noise, 1 at the clean image; it multiplies by its own ``t_scale`` 1000) and it
predicts x0 - noise, the *negated* velocity: the pipeline calls it with ``(1000 - timestep) / 1000`` and
steps the FlowMatchEulerDiscreteScheduler with ``-output``. ``denoise`` does both conversions, so train, the
validation loss and the FLOP count see a velocity predictor of sigma like every flow family
(``timestep_scale`` 1: the timestep handed to ``denoise`` is sigma). Sigma: laionkit's logit-normal draw and
the static shift of the base model's scheduler (Tongyi-MAI/Z-Image: 6; Turbo's is 3: ``--shift 3``);
diffusers' LoRA script draws uniform u through the same shifted table (``--sigma-sampling uniform``).

Guidance: ZImagePipeline's classifier-free guidance is ``pos + s (pos - neg)``, applied whenever
``guidance_scale > 0``: its s is the usual scale less 1 (``cfg_offset``), so laionkit's ``--guidance-scale 1``
draws without guidance as it does for every family. The VAE is Flux's (16 channels, shift 0.1159, scale
0.3611) and the pipeline's images are multiples of 16 px (the VAE's 8 x the 2x2 patches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"z-image": "Tongyi-MAI/Z-Image", "z-image-turbo": "Tongyi-MAI/Z-Image-Turbo"}

# Tongyi-MAI/Z-Image(-Turbo) transformer/config.json (6.15B parameters; both variants share the architecture).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
    "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True,
    "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}
MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.encode_prompt's max_sequence_length
TEXT_LAYER = -2  # the hidden states the pipeline takes: the second to last (Qwen3-4B: 35 of 36 layers)
TINY_QWEN = 32
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config):
# head dim 16 = sum(axes_dims), rotary positions as the real ones (caption positions up to 512 + 32 + 1).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 32, "n_layers": 2,
    "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "norm_eps": 1e-5, "qk_norm": True,
    "cap_feat_dim": TINY_QWEN, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [4, 6, 6],
    "axes_lens": [1536, 512, 512],
}
# Tongyi-MAI/Z-Image scheduler/scheduler_config.json (the base model; Z-Image-Turbo's has shift 3.0):
# validation sampling, and the shift training draws sigma with.
SAMPLER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 6.0}
# The caption positions the transformer adds its own rotary positions after (patchify_and_embed: a caption
# padded to a multiple of 32, the image starting one after it): axes_lens[0] must cover them.
CAPTION_POSITIONS = MAX_SEQUENCE_LENGTH + 32 + 1


def prompts(tokenizer, captions: Sequence[str]) -> list[str]:
    """The captions as ZImagePipeline._encode_prompt renders them: one user turn in the chat template."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=True) for text in captions]


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list:
    """Qwen token ids [B, T] of the rendered prompts, padded as the pipeline pads them, -1 where its attention
    mask is 0 (one int tensor carries ids and mask, as PixArt's: encode --text online stores it)."""
    (tokenizer,) = tokenizers
    found = tokenizer(prompts(tokenizer, captions), padding="max_length", max_length=max_sequence_length,
                      truncation=True, return_tensors="pt")
    return [found.input_ids.masked_fill(found.attention_mask == 0, -1)]


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, T, D] and ``mask`` [B, T] (bool) from ``tokenize``'s ids: Qwen3 with the mask, its
    ``hidden_states[-2]``; each row's unmasked states packed to the front (the pipeline's
    ``prompt_embeds[i][prompt_masks[i]]``, whatever side the tokenizer pads), zeros and mask 0 after them."""
    import torch

    (encoder,) = text_encoders
    (found,) = ids
    found = found.to(encoder.device)
    mask = found >= 0
    with torch.no_grad():
        states = encoder(input_ids=found.clamp(min=0), attention_mask=mask, output_hidden_states=True
                         ).hidden_states[TEXT_LAYER]
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # unmasked first, in order
    states = states.gather(1, order[..., None].expand_as(states))
    mask = mask.gather(1, order)
    return {"states": states * mask[..., None].to(states.dtype), "mask": mask}


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """ZImageTransformer2DModel's caption features: the list of each sample's unmasked states (the stored
    rows are packed to the front), as the pipeline passes ``prompt_embeds``. A sample with no unmasked
    position (the all-zero mask of a FLOP count) keeps one row."""
    states, mask = batch["states"], batch["mask"]
    lengths = mask.bool().sum(dim=1).clamp(min=1).tolist()
    return {"cap_feats": [row[:length] for row, length in zip(states, lengths, strict=True)]}


def denoise(model, noisy, timestep, kwargs: Mapping[str, Any]):
    """The velocity noise - x0 for [B, C, h, w] latents at sigma = ``timestep``: the transformer on the list of
    [C, 1, h, w] frames at t = 1 - sigma, its x0 - noise output stacked and negated, as ZImagePipeline steps."""
    import torch

    frames = list(noisy.unsqueeze(2).unbind(dim=0))
    out = model(frames, 1 - timestep, kwargs["cap_feats"], return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


def pipeline_text(texts: Mapping[str, Any]) -> dict[str, Any]:
    """ZImagePipeline's ``prompt_embeds`` for stored text tensors: the list of each prompt's unmasked states."""
    return {"prompt_embeds": conditioning(texts)["cap_feats"]}


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch Z-Image architecture fitted to the latents: channels, caption width, and rotary tables
    long enough for the caption positions and the largest latent side (in 2x2 patches)."""
    patches = -(-latent_size // arch.get("all_patch_size", [2])[0])
    lens = list(arch.get("axes_lens", [1536, 512, 512]))
    lens = [max(lens[0], CAPTION_POSITIONS + 1), max(lens[1], patches), max(lens[2], patches)]
    arch.update(in_channels=latent_channels, cap_feat_dim=text_dim, axes_lens=lens)
    return arch


def expects(config) -> tuple:
    """(latent channels, text width, pooled width) a built ZImageTransformer2DModel takes."""
    return config.in_channels, config.cap_feat_dim, None


def tiny_qwen3(output: Path, hidden: int = TINY_QWEN):
    """A tiny Qwen3 text model (Qwen3Model, as ZImagePipeline loads it) with a Qwen2Tokenizer trained on the
    shipped captions (Qwen3's chat template and model_max_length; encode's window is ``text_window``)."""
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

    from laionkit.families.tokenizers import write_qwen

    tokenizer = Qwen2Tokenizer.from_pretrained(write_qwen(output))
    encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    ))
    return encoder, tokenizer


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init ZImagePipeline folder in the real diffusers layout.

    vae/ (16 channels, Flux's scaling and shift factors, as Z-Image's), text_encoder/ (Qwen3Model) +
    tokenizer/ (a Qwen2Tokenizer trained on the shipped captions, with the chat template), transformer/
    (ZImageTransformer2DModel), scheduler/ (FlowMatchEulerDiscreteScheduler, Z-Image's static shift 6).
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from laionkit.families.sd3 import tiny_vae

    output = Path(output)
    torch.manual_seed(seed)
    text_encoder, tokenizer = tiny_qwen3(output / "tokenizer")
    pipeline = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SAMPLER_CONFIG),
        vae=tiny_vae(scaling_factor=0.3611, shift_factor=0.1159), text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=ZImageTransformer2DModel.from_config(TINY_TRANSFORMER_CONFIG),
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="z-image",
    pipeline_class="ZImagePipeline",
    denoiser_class="ZImageTransformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"),),
    stored=("states", "mask"),
    text_mask="mask",
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    conditioning=conditioning,
    text_layer="penultimate",
    objective=Objective(kind="flow", prediction="velocity", sigma_sampling="logit_normal",
                        shift=SAMPLER_CONFIG["shift"], timestep_scale=1.0),
    block_classes=("ZImageTransformerBlock",),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"z-image": TRANSFORMER_CONFIG, "tiny": TINY_TRANSFORMER_CONFIG},
    vae_shift=True,
    denoise=denoise,
    fit_config=fit_config,
    expects=expects,
    sampler=SAMPLER_CONFIG,
    patch_size=2,
    pipeline_text=pipeline_text,
    text_window=MAX_SEQUENCE_LENGTH,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
    # within the caption axis of the real transformer's rotary table (axes_lens[0]: 1,536 positions), which holds
    # the caption padded to a multiple of 32 and the image's first position after it
    max_sequence_limit=1024,
    cfg_offset=1.0,
))
