"""Flow-matching pieces agree with diffusers' own formulas and sampler on fixed seeds."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from laionkit.families import flow


@pytest.mark.parametrize("scheme, kwargs", [
    ("logit_normal", {"logit_mean": 0.3, "logit_std": 1.2}),
    ("uniform", {}),
    ("mode", {"mode_scale": 1.29}),
])
def test_sigma_sampling_matches_diffusers_density(scheme, kwargs):
    ours = flow.sample_sigmas(4096, scheme, **kwargs, generator=torch.Generator().manual_seed(7))
    theirs = compute_density_for_timestep_sampling(
        scheme, 4096, logit_mean=kwargs.get("logit_mean"), logit_std=kwargs.get("logit_std"),
        mode_scale=kwargs.get("mode_scale"), generator=torch.Generator().manual_seed(7),
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert 0 <= ours.min() and ours.max() <= 1


def test_logit_mean_moves_sigma_toward_noise():
    # SD3's convention: sigma is the noise share, so a positive logit mean trains noisier inputs.
    low = flow.sample_sigmas(2048, logit_mean=-1.0, generator=torch.Generator().manual_seed(0))
    high = flow.sample_sigmas(2048, logit_mean=1.0, generator=torch.Generator().manual_seed(0))
    assert high.mean() > 0.6 > 0.4 > low.mean()


def test_unknown_scheme_and_weighting_are_refused():
    with pytest.raises(ValueError, match="logit_normal"):
        flow.sample_sigmas(2, "lognormal")
    with pytest.raises(ValueError, match="cosmap"):
        flow.loss_weights(torch.ones(2), "cos")


@pytest.mark.parametrize("shift", [1.0, 3.0, 6.0])
def test_static_shift_matches_the_schedulers_training_table(shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    unshifted = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(flow.shift_sigmas(unshifted, shift), scheduler.sigmas, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seq_len", [256, 1024, 4096, 6144])
def test_resolution_shift_matches_flux_calculate_shift_and_dynamic_scheduler(seq_len):
    assert flow.flux_mu(seq_len) == pytest.approx(calculate_shift(seq_len))
    sigmas = [0.95, 0.7, 0.5, 0.2, 0.05]
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    scheduler.set_timesteps(sigmas=sigmas, mu=calculate_shift(seq_len))
    ours = flow.shift_sigmas(torch.tensor(sigmas), flow.resolution_shift(seq_len))
    torch.testing.assert_close(ours, scheduler.sigmas[:-1], rtol=1e-5, atol=1e-6)


def test_dynamic_scheduler_table_is_unshifted_so_sigmas_are_computed_directly():
    # Why flow.py never indexes a scheduler's table: with dynamic shifting the table carries no shift.
    table = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).sigmas
    torch.testing.assert_close(table, torch.linspace(1, 1000, 1000).flip(0) / 1000)
    shifted = flow.shift_sigmas(table, flow.resolution_shift(4096))
    assert (shifted[1:-1] > table[1:-1]).all()


def test_image_seq_len_is_flux_packed_tokens():
    # A 1024 px image: 128x128 latent, 2x2 patches -> 4096 tokens, Flux's max_seq_len anchor.
    assert flow.image_seq_len(128, 128) == 4096
    assert flow.image_seq_len(64, 96) == 32 * 48


def test_velocity_target_is_what_the_euler_sampler_integrates():
    # One step of diffusers' FlowMatchEulerDiscreteScheduler with the exact target moves x_t along the
    # straight line to x_{t'}: the interpolation and target conventions are the sampler's.
    generator = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_inference_steps=10)
    index = 4
    sigma, sigma_next = scheduler.sigmas[index], scheduler.sigmas[index + 1]
    x_t = flow.interpolate(x0, noise, sigma.repeat(2))
    torch.testing.assert_close(x_t, scheduler.scale_noise(x0, scheduler.timesteps[index: index + 1], noise))
    stepped = scheduler.step(flow.velocity_target(x0, noise), scheduler.timesteps[index], x_t).prev_sample
    torch.testing.assert_close(stepped, flow.interpolate(x0, noise, sigma_next.repeat(2)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flow.timesteps(sigma), scheduler.timesteps[index])


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_loss_weighting_matches_diffusers(weighting):
    sigmas = flow.sample_sigmas(64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(flow.loss_weights(sigmas, weighting),
                               compute_loss_weighting_for_sd3(weighting, sigmas))


def test_loss_is_diffusers_sd3_loss():
    generator = torch.Generator().manual_seed(5)
    x0, noise, pred = (torch.randn(3, 4, 8, 8, generator=generator) for _ in range(3))
    sigmas = flow.sample_sigmas(3, generator=generator)
    # diffusers' train_dreambooth_sd3.py: weighting[:, None, None, None] * (pred - target)^2, mean per sample.
    weighting = compute_loss_weighting_for_sd3("cosmap", sigmas).view(-1, 1, 1, 1)
    expected = torch.mean((weighting * (pred - (noise - x0)) ** 2).reshape(3, -1), 1).mean()
    torch.testing.assert_close(flow.loss(pred, x0, noise, sigmas, "cosmap"), expected)
    assert flow.loss(noise - x0, x0, noise, sigmas, "cosmap") == 0
