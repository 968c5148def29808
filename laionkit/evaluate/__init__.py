"""``laionkit eval``: score an exported diffusers pipeline the way papers score text-to-image models, on
its own, so runs of different settings or data filters can be compared (DataComp compares filters with
small proxy runs scored alike).

It generates N images for N prompts at fixed seeds (image i from seed + i, drawn on the CPU so the same
seed gives the same noise on any device), then computes

- FID and KID (mean and standard deviation over subsets) against reference images, on the 2048 pool
  features of torch-fidelity's Inception-v3 (inception.py says why that one), as torchmetrics defines
  them (fid.py);
- CLIP score of each image against its prompt with an open_clip model (clipscore.py).

Outputs in OUTPUT: eval.json (every number, the settings and the prompts), eval-grid.png (the first
images), and, where OUTPUT is a run folder (it holds metrics.jsonl), a record appended to metrics.jsonl
(``fid``, ``kid``, ``kid_std``, ``clip_score`` at the run's last step) and eval.png, the scores of every
such record against step.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from laionkit.common import LaionkitError, atomic_output, save_image_grid, strict_json, write_json
from laionkit.common.models import refused_pickle, weights_error

GRID_IMAGES = 64


@dataclass
class EvalConfig:
    pipeline: Path
    reference: Path
    output: Path
    prompts: Path | None = None
    val_latents: Path | None = None
    count: int = 1000
    seed: int = 0
    steps: int = 25
    guidance_scale: float | None = None
    resolution: int | None = None
    batch_size: int = 8
    reference_count: int = 0
    inception: str = field(default="")
    clip_model: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    kid_subsets: int = 100
    kid_subset_size: int = 1000
    device: str | None = None
    dtype: str = "auto"
    quiet: bool = False
    # the pipeline's max_sequence_length: the caption window the model was trained with (encode
    # --max-sequence-length), where it is not the pipeline's default
    max_sequence_length: int | None = None

    def __post_init__(self) -> None:
        from laionkit.evaluate.inception import INCEPTION_URL

        self.inception = self.inception or INCEPTION_URL
        for name in ("count", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise LaionkitError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.count < 2:
            raise LaionkitError(f"--count {self.count}: FID and KID need at least 2 images")


def check_folders(config: EvalConfig) -> None:
    """The pipeline folder is a diffusers pipeline; the output neither is nor lies inside an input
    (eval.json and the grid would change the pipeline or become reference images)."""
    pipeline = Path(config.pipeline)
    if not pipeline.is_dir():
        raise LaionkitError(f"PIPELINE {pipeline}: no such folder")
    if not (pipeline / "model_index.json").is_file():
        raise LaionkitError(f"PIPELINE {pipeline}: no model_index.json; give an exported diffusers pipeline folder "
                            "(RUN/pipeline, or `laionkit export RUN --format pipeline`)")
    check_family(pipeline)
    if not Path(config.reference).exists():
        raise LaionkitError(f"--reference {config.reference}: no such folder or tar file")
    out = Path(config.output).expanduser().resolve()
    for flag, given in (("PIPELINE", pipeline), ("--reference", Path(config.reference))):
        source = given.expanduser().resolve()
        if out == source or source in out.parents:
            raise LaionkitError(f"--output {config.output} {'is' if out == source else 'lies inside'} {flag} "
                                f"{given}; outputs never go into inputs, choose another folder")


def check_family(pipeline: Path) -> None:
    """The folder holds what the pipeline its model_index.json names draws with (that family's denoiser and
    text encoders): one of another family's loads in diffusers and fails only once it generates."""
    from laionkit.families import detect_family

    spec = detect_family(str(pipeline))
    folders = (spec.denoiser_subfolder, *(folder for pair in spec.text_encoders for folder in pair))
    missing = [folder for folder in folders if not (pipeline / folder).is_dir()]
    try:
        denoiser = json.loads((pipeline / spec.denoiser_subfolder / "config.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        denoiser = None
    if missing or denoiser != spec.denoiser_class:
        found = f"no {', '.join(missing)} folder" if missing else \
            f"{spec.denoiser_subfolder}/ holds a {denoiser or 'model of no known class'}"
        raise LaionkitError(f"PIPELINE {pipeline}: model_index.json names {spec.pipeline_class} ({spec.name}), but "
                            f"the folder has {found} (that family draws with a {spec.denoiser_class}); give a "
                            "pipeline exported whole (`laionkit export RUN --format pipeline`)")


def check_output(output: Path) -> None:
    """The output folder can be written (a file written and removed there), before anything is generated."""
    probe = output / f".eval-probe-{os.getpid()}"
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise LaionkitError(f"--output {output}: cannot write there ({error.strerror or error}); nothing was "
                            "generated") from None


def pick_device(device: str | None):
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_pipeline(folder: Path, device, dtype: str = "auto"):
    """Any family's exported pipeline, through diffusers' own DiffusionPipeline.from_pretrained."""
    import torch
    from diffusers import DiffusionPipeline

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype != "auto" and dtype not in dtypes:
        raise LaionkitError(f"--dtype {dtype}: expected auto, fp32, fp16 or bf16")
    torch_dtype = dtypes.get(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch_dtype)  # torch_dtype: deprecated, warns
    except pickle.UnpicklingError as error:  # a .bin weights file that torch's weights-only loader refused
        raise LaionkitError(f"PIPELINE {folder}: a weights file there is {weights_error(error)}") from None
    except (OSError, ValueError) as error:
        if refused_pickle(error) is not None:  # diffusers wraps the refusal
            raise LaionkitError(f"PIPELINE {folder}: a weights file there is {weights_error(error)}") from None
        raise LaionkitError(f"PIPELINE {folder}: diffusers could not load it ({str(error).splitlines()[0]})") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def generate(pipe, prompts: list[str], seed: int, steps: int, batch_size: int, guidance_scale: float | None,
             resolution: int | None, quiet: bool = True, max_sequence_length: int | None = None) -> np.ndarray:
    """(N, H, W, 3) uint8 images, image i from a CPU generator seeded ``seed + i`` (batching does not
    change any image); ``max_sequence_length``: the caption window, where the pipeline takes one."""
    import torch
    from tqdm import tqdm

    options = {"num_inference_steps": steps, "output_type": "np"}
    if guidance_scale is not None:
        options["guidance_scale"] = guidance_scale
    if resolution is not None:
        options["height"] = options["width"] = resolution
    if max_sequence_length is not None:
        options["max_sequence_length"] = max_sequence_length
    images = []
    with tqdm(total=len(prompts), desc="generate", unit="img", disable=quiet) as bar:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            generators = [torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))]
            with torch.no_grad():
                out = pipe(prompt=chunk, generator=generators, **options).images
            out = np.asarray(out, dtype=np.float32)
            images.append((np.nan_to_num(out) * 255).round().clip(0, 255).astype(np.uint8))
            bar.update(len(chunk))
    return np.concatenate(images)


def reference_features(config: EvalConfig, size: int, model, device, cache: dict | None = None):
    """Reference images and their Inception features (kept in ``cache`` by source and size: train
    --eval-every computes them once per run)."""
    from laionkit.evaluate.inception import inception_features
    from laionkit.evaluate.prompts import reference_images

    key = (str(config.reference), size, config.reference_count, config.inception)
    if cache is not None and key in cache:
        return cache[key]
    images, skipped = reference_images(Path(config.reference), size, config.reference_count)
    result = (inception_features(model, images, config.batch_size, device), len(images), skipped)
    if cache is not None:
        cache[key] = result
    return result


def load_scorers(config: EvalConfig, device, cache: dict) -> None:
    """The Inception and the CLIP model into ``cache`` (once: train --eval-every reuses them), loaded
    before anything is generated so that a wrong weights file fails at once."""
    from laionkit.evaluate import clipscore
    from laionkit.evaluate.inception import load_inception

    if ("inception", config.inception) not in cache:
        cache[("inception", config.inception)] = load_inception(config.inception)
    clip_key = ("clip", config.clip_model, config.clip_pretrained)
    if clip_key not in cache:
        cache[clip_key] = clipscore.load_clip(config.clip_model, config.clip_pretrained, device)


def score(config: EvalConfig, images: np.ndarray, prompts: list[str], device, cache: dict | None = None) -> dict:
    """FID, KID and CLIP score of generated uint8 images for their prompts."""
    from laionkit.evaluate import clipscore, fid
    from laionkit.evaluate.inception import inception_features

    if images.shape[1] != images.shape[2]:
        raise LaionkitError(f"generated images are {images.shape[2]}x{images.shape[1]}; give --resolution for square "
                            "images (the reference images are centre-cropped to squares)")
    cache = {} if cache is None else cache
    load_scorers(config, device, cache)
    model = cache[("inception", config.inception)]
    real, reference_count, skipped = reference_features(config, images.shape[1], model, device, cache)
    fake = inception_features(model, images, config.batch_size, device)
    kid_mean, kid_std = fid.kid(real, fake, config.kid_subsets, config.kid_subset_size, config.seed)
    clip = cache[("clip", config.clip_model, config.clip_pretrained)]
    similarities = clipscore.clip_similarities(*clip, list(images), prompts, config.batch_size, device)
    return {
        "fid": fid.fid(real, fake), "kid": kid_mean, "kid_std": kid_std,
        "clip_score": clipscore.clip_score(similarities), "clip_scores": similarities.tolist(),
        "reference_images": reference_count, "reference_skipped": skipped,
    }


def append_record(run: Path, record: dict) -> None:
    """A metrics.jsonl line in a run folder, and eval.png beside training.png."""
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(strict_json(record) + "\n")
    plot_scores(run / "metrics.jsonl", run / "eval.png")


def plot_scores(metrics: Path, output: Path) -> None:
    """FID, KID and CLIP score against step, from the metrics.jsonl records that have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("fid") is not None]
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    steps = [r.get("step", 0) for r in records]
    for axis, key, label in zip(axes, ("fid", "kid", "clip_score"), ("FID", "KID", "CLIP score")):
        axis.plot(steps, [r.get(key, math.nan) for r in records], "o-")
        axis.set(xlabel="step", ylabel=label, title=label)
    figure.tight_layout()
    with atomic_output(output) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)


def save_grid(images: np.ndarray, path: Path) -> None:
    import torch

    save_image_grid(torch.from_numpy(images[:GRID_IMAGES]).permute(0, 3, 1, 2).float() / 255, path)


def last_step(metrics: Path) -> int | None:
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if isinstance(s, int)]
    return max(steps) if steps else None


def run(config: EvalConfig, log=print) -> dict:
    """Generate, score, write OUTPUT/eval.json (and the run's metrics.jsonl record); returns eval.json's
    content."""
    from laionkit.evaluate.prompts import read_prompts, reference_images

    check_folders(config)
    prompts = read_prompts(config.prompts, config.val_latents, config.count)
    device = pick_device(config.device)
    started = time.perf_counter()
    cache: dict = {}
    load_scorers(config, device, cache)
    pipe = load_pipeline(Path(config.pipeline), device, config.dtype)
    check_output(Path(config.output))  # the output and enough readable reference images, before generating
    reference_images(Path(config.reference), None, config.reference_count)
    images = generate(pipe, prompts, config.seed, config.steps, config.batch_size, config.guidance_scale,
                      config.resolution, config.quiet, config.max_sequence_length)
    del pipe
    scores = score(config, images, prompts, device, cache)
    output = Path(config.output)
    result = {
        "fid": scores["fid"], "kid": scores["kid"], "kid_std": scores["kid_std"],
        "clip_score": scores["clip_score"], "count": len(images), "resolution": int(images.shape[1]),
        "reference_images": scores["reference_images"], "reference_skipped": scores["reference_skipped"],
        "seconds": round(time.perf_counter() - started, 1),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "device": str(device), "prompts": prompts, "clip_scores": scores["clip_scores"],
    }
    output.mkdir(parents=True, exist_ok=True)
    write_json(output / "eval.json", result)
    save_grid(images, output / "eval-grid.png")
    if (output / "metrics.jsonl").is_file():
        append_record(output, {"step": last_step(output / "metrics.jsonl"), "fid": result["fid"], "kid": result["kid"],
                               "kid_std": result["kid_std"], "clip_score": result["clip_score"],
                               "eval_count": len(images), "eval_pipeline": str(config.pipeline)})
    log(f"FID {result['fid']:.4g}  KID {result['kid']:.4g} ± {result['kid_std']:.2g}  CLIP score "
        f"{result['clip_score']:.4g}  ({len(images)} images vs {result['reference_images']} reference) "
        f"-> {output / 'eval.json'}")
    return result
