"""Benchmark `laionkit train` on the flow-matching transformers (SD3, Flux, Sana, Z-Image, Qwen-Image, FLUX.2) against the
bare diffusers step (not a test; results in docs/BENCHMARKS.md).

Per family, at real size and random init (``--transformer-config sd3-medium``: 2.0B; ``flux-dev``: 11.9B;
``pixart-sigma-xl``: 0.61B, stored vs online text only; ``sana-1600m``: 1.6B; ``z-image``: 6.15B;
``qwen-image``: 20B; ``flux2-klein-4b``: 3.9B; ``flux2-dev``: 32B), bf16, per resolution (1024 px and 512 px; Sana also 4096 px):

(peak)    the bf16 matmul peak of this GPU (torch.mm, 8192^3), measured in this run: MFU is against it.
(a)       the ceiling, bare diffusers + torch, no laionkit code: the transformer ``from_config``, flow matching
          as diffusers' training scripts compute it (logit-normal sigma via ``compute_density_for_timestep_sampling``,
          the family's shift, x_t = (1 - s) x0 + s e, target e - x0, MSE), backward, fused AdamW, on tensors
          already on the GPU; the whole model in bf16 (the fastest bare step). Eager, and compiled per block
          (``block.compile()``, as torchtitan's Flux does). Per family (``bare_<family>``, the ``BARE`` table),
          the inputs and call of its script:
          SD3 (train_dreambooth_sd3.py): 16 channels at 8x, CLIP + T5 states and pooled, timestep sigma x 1000,
          shift 3. Flux (train_dreambooth_flux.py): 2x2-packed latents, img_ids / txt_ids, guidance 3.5,
          timestep sigma, the resolution shift.
          Sana (train_dreambooth_lora_sana.py): 32 channels at 32x, Gemma-2 states (2304) with
          ``encoder_attention_mask``, timestep sigma x 1000, shift 3.
          Z-Image (train_dreambooth_lora_z_image.py): a list of [C, 1, h, w] frames and a list of each caption's
          Qwen3 states (2560), timestep t = 1 - sigma, the output negated (the model predicts x0 - e), shift 6.
          Qwen-Image (train_dreambooth_lora_qwen_image.py): 2x2-packed latents with ``img_shapes``, Qwen2.5-VL
          states (3584) with ``encoder_hidden_states_mask``, timestep sigma, the scheduler's exponential shift
          (mu from the packed length); 20B does not train full-parameter on one GPU, so its (a) is LoRA rank 64
          (peft ``add_adapter`` on to_q/to_k/to_v/to_out.0 of the frozen bf16 model) with diffusers' gradient
          checkpointing, as its (b) is. FLUX.2 (train_dreambooth_lora_flux2_klein.py, _flux2.py): 32 channels
          at 8x patchified 2x2 and packed, 512 text rows (klein: Qwen3, 3 x 2560; dev: Mistral-3, 3 x 5120),
          timestep sigma, unshifted sigmas; dev (32B) embeds guidance 3.5 and is LoRA-64 on both sides, as
          Qwen-Image.
          The masked families' (Sana, Z-Image, Qwen-Image) text is as long as the longest stored caption of
          (b)'s first latent shard (``stored_text_len``), so both sides attend over the same text.
(b)       `laionkit train` on latent shards with stored text (``encode --text stored``), eager and compiled,
          with the family's ``TRAIN_FLAGS``: Z-Image ``--full-bf16`` (the bare step's 8 bytes per parameter;
          the default policy's 20 leave no room for 1024 px activations), Qwen-Image ``--lora-rank 64
          --lora-random-base --checkpointing blocks`` (its LoRA-64 rows).
(online)  the same on ``encode --text online`` latents: the frozen text encoders (real sizes, random init:
          CLIP-L, CLIP-G, T5-XXL for SD3; CLIP-L, T5-XXL for Flux; Gemma-2-2B for Sana; Qwen3-4B for Z-Image
          and FLUX.2 [klein]; Qwen2.5-VL-7B for Qwen-Image; Mistral-Small-3 (24B) for FLUX.2 [dev]) run in the
          train loop.
(window)  `laionkit train` (eager, stored text) at the first resolution on latents encoded with each
          ``--windows`` caption window (``encode --max-sequence-length``): what a shorter caption window buys
          the families that attend to every padding row (Flux, SD3, FLUX.2).
(b16)     (b) eager under ``--full-bf16`` (the bare step's precision: bf16 weights and AdamW state, no fp32
          master), for a family whose (b) keeps fp32 master weights: b16/a is the loop's cost alone.
(lora)    `laionkit train --lora-rank 64` on the whole random-init model at the first resolution (Sana,
          Z-Image; Qwen-Image's (b) rows are this).
(fp8)     `laionkit train --fp8` against the same run in bf16, compiled, over ``--fp8-steps`` steps on the same
          data: samples/s and the two loss curves (mean |difference| against the bf16 run's own step noise).
(offload) A full fine-tune on one GPU under `--cpu-offload` (FSDP2 over a world of 1, ``accelerate launch
          --config_file train/fsdp.yaml --num_processes 1``; the parameters, gradients and AdamW state on the host),
          batch 1 at the first resolution with ``--checkpointing blocks``, at the ``OFFLOAD`` depth fraction the
          host holds (``--offload-config``): samples/s, GPU peak and the host's peak resident memory.
(full8bit) The whole model's full fine-tune on one GPU without offload: ``--full-bf16 --optimizer adamw8bit``
          (bf16 weights and gradients, AdamW's moments in 8 bits: 6 bytes per parameter), batch 1 at the first
          resolution with ``--checkpointing blocks``.
(big)     The largest configurations that train on this GPU, samples/s, MFU and peak memory, all with
          ``--checkpointing blocks``. Flux: LoRA rank 64 on the whole 12B with stored and with online text per
          resolution (Flux's stored vs online comparison), full-parameter 12B under ``--full-bf16``, and a
          full-parameter depth fraction under the default policy (fp32 master weights). Qwen-Image and
          FLUX.2 [dev]: a full-parameter depth fraction (``FRACTIONS``) under ``--full-bf16``.
(swap)    ``--block-swap N``: `laionkit train --block-swap 0` and ``N`` (LoRA-64, ``--swap-kinds lora,full`` adds
          full-parameter rows) on a pipeline folder holding the full-size random-init transformer in bf16, same
          seed: samples/s, peak GiB and the first five losses of each (``swap_rows``); ``--parts swap`` runs it alone.

The latents come from `laionkit encode` of generated photos with the family's tiny VAE at the real
downsampling (16 channels at 8x for SD3, Flux, Z-Image and Qwen-Image; for Sana a tiny 32-channel DC-AE at 32x,
``dc_ae_32x``) and real-size text encoders (``TEXT_ENCODERS``; ``--text-layers`` keeps their width at fewer
layers): the train step sees real shapes, and online text costs what it would. Every measurement runs in its
own process.

    python scripts/bench_train_flow.py --family sd3 --out /tmp/flow --report $OUT        # GPU machine
    python scripts/bench_train_flow.py --family sd3 --smoke --out /tmp/flow-smoke         # CPU plumbing check
    python scripts/bench_train_flow.py --family pixart --parts online --out /tmp/pixart   # stored vs online only
    python scripts/bench_train_flow.py --family flux --parts offload --resolutions 1024 --images 32 --steps 6 \
        --text-layers 2 --out /tmp/offload --report $OUT                               # Flux full FT, --cpu-offload
    python scripts/bench_train_flow.py --family sana --resolutions 1024 512 --ab-resolutions 1024 512 \
        --parts peak,a,b,online,lora --out /tmp/sana --report $OUT
    python scripts/bench_train_flow.py --family flux --parts swap --block-swap 30 --resolutions 512 --images 32 \
        --text-layers 1 --steps 6 --out /tmp/swap --report $OUT                           # block swap, one H100
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import child_argv, family_bench_parser, measurer, print_table, save_results, time_bare_step  # noqa: E402
from bench_train_sdxl import prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BATCH = {"sd3": {1024: 8, 512: 32, 64: 2}, "flux": {1024: 1, 512: 4, 64: 2}, "pixart": {1024: 16, 512: 64, 64: 2},
         "sana": {4096: 1, 1024: 16, 512: 64, 64: 2}, "z-image": {1024: 2, 512: 8, 64: 2},
         "qwen-image": {1024: 4, 512: 16, 64: 2},  # qwen-image, flux2-dev: LoRA-64 with --checkpointing blocks
         "flux2": {1024: 2, 512: 8, 64: 2}, "flux2-dev": {1024: 2, 512: 8, 64: 2}}
CONFIG = {"sd3": "sd3-medium", "flux": "flux-dev", "pixart": "pixart-sigma-xl", "sana": "sana-1600m",
          "z-image": "z-image", "qwen-image": "qwen-image", "flux2": "flux2-klein-4b", "flux2-dev": "flux2-dev"}
LORA_BATCH = {1024: 4, 512: 16}  # Flux-12B LoRA with --checkpointing blocks
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]  # diffusers' LoRA scripts' and laionkit's default targets
# `laionkit train` flags of a family's (b), stored and online rows, and (a)'s matching bare configuration:
# Z-Image (6.15B): the default policy's 20 bytes per parameter (123 GB) leaves no room for 1024 px
# activations; full bf16 (8 bytes, what the bare step does) does. Qwen-Image (20B): 8 bytes per parameter
# are 163 GB, over one H200: LoRA rank 64 on the frozen bf16 base with checkpointed blocks, on both sides.
# FLUX.2 [dev] (32B: 64 GB in bf16) trains as Qwen-Image does.
TRAIN_FLAGS = {"z-image": ("--full-bf16",),
               "qwen-image": ("--lora-rank", "64", "--lora-random-base", "--checkpointing", "blocks"),
               "flux2-dev": ("--lora-rank", "64", "--lora-random-base", "--checkpointing", "blocks")}
BARE_FLAGS = {"qwen-image": {"lora": 64, "checkpointing": True}, "flux2-dev": {"lora": 64, "checkpointing": True}}
# Full-parameter depth fractions (the transformer config with these overrides, and the train flags): the
# largest full-parameter configurations of a family that does not fit whole. Flux: 8 double + 16 single blocks
# under the default policy; Qwen-Image: 30 of 60 blocks (~10B) in full bf16; FLUX.2 [dev]: 4 of 8 double and
# 12 of 48 single blocks (~10B of 32B: ~0.98B a double block, ~0.49B a single one) in full bf16.
FRACTIONS = {"flux": (({"num_layers": 8, "num_single_layers": 16}, ()),),
             "qwen-image": (({"num_layers": 30}, ("--full-bf16",)),),
             "flux2-dev": (({"num_layers": 4, "num_single_layers": 12}, ("--full-bf16",)),)}
# (offload) The full fine-tune under --cpu-offload that one GPU's host holds: FSDP2 keeps the fp32 parameters,
# gradients and AdamW state on the host, 16 bytes per parameter (docs/CLUSTER.md, "Offload: when each pays"), so
# the lent H100's 128 GB host holds ~7B: Flux 8 double + 16 single blocks (~5.1B, ~82 GB), Qwen-Image 16 of 60
# blocks (~5.4B). --offload-config '{}' takes the whole model (Flux-12B: ~190 GB of host memory).
OFFLOAD = {"flux": {"num_layers": 8, "num_single_layers": 16}, "qwen-image": {"num_layers": 16}}


def _clip(cls, hidden: int, real_layers: int, act: str, layers: int | None):
    from transformers import CLIPTextConfig

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW

    return cls(CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden,
                              num_hidden_layers=layers or real_layers, num_attention_heads=hidden // 64,
                              projection_dim=hidden, max_position_embeddings=CLIP_WINDOW, hidden_act=act,
                              bos_token_id=49406, eos_token_id=49407, pad_token_id=1))


def _clip_l(folder: Path, layers: int | None):
    from transformers import CLIPTextModel

    return _clip(CLIPTextModel, 768, 12, "quick_gelu", layers)


def _clip_l_projected(folder: Path, layers: int | None):
    from transformers import CLIPTextModelWithProjection

    return _clip(CLIPTextModelWithProjection, 768, 12, "quick_gelu", layers)


def _clip_g(folder: Path, layers: int | None):
    from transformers import CLIPTextModelWithProjection

    return _clip(CLIPTextModelWithProjection, 1280, 32, "gelu", layers)


def _t5_xxl(folder: Path, layers: int | None):
    """google/t5-v1_1-xxl's encoder."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers or 24, num_heads=64,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, is_encoder_decoder=False))


def _gemma2_2b(folder: Path, layers: int | None):
    """google/gemma-2-2b-it's decoder (Sana's text_encoder/, a Gemma2Model); the tiny tokenizer's ids are Gemma's
    specials (pad 0, eos 1, bos 2) and fit in the real vocabulary."""
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(Gemma2Config(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=layers or 26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        pad_token_id=0, eos_token_id=1, bos_token_id=2))


def _qwen3_4b(folder: Path, layers: int | None):
    """Qwen/Qwen3-4B (Z-Image's text_encoder/, a Qwen3Model), with the tiny tokenizer's pad and eos ids."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    return Qwen3Model(Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=layers or 36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))


def _qwen25_vl_7b(folder: Path, layers: int | None):
    """Qwen/Qwen2.5-VL-7B-Instruct (Qwen-Image's text_encoder/, a Qwen2_5_VLForConditionalGeneration, vision
    tower included though text encoding never runs it), with the tiny tokenizer's special ids."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                     "num_hidden_layers": layers or 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                     "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "bos_token_id": ids["<|endoftext|>"],
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False))


def _mistral_small_3(folder: Path, layers: int | None):
    """mistralai/Mistral-Small-3.2-24B (FLUX.2-dev's text_encoder/, a Mistral3ForConditionalGeneration with its
    Pixtral vision tower), with the tiny processor's special ids; FLUX.2 reads hidden states 10, 20 and 30, so
    ``layers`` must be at least 31."""
    from transformers import AutoTokenizer, Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
                     "num_hidden_layers": max(layers or 40, 31), "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                     "rope_theta": 1_000_000_000.0, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                       "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64, "image_size": 1540,
                       "patch_size": 14},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        multimodal_projector_bias=False))


def _qwen3_4b_klein(folder: Path, layers: int | None):
    """Qwen3-4B as FLUX.2-klein-4B reads it: hidden states 9, 18 and 27, so at least 28 layers."""
    return _qwen3_4b(folder, max(layers or 36, 28))


# Each family's text encoders at real size (random init), by subfolder.
TEXT_ENCODERS = {
    "sd3": {"text_encoder": _clip_l_projected, "text_encoder_2": _clip_g, "text_encoder_3": _t5_xxl},
    "sd": {"text_encoder": _clip_l},  # SD 1.x: CLIP-L's last hidden state
    "flux": {"text_encoder": _clip_l, "text_encoder_2": _t5_xxl},
    "pixart": {"text_encoder": _t5_xxl},
    "sana": {"text_encoder": _gemma2_2b},
    "z-image": {"text_encoder": _qwen3_4b},
    "qwen-image": {"text_encoder": _qwen25_vl_7b},
    "flux2": {"text_encoder": _qwen3_4b_klein},
    "flux2-dev": {"text_encoder": _mistral_small_3},
}


def real_text_encoders(family: str, folder: Path, layers: int | None = None, dtype=torch.bfloat16) -> None:
    """Replace the tiny writer's text encoders by real-size ones (random init, saved in ``dtype``; the tiny
    tokenizers stay): CLIP-L (768, 12 layers; SD 1.x alone), CLIP-G (1280, 32 layers; SD3), T5-XXL (4096, 24
    layers, 10240 ff), Gemma-2-2B (2304, 26 layers; Sana), Qwen3-4B (2560, 36 layers; Z-Image), Qwen2.5-VL-7B
    (3584, 28 layers; Qwen-Image). ``layers``: that many layers each instead (the real widths, so the stored
    text has the real shapes, at a fraction of the build time; bench_learning.py, which saves them in float32
    as the rest of the pipeline is: a pipeline loaded without a torch_dtype runs each part in its saved dtype)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for sub, build in TEXT_ENCODERS[family].items():
        torch.manual_seed(0)
        with torch.device(device):
            model = build(folder, layers).to(dtype)
        shutil.rmtree(folder / sub)
        model.save_pretrained(folder / sub)
        del model


def free_gpu() -> None:
    """Give back what this process's model building (the real-size text encoders) left in torch's CUDA cache, before
    the children run: blocks cached here are memory their timed steps cannot have (docs/BENCHMARKS.md tells of a
    bare step that ran out of memory beside them)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def dc_ae_32x(scaling_factor: float = 0.41407):
    """A tiny AutoencoderDC with Sana's DC-AE downsampling (32x: six stages, ResBlocks then EfficientViT
    blocks) and 32 latent channels, so Sana's latents have the real side (32 at 1024 px); the family's own
    tiny one is 8x, for the tests' 64 px images."""
    from diffusers import AutoencoderDC

    blocks = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    widths = (8, 8, 16, 16, 32, 32)
    scales = ((), (), (), (5,), (5,), (5,))
    return AutoencoderDC(
        in_channels=3, latent_channels=32, attention_head_dim=8, encoder_block_types=blocks,
        decoder_block_types=blocks, encoder_block_out_channels=widths, decoder_block_out_channels=widths,
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=scales,
        decoder_qkv_multiscales=scales, upsample_block_type="interpolate", downsample_block_type="Conv",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=scaling_factor)


# VAEs that replace a family's tiny one where its downsampling is not the real model's.
VAES = {"sana": dc_ae_32x}


def write_models(folder: Path, family: str, smoke: bool, text_layers: int | None = None) -> Path:
    """The family's tiny pipeline with the real VAE downsampling (``VAES``) and, unless ``smoke``, real-size
    text encoders (``text_layers`` deep each where given)."""
    from laionkit.families import get_family

    if not (folder / "model_index.json").exists():
        get_family(family).write_tiny(folder, 0)
        if family in VAES:
            torch.manual_seed(0)
            shutil.rmtree(folder / "vae")
            VAES[family]().save_pretrained(folder / "vae")
        if not smoke:
            real_text_encoders(family, folder, text_layers)
    return folder


def stored_text_len(latents: Path) -> int:
    """The longest stored caption (its mask's length) of the first latent shard: at most what (b)'s
    micro-batches pad their text states to, and what the bare step of a masked family is given."""
    import io
    import tarfile

    import numpy as np

    with tarfile.open(sorted(latents.rglob("*.tar"))[0]) as tar:
        return max(len(np.load(io.BytesIO(tar.extractfile(member).read()))) for member in tar.getmembers()
                   if member.name.endswith(".mask.npy"))


# --- children: one measurement per process ---------------------------------------------------------

def child_peak(args) -> dict:
    """bf16 matmul TFLOP/s of this GPU: the best of a few 8192^3 torch.mm runs."""
    if not torch.cuda.is_available():
        return {"peak_tflops": 0.0}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    best = 0.0
    for _ in range(5):
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(50):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 2 * n**3 * 50 / (time.perf_counter() - started) / 1e12)
    return {"peak_tflops": best}


@dataclass
class Bare:
    """One family's bare step: its latent x0 [B, C, h, w] on the device, ``forward(model, noisy, sigma, rows)``
    (the velocity for the first ``rows`` samples, in x0's layout, called as diffusers' training script calls
    the transformer) and the shift its sigmas are drawn with.

    A ``bare_<family>(arch, resolution, batch, smoke, text_len, device, dtype)`` builds it (and fits ``arch``,
    the transformer config, to the resolution before the model is built); ``text_len``: a masked family's
    text length (the stored data's, which (b) trains on), else its pipeline's padded window."""

    x0: torch.Tensor
    forward: Callable
    shift: float


def bare_sd3(arch: dict, resolution: int, batch: int, smoke: bool, text_len: int | None, device, dtype) -> Bare:
    """SD3: 16 channels at 8x, CLIP-L + CLIP-G (77) and T5 (256) states and pooled, timestep sigma x 1000, shift 3."""
    latent = resolution // 8
    arch.update(sample_size=latent, pos_embed_max_size=max(arch["pos_embed_max_size"], latent // 2))
    text_len = 77 + (16 if smoke else 256)
    states = torch.randn(batch, text_len, arch["joint_attention_dim"], device=device, dtype=dtype)
    pooled = torch.randn(batch, arch["pooled_projection_dim"], device=device, dtype=dtype)

    def forward(model, noisy, sigma, rows):
        return model(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=states[:rows],
                     pooled_projections=pooled[:rows], return_dict=False)[0]

    return Bare(torch.randn(batch, 16, latent, latent, device=device, dtype=dtype), forward, 3.0)


def bare_flux(arch: dict, resolution: int, batch: int, smoke: bool, text_len: int | None, device, dtype) -> Bare:
    """Flux: 16 channels at 8x packed 2x2 with img_ids / txt_ids, T5 (512) states and CLIP pooled, guidance 3.5,
    timestep sigma, train_dreambooth_flux.py's resolution shift."""
    from diffusers import FluxPipeline

    latent = resolution // 8
    text_len = 16 if smoke else 512
    states = torch.randn(batch, text_len, arch["joint_attention_dim"], device=device, dtype=dtype)
    pooled = torch.randn(batch, arch["pooled_projection_dim"], device=device, dtype=dtype)
    ids = FluxPipeline._prepare_latent_image_ids(batch, latent // 2, latent // 2, device, dtype)
    txt_ids = torch.zeros(text_len, 3, device=device, dtype=dtype)
    guidance = torch.full((batch,), 3.5, device=device, dtype=torch.float32)
    mu = (1.15 - 0.5) / (4096 - 256) * ((latent // 2) ** 2 - 256) + 0.5  # train_dreambooth_flux's mu

    def forward(model, noisy, sigma, rows):
        packed = FluxPipeline._pack_latents(noisy, rows, 16, latent, latent)
        out = model(hidden_states=packed, timestep=sigma, guidance=guidance[:rows], pooled_projections=pooled[:rows],
                    encoder_hidden_states=states[:rows], txt_ids=txt_ids, img_ids=ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out, resolution, resolution, 8)

    return Bare(torch.randn(batch, 16, latent, latent, device=device, dtype=dtype), forward,
                float(torch.tensor(mu).exp()))


def bare_sana(arch: dict, resolution: int, batch: int, smoke: bool, text_len: int | None, device, dtype) -> Bare:
    """Sana (train_dreambooth_lora_sana.py): 32 channels at 32x (DC-AE, deterministic: the latent itself), Gemma-2
    states (2304) with their mask as ``encoder_attention_mask``, timestep sigma x 1000, static shift 3."""
    latent = resolution // 32
    length = text_len or (16 if smoke else 300)
    states = torch.randn(batch, length, arch["caption_channels"], device=device, dtype=dtype)
    mask = torch.ones(batch, length, device=device, dtype=torch.bool)

    def forward(model, noisy, sigma, rows):
        return model(hidden_states=noisy, encoder_hidden_states=states[:rows], encoder_attention_mask=mask[:rows],
                     timestep=sigma * 1000, return_dict=False)[0]

    channels = arch["in_channels"]
    return Bare(torch.randn(batch, channels, latent, latent, device=device, dtype=dtype), forward, 3.0)


def bare_zimage(arch: dict, resolution: int, batch: int, smoke: bool, text_len: int | None, device, dtype) -> Bare:
    """Z-Image (train_dreambooth_lora_z_image.py): 16 channels at 8x as a list of [C, 1, h, w] frames, the list of
    each caption's Qwen3 states (2560, unmasked rows only), timestep t = 1 - sigma, the output negated (the
    model predicts x0 - noise), static shift 6."""
    latent = resolution // 8
    length = text_len or (16 if smoke else 512)
    feats = [torch.randn(length, arch["cap_feat_dim"], device=device, dtype=dtype) for _ in range(batch)]

    def forward(model, noisy, sigma, rows):
        out = model(list(noisy.unsqueeze(2).unbind(dim=0)), 1 - sigma, feats[:rows], return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    channels = arch["in_channels"]
    return Bare(torch.randn(batch, channels, latent, latent, device=device, dtype=dtype), forward, 6.0)


def bare_qwenimage(arch: dict, resolution: int, batch: int, smoke: bool, text_len: int | None, device,
                   dtype) -> Bare:
    """Qwen-Image (train_dreambooth_lora_qwen_image.py): 16 channels at 8x packed 2x2 with img_shapes (1 frame),
    Qwen2.5-VL states (3584) with ``encoder_hidden_states_mask``, timestep sigma, the scheduler's exponential
    shift exp(mu), mu linear in the packed length from 0.5 at 256 to 0.9 at 8192 tokens."""
    from diffusers import QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    latent = resolution // 8
    channels = arch["out_channels"]
    length = text_len or (16 if smoke else 1024)
    states = torch.randn(batch, length, arch["joint_attention_dim"], device=device, dtype=dtype)
    mask = torch.ones(batch, length, device=device, dtype=torch.bool)
    shapes = [[(1, latent // 2, latent // 2)]] * batch

    def forward(model, noisy, sigma, rows):
        packed = QwenImagePipeline._pack_latents(noisy, rows, channels, latent, latent)
        out = model(hidden_states=packed, timestep=sigma, encoder_hidden_states=states[:rows],
                    encoder_hidden_states_mask=mask[:rows], img_shapes=shapes[:rows], return_dict=False)[0]
        return QwenImagePipeline._unpack_latents(out, resolution, resolution, 8).squeeze(2)

    mu = calculate_shift((latent // 2) ** 2, 256, 8192, 0.5, 0.9)
    return Bare(torch.randn(batch, channels, latent, latent, device=device, dtype=dtype), forward,
                float(torch.tensor(mu).exp()))


def bare_flux2(arch: dict, resolution: int, batch: int, smoke: bool, text_len: int | None, device, dtype) -> Bare:
    """FLUX.2 (train_dreambooth_lora_flux2_klein.py / _flux2.py): 32 channels at 8x, patchified 2x2 to 128 and
    packed one token per patch with _prepare_latent_ids, the 512 text states (Qwen3 3 x 2560 for klein, Mistral
    3 x 5120 for dev) with _prepare_text_ids, timestep sigma, guidance 3.5 where the transformer embeds it (dev),
    sigmas unshifted as those scripts draw them."""
    from diffusers import Flux2Pipeline

    latent = resolution // 8
    length = 16 if smoke else 512
    states = torch.randn(batch, length, arch["joint_attention_dim"], device=device, dtype=dtype)
    txt_ids = Flux2Pipeline._prepare_text_ids(states).to(device)
    guidance = torch.full((batch,), 3.5, device=device) if arch.get("guidance_embeds") else None

    def forward(model, noisy, sigma, rows):
        patches = Flux2Pipeline._patchify_latents(noisy)
        ids = Flux2Pipeline._prepare_latent_ids(patches).to(device)
        out = model(hidden_states=Flux2Pipeline._pack_latents(patches), timestep=sigma,
                    guidance=None if guidance is None else guidance[:rows], encoder_hidden_states=states[:rows],
                    txt_ids=txt_ids[:rows], img_ids=ids, return_dict=False)[0]
        return Flux2Pipeline._unpatchify_latents(Flux2Pipeline._unpack_latents_with_ids(out, ids))

    return Bare(torch.randn(batch, 32, latent, latent, device=device, dtype=dtype), forward, 1.0)


BARE = {"sd3": bare_sd3, "flux": bare_flux, "sana": bare_sana, "z-image": bare_zimage, "qwen-image": bare_qwenimage,
        "flux2": bare_flux2, "flux2-dev": bare_flux2}


def child_bare(args) -> dict:
    """(a): the bare diffusers flow-matching step on in-GPU tensors, whole model in bf16; with ``--lora`` adapters
    of that rank on the frozen bf16 model (peft, as diffusers' LoRA scripts add them), with ``--checkpointing``
    diffusers' gradient checkpointing per block (off while the model FLOPs are counted)."""
    import diffusers
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from laionkit.families import get_family

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    spec = get_family(args.family)
    if not spec.cudnn_attention:  # its backward fails there (Flux): the fastest bare step that runs
        torch.backends.cuda.enable_cudnn_sdp(False)
    arch = dict(spec.configs["tiny" if args.smoke else CONFIG[args.family]])
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = args.batch
    bare = BARE[args.family](arch, args.resolution, batch, args.smoke, args.text_len, device, dtype)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16: a 20-32B model's fp32 (80-128 GB) fits no card
    try:
        with torch.device(device):
            model = getattr(diffusers, spec.denoiser_class).from_config(arch).to(dtype)
    finally:
        torch.set_default_dtype(default_dtype)
    model.train()
    if args.base_quant:
        quantize_blocks_nf4(model, spec)
    if args.lora:
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=args.lora, lora_alpha=args.lora, init_lora_weights="gaussian",
                                     target_modules=LORA_TARGETS))
    if args.compile:
        for block in spec.blocks(model):
            block.compile()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=cuda)
    x0, shift = bare.x0, bare.shift

    def step():
        noise = torch.randn_like(x0)
        u = compute_density_for_timestep_sampling("logit_normal", batch, logit_mean=0.0, logit_std=1.0).to(device)
        sigma = shift * u / (1 + (shift - 1) * u)
        s = sigma.view(-1, 1, 1, 1).to(dtype)
        pred = bare.forward(model, (1 - s) * x0 + s * noise, sigma.to(dtype), batch)
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def one_sample():
        if not args.base_quant:  # a quantized 20-32B base's whole activations fit no card: no FLOP count
            bare.forward(model, x0[:1], torch.full((1,), 0.5, device=device, dtype=dtype), 1).float().sum().backward()
        if args.checkpointing:  # model FLOPs, not the recomputed ones: checkpointing only for the timed steps
            model.enable_gradient_checkpointing()

    return time_bare_step(step, one_sample, model, args.steps, args.warmup, batch, device)


def quantize_blocks_nf4(model: torch.nn.Module, spec) -> None:
    """The frozen base of a bare QLoRA step, as torchtune's FrozenNF4Linear and diffusers' QLoRA example keep it:
    each ``nn.Linear`` weight inside the family's blocks as torchao's NF4Tensor (blocks of 64, double-quantized
    scales), which ``F.linear`` dequantizes per call; layer by layer, so the bf16 weights are freed as they go."""
    try:
        from torchao.dtypes.nf4tensor import to_nf4
    except ImportError:  # torchao >= 0.18 moved it
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for block in spec.blocks(model):
        for layer in block.modules():
            blocks = layer.weight.numel() // 64 if isinstance(layer, torch.nn.Linear) else 0
            if blocks and layer.weight.numel() % 64 == 0:  # every real-size layer; a smoke run's tiny ones may not
                scaler_block = next(size for size in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % size == 0)
                layer.weight = torch.nn.Parameter(to_nf4(layer.weight.detach(), 64, scaler_block), requires_grad=False)


def main() -> None:
    parser = family_bench_parser(__doc__)
    parser.add_argument("--family", choices=sorted(BATCH), default="sd3")
    parser.add_argument("--parts", default="peak,a,b,online,fp8",
                        help="comma list of peak, a, b, online, fp8, lora, big, full8bit, window, offload")
    parser.add_argument("--offload-config", type=json.loads,
                        help="(offload) transformer config overrides as JSON (default: the family's OFFLOAD "
                             "fraction; '{}': the whole model)")
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 256],
                        help="(window): caption windows to train at, besides the family's own (b-<first>-eager)")
    parser.add_argument("--window-flags", default="",
                        help="(window): more `laionkit train` flags for its rows, given with '=' (argparse takes a "
                             "spaced value starting with -- as a flag), e.g. --window-flags=--full-bf16 where the "
                             "family's default policy does not fit the card (FLUX.2 [klein] on an 80 GB H100)")
    parser.add_argument("--online-flags", default="",
                        help="(online): more `laionkit train` flags for its stored and online rows, given with '=' "
                             "as --window-flags, e.g. --online-flags='--checkpointing blocks' where the family's "
                             "rows do not fit the card (Z-Image, FLUX.2 [klein] on an 80 GB H100)")
    parser.add_argument("--modes", default="eager,compiled", help="(a) and (b) per --ab-resolutions")
    parser.add_argument("--ab-resolutions", type=int, nargs="+",
                        help="resolutions of the (a) and (b) rows (default: the first of --resolutions)")
    parser.add_argument("--batches", default="", help="per-resolution batch overrides, e.g. 1024:8,4096:2")
    parser.add_argument("--text-layers", type=int, help="real-width text encoders this many layers deep "
                        "(default: the real depth, so online text costs what it would)")
    parser.add_argument("--fp8-steps", type=int, default=200)
    parser.add_argument("--fp8-resolution", type=int, default=512)
    parser.add_argument("--fp8-batch", type=int, default=16)
    parser.add_argument("--block-swap", type=int, default=0,
                        help="(swap): `laionkit train --block-swap N` against N = 0 on a pretrained folder holding "
                             "the full-size random-init transformer in bf16 (LoRA-64; --swap-kinds full adds "
                             "full-parameter rows): samples/s, peak GiB and the first losses of each")
    parser.add_argument("--swap-kinds", default="lora", help="(swap): comma list of lora, full")
    parser.add_argument("--child", choices=["bare", "peak"])
    parser.add_argument("--text-len", type=int, help="child: a masked family's text length")
    parser.add_argument("--lora", type=int, help="child: LoRA adapters of this rank on the frozen model")
    parser.add_argument("--checkpointing", action="store_true", help="child: gradient checkpointing per block")
    parser.add_argument("--base-quant", choices=["nf4"], help="child: the frozen base's block linears as torchao "
                        "NF4 (with --lora), no FLOP count")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        result = child_bare(args) if args.child == "bare" else child_peak(args)
        (args.out / f"{args.name}.json").write_text(json.dumps(result))
        return

    from laionkit.families import get_family

    started = time.perf_counter()
    if args.smoke:
        args.resolutions, args.images, args.steps, args.fp8_steps, args.fp8_resolution = [64], 16, 3, 4, 64
        args.ab_resolutions = None
    family = args.family
    batches = {**BATCH[family], **{int(r): int(b) for r, b in (item.split(":") for item in args.batches.split(",")
                                                               if item)}}
    batch_of = lambda resolution: batches.get(resolution, 2)  # noqa: E731
    parts = set(args.parts.split(","))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    models = write_models(args.out / "models", family, args.smoke, args.text_layers)
    free_gpu()
    print(f"models ready after {time.perf_counter() - started:.0f} s", flush=True)
    results: dict[str, dict] = {}
    measure = measurer(args.out, args.budget, started, env, results, show=300, report=args.report)
    # the family's own train flags (full bf16, LoRA): bf16 ones mean nothing in a CPU smoke run in float32
    family_flags = [flag for flag in TRAIN_FLAGS.get(family, ()) if not (args.smoke and flag == "--full-bf16")]

    def latents_at(resolution: int, text: str = "stored", window: int | None = None) -> Path:
        images = args.images if resolution <= 2048 else min(args.images, 64)  # 4096 px photos: ~5 MB each
        return prepare(args.out, resolution, images, False, models, text, window)  # encode: a process of its own

    def train(name: str, latents: Path, batch: int, *extra: str, steps: int | None = None,
              config: str | None = None, log_every: int | None = None, launch: tuple[str, ...] = ()) -> Path:
        run = args.out / f"run-{name}"
        window = max(2, args.steps // 3)
        total = steps or window * 4
        measure(name, [sys.executable, *launch, "-m", "laionkit.cli", "train", str(latents), "--output", str(run),
                       # config "": the extra flags name a pretrained --transformer (swap_rows)
                       *(("--transformer-config", "tiny" if args.smoke else (config or CONFIG[family]))
                         if config != "" else ()),
                       "--batch-size", str(batch), "--max-steps", str(total), "--log-every", str(log_every or window),
                       "--checkpoint-every", str(10**9), "--no-checkpoint-at-end", "--export", "none",
                       "--log-with", "none", "--quiet", "--workers", "4", "--shuffle-buffer", "64",
                       "--mixed-precision", "no" if args.smoke else "bf16", *extra], run)
        return run

    first = args.resolutions[0]
    ab_resolutions = args.ab_resolutions or [first]
    masked = get_family(family).text_mask is not None
    if "peak" in parts:
        measure("peak", child_argv(args.out, "peak", "peak", script=__file__))
    for resolution in ab_resolutions:
        # a masked family's bare step gets the text length (b)'s stored data pads to
        text_len = stored_text_len(latents_at(resolution)) if masked and parts & {"a", "b"} else None
        for mode in args.modes.split(","):
            compiled = mode == "compiled"
            flags = ["--compile", "--bf16-weights"] if compiled else []
            if "a" in parts:
                measure(f"a-{resolution}-{mode}", child_argv(
                    args.out, f"a-{resolution}-{mode}", "bare", script=__file__, family=family, resolution=resolution,
                    batch=batch_of(resolution), steps=args.steps, compile=compiled, smoke=args.smoke,
                    text_len=text_len, **BARE_FLAGS.get(family, {})))
            if "b" in parts:
                train(f"b-{resolution}-{mode}", latents_at(resolution), batch_of(resolution), *flags, *family_flags)
            if "b16" in parts and not compiled and "--full-bf16" not in family_flags and not args.smoke:
                train(f"b16-{resolution}-{mode}", latents_at(resolution), batch_of(resolution), "--full-bf16",
                      *family_flags)
    texts = ("stored", "online") if "online" in parts else ()
    if texts and get_family(family).tokenize is None:  # encode --text online needs the family's tokenize
        print(f"online: skipped, `encode --text online` does not serve {family} (stored text only)", flush=True)
        texts = ()
    online_flags = shlex.split(args.online_flags)
    for resolution in args.resolutions:
        for text in texts:
            if text == "stored" and resolution in ab_resolutions and "b" in parts and "eager" in args.modes \
                    and not online_flags:
                continue  # b-<resolution>-eager is this row
            train(f"{text}-{resolution}-eager", latents_at(resolution, text), batch_of(resolution), *family_flags,
                  *online_flags)

    def own_window(resolution: int) -> str | None:  # the stored-text eager row at the family's window, if one ran
        return next((name for name in (f"stored-{resolution}-eager", f"b-{resolution}-eager") if name in results),
                    None)

    windows = [w for w in args.windows if w != get_family(family).max_sequence_length] if "window" in parts else []
    if windows and get_family(family).max_sequence_length is None:
        print(f"window: skipped, {family}'s caption window is fixed", flush=True)
        windows = []
    window_flags = shlex.split(args.window_flags)
    # the family's own window beside them, under the same flags: (b)'s stored-text row where it ran without more
    own_name = own_window(first)
    if windows and (own_name is None or window_flags):
        own_name = f"window{get_family(family).max_sequence_length}-{first}-eager" if window_flags else f"b-{first}-eager"
        train(own_name, latents_at(first), batch_of(first), *family_flags, *window_flags)
    for window in windows:
        train(f"window{window}-{first}-eager", latents_at(first, window=window), batch_of(first), *family_flags,
              *window_flags)
    if "lora" in parts and family not in BARE_FLAGS:  # Qwen-Image's (b) rows are LoRA-64 already
        train(f"lora64-{first}-eager", latents_at(first), batch_of(first), "--lora-rank", "64", "--lora-random-base")
    if "fp8" in parts:
        latents = latents_at(args.fp8_resolution)
        common = ["--compile", "--bf16-weights", "--seed", "0"]
        window = max(1, args.fp8_steps // 10)
        for name, extra in (("fp8-off", []), ("fp8-on", ["--fp8"])):
            train(name, latents, args.fp8_batch, *common, *extra, steps=args.fp8_steps, log_every=1)
            logged = args.out / f"{name}-metrics.jsonl"  # measure's copy of the run's metrics.jsonl
            if logged.exists():
                records = [json.loads(line) for line in logged.read_text().splitlines()]
                results[name]["losses"] = [record["loss"] for record in records]
                rates = [record["samples_per_s"] for record in records]
                results[name]["samples_per_s"] = statistics.median(rates[window:]) if len(rates) > window else None
    if "big" in parts and family == "flux":
        latents = latents_at(first)
        # Full-parameter: the default policy (bf16 weights, fp32 master + AdamW) needs 20 bytes per parameter,
        # 238 GB for 11.9B: a depth fraction fits; --full-bf16 (8 bytes per parameter, 95 GB) fits all 12B.
        train(f"big-full-12b-fullbf16-{first}", latents, 1, "--full-bf16", "--mixed-precision", "bf16",
              "--checkpointing", "blocks")
        # LoRA rank 64 on the whole 12B (frozen bf16 base, checkpointed blocks): the single-GPU Flux run, and
        # the one where stored vs online text is measured for Flux (full-parameter 12B fits only below).
        for resolution in args.resolutions:
            for text in ("stored", "online"):
                train(f"big-lora64-12b-{text}-{resolution}", latents_at(resolution, text),
                      LORA_BATCH.get(resolution, 2), "--lora-rank", "64", "--lora-random-base",
                      "--checkpointing", "blocks")
    if "full8bit" in parts:
        # the whole model's full fine-tune on one GPU without offload: bf16 weights and gradients, AdamW's moments
        # in 8 bits (bitsandbytes): 6 bytes per parameter, 72 GB for Flux-12B
        train(f"full8bit-{first}", latents_at(first), 1, "--optimizer", "adamw8bit", "--checkpointing", "blocks",
              *(() if args.smoke else ("--full-bf16", "--mixed-precision", "bf16")))
    for overrides, flags in FRACTIONS.get(family, ()) if "big" in parts else ():
        arch = {**get_family(family).configs[CONFIG[family]], **overrides}
        tag = "x".join(str(value) for value in overrides.values())
        path = args.out / f"{family}-{tag}.json"
        path.write_text(json.dumps(arch))
        flags = [flag for flag in flags if not (args.smoke and flag == "--full-bf16")]
        train(f"big-full-{tag}-{first}", latents_at(first), 1, "--checkpointing", "blocks", *flags, config=str(path))

    if args.block_swap:  # (swap): what --block-swap N costs and saves against the same run without it
        swap_rows(args, train, latents_at(first), models, results)

    if "offload" in parts and family in OFFLOAD:
        # one GPU's full fine-tune with FSDP2 CPU offload: FSDP2 over a world of 1, launched as a user would
        overrides = OFFLOAD[family] if args.offload_config is None else args.offload_config
        path = args.out / f"{family}-offload.json"
        path.write_text(json.dumps({**get_family(family).configs[CONFIG[family]], **overrides}))
        name = f"offload-{'x'.join(map(str, overrides.values())) or 'whole'}-{first}"
        launch = ("-m", "accelerate.commands.launch", "--config_file", str(REPO / "train" / "fsdp.yaml"),
                  "--num_processes", "1", "--mixed_precision", "no" if args.smoke else "bf16")
        train(name, latents_at(first), 1, "--cpu-offload", "--checkpointing", "blocks", config=str(path),
              launch=launch)
        # the largest resident set of a child so far (Linux counts a child's waited-for descendants, the rank
        # here): the host's peak under offload, which this part runs last to keep its own
        results[name]["host_peak_gib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        print(f"{name}: host peak {results[name]['host_peak_gib']:.1f} GiB", flush=True)

    summary = {"date": time.strftime("%Y-%m-%d"), "family": family, "device": torch.cuda.get_device_name(0)
               if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "results": results}
    save_results(summary, args.out, args.report, suffix=f"-{family}", tail=8000)
    print_table({k: v for k, v in results.items() if k != "peak"}, f"{summary['device']}, torch {torch.__version__}")
    rate = lambda name: results.get(name, {}).get("samples_per_s")  # noqa: E731
    # a train run (b) that errored before 3 timed log windows (b: 3 windows after the first), or a bare one (a)
    # that errored at all (its rate is written only after its timed steps)
    cut_short = lambda name: "error" in results.get(name, {}) and results[name].get("timed_windows", 3) < 3  # noqa: E731
    peak = results.get("peak", {}).get("peak_tflops")
    print(f"\nmeasured bf16 matmul peak: {peak}")
    for resolution in ab_resolutions:
        for mode in args.modes.split(","):
            a, b = rate(f"a-{resolution}-{mode}"), rate(f"b-{resolution}-{mode}")
            cut = [name for name in (f"a-{resolution}-{mode}", f"b-{resolution}-{mode}") if cut_short(name)]
            if a and b and cut:  # a run stopped in its warm-up or compilation: a rate of start-up, not of steps
                print(f"  b/a {resolution} {mode}: not computed, {' and '.join(cut)} stopped before its timed "
                      "steps ended")
            elif a and b:
                flops = results[f"a-{resolution}-{mode}"]["flops_per_sample"]
                print(f"  b/a {resolution} {mode}: {b / a:.3f} (target >= 0.98); b model TFLOP/s "
                      f"{flops * b / 1e12:.0f}" + (f" = {flops * b / 1e12 / peak:.2f} x the measured peak "
                                                  "(target >= 0.5)" if peak else ""))
            b16 = rate(f"b16-{resolution}-{mode}")
            if a and b16 and not cut_short(f"b16-{resolution}-{mode}"):
                print(f"  b16/a {resolution} {mode}: {b16 / a:.3f} (--full-bf16: the bare step's precision)")
    for resolution in args.resolutions:
        stored = rate(own_window(resolution))
        online = rate(f"online-{resolution}-eager")
        if stored and online:
            print(f"  online/stored text {resolution}: {online / stored:.3f}")
    for window in windows:
        own, short = rate(own_name), rate(f"window{window}-{first}-eager")
        if own and short:
            print(f"  caption window {window} / {get_family(family).max_sequence_length} tokens, {first} px: "
                  f"{short / own:.3f} x the samples/s")
    if rate("fp8-on") and rate("fp8-off"):
        on, off = results["fp8-on"]["losses"], results["fp8-off"]["losses"]
        tail = len(off) // 2
        print(f"  fp8 speed-up: {rate('fp8-on') / rate('fp8-off'):.3f}; mean loss, second half: fp8 "
              f"{statistics.mean(on[tail:]):.4f} vs bf16 {statistics.mean(off[tail:]):.4f} (bf16 step-to-step "
              f"std {statistics.pstdev(off[tail:]):.4f})")
    for kind in args.swap_kinds.split(",") if args.block_swap else ():
        off, on = results.get(f"swap0-{kind}", {}), results.get(f"swap{args.block_swap}-{kind}", {})
        if off.get("losses") and on.get("losses"):
            print(f"  block swap {args.block_swap} {kind}: {(on.get('samples_per_s') or 0) / (off.get('samples_per_s') or 1):.3f}"
                  f" x the samples/s, peak {on.get('gpu_mem_gib')} vs {off.get('gpu_mem_gib')} GiB, largest loss "
                  f"difference over the first steps {max(abs(a - b) for a, b in zip(on['losses'], off['losses'])):.3g}")
    print(f"total {time.perf_counter() - started:.0f} s")


def swap_rows(args, train: Callable, latents: Path, models: Path, results: dict) -> None:
    """(swap) rows: `laionkit train --transformer FOLDER` with --block-swap 0 and N, same seed and data, a loss
    logged every step. The folder is the tiny pipeline with the full-size random-init transformer saved in bf16
    (the tiny one under --smoke): a pretrained base is what block swap is for, and what it keeps off the GPU
    from the load on (a from-scratch build draws every weight on the GPU first)."""
    import diffusers

    from laionkit.families import get_family

    spec = get_family(args.family)
    folder = args.out / "swap-base"
    if not (folder / "model_index.json").exists():
        shutil.copytree(models, folder, dirs_exist_ok=True)
        if not args.smoke:
            arch = spec.configs[CONFIG[args.family]]
            torch.manual_seed(0)
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = getattr(diffusers, spec.denoiser_class).from_config(arch).to(torch.bfloat16)
            shutil.rmtree(folder / spec.denoiser_subfolder)
            model.save_pretrained(folder / spec.denoiser_subfolder)
            del model
            free_gpu()
    kinds = {"lora": ("--lora-rank", "64", "--checkpointing", "blocks"),
             "full": ("--checkpointing", "blocks", *(() if args.smoke else ("--full-bf16",)))}
    for kind in args.swap_kinds.split(","):
        for n in (0, args.block_swap):
            name = f"swap{n}-{kind}"
            train(name, latents, LORA_BATCH.get(args.resolutions[0], 2), "--transformer", str(folder), "--seed", "0",
                  "--block-swap", str(n), *kinds[kind], config="", log_every=1)
            logged = args.out / f"{name}-metrics.jsonl"
            if logged.exists():
                results[name]["losses"] = [json.loads(line)["loss"] for line in logged.read_text().splitlines()][:5]


if __name__ == "__main__":
    main()
