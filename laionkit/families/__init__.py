"""Model families: everything that differs between SD-, SDXL-, SD3-, Flux-, PixArt- and Sana-class models, in
one place.

encode's and train's loops stay family-agnostic; they look a family up by name (the name encode writes
into the latent manifest, so train never asks for it twice) and call what its ``FamilySpec`` holds, the
way torchtitan's ``TrainSpec`` lets one trainer drive many models. The contract, field by field:

- which encoders encode runs and what it stores per sample: ``text_encoders`` names the pipeline
  subfolders of the tokenizer/encoder pairs, ``encode_text(tokenizers, encoders, captions)`` returns the
  per-sample tensors keyed by ``stored`` (encode writes them, and their empty-caption versions for caption
  dropout, which must drop every key together); a family with ``tokenize`` and ``encode_tokens`` (the
  ``--text online`` pair) gets it as their composition;
- how train builds the denoiser: ``denoiser_class`` + ``denoiser_subfolder`` (from_pretrained on a
  preset, a hub id or a folder, or from_config on a dict for training from scratch), with ``presets``
  (name -> hub pipeline repo) and ``configs`` (name -> real-size architecture config);
- the conditioning fed to the denoiser per batch: ``conditioning(batch)`` maps the stored tensors of a
  micro-batch to the denoiser's keyword arguments; train calls
  ``denoiser(noisy, timestep=t, **spec.conditioning(batch))`` for every family (the UNet's and the
  transformers' positional orders differ, so only the noisy input goes positionally);
- the objective's defaults: ``objective`` (``ddpm`` with a prediction type, or ``flow`` matching with
  its sigma sampling, shift and loss weighting; see ``laionkit.families.flow``);
- ``block_classes``: the denoiser's repeated block, the FSDP wrap unit and the activation-checkpointing
  unit (class names, resolved on the built model, so importing a family imports no diffusers);
  ``checkpoint_blocks`` (train ``--checkpointing``) and ``compile_blocks`` (``--compile`` where
  ``regional_compile``: the transformers and SDXL, whose whole-model compile is too slow) act on these blocks;
- ``pipeline_class``: the diffusers pipeline that draws validation grids and that an export must load
  into; the export is that pipeline's folder layout with the trained denoiser in ``denoiser_subfolder``;
- ``write_tiny(output, seed)``: a tiny random-init model in the real diffusers layout for offline tests;
- ``encode_ids``: set when encode may run the text encoder on the ids its DataLoader workers tokenized
  (fixed shapes, so it compiles; SD, whose ``--text-layer`` it takes), else encode calls ``encode_text``
  on the captions; ``text_layer`` is the hidden layer ``encode_text`` takes when it is fixed;
- ``vae_upcast``: the VAE overflows in fp16, so encode runs it in fp32 when its config says
  ``force_upcast`` (SDXL), as the family's pipeline does;
- transformers (SD3, Flux): ``denoise`` replaces the plain call where the denoiser takes its input in
  another layout (Flux's 2x2-packed tokens with per-shape ``img_ids``), ``fit_config`` fits a
  from-scratch architecture to the data and ``expects`` reads what a pretrained one takes (the UNet
  families keep train's own fitting), ``sampler`` is the FlowMatchEulerDiscreteScheduler config that
  draws validation images, ``pack_latents`` / ``unpack_latents`` the pipeline's latent layout when it
  differs from [B, C, h, w], and ``embedded_guidance`` says the pipeline's guidance_scale feeds the
  transformer's guidance embedding (Flux) instead of classifier-free guidance on negative embeddings;
  ``patch_size``: latent sides must be multiples of it (2: the transformer takes 2x2 latent patches);
- ``text_mask``: the stored key of a text attention mask the denoiser takes (PixArt: ``mask``). Masked
  positions carry nothing, so encode trims the sequence tensors (``states`` and the mask) of each sample
  after its last unmasked position (``text_lengths``), the latent loader zero-pads them back to the
  longest of each batch (masked out), and caption dropout / validation pad the empty caption's alike;
- ``unconditional``: the token ids of the text caption dropout and validation's negative use (the stored
  empty-caption files), where the pipeline encodes its negative prompt otherwise than the caption ""
  (Sana: "" without the instruction prefix its captions get); by default the caption "" itself.
- ``pipeline_text`` / ``cfg_offset``: the pipeline's own prompt keywords and guidance scale (Z-Image, zimage.py).
- video VAEs and per-channel latent statistics (Qwen-Image): ``vae_frames`` (the VAE takes [B, C, frames,
  H, W]; encode gives it one frame and stores frame-free moments, validation decodes one frame),
  ``latent_stats`` (the pipeline normalises latents with the VAE config's latents_mean / latents_std; encode
  records them in the manifest and train's ``LatentSet.normalize`` applies them), ``Objective.shift_anchors``
  (the dynamic shift's anchors where they are not Flux's), ``pipeline_keywords`` (the pipeline's keyword of a
  stored key where it is not PixArt's / SD3's; ``pipeline_text`` replaces the whole mapping where a rename
  is not enough); ``vae_stats`` (FLUX.2: the statistics are the VAE's batch-norm buffers, per 2x2-patchified
  channel) and ``pipeline_denormalizes`` (its pipeline returns latents the VAE decodes); ``text_window`` (Z-Image, Qwen-Image, Sana): the caption window encode counts tokens in, where the
  tokenizer's model_max_length is not it.

Stored tensors travel under their ``stored`` key, except ``states``, whose member stays ``text.npy`` and
whose empty-caption file stays ``empty_caption.npy`` (SD's format); any other key ``k`` is ``k.npy`` per
sample and ``empty_k.npy`` once per folder.

Family modules import torch / diffusers / transformers only inside functions, so listing families is cheap.
"""

from __future__ import annotations

# Importing the family modules registers them (each calls spec.register_family).
from laionkit.families import flux as _flux  # noqa: F401
from laionkit.families import flux2 as _flux2  # noqa: F401
from laionkit.families import flux2_dev as _flux2_dev  # noqa: F401
from laionkit.families import pixart as _pixart  # noqa: F401
from laionkit.families import qwenimage as _qwenimage  # noqa: F401
from laionkit.families import sana as _sana  # noqa: F401
from laionkit.families import sd as _sd  # noqa: F401
from laionkit.families import sd3 as _sd3  # noqa: F401
from laionkit.families import sdxl as _sdxl  # noqa: F401
from laionkit.families import zimage as _zimage  # noqa: F401
from laionkit.families.spec import (
    DEFAULT_FAMILY,
    FamilySpec,
    Objective,
    detect_family,
    families,
    get_family,
    register_family,
)

__all__ = ["DEFAULT_FAMILY", "FamilySpec", "Objective", "detect_family", "families", "get_family", "register_family"]
