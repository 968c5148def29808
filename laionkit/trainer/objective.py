"""What the denoiser learns: DDPM and flow-matching losses, noise / timestep / sigma sampling, caption
dropout and the conditioning a batch gives (stored text or OnlineText, run by train's own text encoders)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from laionkit.common import (
    LaionkitError,
)
from laionkit.families import FamilySpec, Objective, get_family
from laionkit.trainer import trainchecks
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.data import LatentSet
from laionkit.trainer.latent_stream import (
    SIZE_FIELDS,
    pad_to,
)


class OnlineText:
    """The frozen text encoders of ``encode --text online`` latents, loaded from where encode loaded them
    (the manifest's models), run on each batch's token ids in the training dtype without gradients."""

    def __init__(self, data: LatentSet, device, dtype, allow_changed: bool = False) -> None:
        from laionkit.common.models import load_text_encoder, load_tokenizer

        self.family, self.device, self.dtype = data.family, device, dtype
        trainchecks.check_text_encoders(data.family, data.models, allow_changed)  # the models encode hashed
        try:
            sources = [(data.models[tok]["source"], tok, data.models[enc]["source"], enc)
                       for tok, enc in data.family.text_encoders]
        except KeyError as error:
            raise LaionkitError(f"online-text latents: the manifest names no {error} model to encode with") from None
        self.tokenizers = [load_tokenizer(source, tok) for source, tok, _, _ in sources]
        self.encoders = [load_text_encoder(source, dtype=dtype, component=enc).to(device)
                         for _, _, source, enc in sources]

    def empty(self) -> dict:
        """The empty caption's stored tensors (caption dropout), from these encoders in this dtype."""
        ids = self.family.empty_ids(self.tokenizers)
        names = [self.family.ids_member(i)[:-4] for i in range(len(ids))]
        return {key: value[0] for key, value in self(dict(zip(names, ids)), self.device, self.dtype).items()}

    def __call__(self, batch: dict, device, dtype) -> dict:
        """The stored tensors (by stored key) of a batch's ids_<tokenizer> members."""
        ids = [batch[self.family.ids_member(i)[:-4]].to(device, non_blocking=True)
               for i in range(len(self.family.text_encoders))]
        with torch.no_grad():
            found = self.family.encode_tokens(self.encoders, ids)
        return {key: found[key].to(dtype) for key in self.family.stored}


def batch_conditioning(batch: dict, data: LatentSet, device, dtype, online: OnlineText | None = None) -> dict:
    """A batch's stored text tensors by stored key on the device in ``dtype`` (encoded from its token ids
    by ``online`` for online-text latents), plus the size fields."""
    if online is not None:
        cond = online(batch, device, dtype)
    else:
        cond = {key: batch["text" if key == "states" else key].to(device, non_blocking=True).to(dtype)
                for key in data.family.stored}
    cond.update({name: batch[name].to(device, non_blocking=True) for name in SIZE_FIELDS if name in batch})
    return cond


def stored_conditioning(cond: dict, online: OnlineText | None, device, dtype) -> dict:
    """A decoded batch's conditioning by stored key: ``text`` is ``states``; token ids (online text) are
    encoded; the size fields pass through."""
    if online is None:
        return {"states" if k == "text" else k: v for k, v in cond.items()}
    return {**{k: v for k, v in cond.items() if not k.startswith("ids_")}, **online(cond, device, dtype)}


def perturbed(config: TrainConfig, noise: torch.Tensor, generator) -> torch.Tensor:
    """The noise that goes into the noisy input: with --input-perturbation, noise + gamma * fresh noise
    (the loss target stays ``noise``)."""
    if not config.input_perturbation:
        return noise
    return noise + config.input_perturbation * randn(noise.shape, generator, noise)


def dropout_captions(config: TrainConfig, cond: dict, empty: dict, batch: int, generator) -> dict:
    """--caption-dropout: each sample's text replaced by the empty caption's with that probability."""
    if not config.caption_dropout:
        return cond
    device = cond["states"].device
    dropped = torch.rand(batch, generator=generator, device=device) < config.caption_dropout
    return drop_captions(cond, empty, dropped)


def drop_captions(cond: dict, empty: dict, dropped: torch.Tensor) -> dict:
    """Caption dropout: the dropped samples get every stored tensor of the empty caption, together.
    Trimmed text (a family with a text mask) and the empty caption's are zero-padded to the longer first."""
    out = dict(cond)
    for key, value in empty.items():
        current = cond[key]
        if value.shape != current.shape[1:] and value.shape[1:] == current.shape[2:]:
            length = max(value.shape[0], current.shape[1])
            value, current = pad_to(value, length), pad_to(current, length, dim=1)
        mask = dropped.view(-1, *([1] * (value.dim())))
        out[key] = torch.where(mask, value, current)
    return out


def load_noise_scheduler(config: TrainConfig, spec: FamilySpec | None = None):
    """DDPM with the model family's schedule: --noise-scheduler, else --unet's folder (or preset), else the
    family's objective's betas (SD's when no family is given)."""
    from diffusers import DDPMScheduler

    from laionkit.common.models import load_scheduler

    spec = spec or get_family("sd")
    source = config.noise_scheduler or (spec.presets.get(config.unet, config.unet) if config.unet else None)
    if source is not None:
        scheduler = load_scheduler(source)
    else:
        objective = spec.objective
        scheduler = DDPMScheduler(beta_start=objective.beta_start, beta_end=objective.beta_end,
                                  beta_schedule=objective.beta_schedule, num_train_timesteps=1000,
                                  clip_sample=False, steps_offset=1)
    if config.prediction_type is not None:
        scheduler.register_to_config(prediction_type=config.prediction_type)
    return scheduler


def randn(shape, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=like.device, dtype=like.dtype)


def draw_latents(moments, deterministic: bool, generator: torch.Generator) -> torch.Tensor:
    """The VAE-space latent of stored moments [B, 2C | C, h, w] (fp32): a draw from the posterior (mean and
    log-variance, AutoencoderKL), or the stored latent itself where the VAE is deterministic (AutoencoderDC)."""
    if deterministic:
        return moments.float()
    mean, logvar = moments.float().chunk(2, dim=1)
    return mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * randn(mean.shape, generator, mean)


def latents_and_noise(moments, config: TrainConfig, data: LatentSet, generator: torch.Generator,
                      channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh latent drawn from the stored moments (a deterministic VAE's stored latent as it is, no draw),
    normalised as the VAE's config says (data.normalize), and the noise for it (with --noise-offset), both from
    ``generator`` in that order."""
    latents = draw_latents(moments, data.deterministic, generator)
    latents = data.normalize(latents)
    if channels_last:
        latents = latents.contiguous(memory_format=torch.channels_last)
    noise = randn(latents.shape, generator, latents)
    if config.noise_offset:
        noise = noise + config.noise_offset * randn((latents.shape[0], latents.shape[1], 1, 1), generator, latents)
    return latents, noise


def diffusion_loss(model, moments, cond, empty, noise_scheduler, config: TrainConfig,
                   data: LatentSet, generator: torch.Generator) -> torch.Tensor:
    """The DDPM training loss for one batch: fresh latent, noise, timestep, prediction, (min-SNR) MSE."""
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_snr

    latents, noise = latents_and_noise(moments, config, data, generator, config.channels_last)
    batch = latents.shape[0]
    steps = noise_scheduler.config.num_train_timesteps
    if config.timestep_sampling == "uniform":
        timesteps = torch.randint(0, steps, (batch,), generator=generator, device=latents.device)
    else:
        u = compute_density_for_timestep_sampling("logit_normal", batch, config.logit_mean, config.logit_std,
                                                  device=latents.device, generator=generator)
        timesteps = (u * steps).long().clamp(max=steps - 1)
    text = cond["states"]
    noisy = noise_scheduler.add_noise(latents, perturbed(config, noise, generator), timesteps).to(text.dtype)
    cond = dropout_captions(config, cond, empty, batch, generator)
    if noise_scheduler.config.prediction_type == "epsilon":
        target = noise
    else:
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    prediction = data.family.predict(model, noisy, timesteps, cond)
    loss = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if config.snr_gamma:
        snr = compute_snr(noise_scheduler, timesteps)
        weight = snr.clamp(max=config.snr_gamma)
        weight = weight / snr if noise_scheduler.config.prediction_type == "epsilon" else weight / (snr + 1)
        loss = loss * weight
    return loss.mean()


FLOW_FLAGS = ("sigma_sampling", "shift", "weighting", "train_guidance")


DDPM_FLAGS = ("noise_scheduler", "prediction_type", "snr_gamma")


def resolve_objective(config: TrainConfig, spec: FamilySpec) -> Objective:
    """The family's objective with the train flags that override it; flags of the other objective are
    refused (a flow family has no DDPM schedule, a UNet family no sigma shift)."""
    objective = spec.objective
    if objective.kind == "ddpm":
        given = [name for name in FLOW_FLAGS if getattr(config, name) is not None]
        if given:
            raise LaionkitError(f"--{given[0].replace('_', '-')} is a flow-matching option; {spec.name} latents "
                                "train with the DDPM objective (--timestep-sampling, --snr-gamma, --prediction-type)")
        return objective
    given = [name for name in DDPM_FLAGS if getattr(config, name) is not None]
    if config.timestep_sampling != "uniform":
        given.append("timestep_sampling")
    if given:
        raise LaionkitError(f"--{given[0].replace('_', '-')} is a DDPM option; {spec.name} latents train with flow "
                            "matching (--sigma-sampling, --logit-mean/--logit-std, --shift, --weighting)")
    changes = {"logit_mean": config.logit_mean, "logit_std": config.logit_std, "mode_scale": config.mode_scale}
    if config.sigma_sampling is not None:
        changes["sigma_sampling"] = config.sigma_sampling.replace("-", "_")
    if config.weighting is not None:
        changes["weighting"] = config.weighting
    if config.shift == "dynamic":
        changes.update(shift=None, dynamic_shift=True)
    elif config.shift is not None:
        changes.update(shift=None if config.shift == "none" else float(config.shift), dynamic_shift=False)
    if config.train_guidance is not None:
        changes["guidance"] = config.train_guidance
    return replace(objective, **changes)


def guidance_input(objective: Objective, cond: dict, batch: int, device) -> dict:
    """cond with the guidance embedding's input (as FluxPipeline makes it: fp32, one value per sample)."""
    if objective.guidance is None:
        return cond
    return {**cond, "guidance": torch.full((batch,), objective.guidance, device=device, dtype=torch.float32)}


def flow_loss(model, moments, cond, empty, config: TrainConfig, data: LatentSet, generator: torch.Generator,
              objective: Objective) -> torch.Tensor:
    """The flow-matching loss for one batch (laionkit.families.flow): flow_batch's draws, the weighted MSE
    of the prediction to noise - x0."""
    from laionkit.families import flow

    noisy, timestep, cond, latents, noise, sigmas = flow_batch(moments, cond, empty, config, data, generator, objective)
    prediction = data.family.predict(model, noisy, timestep, cond)
    return flow.loss(prediction, latents, noise, sigmas, objective.weighting)


def flow_batch(moments, cond, empty, config: TrainConfig, data: LatentSet, generator: torch.Generator,
               objective: Objective) -> tuple:
    """One batch's flow-matching draws, in the one order a run makes them (a pipeline-parallel run's ranks
    draw them alike): fresh latent and noise, sigma drawn and shifted directly (per bucket under a dynamic
    shift), x_t = (1 - sigma) x0 + sigma noise, caption dropout, the guidance input. Returns (x_t, the
    timestep input: sigma x the family's scale, the conditioning, x0, noise, sigma)."""
    from laionkit.families import flow

    latents, noise = latents_and_noise(moments, config, data, generator)
    batch, _, height, width = latents.shape
    sigmas = flow.sample_sigmas(batch, objective.sigma_sampling, logit_mean=objective.logit_mean,
                                logit_std=objective.logit_std, mode_scale=objective.mode_scale,
                                generator=generator, device=latents.device)
    shift = objective.sigma_shift(height, width)
    if shift != 1.0:
        sigmas = flow.shift_sigmas(sigmas, shift)
    text = cond["states"]
    noisy = flow.interpolate(latents, perturbed(config, noise, generator), sigmas).to(text.dtype)
    cond = dropout_captions(config, cond, empty, batch, generator)
    cond = guidance_input(objective, cond, batch, latents.device)
    return noisy, sigmas * objective.timestep_scale, cond, latents, noise, sigmas
