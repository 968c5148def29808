"""CLIP score of generated images against their prompts, with an open_clip model, as torchmetrics'
CLIPScore computes it: ``100 * cos(E_I, E_C)`` per image-caption pair, averaged, and the average clipped
at 0 (torchmetrics clips the mean, not each pair; the two agree whenever no pair is negative, as with
real CLIP models).

The model is what open_clip itself loads: ``--clip-model`` a model name (``ViT-L-14``), ``hf-hub:org/repo``
or a model config JSON file in open_clip's ``model_configs`` format (its file name is the model name);
``--clip-pretrained`` a tag open_clip knows (``openai``, ``laion2b_s32b_b82k``) or a weights file
(``.safetensors``, or a state dict open_clip reads with ``torch.load(weights_only=True)``).
``write_tiny_clip`` saves a random-init model in that layout for tests and the offline demo.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import numpy as np
import torch

from laionkit.common import LaionkitError
from laionkit.common.clip_scores import open_clip_name
from laionkit.common.models import weights_error

# A small ViT CLIP in open_clip's config format (a model_configs/*.json file); the real BPE vocabulary.
TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def load_clip(model: str, pretrained: str | None, device: torch.device | str = "cpu"):
    """(model, image preprocess, tokenizer) from open_clip's create_model_and_transforms."""
    import open_clip

    name = open_clip_name(model)
    if pretrained and not model.startswith(("hf-hub:", "local-dir:")):
        weights = Path(pretrained).expanduser()
        known = pretrained in open_clip.list_pretrained_tags_by_model(name)
        if not known and not weights.is_file():
            raise LaionkitError(f"--clip-pretrained {pretrained}: neither a weights file nor a tag open_clip "
                                f"knows for {name} ({', '.join(open_clip.list_pretrained_tags_by_model(name)) or 'none'})")
    try:
        clip, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=pretrained or None, device=device, weights_only=True)
    except TypeError:  # open_clip releases before weights_only=: they read with torch.load's default
        clip, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained or None,
                                                                    device=device)
    except pickle.UnpicklingError as error:  # torch's weights-only loader: a pickle that would run code
        raise LaionkitError(f"--clip-pretrained {pretrained}: {weights_error(error)}") from None
    except (RuntimeError, AssertionError, KeyError, ValueError) as error:  # missing / unexpected keys, sizes
        first = str(error).splitlines() or [type(error).__name__]
        raise LaionkitError(f"--clip-pretrained {pretrained}: does not fit --clip-model {model}: "
                            f"{' '.join(line.strip() for line in first[:3])[:300]}") from None
    return clip.eval(), preprocess, open_clip.get_tokenizer(name)


@torch.no_grad()
def clip_similarities(clip, preprocess, tokenizer, images: list, prompts: list[str], batch_size: int = 32,
                      device: torch.device | str = "cpu") -> np.ndarray:
    """``100 * cos`` of each (image, prompt) pair, images as PIL images or uint8 (H, W, 3) arrays."""
    from PIL import Image

    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    scores = []
    for start in range(0, len(images), batch_size):
        chunk = [image if isinstance(image, Image.Image) else Image.fromarray(image)
                 for image in images[start:start + batch_size]]
        pixels = torch.stack([preprocess(image) for image in chunk]).to(device)
        image_features = clip.encode_image(pixels).float()
        text_features = clip.encode_text(tokenizer(prompts[start:start + batch_size]).to(device)).float()
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        scores.append((100 * (image_features * text_features).sum(-1)).double().cpu().numpy())
    return np.concatenate(scores) if scores else np.zeros(0)


def clip_score(similarities: np.ndarray) -> float:
    """torchmetrics' CLIPScore.compute: the mean of the pairs' ``100 * cos``, clipped at 0."""
    return max(float(np.mean(similarities)), 0.0)


def write_tiny_clip(folder: Path, seed: int = 0, embed_dim: int | None = None, name: str = "tiny-clip"
                    ) -> tuple[Path, Path]:
    """A random-init open_clip model: FOLDER/tiny-clip.json (open_clip's model config format) and
    FOLDER/tiny-clip.safetensors (its state dict); load with ``--clip-model FOLDER/tiny-clip.json
    --clip-pretrained FOLDER/tiny-clip.safetensors``. ``embed_dim`` widens the joint embedding (768: LAION's
    ViT-L/14 width, so its aesthetic and NSFW heads apply); ``name`` names the two files."""
    import open_clip
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{name}.json"
    config.write_text(json.dumps({**TINY_CLIP, **({"embed_dim": embed_dim} if embed_dim else {})}, indent=2) + "\n")
    open_clip.add_model_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        level = logging.root.level
        logging.root.setLevel(logging.ERROR)  # open_clip warns that no pretrained weights were loaded
        try:
            model = open_clip.create_model(config.stem)
        finally:
            logging.root.setLevel(level)
    weights = folder / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return config, weights
