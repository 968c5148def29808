"""Qwen-Image: an MMDiT (QwenImageTransformer2DModel) on 2x2-packed 16-channel latents of a video VAE, flow
matching with Qwen-Image's resolution-dependent shift, conditioned on masked Qwen2.5-VL states.

Text conditioning, as ``QwenImagePipeline.encode_prompt`` builds it: each caption goes into the pipeline's
prompt template (a system message asking for a description, then the caption as the user's message), is
tokenized (Qwen2 BPE, padded to the longest of the batch), and Qwen2.5-VL's last hidden states are taken with
the attention mask; the first ``DROP_IDX`` = 34 unmasked positions (the template's system part: the real
tokenizer's 34 tokens) are dropped, and the rest is left-aligned, with a mask of ones over it, and cut to
``max_sequence_length`` (512: ``__call__``'s default, where ``encode_prompt`` alone keeps 1024). The
transformer takes that mask as ``encoder_hidden_states_mask``, so padding carries nothing: encode stores the
states trimmed to each caption's length (``FamilySpec.text_mask``), as PixArt's.

Latents: AutoencoderKLQwenImage is a video VAE ([B, C, frames, H, W]); encode gives it one frame and stores the
frame-free moments [2C, h, w] (``vae_frames``). Its config has no scaling / shift factor but per-channel
``latents_mean`` / ``latents_std``: the pipeline's latents are (z - mean) / std (``latent_stats``; the
manifest records the statistics, scaling 1 and no shift). The transformer takes them packed in 2x2
patches (Flux's layout) with ``img_shapes`` = (1 frame, h / 2, w / 2) per sample for its 3-D RoPE.

Objective: flow matching (velocity noise - x0), logit-normal sigmas shifted per bucket with the rule of the
pipeline's scheduler (exponential time shift, mu linear in the packed sequence length between 256 and 8192
tokens, 0.5 to 0.9), the shift the samples are drawn with at inference. The transformer's timestep input is
sigma (the pipeline passes t / 1000; the model scales by 1000 inside). Classifier-free guidance is the
pipeline's true_cfg_scale on the empty caption's states (Qwen-Image has no guidance embedding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laionkit.families.flux import pack, unpack
from laionkit.families.spec import FamilySpec, Objective, register_family

PRESETS = {"qwen-image": "Qwen/Qwen-Image"}

# Qwen/Qwen-Image transformer/config.json (20B parameters); the hub file's pooled_projection_dim (768) is a
# leftover that QwenImageTransformer2DModel does not take.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
}
# Qwen/Qwen-Image scheduler/scheduler_config.json: validation sampling, and the training shift's anchors.
SAMPLER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "invert_sigmas": False, "stochastic_sampling": False, "use_beta_sigmas": False, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
SHIFT_ANCHORS = (256, 8192, 0.5, 0.9)
# QwenImagePipeline.prompt_template_encode / prompt_template_encode_start_idx / tokenizer_max_length.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
DROP_IDX = 34
TOKENIZER_MAX_LENGTH = 1024
# QwenImagePipeline.__call__'s max_sequence_length: encode_prompt's states (of up to TOKENIZER_MAX_LENGTH tokens
# after the template) are cut to it. Qwen2.5-VL's attention is causal, so tokenizing only the template's
# DROP_IDX tokens and this many gives those states exactly, without encoding what the cut drops.
MAX_SEQUENCE_LENGTH = 512
# Qwen2.5-VL's special tokens: Qwen2-VL's, then the tool and fill-in-the-middle ones (ids 151643.. on the hub).
SPECIAL_TOKENS_25 = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
TINY_TEXT = 32
TINY_Z = 16  # the real VAE's 16 channels: the transformer's in_channels stay 64, as Qwen-Image's
# The tiny transformer write_tiny saves, also ``--transformer-config tiny`` (fitted to the data by fit_config).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2, "in_channels": 4 * TINY_Z, "out_channels": TINY_Z, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": TINY_TEXT, "guidance_embeds": False, "axes_dims_rope": [4, 6, 6],
}


def tokenize(tokenizers: Sequence, captions: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list:
    """Qwen2 token ids [B, 34 + 512] of the pipeline's template around each caption (as many as the pipeline's
    states keep: MAX_SEQUENCE_LENGTH), -1 where the attention mask is 0: one int tensor carries ids and mask
    (``encode --text online`` stores it per sample; the fixed width lets any batch of them stack)."""
    (tokenizer,) = tokenizers
    found = tokenizer([PROMPT_TEMPLATE.format(text) for text in captions], max_length=DROP_IDX + max_sequence_length,
                      padding="max_length", truncation=True, return_tensors="pt")
    return [found.input_ids.masked_fill(found.attention_mask == 0, -1)]


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, T, D] and ``mask`` [B, T] (bool) from ``tokenize``'s ids, as
    QwenImagePipeline._get_qwen_prompt_embeds builds them: the columns no caption of the batch uses are cut
    first (the pipeline pads to the batch's longest), then the last hidden states with the attention mask, each
    sample's unmasked positions after the first DROP_IDX left-aligned, zeros and False after them (T: the
    longest caption of the batch)."""
    import torch

    (encoder,), (found,) = text_encoders, ids
    found = found.to(encoder.device)
    valid = found >= 0
    keep = valid.any(dim=0)
    found, valid = found[:, keep], valid[:, keep]
    # The pipeline calls the whole Qwen2_5_VLForConditionalGeneration; its inner model gives the same hidden
    # states without the language-model head's logits (152k per token at real size: GBs per batch).
    with torch.no_grad():
        hidden = encoder.model(input_ids=found.clamp(min=0), attention_mask=valid.long(),
                               output_hidden_states=True).hidden_states[-1]
    lengths = (valid.sum(dim=1) - DROP_IDX).clamp(min=0)
    width = max(int(lengths.max()), 1)
    # the positions of each sample's unmasked tokens in order (stable: padding on either side), template dropped
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, DROP_IDX:DROP_IDX + width]
    order = torch.nn.functional.pad(order, (0, width - order.shape[1]))
    mask = torch.arange(width, device=hidden.device)[None, :] < lengths[:, None]
    states = hidden.gather(1, order[..., None].expand(-1, -1, hidden.shape[-1])) * mask[..., None]
    return {"states": states.to(encoder.dtype), "mask": mask}


def conditioning(batch: Mapping[str, Any]) -> dict[str, Any]:
    """QwenImageTransformer2DModel keyword arguments besides the packed latents, timestep and img_shapes: the
    states and their mask (padded positions masked out, per micro-batch)."""
    return {"encoder_hidden_states": batch["states"], "encoder_hidden_states_mask": batch["mask"]}


def image_shapes(batch: int, height: int, width: int) -> list:
    """The pipeline's img_shapes for ``batch`` latents of ``height`` x ``width``: one frame of 2x2 patches each."""
    return [[(1, height // 2, width // 2)]] * batch


def denoise(model, noisy, timestep, kwargs: Mapping[str, Any]):
    """The transformer on [B, C, h, w] latents: packed 2x2 in (the pipeline's _pack_latents), ``img_shapes`` of
    this bucket, the velocity unpacked back. ``timestep`` is sigma, as the pipeline passes t / 1000."""
    batch, _, height, width = noisy.shape
    out = model(hidden_states=pack(noisy), timestep=timestep, img_shapes=image_shapes(batch, height, width),
                **kwargs, return_dict=False)[0]
    return unpack(out, height, width)


def fit_config(arch: dict[str, Any], latent_channels: int, latent_size: int, text_dim: int,
               pooled_dim: int | None) -> dict[str, Any]:
    """A from-scratch Qwen-Image architecture fitted to the latents: 2x2-packed channels in, the latent channels
    out, the text width (positions are rotary: no size to fit)."""
    arch.update(in_channels=4 * latent_channels, out_channels=latent_channels, joint_attention_dim=text_dim)
    return arch


def expects(config) -> tuple:
    """(latent channels, text width, pooled width) a built QwenImageTransformer2DModel takes."""
    return config.in_channels // 4, config.joint_attention_dim, None


def tiny_tokenizer():
    """A Qwen2 BPE trained on the shipped captions with Qwen2.5-VL's special tokens. The prompt template's words
    are trained in too, each to one token, so the template's system part is 34 tokens as with the real tokenizer,
    and the pipeline's DROP_IDX drops exactly it."""
    from laionkit.families.tokenizers import QWEN2_VL_SPECIALS, captions, qwen2_vl_tokenizer

    template = PROMPT_TEMPLATE.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("{}", "")
    return qwen2_vl_tokenizer(captions() + [template] * 200, specials=QWEN2_VL_SPECIALS + SPECIAL_TOKENS_25)


def tiny_text_encoder(tokenizer):
    """A tiny random-init Qwen2_5_VLForConditionalGeneration (the real class and layout) for ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": TINY_TEXT, "intermediate_size": 2 * TINY_TEXT,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": ids["<|endoftext|>"],
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1]}},
        vision_config={"depth": 1, "hidden_size": TINY_TEXT, "intermediate_size": TINY_TEXT, "num_heads": 2,
                       "out_hidden_size": TINY_TEXT, "fullatt_block_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_vae(latents_mean: Sequence[float] | None = None, latents_std: Sequence[float] | None = None):
    """A tiny AutoencoderKLQwenImage: 8x downsampling (three downsamples) and 16 channels as the real one, with
    the real per-channel statistics unless others are given. One width throughout (dim_mult 1): narrowing it
    at depth left a random-init encoder's latents mostly a pattern shared by every image (8 photos' latents, at
    unit spread, 0.6 apart in MSE against 1.3 here), which the proof-of-learning test cannot learn from."""
    from diffusers import AutoencoderKLQwenImage

    stats = {key: list(value) for key, value in (("latents_mean", latents_mean), ("latents_std", latents_std))
             if value is not None}
    return AutoencoderKLQwenImage(base_dim=16, z_dim=TINY_Z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                  temperal_downsample=[False, True, True], **stats)


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init QwenImagePipeline folder in the real diffusers layout.

    vae/ (AutoencoderKLQwenImage, 16 channels, Qwen-Image's latents_mean / latents_std), text_encoder/
    (Qwen2_5_VLForConditionalGeneration) + tokenizer/ (a Qwen2 BPE trained on the shipped captions with
    Qwen2.5-VL's special tokens and chat template), transformer/ (QwenImageTransformer2DModel),
    scheduler/ (FlowMatchEulerDiscreteScheduler as Qwen-Image ships it).
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    output = Path(output)
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SAMPLER_CONFIG), vae=tiny_vae(),
        text_encoder=tiny_text_encoder(tokenizer), tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel.from_config(TINY_TRANSFORMER_CONFIG),
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output


SPEC = register_family(FamilySpec(
    name="qwen-image",
    pipeline_class="QwenImagePipeline",
    denoiser_class="QwenImageTransformer2DModel",
    denoiser_subfolder="transformer",
    text_encoders=(("tokenizer", "text_encoder"),),
    stored=("states", "mask"),
    text_mask="mask",
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    # Qwen2.5-VL-7B in the loop costs the 20B's step little, while encode --text stored runs it over every caption
    # before training and stores 3584 floats a token (docs/BENCHMARKS.md, train: Qwen-Image stored vs online
    # text): online by default, as Flux
    default_text="online",
    conditioning=conditioning,
    objective=Objective(kind="flow", prediction="velocity", sigma_sampling="logit_normal", dynamic_shift=True,
                        shift_anchors=SHIFT_ANCHORS, timestep_scale=1.0),
    block_classes=("QwenImageTransformerBlock",),
    regional_compile=True,
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"qwen-image": TRANSFORMER_CONFIG, "tiny": TINY_TRANSFORMER_CONFIG},
    denoise=denoise,
    fit_config=fit_config,
    expects=expects,
    sampler=SAMPLER_CONFIG,
    pack_latents=pack,
    unpack_latents=unpack,
    patch_size=2,
    vae_frames=True,
    latent_stats=True,
    pipeline_keywords={"mask": "prompt_embeds_mask"},
    text_window=MAX_SEQUENCE_LENGTH,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
    max_sequence_limit=TOKENIZER_MAX_LENGTH,  # QwenImagePipeline refuses more
))
