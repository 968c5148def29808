"""Validation grids of the DDPM families sample as the family's pipeline does: DDIM on the model's noise
schedule without clipping x0 to [-1, 1] (issue 32), checked with an oracle denoiser.

The oracle returns, for any x_t and t, the exact noise of one fixed x0 with unit spread (a latent as the
VAE's scaling makes it), so a correct sampler ends on x0 and one that clips the predicted x0 cannot.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from laionkit.families import get_family
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.evaluation import sample_latents
from laionkit.trainer.objective import load_noise_scheduler

COUNT, SHAPE = 2, (4, 8, 8)  # prompts, latent (C, h, w)


class Oracle(torch.nn.Module):
    """Predicts eps = (x_t - sqrt(abar_t) x0) / sqrt(1 - abar_t) for the fixed ``x0``; everything else
    (config, dtype, SDXL's add_embedding) is the wrapped tiny denoiser's, so the pipeline takes it for one."""

    def __init__(self, model, x0: torch.Tensor, alphas_cumprod: torch.Tensor) -> None:
        super().__init__()
        self.model, self.x0, self.abar = model, x0, alphas_cumprod.double()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def forward(self, sample, timestep, *args, return_dict=True, **kwargs):
        abar = self.abar[torch.as_tensor(timestep).long().flatten()].view(-1, 1, 1, 1)
        x0 = self.x0.repeat(len(sample) // len(self.x0), 1, 1, 1).double()  # classifier-free guidance: x2
        eps = ((sample.double() - abar.sqrt() * x0) / (1 - abar).sqrt()).to(sample.dtype)
        if self.model.config.out_channels == 2 * self.model.config.in_channels:  # learned variance (PixArt)
            eps = torch.cat([eps, torch.zeros_like(eps)], dim=1)
        return (eps,)


@pytest.mark.parametrize("family", ["pixart", "sdxl", "sd"])
def test_ddpm_validation_sampling_reproduces_an_unclipped_x0(family, tmp_path):
    """PixArt-Σ's scheduler config (DPMSolverMultistepScheduler) and the SDXL one name no clip_sample, so
    DDIM took its default, True: samples cut to [-1, 1] (spread 0.6 to 0.75 of x0's here). SD's says false."""
    import diffusers

    spec = get_family(family)
    model = Path(spec.write_tiny(tmp_path / "model", 0))
    denoiser = getattr(diffusers, spec.denoiser_class).from_pretrained(model, subfolder=spec.denoiser_subfolder)
    vae = diffusers.AutoencoderKL.from_pretrained(model, subfolder="vae")
    config = TrainConfig(latents=tmp_path, output=tmp_path / "run", unet=str(model), max_steps=1,
                         validation_steps=25, validation_count=COUNT)
    scheduler = load_noise_scheduler(config, spec)  # from the model's scheduler/, as a fine-tune loads it
    x0 = torch.randn(COUNT, *SHAPE, generator=torch.Generator().manual_seed(7))
    assert x0.abs().max() > 2  # values a [-1, 1] clip would cut
    oracle = Oracle(denoiser, x0, scheduler.alphas_cumprod)
    # The prompts' stored text tensors: any values (the oracle ignores them), the family's shapes.
    texts = {"states": torch.randn(COUNT, 6, denoiser.config.cross_attention_dim
                                   if family != "pixart" else denoiser.config.caption_channels)}
    if family == "sdxl":
        width = (denoiser.config.projection_class_embeddings_input_dim - 6 * denoiser.config.addition_time_embed_dim)
        texts["pooled"] = torch.randn(COUNT, width)
    if family == "pixart":
        texts["mask"] = torch.ones(COUNT, 6)
    empty = {key: torch.zeros_like(value[0]) for key, value in texts.items()}
    data = SimpleNamespace(family=spec, moments_shape=(2 * SHAPE[0], *SHAPE[1:]), moments_per_channel=2, scaling_factor=1.0,
                           shift_factor=0.0)
    found = sample_latents(oracle, vae, scheduler, texts, empty, data, config, torch.device("cpu")).float()
    assert found.shape == x0.shape
    assert found.std().item() == pytest.approx(x0.std().item(), rel=0.03)
    assert (found - x0).abs().mean().item() < 0.05 and (found - x0).abs().max().item() < 0.2
