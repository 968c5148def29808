"""`train --eval-every N`: FID, KID and CLIP score of the run's weights every N steps and at the end, scored as
`laionkit eval` scores an exported pipeline (laionkit/evaluate), written into that step's metrics.jsonl record
and plotted in RUN/eval.png.

Why it works this way:

- What is scored is what the run would export at that step: every rank takes part in the end of run's own
  export (``export`` / ``lora.export``: under FSDP or ZeRO a gather every rank must join) into a folder of its
  own inside the run folder, never RUN/pipeline, which readers of a finished run trust; rank 0 writes the
  pipeline there (base components hard-linked where the filesystem allows), generates and scores while the
  other ranks wait, and removes the folder. A record therefore equals `laionkit eval` of the pipeline exported
  at that step, whatever the number of ranks: image i is drawn from a CPU generator seeded i.
- The other ranks wait in a gloo group of their own with a long timeout, not in an NCCL barrier, whose
  10 minutes scoring a large model can outlast.
- The prompts, the Inception and the CLIP model are read and loaded once, at setup, on rank 0 (a wrong weights
  file or a reference without images stops the run before its first step, on every rank); the reference
  images' features are computed at the first evaluation and kept. Between evaluations the scorers wait in
  host memory.
- Scoring draws no random number from the run's state (CPU and CUDA generators, numpy's and Python's are
  restored after it), so a run with --eval-every trains, checkpoints and resumes byte for byte as one without.
- A failure while scoring (out of memory, say) does not stop the run: a warning, ``eval_error`` in the record
  instead of scores, and training goes on to its checkpoints and export, which are what it is for. The
  --eval-* flags are not part of what an exact resume compares: a run resumes with them changed or dropped.
"""

from __future__ import annotations

import random
import re
import shutil
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from laionkit.common import LaionkitError
from laionkit.trainer import lora
from laionkit.trainer.export import export
from laionkit.trainer.pipeline_folder import _base, merge_lora, write_pipeline
from laionkit.trainer.runfolder import _broadcast

# How long the other ranks wait for rank 0's scoring: NCCL's barrier gives up after 10 minutes, which
# 1,000 images of a large model can take.
WAIT = timedelta(hours=24)
FOLDER_PREFIX = ".eval-step-"  # RUN/.eval-step-N: the weights and pipeline of one evaluation, removed after it
SCORES = ("fid", "kid", "kid_std", "clip_score")
# `laionkit eval`'s flags in messages of laionkit.evaluate, as train spells them.
FLAGS = re.compile(r"--(reference|prompts|count|steps|resolution|inception|clip-model|clip-pretrained)\b")


@dataclass
class Scoring:
    """What every evaluation of a run shares: on rank 0 the settings, the prompts, and the loaded scorers and
    reference features (laionkit.evaluate's cache); on every rank of several, the group they wait in."""

    settings: object = None  # laionkit.evaluate.EvalConfig
    prompts: list[str] = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    waiting: object = None  # a gloo group with a long timeout (wait_for_ranks)


def due(config, step: int, max_steps: int) -> bool:
    return bool(config.eval_every) and (step % config.eval_every == 0 or step == max_steps)


def settings(config):
    """The run's --eval-* flags as `laionkit eval`'s EvalConfig (``pipeline`` is set per evaluation)."""
    from laionkit.evaluate import EvalConfig

    return EvalConfig(pipeline=Path(), reference=Path(config.eval_reference), output=Path(config.output),
                      prompts=config.eval_prompts, count=config.eval_count, seed=0, steps=config.eval_steps,
                      resolution=config.eval_resolution, inception=config.eval_inception or "",
                      clip_model=config.eval_clip_model, clip_pretrained=config.eval_clip_pretrained, quiet=True)


def read_prompts(config) -> list[str]:
    """--eval-prompts, else the captions of --val-latents, else of LATENTS."""
    from laionkit.evaluate.prompts import read_prompts as read

    if config.eval_prompts is not None:
        return read(config.eval_prompts, None, config.eval_count)
    return read(None, config.val_latents if config.val_latents is not None else config.latents, config.eval_count)


@contextmanager
def random_state_kept(device: torch.device):
    """The CPU (and this device's CUDA) generator, numpy's and Python's, as they were before."""
    kept = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        try:
            yield
        finally:
            np.random.set_state(kept[0])
            random.setstate(kept[1])


def _agreed(accelerator, error: str | None) -> None:
    """Rank 0's error (or None), raised on every rank as one line."""
    (error,) = _broadcast(accelerator, [error])
    if error is not None:
        raise LaionkitError(error)


def _named(error: Exception) -> str:
    """A message of laionkit.evaluate with its flags spelt as train's (--clip-model: --eval-clip-model)."""
    return FLAGS.sub(lambda m: f"--eval-{m.group(1)}", str(error))


def prepare(trainer) -> Scoring | None:
    """--eval-every: rank 0 reads the prompts, checks that the reference holds images, loads the scorers
    (weights as data, to host memory) and removes folders a killed run's evaluation left; every rank learns
    whether that worked, so a bad file stops the run here. None without --eval-every."""
    config, accelerator = trainer.config, trainer.accelerator
    if not config.eval_every:
        return None
    from laionkit.evaluate import load_scorers
    from laionkit.evaluate.prompts import reference_images

    scoring, error = Scoring(), None
    if accelerator.num_processes > 1:  # every rank creates it (a collective), before any rank may fail
        import torch.distributed as dist

        scoring.waiting = dist.new_group(backend="gloo", timeout=WAIT)
    if accelerator.is_main_process:
        for stale in Path(config.output).glob(FOLDER_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            with random_state_kept(trainer.device):  # open_clip draws the random init its weights replace
                scoring.settings, scoring.prompts = settings(config), read_prompts(config)
                reference_images(scoring.settings.reference, 8, limit=2)  # at least 2 readable, or one line
                load_scorers(scoring.settings, torch.device("cpu"), scoring.cache)
        except LaionkitError as found:
            error = _named(found)
    _agreed(accelerator, error)
    accelerator.print(f"scoring every {config.eval_every} steps and at the end: {config.eval_count} images "
                      f"against {config.eval_reference}")
    return scoring


def evaluate(trainer, scoring: Scoring) -> dict:
    """The scores of the weights at this step (every rank calls it): rank 0 returns the metrics record's
    fields, the other ranks {}. A failure while scoring is a warning and ``eval_error`` in the record; the
    run goes on (the checkpoints and the export are what it is for)."""
    t, config, accelerator = trainer, trainer.config, trainer.accelerator
    main = accelerator.is_main_process
    started = time.perf_counter()
    folder = Path(config.output) / f"{FOLDER_PREFIX}{t.step:08d}"
    result = {}
    try:
        if main:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
        # the run's own export, into the folder: rank 0 writes, every rank joins the gather
        if config.lora_rank is not None:
            lora.export(accelerator, t.unet, t.ema, t.master, folder)
        else:
            export(accelerator, t.unet, t.ema, t.master, folder, t.data.family.denoiser_subfolder,
                   torch.bfloat16 if config.full_bf16 else torch.float32)
        if main:
            try:
                with random_state_kept(t.device):
                    result = score(t, scoring, folder)
            except Exception as found:  # noqa: BLE001 - scoring is not worth the run: said, recorded, skipped
                message = _named(found) if isinstance(found, LaionkitError) else \
                    f"{type(found).__name__}: {(str(found).splitlines() or [''])[0][:300]}"
                if not isinstance(found, LaionkitError):
                    traceback.print_exc()
                accelerator.print(f"warning: --eval-every, step {t.step}: no scores ({message}); training goes on")
                result = {"eval_error": message}
    finally:
        if main:
            shutil.rmtree(folder, ignore_errors=True)
    if scoring.waiting is not None:  # the other ranks wait here, in gloo, for as long as scoring takes
        import torch.distributed as dist

        dist.barrier(group=scoring.waiting)
    if main:
        result["eval_seconds"] = round(time.perf_counter() - started, 2)
    return result


def score(trainer, scoring: Scoring, folder: Path) -> dict:
    """Rank 0: the pipeline of the weights in ``folder`` written there, ``count`` images generated on this
    rank's device and scored; the scorers go back to host memory after."""
    from laionkit import evaluate

    t, config = trainer, trainer.config
    spec, base = t.data.family, _base(config, t.data.family)
    merged = merge_lora(folder, spec, base, config.ema) if config.lora_rank is not None else None
    pipeline = write_pipeline(folder, spec, t.data.models, base=base, noise_scheduler=t.noise_scheduler,
                              use_ema=config.ema, files="hardlink", denoiser=merged)
    # the caption window the run trained with where it is not the pipeline's default (encode --max-sequence-length)
    found = replace(scoring.settings, pipeline=pipeline, max_sequence_length=spec.given_max_sequence_length)
    device = t.device
    pipe = evaluate.load_pipeline(pipeline, device, found.dtype)
    images = evaluate.generate(pipe, scoring.prompts, found.seed, found.steps, found.batch_size,
                               found.guidance_scale, found.resolution, max_sequence_length=found.max_sequence_length)
    del pipe
    inception = scoring.cache[("inception", found.inception)]
    clip = scoring.cache[("clip", found.clip_model, found.clip_pretrained)][0]
    try:
        clip.to(device)
        scores = evaluate.score(found, images, scoring.prompts, device, scoring.cache)
    finally:
        inception.to("cpu")
        clip.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**{key: scores[key] for key in SCORES}, "eval_count": len(images)}


def plot(config) -> None:
    """RUN/eval.png (rank 0): the scores of every record that has them, against step."""
    from laionkit.evaluate import plot_scores

    plot_scores(Path(config.output) / "metrics.jsonl", Path(config.output) / "eval.png")
