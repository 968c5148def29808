"""Benchmark the proof of learning at a size that means something (not a test; docs/BENCHMARKS.md, issue 28).

tests/test_learning.py shows on 8 photos at 64 px, with denoisers a few times wider than ``tiny``, that a model
trained from scratch by `laionkit encode` + `laionkit train` regenerates each caption's own image. This runs
the same proof with a real-size denoiser (``--family sd``: SD 1.5's UNet, ``--unet-config sd15``, 0.86B;
``--family sd3``: SD3-medium's MMDiT, ``--transformer-config sd3-medium``, 2.0B; random init, bf16) on
1,152 captioned images at 256 px for a wall-time budget, and reports:

- retrieval: for K training captions (64), the latent the family's own diffusers pipeline generates
  (loaded from RUN/pipeline in a fresh interpreter that never imports laionkit, ``output_type="latent"``,
  seed = index, guidance 1 so that the caption alone decides) is nearest its own image's latent among the
  K (tests/learning.py's ``retrieval``: count, own MSE against the mean MSE to the others, spread), also
  among all training images, and which of the caption's parts the nearest image shares; the negative: the
  same latents judged against shuffled captions;
- the stratified validation loss curve (``--val-latents`` held-out images, 8 strata, every ``--val-every``
  steps): val_loss and val_loss_strata from metrics.jsonl;
- the cost of scoring a run: `laionkit eval` (FID and KID on 1,000 generated images against the training
  images, CLIP score) on the exported pipeline, its seconds as a share of the training time and in training
  steps; ``train --eval-every`` does the same work in the run.

The data. Each image is one of the 8 real photos shipped in laionkit/data/demo (the PNG mirrored: it and
389_535.jpg are one photo, laionkit/common/learnable_models.py's distinct_photos) with one coloured shape drawn
on it, and its caption names all of it: "a red circle at the top left of photo 3" (8 photos x 3 shapes x 6 colours x 9
positions = 1,296 scenes; 1,152 train, 144 held out for the validation loss). The caption determines the
image, so "is the generated latent nearest its own image's" has one right answer, and the proxy is fair in
what matters here: the model must learn an identity per photo (a concept, as a class name or a style) and
bind attribute words to what they name and where (colour to shape, a spatial phrase to a place), through the
family's real conditioning path (text states, pooled vector, their order and widths). A conditioning mistake
that tests/test_learning.py would catch at 64 px shows here too, and a model that learned only the photos
scores about 1 in 8 among the K; it is also learnable in minutes at these widths, which real captions of
real photos are not. The images are written as pack's webdataset tars (jpg, txt, json), encoded by `laionkit
encode --text stored` at 256 px with the family's tiny VAE made sharp (laionkit/common/learnable_models.py's
sharpen_vae: a posterior log-variance of -30 and latents of unit spread, what a trained VAE has; a random-init one's latents
are noise around nearly equal means) and text encoders of the real widths with one layer each, random init
(SD: CLIP-L 768; SD3: CLIP-L 768, CLIP-G 1280, T5-XXL 4096), so the stored text has the real shapes.

Time. One call of under 10 minutes per family: `laionkit train --max-steps` far out, stopped by SIGTERM (train
checkpoints and exits 143) at ``--minutes`` of training or when only ``--reserve`` seconds of ``--budget``
are left, whichever comes first; `laionkit export` rebuilds RUN/pipeline from a run's denoiser export only, so
the run is resumed from that checkpoint with ``--max-steps`` at its step, which exports without training on.
Training, the export, generation and eval each run in a process of their own; encode runs in this one, through
its Python API, before any of them. Ten minutes of training with the checkpoint, export, generation and eval after
it do not fit one call (SD-1.5's took 14.5 min in all, SD3-medium's over 16 on an H200): ``--train-only`` stops
after the checkpoint, and a second call with ``--resume`` (on the same warm machine: the run is in ``--out``)
trains on from it, then exports and scores.

    python scripts/bench_learning.py --family sd --out /tmp/bl-sd --report $OUT     # GPU machine, call 1
    python scripts/bench_learning.py --family sd3 --out /tmp/bl-sd3 --report $OUT   # GPU machine, call 2
    python scripts/bench_learning.py --family sd3 --minutes 8 --train-only --out /tmp/bl-sd3   # 10 minutes of
    python scripts/bench_learning.py --family sd3 --minutes 2 --resume --out /tmp/bl-sd3 --report $OUT  # training
    python scripts/bench_learning.py --smoke --out /tmp/bl                          # CPU plumbing check
    python scripts/bench_learning.py --smoke --family sd3 --text-layers 1 --out /tmp/bl3  # CPU, SD3's real widths
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent), str(REPO / "tests")]  # tests/learning.py: the learning test's criterion
from learning import GENERATE, retrieval, shard_latents, spread  # noqa: E402

from laionkit.common.learnable_models import distinct_photos, sharpen_vae  # noqa: E402

PHOTOS = REPO / "laionkit" / "data" / "demo"  # the 8 real photos, shipped (../shared does not travel)
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 190, 60), "blue": (40, 70, 230), "yellow": (245, 215, 40),
           "white": (250, 250, 250), "black": (12, 12, 12)}
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
PARTS = ("photo", "shape", "colour", "position")
# Per family: the from-scratch architecture, a batch and learning rate for it at 256 px on one H200, the
# validation-loss period (about a dozen points in the budget), the seconds kept after training for the
# checkpoint, the export, generation and eval (2.0B's checkpoint and export write ~30 GB) and the images eval
# generates (SD3-size: 1,000 with classifier-free guidance are ~120 PFLOP, minutes of an H200: extrapolated).
FAMILIES = {
    "sd": dict(flag="--unet-config", config="sd15", batch=128, lr=1e-4, val_every=100, reserve=240, eval_count=1000),
    "sd3": dict(flag="--transformer-config", config="sd3-medium", batch=64, lr=1e-4, val_every=50, reserve=340,
                eval_count=128),
}
# A fresh interpreter running tests/learning.py's GENERATE with the pipeline on the GPU where there is one,
# TF32 matmuls (the same code otherwise; its noise is drawn on the CPU, so the same on any device).
ON_DEVICE = ("import diffusers, torch\ntorch.backends.cuda.matmul.allow_tf32 = True\n"
             "_load = diffusers.DiffusionPipeline.from_pretrained\n"
             "diffusers.DiffusionPipeline.from_pretrained = lambda *a, **k: _load(*a, **k).to("
             "'cuda' if torch.cuda.is_available() else 'cpu')\n")


# --- the data: photos with a named shape on them ---------------------------------------------------------

def scenes() -> list[dict]:
    """Every scene, in a fixed shuffled order: photo, shape, colour, position and the caption naming them."""
    found = [{"photo": photo, "shape": shape, "colour": colour, "position": position,
              "caption": f"a {colour} {shape} at the {position} of photo {photo}"}
             for photo in range(8) for shape in SHAPES for colour in COLOURS for position in POSITIONS]
    random.Random(0).shuffle(found)
    return found


def load_photos(folder: Path, side: int) -> list:
    """The 8 distinct photos (sorted by name), each resized and centre-cropped to side x side."""
    from PIL import Image, ImageOps

    names = sorted(p for p in folder.iterdir() if p.suffix in (".jpg", ".png"))
    assert len(names) == 8, names
    found = []
    for path in names:
        with Image.open(path) as image:
            found.append(ImageOps.fit(image.convert("RGB"), (side, side), Image.Resampling.BICUBIC))
    return found


def render(scene: dict, photos: list):
    """The scene's image: its photo with its shape (0.3 of the side) centred in its cell of a 3 x 3 grid."""
    from PIL import ImageDraw

    image = photos[scene["photo"]].copy()
    side = image.size[0]
    row, column = divmod(POSITIONS.index(scene["position"]), 3)
    cx, cy, r = (column + 0.5) * side / 3, (row + 0.5) * side / 3, 0.15 * side
    draw, fill = ImageDraw.Draw(image), COLOURS[scene["colour"]]
    if scene["shape"] == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif scene["shape"] == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(((cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)), fill=fill)
    return image


def write_shards(folder: Path, chosen: list[dict], photos: list, per_shard: int = 128) -> None:
    """Pack's layout (docs/FORMATS.md section 2): NNNNN.tar of <key>.jpg, <key>.txt, <key>.json."""
    import io

    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(0, len(chosen), per_shard):
        with wds.TarWriter(str(folder / f"{shard // per_shard:05d}.tar")) as sink:
            for index, scene in enumerate(chosen[shard:shard + per_shard]):
                image = render(scene, photos)
                buffer = io.BytesIO()
                image.save(buffer, format="JPEG", quality=95)
                key = f"{shard // per_shard:05d}{index:04d}"
                meta = {"key": key, "caption": scene["caption"], "status": "success", "error_message": None,
                        "url": f"https://example.org/scenes/{key}.jpg", "width": image.size[0],
                        "height": image.size[1], "original_width": image.size[0], "original_height": image.size[1],
                        **{part: scene[part] for part in PARTS}}
                sink.write({"__key__": key, "jpg": buffer.getvalue(), "txt": scene["caption"],
                            "json": json.dumps(meta)})


def prepare(args, log) -> dict:
    """Models (tiny pipeline, sharp VAE, real-width one-layer text encoders), image shards, their latents
    (`laionkit encode` through its Python API, in this process)."""
    import torch

    from laionkit.encode import EncodeConfig, run
    from laionkit.families import get_family

    out, side = args.out, args.resolution
    everything = scenes()
    train, val = everything[:args.images], everything[args.images:args.images + args.val_images]
    photos = load_photos(distinct_photos(PHOTOS, out / "photos"), side)
    models = out / "models"
    if not (models / "model_index.json").exists():
        shutil.rmtree(models, ignore_errors=True)
        get_family(args.family).write_tiny(models, 0)
        if args.text_layers:
            from bench_train_flow import real_text_encoders

            real_text_encoders(args.family, models, layers=args.text_layers, dtype=torch.float32)
        samples = out / "sharpen"  # the VAE's statistics: 64 training images at the training resolution
        samples.mkdir(exist_ok=True)
        for index, scene in enumerate(train[:64]):
            render(scene, photos).save(samples / f"{index:03d}.png")
        log(f"sharp VAE: {sharpen_vae(models / 'vae', samples, side)}")
    made = {"models": models, "train": train, "val": val}
    for name, chosen in (("train", train), ("val", val)):
        images, latents = out / f"images-{name}", out / f"latents-{name}"
        if not (latents / "manifest.json").exists():
            shutil.rmtree(images, ignore_errors=True)
            shutil.rmtree(latents, ignore_errors=True)
            write_shards(images, chosen, photos)
            run(EncodeConfig(shards=(str(images),), output=latents, model=str(models), resolution=side, text="stored",
                             batch_size=64, workers=args.workers, quiet=True), log=lambda _: None)
        made[f"images_{name}"], made[f"latents_{name}"] = images, latents
    if torch.cuda.is_available():  # what encode cached goes back to train's process
        torch.cuda.empty_cache()
    return made


# --- the processes --------------------------------------------------------------------------------------------

def cli(out: Path, name: str, argv: list[str], env: dict, timeout: float) -> dict:
    """`laionkit ARGV` in its own process, output in OUT/<name>.log: exit status, wall seconds, the log's tail."""
    started = time.perf_counter()
    log = out / f"{name}.log"
    try:
        with open(log, "w") as handle:
            rc = subprocess.run([sys.executable, "-m", "laionkit.cli", *argv], stdout=handle, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, timeout=max(timeout, 1)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    return {"rc": rc, "wall_s": round(time.perf_counter() - started, 1), "tail": log.read_text()[-1500:]}


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train(args, spec: dict, made: dict, env: dict, started: float) -> dict:
    """`laionkit train` from scratch until its time is up (SIGTERM: a checkpoint, exit 143), then the same
    command resumed at that step, which exports RUN/unet or RUN/transformer and RUN/pipeline and stops."""
    run = args.out / "run"
    if not args.resume:
        shutil.rmtree(run, ignore_errors=True)
    before = len(read_metrics(run))  # records of an earlier call's part of the run (--resume)
    argv = ["train", str(made["latents_train"]), "--output", str(run), spec["flag"],
            "tiny" if args.smoke else spec["config"], "--batch-size", str(args.batch or spec["batch"]),
            "--lr", str(args.lr or spec["lr"]), "--warmup-steps", str(args.warmup), "--caption-dropout", "0.1",
            "--mixed-precision", "no" if args.smoke else "bf16", "--val-latents", str(made["latents_val"]),
            "--val-every", str(args.val_every or spec["val_every"]), "--log-every", str(args.log_every),
            "--checkpoint-every", str(10**9), "--keep-checkpoints", "1", "--log-with", "none", "--quiet",
            "--workers", str(args.workers), "--shuffle-buffer", "256", "--seed", "0"]
    result: dict = {"argv": argv}
    begun = time.perf_counter()
    with open(args.out / "train.log", "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "laionkit.cli", *argv, "--max-steps", str(10**8),
                                    *(["--resume", "latest"] if args.resume else [])],
                                   stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = min(begun + args.minutes * 60, started + args.budget - (args.reserve or spec["reserve"]))
        first = None  # when the first log record appeared: the loop runs and SIGTERM now checkpoints
        while process.poll() is None:
            now = time.perf_counter()
            if first is None and len(read_metrics(run)) > before:
                first = now
                result["startup_s"], result["first_step"] = round(now - begun, 1), read_metrics(run)[before]["step"]
                if args.smoke:  # a CPU's start-up can take the whole --minutes: train that long after it
                    deadline = max(deadline, first + args.minutes * 60)
            if first is not None and now >= deadline:
                break
            if first is None and now >= deadline + 120:  # never started training: nothing to keep
                process.kill()
                break
            time.sleep(1)
        stopped = time.perf_counter()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            result["rc"] = process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            result["rc"] = process.wait()
    result["train_s"] = round(stopped - begun, 1)  # process start to the stop signal
    result["loop_s"] = round(stopped - first, 1) if first else None
    result["checkpoint_s"] = round(time.perf_counter() - stopped, 1)  # the stop: its checkpoint, the exit
    records = read_metrics(run)
    folders = (run / "checkpoints").glob("step-*") if (run / "checkpoints").exists() else ()
    steps = [int(path.name[5:]) for path in folders if path.name[5:].isdigit()]  # not a temporary one
    if not steps:
        result["error"] = f"no checkpoint (train exit {result['rc']}): {(args.out / 'train.log').read_text()[-1500:]}"
        return result
    step = max(steps)
    rates = [r["samples_per_s"] for r in records[before:] if "samples_per_s" in r]
    rates = rates[1:] or rates  # the windows after the first (start-up)
    result.update(step=step, samples=step * (args.batch or spec["batch"]), images=len(made["train"]),
                  samples_per_s=statistics.median(rates) if rates else None,
                  loss=[(r["step"], r["loss"]) for r in records if "loss" in r],
                  val=[{"step": r["step"], "val_loss": r["val_loss"], "val_loss_strata": r.get("val_loss_strata")}
                       for r in records if "val_loss" in r],
                  gpu_mem_gib=max((r.get("gpu_mem_gib") or 0 for r in records), default=None))
    if args.train_only:  # a later call goes on with --resume
        return result
    if not (run / "pipeline" / "model_index.json").exists():  # stopped, not finished: export through resume
        result["export"] = cli(args.out, "export", [*argv, "--max-steps", str(step), "--resume", "latest"], env,
                               timeout=args.budget - (time.perf_counter() - started))
        if result["export"]["rc"] == 0:
            del result["export"]["tail"]
    shutil.copy(run / "metrics.jsonl", args.out / "metrics.jsonl")
    result["pipeline"] = str(run / "pipeline") if (run / "pipeline" / "model_index.json").exists() else None
    return result


def judge(args, made: dict, pipeline: Path, env: dict, timeout: float) -> dict:
    """Retrieval of K training captions' generated latents (tests/learning.py's criterion), the shuffled
    negative, and which parts of the caption the nearest training image shares."""
    import torch
    from safetensors.torch import load_file

    own_all = shard_latents(made["latents_train"], made["models"] / "vae")
    chosen = made["train"][:args.captions]
    captions = [scene["caption"] for scene in chosen]
    output = args.out / "generated.safetensors"
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", ON_DEVICE + GENERATE, str(pipeline), json.dumps([captions]),
                               str(output), str(args.sample_steps), str(args.resolution), "1.0"],
                              capture_output=True, text=True, timeout=max(timeout, 1), env=env)
    except subprocess.TimeoutExpired:
        return {"error": "generation ran out of the time budget"}
    if done.returncode != 0 or done.stdout.split()[-1:] != ["False"]:
        return {"error": f"generation failed: {done.stdout[-500:]} {done.stderr[-1500:]}"}
    found = load_file(output)
    generated = {caption: found[f"0.{index}"] for index, caption in enumerate(captions)}
    own = {caption: own_all[caption] for caption in captions}
    result = {"generate_s": round(time.perf_counter() - began, 1), "captions": len(captions),
              **retrieval(generated, own)}
    result["ratios"] = statistics.median(result["ratios"].values())  # each caption's own / other MSE: the median
    shuffled = retrieval(generated, own, dict(zip(captions, captions[1:] + captions[:1], strict=True)))
    result["shuffled"] = {key: shuffled[key] for key in ("nearest_own", "own_mse", "other_mse")}
    result["spread_ratio"] = spread(generated) / spread(own)
    # Among all training images, and which parts the nearest shares (a model that learned only the photos
    # gets the photo right and the rest at chance).
    names = list(own_all)
    every = torch.stack([own_all[name].float() for name in names]).flatten(1)
    scene_of = {scene["caption"]: scene for scene in made["train"]}
    shares, nearest_all = dict.fromkeys(PARTS, 0), 0
    for caption, latent in generated.items():
        nearest = names[int(((every - latent.float().flatten()) ** 2).mean(1).argmin())]
        nearest_all += nearest == caption
        for part in PARTS:
            shares[part] += scene_of[nearest][part] == scene_of[caption][part]
    result["nearest_own_all"] = nearest_all
    result["nearest_shares"] = {part: n / len(captions) for part, n in shares.items()}
    return result


def evaluate(args, made: dict, pipeline: Path, train_s: float, steps_per_s: float | None, env: dict,
             timeout: float) -> dict:
    """`laionkit eval` of the pipeline: FID / KID on --eval-count images of training captions against the
    training images, CLIP score; random-init scorers in the real layout unless --inception / --clip-model
    are given. Under 1,000 images (SD3-size: 1,000 would not fit the call), a second eval of one batch gives
    the fixed part of the cost (start-up, loading, the reference features), and 1,000 images' seconds are
    extrapolated from the two: generation is linear in the count."""
    scorers = args.out / "eval-models"
    began = time.perf_counter()
    if not args.inception and not (scorers / "inception.pth").exists():
        wrote = cli(args.out, "tiny-eval", ["models", "tiny-eval", "--output", str(scorers)], env, timeout=300)
        if wrote["rc"] != 0 or not (scorers / "inception.pth").exists():
            return {"error": f"laionkit models tiny-eval exit {wrote['rc']}: {wrote['tail']}"}
    flags = ["--inception", args.inception or str(scorers / "inception.pth")]
    if args.clip_model:
        flags += ["--clip-model", args.clip_model, "--clip-pretrained", args.clip_pretrained]
    else:
        flags += ["--clip-model", str(scorers / "tiny-clip.json"), "--clip-pretrained",
                  str(scorers / "tiny-clip.safetensors")]

    def score(count: int, name: str) -> dict:
        folder = args.out / name
        shutil.rmtree(folder, ignore_errors=True)
        result = cli(args.out, name, ["eval", str(pipeline), "--reference", str(made["images_train"]), "--val-latents",
                                      str(made["latents_train"]), "--count", str(count), "--output", str(folder),
                                      "--resolution", str(args.resolution), "--batch-size", str(args.eval_batch),
                                      "--reference-count", str(args.reference_count), "--steps", str(args.eval_steps), "--quiet",
                                      *flags], env, timeout=timeout - (time.perf_counter() - began))
        if result["rc"] != 0 or not (folder / "eval.json").exists():
            return {"error": f"eval of {count} exit {result['rc']}: {result['tail']}"}
        found = json.loads((folder / "eval.json").read_text())
        return {"count": found["count"], "wall_s": result["wall_s"], "seconds": found["seconds"], "fid": found["fid"],
                "kid": found["kid"], "clip_score": found["clip_score"]}

    count = args.eval_count or FAMILIES[args.family]["eval_count"]
    result = score(count, "eval")
    if "error" in result:
        return result
    # The scores mean nothing here (a random-init VAE decoder draws the images): the cost is the measurement.
    result["scorers"] = "given" if args.inception else "random-init (laionkit models tiny-eval), real-size Inception"
    wall = result["wall_s"]
    if count < 1000:
        small = args.eval_batch
        left = timeout - (time.perf_counter() - began)
        result["fixed"] = score(small, "eval-fixed") if left > 60 else {"error": "skipped: out of time budget"}
        if "error" in result["fixed"]:
            return result
        per_image = (wall - result["fixed"]["wall_s"]) / (count - small)
        if per_image <= 0:  # the smaller eval took as long: noise (a busy CPU), no line through the two
            result["fixed"]["error"] = "not extrapolated: the smaller eval was not faster"
            return result
        wall = result["fixed"]["wall_s"] + per_image * (1000 - small)
        result["per_image_s"] = per_image
    result["wall_1000_s"] = wall  # measured, or extrapolated from the two
    result.update(share_of_10_min=wall / 600, share_of_train=wall / train_s if train_s else None,
                  train_steps_equivalent=wall * steps_per_s if steps_per_s else None)
    return result


# --- the orchestrator ------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="sd")
    parser.add_argument("--out", type=Path, required=True, help="work folder: models, shards, latents, the run")
    parser.add_argument("--report", type=Path, help="also write results-FAMILY.json, metrics and logs here")
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny models, 64 px, a few minutes")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--images", type=int, default=1152, help="training scenes (of 1,296)")
    parser.add_argument("--val-images", type=int, default=144, help="held-out scenes: the validation loss's")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time at most (process start to stop)")
    parser.add_argument("--budget", type=float, default=555, help="seconds for the whole call (a device call: 600)")
    parser.add_argument("--train-only", action="store_true",
                        help="stop after training (a checkpoint); a second call with --resume goes on and scores")
    parser.add_argument("--resume", action="store_true",
                        help="go on training the run an earlier --train-only call in the same --out left")
    parser.add_argument("--reserve", type=float, help="seconds kept after training (default: the family's)")
    parser.add_argument("--batch", type=int, help="default: the family's (sd 128, sd3 64)")
    parser.add_argument("--lr", type=float, help="default: the family's (1e-4)")
    parser.add_argument("--warmup", type=int, default=100, help="linear LR warmup steps")
    parser.add_argument("--val-every", type=int, help="validation-loss period in steps (sd 100, sd3 50)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--text-layers", type=int, default=1,
                        help="layers of the real-width text encoders (0: the tiny writer's; --smoke's default)")
    parser.add_argument("--captions", type=int, default=64, help="K: training captions generated and judged")
    parser.add_argument("--sample-steps", type=int, default=20, help="the pipeline's sampling steps (as the test)")
    parser.add_argument("--eval-count", type=int, help="images eval generates (sd 1000; sd3 128, extrapolated to 1000)")
    parser.add_argument("--eval-batch", type=int, default=32)
    parser.add_argument("--eval-steps", type=int, default=25, help="eval's sampling steps (its default)")
    parser.add_argument("--reference-count", type=int, default=0, help="eval's reference images (0: all training)")
    parser.add_argument("--inception", help="FID Inception weights (default: random-init, laionkit models tiny-eval)")
    parser.add_argument("--clip-model", help="open_clip model for the CLIP score (default: tiny-eval's)")
    parser.add_argument("--clip-pretrained", default="openai")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.smoke:
        args.resolution, args.images, args.val_images, args.captions, args.eval_count = 64, 96, 16, 8, 8
        args.minutes, args.batch, args.val_every, args.log_every, args.warmup, args.workers = 0.5, 4, 5, 5, 0, 1
        args.reserve, args.reference_count, args.eval_batch, args.eval_steps = args.reserve or 120, 8, 4, 5
        args.sample_steps, args.budget = 5, max(args.budget, 900)
        args.text_layers = 0 if "--text-layers" not in sys.argv else args.text_layers
    args.out.mkdir(parents=True, exist_ok=True)
    spec = FAMILIES[args.family]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary: dict = {"date": time.strftime("%Y-%m-%d"), "family": args.family, "device": device,
                     "torch": torch.__version__, "settings": {k: str(v) for k, v in vars(args).items()}}
    left = lambda: args.budget - (time.perf_counter() - started)  # noqa: E731

    def save() -> None:
        (args.out / f"results-{args.family}.json").write_text(json.dumps(summary, indent=1))
        if args.report:
            args.report.mkdir(parents=True, exist_ok=True)
            shutil.copy(args.out / f"results-{args.family}.json", args.report / f"results-{args.family}.json")

    made = prepare(args, lambda line: print(line, flush=True))
    summary["prepare_s"] = round(time.perf_counter() - started, 1)
    print(f"models and latents ready after {summary['prepare_s']} s; training until {args.minutes} min or "
          f"{args.reserve or spec['reserve']} s before the {args.budget} s budget", flush=True)
    earlier = args.out / f"results-{args.family}.json"
    if args.resume and earlier.exists():  # the first call's part of the run
        summary["earlier_train"] = json.loads(earlier.read_text()).get("train")
    summary["train"] = trained = train(args, spec, made, env, started)
    save()
    print(f"train: {json.dumps({k: v for k, v in trained.items() if k not in ('loss', 'val', 'argv')})[:800]}",
          flush=True)
    pipeline = Path(trained["pipeline"]) if trained.get("pipeline") else None
    if args.train_only:
        pipeline = None
    if pipeline is not None:
        summary["retrieval"] = judge(args, made, pipeline, env, timeout=left() - 20)
        save()
        print(f"retrieval: {json.dumps(summary['retrieval'])[:800]}", flush=True)
        steps_per_s = ((trained["step"] - trained["first_step"]) / trained["loop_s"]) if trained.get("loop_s") else None
        summary["eval"] = (evaluate(args, made, pipeline, trained["train_s"], steps_per_s, env, timeout=left() - 5)
                           if left() > 40 else {"error": "skipped: out of time budget"})
    summary["seconds"] = round(time.perf_counter() - started, 1)
    save()
    if args.report:
        for name in ("metrics.jsonl",):
            if (args.out / name).exists():
                shutil.copy(args.out / name, args.report / f"metrics-{args.family}.jsonl")
        logs = "".join(f"===== {log.name}\n{log.read_text()[-20000:]}\n" for log in sorted(args.out.glob("*.log")))
        (args.report / f"logs-{args.family}.log").write_text(logs)
    print_table(summary)


def print_table(summary: dict) -> None:
    """The figures that answer the benchmark's questions, last in the output."""
    trained, found, scored = summary.get("train", {}), summary.get("retrieval", {}), summary.get("eval", {})
    print(f"\n{summary['family']} on {summary['device']}, torch {summary['torch']}; {summary.get('seconds')} s in all")
    if "error" in trained:
        print(f"train ERROR {trained['error'][-600:]}")
        return
    print(f"train: {trained['step']} steps, {trained['samples']} samples ({trained['samples'] / trained['images']:.1f} "
          f"epochs of {trained['images']}) in {trained['train_s']} s ({trained.get('startup_s')} s start-up), "
          f"{trained['samples_per_s'] or 0:.1f} samples/s, exit {trained['rc']}, stop + checkpoint "
          f"{trained['checkpoint_s']} s, export {trained.get('export', {}).get('wall_s')} s")
    print("validation loss (8 strata, held-out images):")
    for record in trained["val"]:
        strata = " ".join(f"{x:.3f}" for x in record["val_loss_strata"] or [])
        print(f"  step {record['step']:>6}  {record['val_loss']:.4f}   [{strata}]")
    if "error" in found:
        print(f"retrieval ERROR {found['error'][-600:]}")
    elif found:
        k = found["captions"]
        print(f"retrieval of {k} captions: nearest own {found['nearest_own']}/{k} (chance 1/{k}), among all "
              f"{trained['images']} training images {found['nearest_own_all']}/{k}; own MSE {found['own_mse']:.3f} vs "
              f"others {found['other_mse']:.3f} (median ratio {found['ratios']:.2f}); spread / data "
              f"{found['spread_ratio']:.2f}")
        print("  nearest shares with the caption: " + ", ".join(f"{part} {share:.2f}" for part, share
                                                              in found["nearest_shares"].items()))
        shuffled = found["shuffled"]
        print(f"  negative, captions shuffled: nearest own {shuffled['nearest_own']}/{k}, own MSE "
              f"{shuffled['own_mse']:.3f} vs others {shuffled['other_mse']:.3f}")
    if "error" in scored:
        print(f"eval ERROR {scored['error'][-600:]}")
    elif scored:
        steps, fixed = scored.get("train_steps_equivalent"), scored.get("fixed", {})
        print(f"eval ({scored['scorers']}): {scored['count']} images {scored['wall_s']} s ({scored['seconds']} s inside "
              f"eval); FID {scored['fid']:.1f} KID {scored['kid']:.4f}"
              + (f"; {fixed['count']} images {fixed['wall_s']} s" if "wall_s" in fixed else "")
              + (f" ({fixed['error'][:200]})" if "error" in fixed else ""))
        if "wall_1000_s" in scored:
            print(f"  1,000 images: {scored['wall_1000_s']:.0f} s{'' if scored['count'] >= 1000 else ' (extrapolated)'}"
                  f" = {100 * scored['share_of_10_min']:.1f} % of 10 min of training, "
                  f"{100 * (scored['share_of_train'] or 0):.1f} % of this run's {trained['train_s']} s"
                  + (f", {steps:.0f} training steps" if steps else ""))


if __name__ == "__main__":
    main()
