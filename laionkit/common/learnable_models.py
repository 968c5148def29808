"""Tiny models that can learn a handful of photos (distinct_photos): a VAE whose latents carry the images
(sharpen_vae, sharpen_dc_vae) and decode back to them (fit_decoder), a CLIP whose states tell their captions
apart (sharpen_text_encoder), and an SD UNet with room to hold them (WIDE_SD_UNET).

`laionkit models tiny` writes random-init models: their VAE's latents are noise around nearly equal means and
its decoder draws colour noise, so nothing trained on them can show that it learned. `laionkit demo` and the
proof-of-learning tests (tests/test_learning.py) build on these instead.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_SUFFIXES = (".jpg", ".png")
LOGVAR = -30.0  # DiagonalGaussianDistribution's lower clamp: a posterior std of exp(-15), 3e-7

# SD's UNet a few times wider than `tiny`'s (room to hold 8 images at 64 px): cross-attention at the 4x4 level,
# two transformer layers there; SDXL's is the same with the text_time embedding. The CLIP that `laionkit models
# tiny` writes, unchanged, tells 8 captions apart enough for it (tests/test_learning.py); `laionkit demo` makes it
# a bag of words (sharpen_text_encoder), so that 300 steps draw each photo from its caption.
WIDE_SD_UNET = {
    "sample_size": 8, "in_channels": 4, "out_channels": 4, "block_out_channels": [64, 128],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "layers_per_block": 1, "attention_head_dim": [4, 8], "transformer_layers_per_block": [1, 2],
    "use_linear_projection": True, "norm_num_groups": 32}

DUPLICATE = ("389_535.jpg", "original.png")  # the same photo, pixel for pixel (a JPEG and a PNG of it)


def distinct_photos(images: Path, output: Path, square: int | None = None) -> Path:
    """A copy of the real photos in which the PNG is mirrored left to right: realdata's (and laionkit/data/demo's)
    389_535.jpg and original.png are the same photo (img2dataset's resize and blur tests each keep one), so with
    them as they are, two captions would own one latent and no model could tell which image is which.

    ``square``: each photo cut to ``square`` x ``square`` px first (short side resized, centre crop), so
    that every photo's original size is the same and its crop corner (0, 0). SDXL conditions on both (its
    time ids): the photos' own sizes would tell the images apart without their captions, and a pipeline
    given no sizes draws with (size, size) and (0, 0), which the model then has seen."""
    from PIL import Image, ImageOps

    output.mkdir(parents=True, exist_ok=True)
    for path in images.iterdir():
        if path.suffix in IMAGE_SUFFIXES:
            (output / path.name).write_bytes(path.read_bytes())
    with Image.open(images / DUPLICATE[1]) as image:
        ImageOps.mirror(image).save(output / DUPLICATE[1])
    if square:
        for path in output.iterdir():
            with Image.open(path) as image:
                cut = ImageOps.fit(image.convert("RGB"), (square, square), Image.Resampling.BICUBIC)
            cut.save(path)
    return output


def photos(images: Path, size: int = 64):
    """The real photos as a VAE takes them: [N, 3, size, size] in [-1, 1], short side resized and centre-cropped
    (as encode's square crops, up to the resampler's details)."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    found = []
    for path in sorted(p for p in images.iterdir() if p.suffix in IMAGE_SUFFIXES):
        with Image.open(path) as image:
            array = np.array(ImageOps.fit(image.convert("RGB"), (size, size), Image.Resampling.BICUBIC))
        found.append(torch.from_numpy(array).permute(2, 0, 1).float() / 127.5 - 1)
    return torch.stack(found)


def sharpen_vae(folder: Path, images: Path, size: int | None = None) -> dict:
    """Rewrite ``folder`` (an AutoencoderKL saved by save_pretrained) into one with what a trained VAE has,
    its statistics taken on the images of the folder ``images`` at ``size`` px (default: the VAE's
    sample_size; scripts/bench_learning.py passes its training resolution).

    A random-init VAE's posterior log-variance is about 0, so the latent drawn from it each epoch is mostly
    noise (std ~1 before scaling, against means whose spread is a few hundredths), and its means barely
    differ between images (8 photos' latents differ by an MSE of ~0.002 after SD's scaling factor): nothing
    a denoiser could learn to tell apart. Here the layer that outputs the posterior's moments (``quant_conv``
    where the VAE has one, SD / SDXL / PixArt-Σ; else ``encoder.conv_out``, SD3 / Flux) is changed:
    - log-variance half: weights 0, bias -30 (diffusers' clamp), so every draw is the mean;
    - mean half: an affine map per channel, chosen on the real photos so that their latents, after the
      config's ``(z - shift_factor) * scaling_factor``, have mean 0 and std 1 per channel, as a trained
      VAE's scaling factor intends. The between-image share of that variance is what the random encoder
      gives (most of it: the latents of different photos differ by an MSE of ~1.5).
    Returns the photos' scaled latent statistics (std, mean pairwise MSE between photos)."""
    import diffusers
    import torch

    from laionkit.families.flux2 import patchify

    config = json.loads((folder / "config.json").read_text())
    vae = getattr(diffusers, config["_class_name"]).from_pretrained(folder)
    config = vae.config
    layer = vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out
    frames = "z_dim" in config  # Qwen-Image's video VAE: one frame, per-channel statistics instead of scaling
    batch_norm = "batch_norm_eps" in config  # FLUX.2's AutoencoderKLFlux2: batch-norm statistics instead of scaling
    channels = config.z_dim if frames else config.latent_channels
    pixels = photos(images, size or (64 if frames else config.sample_size))
    pixels = pixels[:, :, None] if frames else pixels
    dims = (0, *range(2, pixels.dim()))
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean  # the layer's mean half, as it is
        centre, spread = mean.mean(dims), mean.std(dims)
        if frames:  # new mean = (old - centre) / spread * std + mean, so that (new - mean) / std = (old - centre) / spread
            want_mean, want_std = torch.tensor(config.latents_mean), torch.tensor(config.latents_std)
            factor, offset = want_std / spread, want_mean
        elif batch_norm:  # FLUX.2: unit latents, and the batch-norm statistics set from them below
            factor, offset = 1.0 / spread, 0.0
        else:  # new mean = (old - centre) / spread / scale + shift, so that (new - shift) * scale = (old - centre) / spread
            shift, scale = config.shift_factor or 0.0, config.scaling_factor
            factor, offset = 1.0 / (spread * scale), shift
        layer.weight[:channels] *= factor.view(-1, *[1] * (layer.weight.dim() - 1))
        layer.bias[:channels] = (layer.bias[:channels] - centre) * factor + offset
        layer.weight[channels:] = 0.0
        layer.bias[channels:] = LOGVAR
        found = vae.encode(pixels).latent_dist
        if frames:
            shape = (1, -1, 1, 1, 1)
            latents = ((found.mean - want_mean.view(shape)) / want_std.view(shape))[:, :, 0]
        elif batch_norm:  # the running statistics of the 2x2-patchified latents, as a trained one's are
            patches = patchify(found.mean)
            vae.bn.running_mean[:] = patches.mean((0, 2, 3))
            vae.bn.running_var[:] = (patches.var((0, 2, 3)) - config.batch_norm_eps).clamp(min=1e-4)
            latents = bn_normalize(found.mean, vae.bn.running_mean, vae.bn.running_var, config.batch_norm_eps)
        else:
            latents = (found.mean - shift) * scale
    assert found.std.max().item() < 1e-5
    vae.save_pretrained(folder, safe_serialization=True)
    n = len(latents)
    pairwise = ((latents[:, None] - latents[None]) ** 2).mean((2, 3, 4)).sum().item() / (n * (n - 1))
    return {"std": latents.std().item(), "pairwise_mse": pairwise}


def bn_normalize(latents, mean, var, eps: float):
    """FLUX.2's normalisation of [B, C, h, w] latents, kept unpatchified: (patchify(z) - mean) / sqrt(var + eps)
    per patchified channel, laid back over the 2x2 pattern."""
    import torch

    b, c, h, w = latents.shape
    pattern = lambda values: values.view(c, 2, 2).repeat(1, h // 2, w // 2)  # noqa: E731
    return (latents - pattern(mean)) / pattern(torch.sqrt(var + eps))


def sharpen_dc_vae(folder: Path, images: Path, size: int = 64) -> dict:
    """sharpen_vae for a deterministic AutoencoderDC (Sana's DC-AE; ``folder`` saved by save_pretrained): it has
    no posterior to make sharp, but its random-init latents, like AutoencoderKL's means, are not at the scale
    a trained one's scaling factor intends. The encoder's last layer (``encoder.conv_out``) gets the affine
    map per channel, chosen on the real photos at ``size`` px, that gives their latents mean 0 and std 1 per
    channel after ``latent * scaling_factor`` (the pipeline's scaling; DC-AE has no shift factor). The encoder
    adds a parameter-free shortcut (its last features averaged per group of channels) after that layer, which
    no weight could rescale: it is turned off (``encoder_out_shortcut: false``, a config switch of the same
    class; the weights are unchanged), so the layer alone gives the latent. Returns the photos' scaled latent
    statistics (std, mean pairwise MSE between photos)."""
    import torch
    from diffusers import AutoencoderDC

    vae = AutoencoderDC.from_pretrained(folder, encoder_out_shortcut=False)
    scale, layer = vae.config.scaling_factor, vae.encoder.conv_out
    pixels = photos(images, size)
    with torch.no_grad():
        latent = vae.encode(pixels).latent
        centre, spread = latent.mean((0, 2, 3)), latent.std((0, 2, 3))
        factor = 1.0 / (spread * scale)
        layer.weight *= factor.view(-1, 1, 1, 1)
        layer.bias[:] = (layer.bias - centre) * factor
        latents = vae.encode(pixels).latent * scale
    vae.save_pretrained(folder, safe_serialization=True)
    n = len(latents)
    pairwise = ((latents[:, None] - latents[None]) ** 2).mean((2, 3, 4)).sum().item() / (n * (n - 1))
    return {"std": latents.std().item(), "pairwise_mse": pairwise}


def sharpen_text_encoder(folder: Path) -> None:
    """Rewrite ``folder`` (a CLIPTextModel saved by save_pretrained, as `laionkit models tiny` writes it) into one
    whose states tell captions apart, as a trained one's do.

    A random-init CLIP's states are mostly what every caption shares: the position embeddings, the end-of-text
    tokens that pad 60-odd of the 77 positions, and random layers that mix them. The 8 demo captions' states
    differ by an MSE of about a tenth of their variance, so a denoiser needs hundreds of steps to learn which
    caption is which. Here the encoder becomes a bag of words: position embeddings and the start / end-of-text
    rows of the token embedding are zero; each layer's attention is uniform over the tokens before it (query and
    key weights zero) and passes them on (value and output projections the identity); its MLP adds nothing
    (fc2 zero). A position's state is then the normalised mean of the caption's words up to it, so every padding
    position carries the whole caption. The weights keep their shapes: from_pretrained loads it as any CLIP."""
    import torch
    from transformers import CLIPTextModel

    encoder = CLIPTextModel.from_pretrained(folder)
    config = encoder.config
    with torch.no_grad():
        encoder.embeddings.position_embedding.weight.zero_()
        for token in {config.bos_token_id, config.eos_token_id, config.pad_token_id}:
            encoder.embeddings.token_embedding.weight[token] = 0.0
        for layer in encoder.encoder.layers:
            attention = layer.self_attn
            for projection in (attention.q_proj, attention.k_proj, layer.mlp.fc2):
                projection.weight.zero_()
                projection.bias.zero_()
            for projection in (attention.v_proj, attention.out_proj):
                projection.weight.copy_(torch.eye(config.hidden_size))
                projection.bias.zero_()
    encoder.save_pretrained(folder, safe_serialization=True)


def fit_decoder(folder: Path, images: Path, steps: int = 300, lr: float = 3e-3, noise: float = 0.2,
                seed: int = 0) -> float:
    """Train the decoder of ``folder`` (an AutoencoderKL that sharpen_vae made sharp) to give back the photos of
    ``images`` from their latents, and save it; returns the last pixel MSE (pixels in [-1, 1]).

    A random-init decoder draws colour noise even from a photo's own latent, so a denoiser that learned the
    latents would still show noise. This one is fitted on these photos only, as a trained VAE's decoder is
    fitted on images: it decodes their latents back to them, and nothing else well. Each step adds Gaussian
    noise of std ``noise`` (in units of the scaled latents, whose std is 1) to the latents, so that a sample
    near a photo's latent, which is what a denoiser draws, decodes near the photo too."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder)
    pixels = photos(images, vae.config.sample_size)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(vae.decoder.parameters(), lr=lr)
    for _ in range(steps):
        nearby = latents + torch.randn(latents.shape, generator=generator) * noise / vae.config.scaling_factor
        loss = torch.nn.functional.mse_loss(vae.decode(nearby).sample, pixels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vae.save_pretrained(folder, safe_serialization=True)
    return loss.item()
