"""FLUX.2 [dev]: the FLUX.2 transformer and VAE of ``flux2`` (klein), conditioned on Mistral-Small-3 states and an
embedded guidance scale, drawn by ``Flux2Pipeline``.

What differs from klein (laionkit/families/flux2.py), and only that lives here:
- Text, as ``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` builds it: each caption rendered by the tokenizer
  folder's PixtralProcessor with its chat template as diffusers' ``format_input`` lays it out (FLUX.2's system
  message, then the caption as a user turn, no generation prompt), padded and cut to 512 tokens, run through
  Mistral3ForConditionalGeneration with the mask, its hidden states 10, 20 and 30 side by side per token ([512,
  3 x 5120] for Mistral-Small-3.2-24B). As klein's, the transformer gets no text mask: all 512 rows are stored.
- Guidance: FLUX.2-dev is guidance-distilled, its transformer embeds the guidance scale (``guidance_embeds``); train
  feeds it 3.5 as diffusers' train_dreambooth_lora_flux2.py does, the pipeline its guidance_scale (default 4), and
  there is no negative prompt (``embedded_guidance``).
- The pipeline's output_type="latent" is the packed, still normalised tokens [B, h/2 * w/2, 128] (klein's pipeline
  un-normalises and unpatchifies first), so ``unpack_latents`` folds and unpatchifies them and nothing is
  normalised back.
Latents, positions, the objective and the blocks are klein's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from laionkit.families import flux2
from laionkit.families.spec import register_family

PRESETS = {"flux2-dev": "black-forest-labs/FLUX.2-dev"}
# black-forest-labs/FLUX.2-dev transformer/config.json (32B parameters): Flux2Transformer2DModel's defaults.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 8, "num_single_layers": 48,
    "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": True,
}
TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
TRAIN_GUIDANCE = 3.5  # train_dreambooth_lora_flux2.py's --guidance_scale default
TINY_MISTRAL = 16
TINY_MISTRAL_LAYERS = 32  # hidden_states[30] is an inner layer's output, as in Mistral-Small-3's 40 layers
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    **flux2.TINY_TRANSFORMER_CONFIG, "joint_attention_dim": len(TEXT_LAYERS) * TINY_MISTRAL, "guidance_embeds": True}
# black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json is klein's (the pipeline passes its own mu).
SAMPLER_CONFIG = flux2.SAMPLER_CONFIG


def tokenize(tokenizers: Sequence, captions: Sequence[str],
             max_sequence_length: int = flux2.MAX_SEQUENCE_LENGTH) -> list:
    """Mistral token ids [B, 512] of the captions as Flux2Pipeline renders them (diffusers' own format_input and
    SYSTEM_MESSAGE, the processor's chat template, padded and cut to 512), as flux2.masked_ids."""
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    (processor,) = tokenizers
    found = processor.apply_chat_template(
        format_input(prompts=list(captions), system_message=SYSTEM_MESSAGE), add_generation_prompt=False,
        tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"padding": "max_length", "truncation": True, "max_length": max_sequence_length})
    return [flux2.masked_ids(found["input_ids"], found["attention_mask"])]


def encode_tokens(text_encoders: Sequence, ids: Sequence) -> dict[str, Any]:
    """``states`` [B, 512, 3 D]: Mistral3ForConditionalGeneration's hidden states 10, 20 and 30 side by side per
    token (flux2.hidden_states_side_by_side), padding rows included."""
    (encoder,) = text_encoders
    (found,) = ids
    return flux2.hidden_states_side_by_side(encoder, found, TEXT_LAYERS)


def tiny_mistral3(output: Path, hidden: int = TINY_MISTRAL):
    """A tiny Mistral3ForConditionalGeneration (the class FLUX.2-dev ships: a Pixtral vision tower and a Mistral
    language model) of 32 layers, so that hidden states 10, 20 and 30 are inner layers, and a PixtralProcessor
    around a tekken-style tokenizer trained on the shipped captions."""
    from transformers import (
        AutoTokenizer,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    from laionkit.families.tokenizers import write_mistral

    tokenizer = AutoTokenizer.from_pretrained(write_mistral(output / "_tokenizer"))
    patch = 16
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=patch), tokenizer=tokenizer,
                                 patch_size=patch, spatial_merge_size=2)
    text = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=TINY_MISTRAL_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=1_000_000_000.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = PixtralVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                                 num_attention_heads=2, head_dim=hidden // 2, image_size=64, patch_size=patch)
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2, vision_feature_layer=-1, multimodal_projector_bias=False))
    return encoder.eval(), processor


def write_tiny(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init Flux2Pipeline folder in the real diffusers layout: vae/ (klein's tiny
    AutoencoderKLFlux2, batch-norm statistics), text_encoder/ (Mistral3ForConditionalGeneration, 32 layers) +
    tokenizer/ (PixtralProcessor: its tokenizer and chat template), transformer/ (Flux2Transformer2DModel with
    the guidance embedding), scheduler/ (FlowMatchEulerDiscreteScheduler as FLUX.2-dev ships it)."""
    import shutil

    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    output = Path(output)
    torch.manual_seed(seed)
    text_encoder, processor = tiny_mistral3(output)
    pipeline = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SAMPLER_CONFIG), vae=flux2.tiny_vae(seed),
        text_encoder=text_encoder, tokenizer=processor,
        transformer=Flux2Transformer2DModel.from_config(TINY_TRANSFORMER_CONFIG),
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    shutil.rmtree(output / "_tokenizer")  # the processor's copy is tokenizer/
    return output


# klein's spec with what differs (encode_text=None: rebuilt from this tokenize / encode_tokens).
SPEC = register_family(replace(
    flux2.SPEC,
    name="flux2-dev",
    pipeline_class="Flux2Pipeline",
    tokenize=tokenize,
    encode_tokens=encode_tokens,
    encode_text=None,
    text_layer="10,20,30",
    # not klein's online: Mistral-3 (24B, 48 GB in bf16) in the loop beside the 32B transformer's 64 GB leaves
    # one GPU too little for the step; the text is encoded once, at encode
    default_text="stored",
    objective=replace(flux2.SPEC.objective, guidance=TRAIN_GUIDANCE),
    write_tiny=write_tiny,
    presets=PRESETS,
    configs={"flux2-dev": TRANSFORMER_CONFIG, "tiny": TINY_TRANSFORMER_CONFIG},
    fit_config=flux2.fit_transformer,
    expects=flux2.transformer_inputs,
    unpack_latents=flux2.unpack_tokens,  # its pipeline's latent output is still packed
    embedded_guidance=True,
    vae_stats=flux2.batch_norm_stats,
    pipeline_denormalizes=False,
    text_encoder_classes=("Mistral3ForConditionalGeneration",),
))
