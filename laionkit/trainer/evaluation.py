"""Validation images: fixed prompts (validation_conditioning), DDIM / the family's sampler over the
latents (sample_latents, validate), and the grid written to RUN/samples."""

from __future__ import annotations

import json

import torch

from laionkit.common import LaionkitError, save_image_grid
from laionkit.common.storage import Location
from laionkit.families import FamilySpec
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.data import LatentSet
from laionkit.trainer.latent_stream import (
    collate,
)
from laionkit.trainer.metrics import log_images
from laionkit.trainer.objective import OnlineText, drop_captions
from laionkit.trainer.wrappers import unwrap


def validation_conditioning(data: LatentSet, count: int, online: OnlineText | None = None
                            ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Fixed prompts: the captions and stored text tensors (by stored key) of the first samples of the
    first shard, and their size fields. Their latents are left out: a grid draws its own, and bucketed
    samples' latents differ in shape, so they do not collate."""
    import webdataset as wds

    from laionkit.trainer.latent_stream import decode

    opened = [{"url": data.shards[0], "stream": Location.parse(data.shards[0]).open_read()}]  # path or URL
    samples = wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander(opened))
    captions, rows = [], []
    for sample in samples:
        captions.append(json.loads(sample["json"]).get("caption", "") if "json" in sample else sample["__key__"])
        rows.append({name: value for name, value in decode(sample).items() if name != "moments"})
        if len(rows) == count:
            break
    batch = collate(rows)  # trimmed text padded to the longest prompt
    if online is not None:  # token ids, encoded by the run's own text encoders
        return captions, {key: value.cpu() for key, value in online(batch, online.device, online.dtype).items()}
    return captions, {key: batch["text" if key == "states" else key] for key in data.family.stored}


def read_prompts(values: tuple[str, ...]) -> list[str]:
    """--validation-prompts: each value a prompt, or a .txt file of prompts (one per line, blank lines
    skipped)."""
    prompts = []
    for value in values:
        if not value.endswith(".txt"):
            prompts.append(value)
            continue
        try:
            lines = Location.parse(value).read_bytes().decode().splitlines()
        except (OSError, UnicodeDecodeError, LaionkitError) as error:
            raise LaionkitError(f"--validation-prompts {value}: cannot read it as a text file of prompts ({error})") \
                from None
        found = [line.strip() for line in lines if line.strip()]
        if not found:
            raise LaionkitError(f"--validation-prompts {value}: no prompt in it (one per line)")
        prompts += found
    return prompts


def prompt_texts(data: LatentSet, prompts: list[str], device) -> dict[str, torch.Tensor]:
    """The stored text tensors (by stored key, on the host) of ``prompts``, encoded as encode encoded the
    latents' captions: the manifest's tokenizers and text encoders, its --text-layer, the family's caption
    window, trimmed and zero-padded to the longest as a batch of stored text collates. The encoders are loaded
    for this alone and dropped after."""
    from laionkit.common.models import load_family_tokenizers, load_text_encoder

    family = data.family
    components = [name for pair in family.text_encoders for name in pair]
    missing = [name for name in components if not (data.models.get(name) or {}).get("source")]
    if missing:
        raise LaionkitError(f"--validation-prompts: {data.manifest} names no {missing[0]} model to encode them with")
    tokenizers = load_family_tokenizers(family, lambda name: data.models[name]["source"])
    encoders = [load_text_encoder(data.models[enc]["source"], component=enc).to(device)
                for _, enc in family.text_encoders]
    layer = (Location.parse(data.manifest).read_json().get("text") or {}).get("layer") or "last"  # SD's --text-layer
    with torch.no_grad():
        found = family.encode_text(tokenizers, encoders, prompts, **({"layer": layer} if family.encode_ids else {}))
    found = {key: found[key].float().cpu() for key in family.stored}
    lengths = family.text_lengths(found)
    if lengths is not None:
        longest = int(lengths.max())
        for key in family.trimmed:
            kept = torch.arange(longest) < lengths[:, None]
            found[key] = found[key][:, :longest] * kept.view(*kept.shape, *[1] * (found[key].dim() - 2))
    return found


# Pipeline keyword of each stored key (the negative_ version takes the empty caption's).
PIPELINE_KEYWORDS = {"states": "prompt_embeds", "pooled": "pooled_prompt_embeds", "mask": "prompt_attention_mask"}


@torch.no_grad()
def validate(unet, vae, noise_scheduler, texts: dict, empty: dict, data: LatentSet, config: TrainConfig,
             device: torch.device) -> torch.Tensor:
    """Samples for the fixed prompts through the family's diffusers pipeline (the one an export loads
    into), from the stored text tensors, decoded by the manifest's VAE, in [0, 1]: DDIM with
    classifier-free guidance for the UNet families; for flow families the family's
    FlowMatchEulerDiscreteScheduler (Flux: the pipeline computes its resolution-dependent mu itself) with
    classifier-free guidance, or the guidance embedding where the family feeds guidance_scale to it.

    The pipeline gets no text encoders (the prompts are stored embeddings) and returns latents (Flux's
    packed, unpacked here, ``sample_latents``): the decode is ours, in the VAE's own dtype, whatever the
    weights' dtype is."""
    latents = sample_latents(unet, vae, noise_scheduler, texts, empty, data, config, device)
    latents = data.denormalize(latents.to(vae.dtype))
    if data.family.vae_frames:  # a video VAE decodes [B, C, 1, h, w]: one frame, dropped again
        images = vae.decode(latents.unsqueeze(2)).sample.squeeze(2)
    else:
        images = vae.decode(latents).sample
    return (images.float() / 2 + 0.5).clamp(0, 1).cpu()


def validation_sampler(spec: FamilySpec, noise_scheduler):
    """The scheduler validation samples with: the flow family's FlowMatchEulerDiscreteScheduler, or DDIM on
    the model's noise schedule with the settings of sampling in latent space stated, not inherited: no
    clipping of the predicted x0 to [-1, 1] and no dynamic thresholding (both are for pixel-space models;
    scaled latents have unit spread). A scheduler config that does not name them (PixArt-Σ's
    DPMSolverMultistepScheduler; the SDXL config laionkit's tiny models write) took DDIM's default
    clip_sample=True and sampled every grid with x0 cut to [-1, 1], which its pipeline never does."""
    import diffusers

    if spec.sampler is not None:
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(dict(spec.sampler))
    return diffusers.DDIMScheduler.from_config(noise_scheduler.config, clip_sample=False, thresholding=False)


@torch.no_grad()
def sample_latents(unet, vae, noise_scheduler, texts: dict, empty: dict, data: LatentSet, config: TrainConfig,
                   device: torch.device) -> torch.Tensor:
    """validate's sampling: the fixed prompts' final latents (unpacked, scaled as the denoiser sees them)."""
    import inspect

    import diffusers

    spec = data.family
    sampler = validation_sampler(spec, noise_scheduler)
    pipeline_class = getattr(diffusers, spec.pipeline_class)
    parameters = inspect.signature(pipeline_class.__init__).parameters
    components = {name: None for name, parameter in parameters.items()
                  if name != "self" and parameter.default is inspect.Parameter.empty}
    components.update({spec.denoiser_subfolder: unet, "vae": vae, "scheduler": sampler})
    if "requires_safety_checker" in parameters:
        components["requires_safety_checker"] = False
    pipe = pipeline_class(**components)
    pipe.set_progress_bar_config(disable=True)
    dtype = next(unet.parameters()).dtype
    guided_by_embedding = spec.embedded_guidance and getattr(unet.config, "guidance_embeds", False)
    # The empty caption's tensors for every prompt, and the prompts', padded alike (trimmed text).
    texts = {key: value.to(device, dtype) for key, value in texts.items()}
    every = torch.ones(len(texts["states"]), dtype=torch.bool, device=device)
    negatives, texts = drop_captions(texts, empty, every), drop_captions(texts, empty, ~every)
    prompts = {}
    if spec.pipeline_text is not None:  # the family's own prompt keywords (Z-Image: lists of unmasked states)
        prompts.update(spec.pipeline_text(texts))
        prompts.update({f"negative_{key}": value for key, value in spec.pipeline_text(negatives).items()})
    keywords = {**PIPELINE_KEYWORDS, **spec.pipeline_keywords}
    for key, keyword in keywords.items() if spec.pipeline_text is None else ():
        if key in texts:
            prompts[keyword] = texts[key]
            if not guided_by_embedding:
                prompts[f"negative_{keyword}"] = negatives[key].to(device, dtype)
    call = inspect.signature(pipeline_class.__call__).parameters
    if "true_cfg_scale" in call and not guided_by_embedding:
        prompts["true_cfg_scale"] = config.guidance_scale  # FluxPipeline's / QwenImagePipeline's classifier-free guidance
    channels, height, width = data.moments_shape
    scale = pipe.vae_scale_factor
    generator = torch.Generator().manual_seed(config.seed)
    latents = torch.randn(len(texts["states"]), channels // data.moments_per_channel, height, width,
                          generator=generator)
    if spec.pack_latents is not None:
        latents = spec.pack_latents(latents)
    if "use_resolution_binning" in call:  # PixArt: draw at the data's size, not at the nearest of its bins
        prompts["use_resolution_binning"] = False
    if "negative_prompt_embeds" in prompts and "negative_prompt" in call:
        prompts["negative_prompt"] = None  # PixArt defaults it to "", which it refuses beside the embeddings
    # Accelerate's prepared forward returns fp32 outputs, so a scheduler step promotes the latents to fp32;
    # they go back to the weights' dtype before the next step (bf16 master weights have no autocast): as
    # callback_on_step_end returns them, or in place where the pipeline has only the per-step `callback`.
    if "callback_on_step_end" in call:
        each_step = {"callback_on_step_end": lambda _pipe, _i, _t, found: {"latents": found["latents"].to(dtype)},
                     "callback_on_step_end_tensor_inputs": ["latents"]}
    else:
        def cast(_step, _t, found):
            found.data = found.data.to(dtype)

        each_step = {"callback": cast, "callback_steps": 1}
    latents = pipe(height=height * scale, width=width * scale, num_inference_steps=config.validation_steps,
                   guidance_scale=config.guidance_scale - spec.cfg_offset, latents=latents.to(device, dtype), output_type="latent",
                   **each_step, **prompts).images
    if spec.unpack_latents is not None:
        latents = spec.unpack_latents(latents, height, width)
    if spec.pipeline_denormalizes:  # FLUX.2: the pipeline returned what the VAE decodes
        latents = data.normalize(latents)
    return latents


# --- --validate-every in the loop (the Trainer of laionkit/trainer/loop.py) ---

def validation_prompts(trainer) -> tuple | None:
    """--validate-every: the VAE and the fixed prompts' text tensors (on every rank: under FSDP the
    forward pass needs them all), --validation-prompts' or the first captions'; rank 0 writes the prompts to
    RUN/samples/prompts.txt."""
    config, data = trainer.config, trainer.data
    if not config.validate_every:
        return None
    from laionkit.common.models import load_vae

    if data.vae_source is None:
        raise LaionkitError(f"{config.latents}/manifest.json names no VAE, needed for --validate-every")
    if config.validation_prompts:
        captions = read_prompts(config.validation_prompts)
        texts = prompt_texts(data, captions, trainer.device)
    else:
        captions, texts = validation_conditioning(data, config.validation_count, trainer.online)
    if trainer.accelerator.is_main_process:
        (config.output / "samples").mkdir(exist_ok=True)
        (config.output / "samples" / "prompts.txt").write_text("\n".join(captions) + "\n")
    return load_vae(data.vae_source).to(trainer.device), texts


def validation_grid(trainer, validation: tuple, latents: LatentSet) -> None:
    """The fixed prompts' samples at this step (validate), at ``latents``' size; rank 0 saves the grid."""
    t = trainer
    vae, texts = validation
    t.unet.eval()
    images = validate(unwrap(t.accelerator, t.unet), vae, t.noise_scheduler, texts, t.empty, latents,
                      t.config, t.device)
    t.unet.train()
    if t.accelerator.is_main_process:
        save_image_grid(images, t.config.output / "samples" / f"step-{t.step:06d}.png")
        log_images(t.accelerator, "validation", images, t.step)
