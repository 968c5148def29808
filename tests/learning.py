"""Helpers of the proof-of-learning tests (tests/test_learning.py): a VAE whose latents carry the images,
the encoded latents read back from the shards, and the retrieval criterion.

Kept free of laionkit imports: what a trained run is judged by must not share code with what trained it.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

IMAGE_SUFFIXES = (".jpg", ".png")
LOGVAR = -30.0  # DiagonalGaussianDistribution's lower clamp: a posterior std of exp(-15), 3e-7


DUPLICATE = ("389_535.jpg", "original.png")  # the same photo, pixel for pixel (a JPEG and a PNG of it)


def distinct_photos(images: Path, output: Path, square: int | None = None) -> Path:
    """A copy of the real photos in which the PNG is mirrored left to right: realdata's 389_535.jpg and
    original.png are the same photo (img2dataset's resize and blur tests each keep one), so with them as
    they are, two captions would own one latent and no model could tell which image is which.

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


def patchify(latents):
    """[B, C, h, w] -> [B, 4C, h/2, w/2], FLUX.2 pipelines' _patchify_latents."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


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


def deterministic(vae: Path) -> bool:
    """Whether the VAE folder ``vae`` is a deterministic AutoencoderDC: its latents are stored as they are."""
    return json.loads((vae / "config.json").read_text()).get("_class_name") == "AutoencoderDC"


def shard_samples(latents: Path) -> dict:
    """{caption: {member kind: array}} of an encode folder's shards (docs/FORMATS.md section 3): ``moments``
    (posterior mean and log-variance), ``text`` (hidden states), ``mask`` and ``pooled`` where stored."""
    import numpy as np

    found = {}
    for shard in sorted(latents.glob("*.tar")):
        members = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, kind = member.name.partition(".")
                members.setdefault(key, {})[kind] = tar.extractfile(member).read()
        for sample in members.values():
            arrays = {kind.removesuffix(".npy"): np.load(io.BytesIO(data)) for kind, data in sample.items()
                      if kind.endswith(".npy")}
            found[json.loads(sample["json"])["caption"]] = arrays
    return found


def shard_latents(latents: Path, vae: Path) -> dict:
    """{caption: the model-space latent [C, h, w]} of an encode folder: each sample's posterior mean (the
    log-variance here is -30), or a deterministic VAE's stored latent, shifted and scaled by ``vae``'s config,
    as train makes it."""
    import torch

    config = json.loads((vae / "config.json").read_text())
    if "batch_norm_eps" in config:  # FLUX.2: its batch-norm statistics over the 2x2 pattern
        from safetensors.torch import load_file

        weights = load_file(vae / "diffusion_pytorch_model.safetensors")
        found = {}
        for caption, arrays in shard_samples(latents).items():
            mean = torch.from_numpy(arrays["moments"].astype("float32")).chunk(2)[0]
            found[caption] = bn_normalize(mean[None], weights["bn.running_mean"], weights["bn.running_var"],
                                          config["batch_norm_eps"])[0]
        return found
    if "latents_mean" in config and "z_dim" in config:  # Qwen-Image: per channel, (z - mean) / std
        shift, scale = torch.tensor(config["latents_mean"]).view(-1, 1, 1), 1 / torch.tensor(config["latents_std"]).view(-1, 1, 1)
    else:
        shift, scale = config.get("shift_factor") or 0.0, config["scaling_factor"]
    stored = 1 if deterministic(vae) else 2  # stored channels per latent channel
    found = {}
    for caption, arrays in shard_samples(latents).items():
        moments = torch.from_numpy(arrays["moments"].astype("float32"))
        found[caption] = (moments[: len(moments) // stored] - shift) * scale
    return found


def stored_texts(latents: Path, captions: list) -> dict:
    """The captions' stored text tensors as validation takes them: ``states`` [N, T, D] (and ``mask`` [N, T],
    ``pooled`` [N, P] where stored), sequences trimmed by encode padded back to the longest (mask False)."""
    import torch

    samples = shard_samples(latents)
    states = [torch.from_numpy(samples[c]["text"].astype("float32")) for c in captions]
    length = max(len(each) for each in states)
    texts = {"states": torch.stack([torch.nn.functional.pad(each, (0, 0, 0, length - len(each))) for each in states])}
    if "mask" in samples[captions[0]]:
        masks = [torch.from_numpy(samples[c]["mask"].astype(bool)) for c in captions]
        texts["mask"] = torch.stack([torch.nn.functional.pad(each, (0, length - len(each))) for each in masks])
    if "pooled" in samples[captions[0]]:
        texts["pooled"] = torch.stack([torch.from_numpy(samples[c]["pooled"].astype("float32")) for c in captions])
    return texts


def retrieval(generated: dict, own: dict, assign: dict | None = None) -> dict:
    """For each caption's generated latent: is its nearest image latent (MSE) the caption's own image
    (``assign[caption]``'s, the caption itself by default)? Returns the count of those, the mean MSE to
    the own latent and the mean MSE to the others', and each caption's ratio own / mean other."""
    captions = list(own)
    assign = assign or {caption: caption for caption in captions}
    nearest, own_mse, other_mse, ratios = 0, [], [], {}
    for caption, latent in generated.items():
        mse = {other: ((latent.float() - own[other]) ** 2).mean().item() for other in captions}
        target = assign[caption]
        others = [value for other, value in mse.items() if other != target]
        nearest += min(mse, key=mse.get) == target
        own_mse.append(mse[target])
        other_mse.append(sum(others) / len(others))
        ratios[caption] = mse[target] / other_mse[-1]
    return {"nearest_own": nearest, "own_mse": sum(own_mse) / len(own_mse),
            "other_mse": sum(other_mse) / len(other_mse), "ratios": ratios}


def spread(latents: dict) -> float:
    """The std of all values of {caption: latent}: samples drawn at the data's scale have the data's."""
    import torch

    return torch.stack([each.float() for each in latents.values()]).std().item()


# A fresh interpreter's generation with the family's own diffusers pipeline (no laionkit import):
# argv = pipeline folder, JSON list of caption orders (each a list of captions), output file, steps, size in
# px, guidance_scale and, where given, a LoRA folder (RUN/lora) loaded with pipe.load_lora_weights. Writes
# {"ORDER.INDEX": latent}, each caption with its own generator seeded with its index in its order, all captions
# of an order in one batch (a list of generators draws each sample's noise as a batch of one would; latents equal
# the one-at-a-time draws within 1e-5). Several orders in one interpreter: importing torch and diffusers costs
# more CPU time (~11 s) than drawing 8 captions.
GENERATE = r"""
import json, sys
import torch, diffusers
from safetensors.torch import save_file
folder, orders, output, steps, size = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
guidance, lora = float(sys.argv[6]), sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "-" else None
window = int(sys.argv[8]) if len(sys.argv) > 8 else 0  # the caption window encode used (0: the pipeline's)
assert "laionkit" not in sys.modules
pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
if lora:
    pipe.load_lora_weights(lora)
pipe.set_progress_bar_config(disable=True)
name = type(pipe).__name__
extra = {"use_resolution_binning": False, "clean_caption": False} if name.startswith(("PixArt", "Sana")) else {}
if window:
    extra["max_sequence_length"] = window
found = {}
for order, captions in enumerate(orders):  # one batch per order, each caption with its own generator
    generators = [torch.Generator().manual_seed(index) for index in range(len(captions))]
    latents = pipe(prompt=list(captions), num_inference_steps=steps, guidance_scale=guidance, height=size, width=size,
                   generator=generators, output_type="latent", **extra).images
    if name == "Flux2Pipeline":  # FLUX.2 [dev]: packed 2x2 patches, still normalised: unpacked, unpatchified
        b, tokens, channels = latents.shape
        latents = pipe._unpatchify_latents(latents.transpose(1, 2).reshape(b, channels, size // 16, size // 16))
    elif name.startswith("Flux2"):  # klein: un-normalised and unpatchified: normalised again, as the model sees it
        mean, var = pipe.vae.bn.running_mean, pipe.vae.bn.running_var
        patches = (pipe._patchify_latents(latents) - mean.view(1, -1, 1, 1)) / torch.sqrt(
            var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        latents = pipe._unpatchify_latents(patches)
    elif name.startswith("Flux"):
        latents = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)
    if name.startswith("QwenImage"):  # packed, and one frame: [B, C, 1, h, w]
        latents = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)[:, :, 0]
    for index in range(len(captions)):
        found[f"{order}.{index}"] = latents[index].float().contiguous()
save_file(found, output)
print(name, type(pipe.scheduler).__name__, "laionkit" in sys.modules)
"""
