"""FLUX.2 [klein]: Flux2Transformer2DModel (double- then single-stream blocks) on FLUX.2's 32-channel latents, 2x2
patchified to 128 channels and normalised with the VAE's batch-norm statistics, conditioned on Qwen3 states of
three hidden layers side by side, trained with flow matching.

Text conditioning, as ``Flux2KleinPipeline.encode_prompt`` builds it: each caption rendered with the tokenizer's
chat template (one user turn, ``add_generation_prompt=True``, ``enable_thinking=False``), tokenized to 512 tokens
with padding, Qwen3 run with the attention mask and its hidden states 9, 18 and 27 concatenated per token
([512, 3 x 2560] for Qwen3-4B). The transformer gets no text mask: it attends to the padding's states too, so
encode stores all 512 rows (nothing to trim), and ``txt_ids`` are (0, 0, 0, position).

Latents, as the pipeline's ``_encode_vae_image`` / its decode make them: AutoencoderKLFlux2's 32 channels are
patchified 2x2 to [128, h/2, w/2] (channel c*4 + 2 dy + dx) and normalised per patchified channel with the
VAE's ``bn`` running statistics, (z - mean) / sqrt(var + eps); the transformer takes the 128 channels flattened
to tokens (``_pack_latents``: one token per 2x2 patch, no further packing) with ``img_ids`` (0, row, column, 0).
laionkit keeps the latent [32, h, w] (buckets, noise and the loss as for every family): normalising it with the
128 statistics laid out over the 2x2 pattern (``LatentSet.normalize``; ``latent_stats`` with ``vae_stats``) is
the pipeline's patchify-then-normalise, and ``denoise`` patchifies, packs and undoes both. The pipeline's
output_type="latent" is already un-normalised and unpatchified (``pipeline_denormalizes``).

Objective: flow matching, velocity noise - x0, sigma as the transformer's timestep (the pipeline passes t / 1000),
logit-normal sigmas with Flux's resolution-dependent shift (the pipeline samples with its empirical mu of the
image sequence length and step count). klein has no guidance embedding: the pipeline's guidance_scale is
classifier-free guidance on the empty caption's states (skipped for the step-distilled checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.common.errors import LaionkitError
from laionkit.families.spec import FamilySpec, Objective, register_family

# The undistilled base is what one trains (the distilled FLUX.2-klein-4B samples in 4 steps, without guidance).
PRESETS = {"flux2-klein-4b": "black-forest-labs/FLUX.2-klein-base-4B",
           "flux2-klein-9b": "black-forest-labs/FLUX.2-klein-base-9B"}

# black-forest-labs/FLUX.2-klein-base-4B transformer/config.json (3.9B parameters; text: Qwen3-4B, 3 x 2560).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 5, "num_single_layers": 20,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": False,
}
# black-forest-labs/FLUX.2-klein-base-9B (text: Qwen3-8B, 3 x 4096).
TRANSFORMER_CONFIG_9B: dict[str, Any] = {**TRANSFORMER_CONFIG, "num_layers": 8, "num_single_layers": 24,
                                         "num_attention_heads": 32, "joint_attention_dim": 12288}
MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline.encode_prompt's max_sequence_length
TEXT_LAYERS = (9, 18, 27)  # its text_encoder_out_layers: hidden states stacked per token
TINY_QWEN = 16
TINY_QWEN_LAYERS = 28  # hidden_states[27] is an inner layer's output, as in Qwen3-4B's 36 layers
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 1, "num_single_layers": 2,
    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": len(TEXT_LAYERS) * TINY_QWEN,
    "timestep_guidance_channels": 32, "mlp_ratio": 3.0, "axes_dims_rope": [4, 4, 4, 4], "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": False,
}
# black-forest-labs/FLUX.2-klein-base-4B scheduler/scheduler_config.json: validation sampling (the pipeline
# passes its own mu).
SAMPLER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "exponential",
}


def require_klein() -> None:
    """Flux2KleinPipeline came with diffusers 0.37 (laionkit declares 0.42.1; an environment that pins an older one,
    installed with --no-deps, gets a one-line error where encode, train or `models tiny` first needs the family,
    not an AttributeError later)."""
    import diffusers

    if not hasattr(diffusers, "Flux2KleinPipeline"):
        raise LaionkitError(f"family flux2 (FLUX.2 [klein]) needs diffusers >= 0.37 for Flux2KleinPipeline; "
                            f"diffusers {diffusers.__version__} is installed: pip install -U 'diffusers>=0.37'")


def prompts(tokenizer, captions: Sequence[str]) -> list[str]:
    """The captions as Flux2KleinPipeline._get_qwen3_prompt_embeds renders them: one user turn, no thinking."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=False) for text in captions]


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list:
    """Qwen token ids [B, 512] of the rendered prompts, padded as the pipeline pads them (``masked_ids``: one int
    tensor carries ids and mask: encode --text online stores it)."""
    (tokenizer,) = tokenizers
    found = tokenizer(prompts(tokenizer, captions), padding="max_length", max_length=max_sequence_length,
                      truncation=True, return_tensors="pt")
    return [masked_ids(found.input_ids, found.attention_mask)]


def masked_ids(ids, mask):
    """Token ids with their attention mask in one tensor: ``-1 - id`` where the mask is 0. FLUX.2's transformer
    attends to all 512 rows, so the padding rows' states count, and they depend on the padding id the text
    encoder read there (a Qwen3 pad is 151,643, Mistral's 11): ``unmasked_ids`` gives both back exactly."""
    import torch

    return torch.where(mask.bool(), ids, -1 - ids)


def unmasked_ids(found):
    """(ids, mask) of ``masked_ids``' tensor. Ids stored with -1 for every masked position (laionkit before
    2026-12-04) read as id 0 there, as they did."""
    import torch

    mask = found >= 0
    return torch.where(mask, found, -1 - found), mask


def hidden_states_side_by_side(encoder, ids, layers: Sequence[int]) -> dict[str, Any]:
    """``states`` [B, 512, len(layers) x D]: ``encoder`` run on ``masked_ids``' tensor with its mask, its hidden
    states ``layers`` side by side per token (FLUX.2 pipelines' stack over layers, permuted and reshaped), the
    padding rows included: the transformer sees them."""
    import torch

    found, mask = unmasked_ids(ids.to(encoder.device))
    with torch.no_grad():
        hidden = encoder(input_ids=found, attention_mask=mask.long(), output_hidden_states=True,
                         use_cache=False).hidden_states
    return {"states": torch.cat([hidden[layer] for layer in layers], dim=-1)}


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, 512, 3 D]: Qwen3's hidden states 9, 18 and 27 side by side per token."""
    (encoder,) = text_encoders
    (found,) = ids
    return hidden_states_side_by_side(encoder, found, TEXT_LAYERS)


def text_ids(states):
    """[B, L, 4] positions (0, 0, 0, token) of the text, Flux2 pipelines' _prepare_text_ids."""
    import torch

    b, length = states.shape[:2]
    ids = torch.zeros(length, 4, device=states.device, dtype=states.dtype)
    ids[:, 3] = torch.arange(length, device=states.device)
    return ids.expand(b, -1, -1)


def image_ids(batch: int, height: int, width: int, device=None, dtype=None):
    """[B, h/2 * w/2, 4] positions (0, row, column, 0) of the 2x2 patches, _prepare_latent_ids' row-major order."""
    import torch

    ids = torch.zeros(height // 2, width // 2, 4, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
    return ids.reshape(1, -1, 4).expand(batch, -1, -1)


def patchify(latents):
    """[B, C, h, w] -> [B, 4C, h/2, w/2], channel c*4 + 2 dy + dx: Flux2 pipelines' _patchify_latents, the layout
    the pipeline takes ``latents`` in."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return latents.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents, height: int | None = None, width: int | None = None):
    """The inverse of patchify (``height`` / ``width``: the unpatchified sides, implied by the shape)."""
    b, c, h, w = latents.shape
    latents = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(b, c // 4, h * 2, w * 2)


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Flux2Transformer2DModel keyword arguments besides the packed hidden_states, timestep (sigma) and img_ids:
    the states and their ``txt_ids``; guidance only where the transformer embeds it (FLUX.2-dev)."""
    states = batch["states"]
    return {"encoder_hidden_states": states, "txt_ids": text_ids(states), "guidance": batch.get("guidance")}


def denoise(model, noisy, timestep, kwargs: Mapping[str, Any]):
    """The velocity for [B, C, h, w] latents at sigma = ``timestep``: patchified to [B, 4C, h/2, w/2], flattened
    to one token per patch (_pack_latents) with its ``img_ids``, the output folded back and unpatchified."""
    b, _, height, width = noisy.shape
    patches = patchify(noisy)
    tokens = patches.flatten(2).transpose(1, 2)
    ids = image_ids(b, height, width, noisy.device, noisy.dtype)
    out = model(tokens, timestep=timestep, img_ids=ids, **kwargs, return_dict=False)[0]
    return unpack_tokens(out, height, width)


def unpack_tokens(tokens, height: int, width: int):
    """[B, h/2 * w/2, 4C] tokens, one per 2x2 patch in row-major order (_pack_latents'), as [B, C, h, w]: the
    transformer's output, and FLUX.2-dev's pipeline's output_type="latent"."""
    b, _, channels = tokens.shape
    return unpatchify(tokens.transpose(1, 2).reshape(b, channels, height // 2, width // 2))


def vae_stats(vae) -> tuple[list[float], list[float]]:
    """klein's ``vae_stats`` (diffusers with Flux2KleinPipeline): ``batch_norm_stats``."""
    require_klein()
    return batch_norm_stats(vae)


def batch_norm_stats(vae) -> tuple[list[float], list[float]]:
    """The pipeline's latent statistics: AutoencoderKLFlux2's batch-norm running mean and sqrt(var + eps), one
    per patchified channel (4 x the latent channels)."""
    import torch

    mean = vae.bn.running_mean.float()
    std = torch.sqrt(vae.bn.running_var.float() + vae.config.batch_norm_eps)
    return [float(v) for v in mean], [float(v) for v in std]


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """klein's ``fit_config`` (diffusers with Flux2KleinPipeline): ``fit_transformer``."""
    require_klein()
    return fit_transformer(arch, latent_channels, latent_size, text_dim, pooled_dim)


def fit_transformer(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
                    pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch FLUX.2 architecture fitted to the latents: 2x2-patchified channels, the text width
    (positions are rotary: no size to fit)."""
    arch.update(in_channels=4 * latent_channels, out_channels=None, joint_attention_dim=text_dim)
    return arch


def expects(config) -> tuple:
    """klein's ``expects`` (diffusers with Flux2KleinPipeline): ``transformer_inputs``."""
    require_klein()
    return transformer_inputs(config)


def transformer_inputs(config) -> tuple:
    """(latent channels, text width, pooled width) a built Flux2Transformer2DModel takes."""
    return config.in_channels // 4, config.joint_attention_dim, None


def tiny_qwen3(output: Path, hidden: int = TINY_QWEN):
    """A tiny Qwen3ForCausalLM (the class FLUX.2-klein ships) of 28 layers, so that the pipeline's hidden states
    9, 18 and 27 are inner layers, with a Qwen2Tokenizer trained on the shipped captions."""
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

    from laionkit.families.tokenizers import write_qwen

    tokenizer = Qwen2Tokenizer.from_pretrained(write_qwen(output))
    encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=TINY_QWEN_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    ))
    return encoder.eval(), tokenizer


def tiny_vae(seed: int = 0):
    """A tiny 8x AutoencoderKLFlux2 with FLUX.2's 32 latent channels and batch-norm statistics that are not the
    identity (random-init ones would be mean 0, variance 1, hiding a normalisation left out)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
                             latent_channels=32, sample_size=64)
    generator = torch.Generator().manual_seed(seed)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(0.2 * torch.randn(channels, generator=generator))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels, generator=generator))
    return vae


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init Flux2KleinPipeline folder in the real diffusers layout.

    vae/ (AutoencoderKLFlux2, 32 channels, batch-norm statistics), text_encoder/ (Qwen3ForCausalLM, 28 layers) +
    tokenizer/ (a Qwen2Tokenizer trained on the shipped captions, with the chat template), transformer/
    (Flux2Transformer2DModel without guidance embedding, as klein's), scheduler/ (FlowMatchEulerDiscreteScheduler
    as FLUX.2-klein ships it).
    """
    import torch

    require_klein()
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    output = Path(output)
    torch.manual_seed(seed)
    text_encoder, tokenizer = tiny_qwen3(output / "tokenizer")
    pipeline = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SAMPLER_CONFIG), vae=tiny_vae(seed),
        text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=Flux2Transformer2DModel.from_config(TINY_TRANSFORMER_CONFIG),
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="flux2",
    pipeline_class="Flux2KleinPipeline",
    denoiser_class="Flux2Transformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"),),
    stored=("states",),
    tokenize=tokenize,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
    encode_tokens=encode_tokens,
    # Qwen3 in the loop costs the step a few percent at 1024 px, while stored text keeps all 512 rows of three
    # layers (the transformer takes no mask, so nothing trims them) at several times a latent's bytes a sample
    # (docs/BENCHMARKS.md, train: FLUX.2 [klein] stored vs online text): online by default, as Flux
    default_text="online",
    conditioning=conditioning,
    text_layer="9,18,27",
    objective=Objective(kind="flow", prediction="velocity", sigma_sampling="logit_normal", dynamic_shift=True,
                        timestep_scale=1.0),
    block_classes=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"flux2-klein-4b": TRANSFORMER_CONFIG, "flux2-klein-9b": TRANSFORMER_CONFIG_9B,
             "tiny": TINY_TRANSFORMER_CONFIG},
    denoise=denoise,
    fit_config=fit_config,
    expects=expects,
    sampler=SAMPLER_CONFIG,
    pack_latents=patchify,
    patch_size=2,
    latent_stats=True,
    vae_stats=vae_stats,
    pipeline_denormalizes=True,
    text_window=MAX_SEQUENCE_LENGTH,
    text_encoder_classes=("Qwen3ForCausalLM", "Qwen3Model"),
))
