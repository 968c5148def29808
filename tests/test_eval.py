"""`laionkit eval`: FID, KID and CLIP score of an exported pipeline (a two-step tiny SD run) against the real
photos of ../shared/realdata/images, with a random-init Inception saved in the real weights file's layout and
a tiny open_clip model saved in open_clip's config + weights layout (`laionkit models tiny-eval`): the loading
code real weights go through."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

COUNT = 8
STEPS = 2


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scorers")
    run_cli("models", "tiny-eval", "--output", folder)
    return folder


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, latent_shards) -> Path:
    """Two train steps from scratch on the session's latents; RUN/pipeline is the export."""
    run = tmp_path_factory.mktemp("eval-run") / "run"
    run_cli("train", latent_shards, "--output", run, "--unet-config", "tiny", "--max-steps", "2", "--batch-size", "2",
            "--workers", "0", "--log-with", "none", "--log-every", "1", "--checkpoint-every", "2", "--quiet")
    assert (run / "pipeline" / "model_index.json").is_file()
    return run


def eval_args(run: Path, scorers: Path, realdata: Path, output: Path, *extra) -> list:
    return ["eval", run / "pipeline", "--reference", realdata / "images", "--val-latents", run.parent.parent,
            "--count", COUNT, "--steps", STEPS, "--output", output, "--inception", scorers / "inception.pth",
            "--clip-model", scorers / "tiny-clip.json", "--clip-pretrained", scorers / "tiny-clip.safetensors",
            "--kid-subsets", "5", "--quiet", *extra]


@pytest.fixture(scope="module")
def evaluated(trained_run, scorers, realdata, latent_shards) -> dict:
    """`laionkit eval RUN/pipeline --output RUN` with the session's latents' captions as prompts."""
    args = eval_args(trained_run, scorers, realdata, trained_run)
    args[args.index("--val-latents") + 1] = latent_shards
    run_cli(*args)
    return json.loads((trained_run / "eval.json").read_text())


@pytest.fixture(scope="module")
def features(evaluated, trained_run, scorers, realdata) -> dict:
    """What the evaluation saw, recomputed through the module: its images (same prompts and seeds) and the
    Inception features of them and of the reference photos."""
    from laionkit.evaluate import generate, load_pipeline
    from laionkit.evaluate.inception import inception_features, load_inception
    from laionkit.evaluate.prompts import reference_images

    pipe = load_pipeline(trained_run / "pipeline", torch.device("cpu"))
    images = generate(pipe, evaluated["prompts"], 0, STEPS, 8, None, None)
    model = load_inception(str(scorers / "inception.pth"))
    reference, _ = reference_images(realdata / "images", images.shape[1])
    return {"images": images, "model": model, "generated": inception_features(model, images, 8),
            "reference": inception_features(model, reference, 8), "reference_images": reference}


def numpy_frechet(x: np.ndarray, y: np.ndarray) -> float:
    """The Fréchet distance by another route: numpy's covariances and tr(sqrt(S1 S2)) as the trace of the square
    root of the symmetric PSD matrix sqrt(S1) S2 sqrt(S1), from eigh (no eigvals of a non-symmetric product)."""
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    w, v = np.linalg.eigh(s1)
    root1 = (v * np.sqrt(w.clip(0))) @ v.T
    inner = np.linalg.eigvalsh(root1 @ s2 @ root1)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(inner.clip(0)).sum())


def numpy_mmd(x: np.ndarray, y: np.ndarray) -> float:
    """The unbiased polynomial-kernel MMD^2 of KID, (x.y / d + 1)^3, written out."""
    d, m = x.shape[1], len(x)
    kxx, kyy, kxy = ((a @ b.T / d + 1) ** 3 for a, b in ((x, x), (y, y), (x, y)))
    return float((kxx.sum() - np.trace(kxx) + kyy.sum() - np.trace(kyy)) / (m * (m - 1)) - 2 * kxy.sum() / m**2)


def test_eval_scores_the_exported_pipeline_into_the_run(evaluated, trained_run):
    assert evaluated["count"] == COUNT and evaluated["reference_images"] == 8 and evaluated["resolution"] == 64
    assert evaluated["fid"] > 0 and evaluated["kid"] > 0 and np.isfinite(evaluated["clip_score"])
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    record = records[-1]
    assert record["step"] == 2 and record["eval_count"] == COUNT
    assert {k: record[k] for k in ("fid", "kid", "clip_score")} == {k: evaluated[k] for k in ("fid", "kid", "clip_score")}
    for name in ("eval-grid.png", "eval.png"):
        assert (trained_run / name).stat().st_size > 1000, name


def test_fid_and_kid_are_their_formulas_on_the_same_features(evaluated, features):
    from laionkit.evaluate import fid

    real, fake = features["reference"], features["generated"]
    assert evaluated["fid"] == pytest.approx(fid.fid(real, fake), rel=1e-9)  # the CLI scored these features
    assert evaluated["fid"] == pytest.approx(numpy_frechet(real, fake), rel=1e-6)
    assert abs(fid.fid(real, real)) < 1e-6 * evaluated["fid"]
    # subsets as large as the sets: every subset is the whole set, so KID is the full MMD, std 0
    kid_mean, kid_std = fid.kid(real, fake, subsets=3, subset_size=100)
    assert kid_mean == pytest.approx(numpy_mmd(real, fake), rel=1e-6) and kid_std < 1e-9 * kid_mean
    assert evaluated["kid"] == pytest.approx(kid_mean, rel=1e-9)
    # KID is unbiased, not zero, for a set against itself: at 8 images that is still far below the generated set's
    self_kid = fid.kid(real, real, subsets=3, subset_size=100)[0]
    assert self_kid == pytest.approx(numpy_mmd(real, real), rel=1e-6) and abs(self_kid) < 0.2 * kid_mean


def test_the_random_inception_is_in_the_real_layout(scorers, features):
    """torch-fidelity's own constructor loads the file (strict load_state_dict), and gives the same features."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    theirs = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                         feature_extractor_weights_path=str(scorers / "inception.pth"))
    images = torch.from_numpy(features["reference_images"][:2]).permute(0, 3, 1, 2).contiguous()
    (expected,) = theirs(images)
    assert np.allclose(expected.double().numpy(), features["reference"][:2], rtol=1e-5, atol=1e-6)


def test_clip_scores_are_per_pair(evaluated, features, scorers):
    from laionkit.evaluate.clipscore import clip_score, clip_similarities, load_clip

    clip, preprocess, tokenizer = load_clip(str(scorers / "tiny-clip.json"), str(scorers / "tiny-clip.safetensors"))
    images, prompts = list(features["images"]), evaluated["prompts"]
    with torch.no_grad():  # every image against every prompt
        from PIL import Image

        img = clip.encode_image(torch.stack([preprocess(Image.fromarray(i)) for i in images])).double()
        txt = clip.encode_text(tokenizer(prompts)).double()
    matrix = 100 * (img / img.norm(dim=-1, keepdim=True)) @ (txt / txt.norm(dim=-1, keepdim=True)).T
    matching = clip_similarities(clip, preprocess, tokenizer, images, prompts, batch_size=3)
    order = np.roll(np.arange(len(prompts)), 1)
    shuffled = clip_similarities(clip, preprocess, tokenizer, images, [prompts[j] for j in order])
    assert np.allclose(matching, matrix.diagonal().numpy(), atol=1e-3)
    assert np.allclose(shuffled, matrix.numpy()[np.arange(len(images)), order], atol=1e-3)
    assert np.allclose(evaluated["clip_scores"], matching, atol=1e-4)
    assert evaluated["clip_score"] == pytest.approx(clip_score(matching), abs=1e-4)
    assert clip_score(np.array([-5.0, 1.0])) == 0.0  # torchmetrics clips the mean at 0


def test_eval_is_deterministic(evaluated, trained_run, scorers, realdata, latent_shards, tmp_path):
    args = eval_args(trained_run, scorers, realdata, tmp_path / "again")
    args[args.index("--val-latents") + 1] = latent_shards
    run_cli(*args)
    again = json.loads((tmp_path / "again" / "eval.json").read_text())
    for key in ("fid", "kid", "kid_std", "clip_score", "clip_scores", "prompts"):
        assert again[key] == evaluated[key], key
    assert (tmp_path / "again" / "eval-grid.png").read_bytes() == (trained_run / "eval-grid.png").read_bytes()
    assert not (tmp_path / "again" / "metrics.jsonl").exists()  # not a run folder: eval.json only


def test_eval_errors_are_one_line(trained_run, scorers, realdata, latent_shards, tmp_path):
    def error(*changes) -> str:
        args = eval_args(trained_run, scorers, realdata, tmp_path / "out")
        args[args.index("--val-latents") + 1] = latent_shards
        for flag, value in changes:
            if flag == "PIPELINE":
                args[1] = value
            else:
                args[args.index(flag) + 1] = value
        result = run_cli(*args, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, result.stderr
        return lines[0]

    assert "no such folder" in error(("PIPELINE", tmp_path / "missing"))
    assert "no model_index.json" in error(("PIPELINE", trained_run))
    clip_weights = scorers / "tiny-clip.safetensors"
    line = error(("--inception", clip_weights))
    assert str(clip_weights) in line and "not the FID Inception-v3 weights" in line
    code = tmp_path / "module.pth"  # a whole pickled module, not a state dict: refused, never unpickled
    torch.save(torch.nn.Linear(2, 2), code)
    assert str(code) in error(("--inception", code)) and not (tmp_path / "out").exists()
    assert "--clip-pretrained" in error(("--clip-model", "ViT-B-32"))
    assert "outputs never go into inputs" in error(("--output", trained_run / "pipeline"))


def test_reference_from_pack_tars_reads_every_photo(image_shards, realdata):
    """pack's webdataset tars give the same photos as the folder (one of them re-encoded as WebP there)."""
    from laionkit.evaluate.prompts import reference_images

    tars, skipped = reference_images(image_shards, 32)
    folder, _ = reference_images(realdata / "images", 32)
    assert skipped == 0 and tars.shape == folder.shape == (8, 32, 32, 3)
    distance = np.abs(tars.astype(float)[:, None] - folder.astype(float)[None]).mean(axis=(2, 3, 4))
    assert (distance.min(axis=1) < 3).all()  # each tar image has its photo in the folder


def test_eval_generates_in_the_caption_window_the_model_trained_in(flow_latents):
    """`laionkit eval --max-sequence-length` (and train --eval-every, with its run's window) hands the pipeline
    that max_sequence_length: the images are those of FluxPipeline called with it, and not those of its default
    512-token window (Flux attends to every padding token)."""
    from laionkit import evaluate

    pipe = evaluate.load_pipeline(flow_latents("flux").model, torch.device("cpu"))
    prompts = ["a red square on grey", "a blue circle"]
    ours = evaluate.generate(pipe, prompts, 0, 2, 2, None, 64, max_sequence_length=32)
    with torch.no_grad():
        direct = pipe(prompt=prompts, generator=[torch.Generator("cpu").manual_seed(i) for i in range(2)],
                      num_inference_steps=2, height=64, width=64, max_sequence_length=32, output_type="np").images
    assert np.array_equal(ours, (np.asarray(direct) * 255).round().clip(0, 255).astype(np.uint8))
    assert not np.array_equal(ours, evaluate.generate(pipe, prompts, 0, 2, 2, None, 64))
