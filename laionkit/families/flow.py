"""Flow matching (rectified flow) as pure functions: sigma sampling, shift, interpolation, target, weighting.

x_t = (1 - sigma) * x0 + sigma * noise, and the denoiser predicts the velocity noise - x0 (SD3, Flux).
Sigma is sampled and shifted directly instead of being looked up in a scheduler's timestep table:
``FlowMatchEulerDiscreteScheduler`` built with ``use_dynamic_shifting`` keeps an *unshifted* table (it
shifts only in ``set_timesteps(mu=...)``), so indexing it at train time silently drops Flux's shift, and
the table also quantizes sigma to 1/1000 steps. The denoiser's timestep input is ``sigma * 1000``.
"""

from __future__ import annotations

import math

SCHEMES = ("logit_normal", "uniform", "mode")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
NUM_TRAIN_TIMESTEPS = 1000


def sample_sigmas(n: int, scheme: str = "logit_normal", *, logit_mean: float = 0.0, logit_std: float = 1.0,
                  mode_scale: float = 1.29, generator=None, device="cpu"):
    """``n`` sigmas in (0, 1) from the SD3 paper's densities (section 3.1), before any shift.

    logit_normal: sigmoid(N(mean, std)); uniform: U(0, 1); mode: 1 - u - s(cos^2(pi u / 2) - 1 + u).
    Draws the same random numbers in the same order as diffusers' compute_density_for_timestep_sampling,
    so one generator state gives the same sigmas here and there.
    """
    import torch

    if scheme == "logit_normal":
        return torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(n,), device=device,
                                          generator=generator))
    u = torch.rand(size=(n,), device=device, generator=generator)
    if scheme == "uniform":
        return u
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    raise ValueError(f"unknown sigma sampling {scheme!r} (one of {', '.join(SCHEMES)})")


def shift_sigmas(sigmas, shift: float):
    """sigma' = s * sigma / (1 + (s - 1) * sigma): s > 1 moves training toward noisier inputs (SD3, Flux)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flux_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
            max_shift: float = 1.15) -> float:
    """Flux's ``calculate_shift``: mu linear in the image sequence length between the two anchors."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def resolution_shift(image_seq_len: int, **anchors) -> float:
    """The static-form shift s = exp(mu) for one resolution (bucket), so shift_sigmas applies Flux's rule."""
    return math.exp(flux_mu(image_seq_len, **anchors))


def image_seq_len(latent_height: int, latent_width: int, patch_size: int = 2) -> int:
    """Tokens the transformer sees for one latent: (h / p) * (w / p) patches."""
    return (latent_height // patch_size) * (latent_width // patch_size)


def _per_sample(sigmas, like):
    return sigmas.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def interpolate(x0, noise, sigmas):
    """x_t = (1 - sigma) * x0 + sigma * noise, sigma per sample."""
    sigma = _per_sample(sigmas, x0)
    return (1 - sigma) * x0 + sigma * noise


def velocity_target(x0, noise):
    """What the denoiser regresses: d x_t / d sigma = noise - x0."""
    return noise - x0


def timesteps(sigmas):
    """The timestep input SD3 / Flux transformers were trained with: sigma * 1000."""
    return sigmas * NUM_TRAIN_TIMESTEPS


def loss_weights(sigmas, weighting: str = "none"):
    """Per-sample loss weights (SD3 paper): none, sigma_sqrt (sigma^-2) or cosmap (2 / (pi (1 - 2s + 2s^2)))."""
    import torch

    if weighting == "none":
        return torch.ones_like(sigmas)
    if weighting == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    raise ValueError(f"unknown loss weighting {weighting!r} (one of {', '.join(WEIGHTINGS)})")


def loss(prediction, x0, noise, sigmas, weighting: str = "none"):
    """Weighted MSE to the velocity target, mean over each sample's elements, then over the batch (fp32)."""
    error = (prediction.float() - velocity_target(x0, noise).float()) ** 2
    weights = _per_sample(loss_weights(sigmas, weighting), error)
    return (weights * error).reshape(error.shape[0], -1).mean(dim=1).mean()
