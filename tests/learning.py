"""Helpers of the proof-of-learning tests (tests/test_learning.py): the encoded latents read back from the
shards, and the retrieval criterion.

The photos and the models that can learn them (a VAE whose latents carry the images, a wide enough denoiser)
are the package's, laionkit/common/learnable_models.py, which `laionkit demo` builds on too. The criterion takes
nothing else of laionkit but bn_normalize (FLUX.2's latent normalisation, which the model's VAE defines): what
a trained run is judged by must not share code with what trained it.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from laionkit.common.learnable_models import bn_normalize


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
