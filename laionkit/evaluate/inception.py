"""The Inception-v3 feature extractor of FID and KID: torch-fidelity's port of the TensorFlow graph FID was
defined on, with its weights loaded as data.

Why this one: torch-fidelity's ``FeatureExtractorInceptionV3`` is the network torchmetrics'
FrechetInceptionDistance and KernelInceptionDistance run (MosaicML's SD2 replication reports its FID with
torchmetrics), its layers reproduce the TensorFlow graph (the TF1 bilinear resize to 299 included), and
its weights (``weights-inception-2015-12-05-6726825d.pth``, the same converted TF weights as pytorch-fid's
``pt_inception-2015-12-05-6726825d.pth``) are a plain state dict. clean-fid ships its Inception as a
TorchScript archive (code, not data), so it is not used. torch-fidelity's own constructor reads a weights
path with an unrestricted ``torch.load(weights_only=False)``; here it is handed an empty placeholder and
the real state dict is read with ``torch.load(weights_only=True)`` (or safetensors) and loaded strictly
afterwards, so a file of another architecture is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import numpy as np
import torch

from laionkit.common import LaionkitError, atomic_output
from laionkit.common.models import weights_error

# torch-fidelity's release of the converted weights (what its constructor downloads when given no path).
INCEPTION_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                 "weights-inception-2015-12-05-6726825d.pth")
# File names tried in a hub repo given as owner/name without a file.
HUB_FILES = ("weights-inception-2015-12-05-6726825d.pth", "pt_inception-2015-12-05-6726825d.pth",
             "model.safetensors")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w.-]+)?$")
FEATURES = "2048"  # the pool3 features FID and KID are defined on
BATCH = 32


def _fidelity():
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError:
        raise LaionkitError("laionkit eval needs torch-fidelity: pip install 'laionkit[eval]'") from None
    return FeatureExtractorInceptionV3


def build_inception(state: dict | None = None) -> torch.nn.Module:
    """torch-fidelity's InceptionV3 returning the 2048 pool features; ``state`` loaded strictly (None:
    the random init, for writing test weights)."""
    base = _fidelity()

    class Inception(base):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            if not state_dict:  # the placeholder the constructor reads
                return None
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    placeholder = io.BytesIO()
    torch.save({}, placeholder)
    placeholder.seek(0)
    model = Inception("inception-v3-compat", [FEATURES], feature_extractor_weights_path=placeholder)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def resolve_weights(source: str) -> Path:
    """A local file, an http(s) URL (downloaded once per URL into torch's hub cache), or a Hugging Face hub id
    ``owner/name`` (one of HUB_FILES) or ``owner/name/FILE``."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if source.startswith(("http://", "https://")):
        # named by the URL's hash too: two URLs of one file name are two files (never one's weights for the other)
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        target = Path(torch.hub.get_dir()) / "checkpoints" / f"{digest}-{source.rsplit('/', 1)[-1]}"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                torch.hub.download_url_to_file(source, str(target), progress=False)
            except Exception as error:  # noqa: BLE001 - any network failure is the same user-facing fact
                raise LaionkitError(f"--inception {source}: download failed ({error}); give a local weights "
                                    "file") from None
        return target
    local = source.count("/") < 2 and source.endswith((".pth", ".pt", ".bin", ".safetensors"))
    if not HUB_ID.match(source) or local or path.exists():
        raise LaionkitError(f"--inception {source}: no such file (give a .pth state dict or .safetensors file, a "
                            "URL, or a hub id owner/name[/FILE])")
    parts = source.split("/")
    from huggingface_hub import hf_hub_download

    repo, names = "/".join(parts[:2]), ([parts[2]] if len(parts) == 3 else list(HUB_FILES))
    errors = []
    for name in names:
        try:
            return Path(hf_hub_download(repo, name))
        except Exception as error:  # noqa: BLE001
            errors.append(f"{name}: {type(error).__name__}")
    raise LaionkitError(f"--inception {source}: not a local file, and the hub gave none of "
                        f"{', '.join(names)} ({'; '.join(errors)})")


def read_state_dict(path: Path) -> dict:
    """A state dict read as data: safetensors, or torch.load(weights_only=True); never a pickle's code."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch and safetensors raise many types; all mean "not a weights file"
        raise LaionkitError(f"{path}: not a state dict loadable as data ({weights_error(error)})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LaionkitError(f"{path}: expected a state dict of tensors, got {type(state).__name__}")
    return state


def load_inception(source: str) -> torch.nn.Module:
    """The FID Inception with the weights of ``source`` (resolve_weights); a file of another layout is
    named with its first missing, unexpected or mis-shaped key."""
    path = resolve_weights(source)
    state = read_state_dict(path)
    model = build_inception()
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} (expected {tuple(expected[k].shape)})"
              for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        detail = "; ".join(part for part in (
            f"{len(missing)} missing keys, e.g. {missing[0]}" if missing else "",
            f"{len(unexpected)} unexpected keys, e.g. {unexpected[0]}" if unexpected else "",
            f"{len(shapes)} mis-shaped, e.g. {shapes[0]}" if shapes else "") if part)
        raise LaionkitError(f"--inception {path}: not the FID Inception-v3 weights "
                            f"(torch-fidelity's / pytorch-fid's layout): {detail}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model


def write_random_inception(path: Path, seed: int = 0) -> Path:
    """A random-init Inception in the real file's layout (same keys and shapes, a torch.save state dict),
    for tests and the offline demo: it loads through load_inception exactly as the real weights do.
    Convolutions get He-normal weights and batch norms unit statistics, so activations keep their scale
    through the ~90 layers and the random features still differ between images."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_inception()
        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with atomic_output(path) as tmp:
        torch.save(state, tmp)
    return Path(path)


@torch.no_grad()
def inception_features(model: torch.nn.Module, images: np.ndarray, batch_size: int = BATCH,
                       device: torch.device | str = "cpu") -> np.ndarray:
    """(N, 2048) float64 features of uint8 images (N, H, W, 3); the network resizes to 299 itself."""
    model = model.to(device)
    out = []
    for start in range(0, len(images), batch_size):
        batch = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size])).permute(0, 3, 1, 2)
        (features,) = model(batch.to(device))
        out.append(features.double().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 2048))
