"""The models `laionkit score` runs: an open_clip CLIP (embeddings, caption similarity), LAION's watermark
detector and LAION's CLIP-embedding NSFW head, in their released architectures; weights are read as
data (safetensors, or torch's weights-only loader), never unpickled.

- Watermark (LAION-5B-WatermarkDetection, ``watermark_model_v1.pt``): timm ``efficientnet_b3a`` (timm >= 0.9
  maps that deprecated name to ``efficientnet_b3``, the same network: every weight name and shape) with its
  classifier replaced by Linear(1536, 625) - ReLU - Dropout(0.3) - Linear(625, 256) - ReLU - Linear(256, 2),
  on 256x256 squashed RGB with ImageNet normalisation; ``pwatermark`` = softmax(logits)[:, 0].
- NSFW (LAION-AI/CLIP-based-NSFW-Detector, ``clip_autokeras_binary_nsfw`` for ViT-L/14): a Keras
  Normalization layer (mean, variance) then Dense 768->64->512->256->1 with ReLU between and a sigmoid
  out, over the L2-normalised CLIP image embedding; ``punsafe`` = that sigmoid. Weights in the layout of
  the torch ports of that Keras model: ``norm.mean``, ``norm.variance``, ``linear_{1..4}.weight/bias``
  (weights (out, in)). Keras' Normalization divides by max(sqrt(variance), 1e-7), and so does this.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from laionkit.common import LaionkitError
from laionkit.common.models import weights_error

WATERMARK_SIZE = 256
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
KERAS_EPSILON = 1e-7
NSFW_HIDDEN = (64, 512, 256, 1)


def read_weights(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file or a torch file read with ``weights_only=True`` (tensors and
    plain containers only: no code runs)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise LaionkitError(f"{what} weights not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same user mistake
        raise LaionkitError(f"{path}: not a {what} state dict ({weights_error(error)})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LaionkitError(f"{path}: not a {what} state dict of tensors")
    return state


def _load_strict(model: nn.Module, state: dict, path: str | Path, what: str) -> nn.Module:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = " ".join(line.strip() for line in str(error).splitlines()[:3])[:400]
        raise LaionkitError(f"{path}: not {what} weights: {first}") from None
    return model.eval()


# --- watermark -------------------------------------------------------------------------------------

def watermark_network() -> nn.Module:
    """LAION's watermark detector, random init (load weights with ``load_watermark``)."""
    import timm

    model = timm.create_model("efficientnet_b3", pretrained=False, num_classes=2)  # = efficientnet_b3a
    model.classifier = nn.Sequential(
        nn.Linear(1536, 625), nn.ReLU(), nn.Dropout(p=0.3), nn.Linear(625, 256), nn.ReLU(), nn.Linear(256, 2))
    return model


def load_watermark(path: str | Path) -> nn.Module:
    return _load_strict(watermark_network(), read_weights(path, "watermark"), path, "LAION watermark detector")


def watermark_probability(logits: torch.Tensor) -> torch.Tensor:
    """pwatermark as LAION computes it: the softmax's first class."""
    return torch.softmax(logits.float(), dim=1)[:, 0]


# --- NSFW ------------------------------------------------------------------------------------------

class NsfwHead(nn.Module):
    """LAION's CLIP-embedding NSFW detector (see the module docstring), input dim ``dim`` (768 for L/14)."""

    def __init__(self, dim: int = 768) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.register_buffer("mean", torch.zeros(dim))
        self.norm.register_buffer("variance", torch.ones(dim))
        sizes = (dim, *NSFW_HIDDEN)
        for index in range(len(NSFW_HIDDEN)):
            setattr(self, f"linear_{index + 1}", nn.Linear(sizes[index], sizes[index + 1]))

    @property
    def dim(self) -> int:
        return int(self.norm.mean.shape[0])

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        x = (embeddings - self.norm.mean) / torch.clamp(self.norm.variance.sqrt(), min=KERAS_EPSILON)
        x = torch.relu(self.linear_1(x))
        x = torch.relu(self.linear_2(x))
        x = torch.relu(self.linear_3(x))
        return torch.sigmoid(self.linear_4(x))[:, 0]


def load_nsfw(path: str | Path) -> NsfwHead:
    state = read_weights(path, "NSFW")
    state = {key: (value.reshape(-1) if key.startswith("norm.") else value) for key, value in state.items()}
    if "norm.mean" not in state:
        raise LaionkitError(f"{path}: not LAION NSFW head weights (no norm.mean; expected norm.mean, norm.variance, "
                            "linear_1..4.weight/bias)")
    return _load_strict(NsfwHead(int(state["norm.mean"].shape[0])), state, path, "LAION NSFW head")


# --- random-init weights in the released layouts (tests, benchmarks, the offline demo) ------------------

def write_random_watermark(path: str | Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = watermark_network()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def write_random_nsfw(path: str | Path, dim: int = 768, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NsfwHead(dim)
        model.norm.mean.normal_(0, 0.02)
        model.norm.variance.uniform_(1e-4, 1e-3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


# --- CLIP --------------------------------------------------------------------------------------------

def load_score_clip(model: str, pretrained: str | None, device: torch.device):
    """(model, preprocess, tokenizer, the open_clip name prompt scores load) via evaluate.clipscore.load_clip:
    a model name, hf-hub:ORG/REPO or a model config .json (then registered under its stem), with a tag or a
    weights file."""
    from laionkit.evaluate.clipscore import load_clip

    level = logging.root.level
    logging.root.setLevel(logging.ERROR)  # open_clip warns when no pretrained weights are loaded (tests)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # a random init (no weights) is seeded as laionkit.common.clip_scores' prompt model is
            clip, preprocess, tokenizer = load_clip(model, pretrained, device)
    finally:
        logging.root.setLevel(level)
    name = Path(model).stem if model.endswith(".json") else model
    return clip, preprocess, tokenizer, name


def write_tiny_score_clip(folder: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """evaluate.clipscore's tiny random-init open_clip model with LAION's embedding width (768, as ViT-L/14),
    so the real aesthetic heads and the NSFW head's shapes apply: FOLDER/tiny-clip-768.json + .safetensors."""
    from laionkit.evaluate.clipscore import write_tiny_clip

    return write_tiny_clip(Path(folder), seed, embed_dim=768, name="tiny-clip-768")
