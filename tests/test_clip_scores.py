"""Score kinds against reference torch modules, on the real LAION aesthetic predictor weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from laionkit.common import LaionkitError
from laionkit.common.clip_scores import ClipChoice, ScoreSpec, build_scorer, clip_text_model, score_embeddings


class ImprovedAestheticMLP(nn.Module):
    """The reference: christophschuhmann/improved-aesthetic-predictor's MLP, as released."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x):
        return self.layers(x)


def reference_scores(module: nn.Module, embeddings: np.ndarray) -> np.ndarray:
    """As LAION's scripts do it: L2-normalise (numpy, zeros kept), then the module in float32."""
    block = embeddings.astype(np.float32)
    norms = np.linalg.norm(block, axis=1, keepdims=True)
    norms[norms == 0] = 1
    with torch.no_grad():
        return module.eval()(torch.from_numpy(block / norms)).squeeze(1).numpy()


def embeddings(rows: int, dim: int, dtype) -> np.ndarray:
    array = np.random.default_rng(0).standard_normal((rows, dim)).astype(dtype)
    array[5] = 0  # an all-zero row must not become NaN
    return array


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "kind, weights, module",
    [
        ("aesthetic-v2", "sac+logos+ava1-l14-linearMSE.pth", ImprovedAestheticMLP),
        ("aesthetic-v1", "sa_0_4_vit_l_14_linear.pth", lambda: nn.Linear(768, 1)),
    ],
)
def test_aesthetic_heads_match_the_reference_module(realdata: Path, kind, weights, module, dtype):
    path = realdata / "aesthetic" / weights
    reference = module()
    reference.load_state_dict(torch.load(path, map_location="cpu"))
    emb = embeddings(20_000, 768, dtype)  # more than one scoring batch
    scores = score_embeddings(build_scorer(ScoreSpec("aes", kind, str(path))), emb)
    expected = reference_scores(reference, emb)
    assert scores.dtype == np.float32 and scores.shape == (len(emb),)
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-4)
    assert np.isfinite(scores).all() and scores.std() > 0.01


def test_any_linear_chain_head(tmp_path: Path):
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8), nn.Linear(8, 1))
    torch.save(head.state_dict(), tmp_path / "head.pth")
    emb = embeddings(100, 64, np.float32)
    scores = score_embeddings(build_scorer(ScoreSpec("nsfw", "head", str(tmp_path / "head.pth"))), emb)
    np.testing.assert_allclose(scores, reference_scores(head, emb), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"weight": torch.zeros(2, 768), "bias": torch.zeros(2)}, "one value per row"),
        ({"a.weight": torch.zeros(16, 768), "b.weight": torch.zeros(1, 8)}, "do not chain"),
        ({"norm.running_mean": torch.zeros(3)}, "not a linear layer"),
    ],
)
def test_heads_that_are_not_linear_chains_are_refused(tmp_path: Path, state, message):
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(LaionkitError, match=message):
        build_scorer(ScoreSpec("x", "head", str(tmp_path / "bad.pth")))


def test_wrong_weights_for_a_kind_and_wrong_dims_are_named(realdata: Path, tmp_path: Path):
    v1 = realdata / "aesthetic" / "sa_0_4_vit_l_14_linear.pth"
    with pytest.raises(LaionkitError, match="not a aesthetic-v2 head"):
        build_scorer(ScoreSpec("aes", "aesthetic-v2", str(v1)))
    scorer = build_scorer(ScoreSpec("aes", "aesthetic-v1", str(v1)))
    with pytest.raises(LaionkitError, match="expects 768-d"):
        score_embeddings(scorer, np.zeros((4, 512), np.float16), "img_emb_0000.npy")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(LaionkitError, match="junk.pth: not a torch state dict"):
        build_scorer(ScoreSpec("aes", "head", str(tmp_path / "junk.pth")))


@pytest.mark.parametrize(
    "text, message",
    [
        ("aes", "NAME=KIND:ARG"),
        ("aes=aesthetic-v2", "NAME=KIND:ARG"),
        ("my-score=head:x.pth", "plain identifier"),
        ("aes=aesthetic-v9:x.pth", "unknown kind"),
    ],
)
def test_score_spec_errors(text, message):
    with pytest.raises(LaionkitError, match=message):
        ScoreSpec.parse(text)


def test_score_spec_keeps_colons_in_the_argument():
    assert ScoreSpec.parse("anime=prompt:anime: a drawing|manga") == ScoreSpec(
        "anime", "prompt", "anime: a drawing|manga"
    )


def test_prompt_score_is_the_best_cosine_to_the_clip_text_embeddings():
    """A random-init open_clip model (offline), checked against open_clip's own text encoding."""
    clip = ClipChoice("ViT-S-32", None)
    model, tokenizer = clip_text_model(clip.model, clip.pretrained)
    with torch.no_grad():
        text = model.encode_text(tokenizer(["an anime drawing", "a manga page"])).numpy()
    dim = text.shape[1]
    emb = embeddings(50, dim, np.float16)
    emb[7] = text[1]  # a row that IS the second prompt's embedding scores 1
    scores = score_embeddings(
        build_scorer(ScoreSpec("anime", "prompt", "an anime drawing | a manga page"), clip), emb
    )
    unit = lambda a: a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)  # noqa: E731
    expected = (unit(emb.astype(np.float32)) @ unit(text).T).max(axis=1)
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-4)
    assert scores[7] == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(LaionkitError, match=f"expects {dim}-d"):
        score_embeddings(build_scorer(ScoreSpec("anime", "prompt", "anime"), clip), np.zeros((2, dim + 1)))
