"""Custom CLIP scores computed from LAION's precomputed image embeddings, chosen from a registry of kinds.

A score kind turns ``ARG`` (a weights file or a prompt) into a function from an (N, D) block of
L2-normalised float32 embeddings to N float32 scores. ``laionkit filter --score NAME=KIND:ARG`` adds
the result as column NAME, usable in ``--where``.

Heads (``aesthetic-v2``, ``aesthetic-v1``, ``head``) are chains of ``nn.Linear`` layers applied in
state-dict order with nothing between them, as in LAION's released predictors (the v2 MLP has dropout
between its layers, a no-op at inference, and no activations). A chain of affine maps is one affine
map, so the chain is folded once in float64 into a single (D,) weight and a bias: scoring 1M rows is
then one matrix-vector product instead of ~0.9 GFLOP per thousand rows, and matches the layer-by-layer
float32 module to ~1e-6.
"""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from laionkit.common import LaionkitError
from laionkit.common.models import weights_error

# Rows scored at once: bounds the float32 copy of a float16 memory-mapped block (8192 x 768 x 4 = 24 MiB).
SCORE_BATCH_ROWS = 8192

# The layer shapes (out, in) of LAION's predictors, checked so a wrong file is named, not silently used.
AESTHETIC_V2_SHAPES = ((1024, 768), (128, 1024), (64, 128), (16, 64), (1, 16))
AESTHETIC_V1_SHAPES = ((1, 768),)

SCORE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ScoreSpec:
    """One ``--score NAME=KIND:ARG``."""

    name: str
    kind: str
    arg: str

    @classmethod
    def parse(cls, text: str) -> ScoreSpec:
        name, eq, rest = text.partition("=")
        kind, colon, arg = rest.partition(":")
        if not eq or not colon or not arg:
            raise LaionkitError(
                f"--score {text!r}: expected NAME=KIND:ARG, e.g. aes=aesthetic-v2:weights.pth"
            )
        if not SCORE_NAME.match(name):
            raise LaionkitError(f"--score {text!r}: the name {name!r} must be a plain identifier")
        if kind not in SCORE_KINDS:
            raise LaionkitError(f"--score {text!r}: unknown kind {kind!r}; known: {', '.join(SCORE_KINDS)}")
        return cls(name, kind, arg)


@dataclass(frozen=True)
class Scorer:
    """A built score for (N, dim) embeddings: ``project(x) / ||x|| + offset``.

    ``project`` is positively homogeneous (linear, or a max of linear maps), so this equals scoring the
    L2-normalised embedding, without dividing the whole block: one pass over memory less.
    """

    spec: ScoreSpec
    dim: int
    project: Callable[[np.ndarray], np.ndarray]
    offset: float = 0.0


@dataclass(frozen=True)
class ClipChoice:
    """Which open_clip model embeds ``prompt:`` texts; ``pretrained=None`` builds a seeded random init."""

    model: str = "ViT-L-14"
    pretrained: str | None = "openai"


def l2_normalise(embeddings: np.ndarray) -> np.ndarray:
    """Float32 rows of unit length; all-zero rows stay zero (as the aesthetic predictor's own helper)."""
    block = np.asarray(embeddings, dtype=np.float32)
    norms = np.linalg.norm(block, axis=1, keepdims=True)
    norms[norms == 0] = 1
    return block / norms


def load_state_dict(path: str) -> dict:
    import torch

    if not Path(path).is_file():
        raise LaionkitError(f"score weights not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for a bad file; all mean "not a state dict"
        raise LaionkitError(f"{path}: not a torch state dict ({weights_error(error)})") from None
    if not isinstance(state, dict) or not state:
        raise LaionkitError(f"{path}: expected a non-empty torch state dict, got {type(state).__name__}")
    return state


def linear_layers(state: dict, path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight, bias) per ``nn.Linear`` in state-dict order; keys must be ``<prefix>.weight/.bias``."""
    layers: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf not in ("weight", "bias"):
            raise LaionkitError(f"{path}: key {key!r} is not a linear layer's weight or bias")
        layers.setdefault(prefix, {})[leaf] = tensor.detach().cpu().double().numpy()
    chain = []
    for prefix, params in layers.items():
        weight = params.get("weight")
        bias = params.get("bias", np.zeros(len(weight) if weight is not None else 0))
        if weight is None or weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise LaionkitError(f"{path}: layer {prefix or '(root)'!r} is not a linear layer (weight, bias)")
        chain.append((weight, bias))
    for (w_prev, _), (w_next, _) in zip(chain[:-1], chain[1:], strict=True):
        if w_next.shape[1] != w_prev.shape[0]:
            raise LaionkitError(f"{path}: layer shapes do not chain: {w_prev.shape} then {w_next.shape}")
    if chain[-1][0].shape[0] != 1:
        raise LaionkitError(f"{path}: the head must output one value per row, not {chain[-1][0].shape[0]}")
    return chain


def folded_head(spec: ScoreSpec, expected_shapes: tuple[tuple[int, int], ...] | None) -> Scorer:
    """Fold an affine chain into one (D,) weight and a bias, in float64, then score in float32."""
    chain = linear_layers(load_state_dict(spec.arg), spec.arg)
    shapes = tuple(weight.shape for weight, _ in chain)
    if expected_shapes is not None and shapes != expected_shapes:
        raise LaionkitError(
            f"{spec.arg}: not a {spec.kind} head: layer shapes {shapes}, expected {expected_shapes}"
        )
    weight, bias = chain[0]
    for next_weight, next_bias in chain[1:]:
        weight, bias = next_weight @ weight, next_weight @ bias + next_bias
    vector = weight[0].astype(np.float32)

    def project(embeddings: np.ndarray) -> np.ndarray:
        return embeddings @ vector

    return Scorer(spec, int(vector.shape[0]), project, float(bias[0]))


def aesthetic_v2(spec: ScoreSpec, clip: ClipChoice) -> Scorer:
    return folded_head(spec, AESTHETIC_V2_SHAPES)


def aesthetic_v1(spec: ScoreSpec, clip: ClipChoice) -> Scorer:
    return folded_head(spec, AESTHETIC_V1_SHAPES)


def linear_head(spec: ScoreSpec, clip: ClipChoice) -> Scorer:
    return folded_head(spec, None)


def open_clip_name(model: str) -> str:
    """open_clip's name for ``--clip-model`` in any form filter, score and eval take: a name open_clip knows,
    hf-hub:ORG/REPO, or a model config .json file (registered with open_clip under its file stem)."""
    import open_clip

    if model.endswith(".json"):
        config = Path(model).expanduser()
        if not config.is_file():
            raise LaionkitError(f"--clip-model {model}: no such model config file")
        open_clip.add_model_config(config)
        return config.stem
    if not model.startswith(("hf-hub:", "local-dir:")) and model not in open_clip.list_models():
        raise LaionkitError(f"--clip-model {model}: not an open_clip model name (open_clip.list_models()), "
                            "hf-hub:ORG/REPO or a model config .json file")
    return model


@functools.lru_cache(maxsize=4)
def clip_text_model(model: str, pretrained: str | None):
    """Load once per process; a random init (``pretrained=None``) is seeded so scores are reproducible."""
    import open_clip
    import torch

    name = open_clip_name(model)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            clip = open_clip.create_model(name, pretrained=pretrained)
    except (RuntimeError, pickle.UnpicklingError) as error:
        raise LaionkitError(f"--clip-model {model} --clip-pretrained {pretrained}: {weights_error(error)}") from None
    return clip.eval(), open_clip.get_tokenizer(name)


def prompt_embeddings(prompts: list[str], clip: ClipChoice) -> np.ndarray:
    import torch

    model, tokenizer = clip_text_model(clip.model, clip.pretrained)
    with torch.inference_mode():
        text = model.encode_text(tokenizer(prompts)).float().numpy()
    return l2_normalise(text)


def prompt_similarity(spec: ScoreSpec, clip: ClipChoice) -> Scorer:
    """Cosine similarity to the prompt's text embedding; with ``a|b|c``, the best of the prompts."""
    prompts = [prompt.strip() for prompt in spec.arg.split("|") if prompt.strip()]
    if not prompts:
        raise LaionkitError(f"--score {spec.name}=prompt:{spec.arg!r}: no prompt text")
    text = prompt_embeddings(prompts, clip).T.copy()

    def project(embeddings: np.ndarray) -> np.ndarray:
        return (embeddings @ text).max(axis=1)

    return Scorer(spec, int(text.shape[0]), project)


SCORE_KINDS: dict[str, Callable[[ScoreSpec, ClipChoice], Scorer]] = {
    "aesthetic-v2": aesthetic_v2,
    "aesthetic-v1": aesthetic_v1,
    "head": linear_head,
    "prompt": prompt_similarity,
}


def build_scorer(spec: ScoreSpec, clip: ClipChoice = ClipChoice()) -> Scorer:
    return SCORE_KINDS[spec.kind](spec, clip)


def score_embeddings(scorer: Scorer, embeddings: np.ndarray, source: str = "embeddings") -> np.ndarray:
    """Score a (possibly memory-mapped, float16) block in bounded chunks; returns (N,) float32."""
    import torch

    if embeddings.ndim != 2 or embeddings.shape[1] != scorer.dim:
        raise LaionkitError(
            f"--score {scorer.spec.name}: {source} has shape {embeddings.shape}, but the {scorer.spec.kind} "
            f"score expects {scorer.dim}-d embeddings"
        )
    out = np.empty(len(embeddings), dtype=np.float32)
    for start in range(0, len(embeddings), SCORE_BATCH_ROWS):
        # torch converts float16 -> float32 several times faster than numpy
        block = torch.from_numpy(np.array(embeddings[start : start + SCORE_BATCH_ROWS])).float()
        norms = torch.linalg.vector_norm(block, dim=1).numpy()
        norms[norms == 0] = 1  # an all-zero row stays zero, as in the aesthetic predictor's own helper
        out[start : start + len(block)] = scorer.project(block.numpy()) / norms + scorer.offset
    return out
