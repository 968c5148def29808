"""`laionkit demo`: the whole chain, offline, on real photos served from a loopback web server.

It does only what a user would do by hand: serve the shipped photos (laionkit/data/demo), write a
LAION-style metadata parquet pointing at them, write tiny models with `laionkit models tiny`, then run
the demo recipe (pipelines/demo.yaml) through `laionkit run`, so every stage is the real command. It
ends with a grid of each photo trained on beside what the trained pipeline draws from its caption, and a
loss / throughput plot.

Random-init tiny models could not show that anything was learned (their VAE draws colour noise from any
latent), so the models are the learnable ones of the proof-of-learning tests (laionkit/common/learnable_models.py):
the tiny VAE made sharp and its decoder fitted to the photos, as a trained VAE's is to images, the tiny CLIP made
a bag of words whose states tell the captions apart (so a few hundred steps learn which is which), and a UNet
wide enough to hold 8 photos, trained from scratch by the recipe.
"""

from __future__ import annotations

import io
import json
import tarfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import LaionkitError, atomic_output
from laionkit.common.imageserver import folder_routes, serve

if TYPE_CHECKING:
    from PIL import Image

DEMO_DATA = Path(__file__).parent / "data" / "demo"
RECIPE = DEMO_DATA / "recipe.yaml"

# Rows the recipe's filter must drop, and one it keeps that the server cannot deliver: the demo shows
# each stage's accounting, not only its happy path.
UNSAFE_ROWS = 2
WATERMARKED_ROWS = 2
MISSING_PATH = "gone.jpg"
STAGES = ("filter", "pack", "encode", "train")  # the recipe's, in order: `laionkit demo --until` stops after one
SAMPLER_STEPS = 20
TILE = 128  # px a 64 px image is shown at in the grid


def write_metadata(path: Path, base_url: str, seed: int = 0) -> int:
    """A LAION-2B-en-aesthetic-like parquet: real photos and captions, synthetic score columns."""
    from PIL import Image

    captions = json.loads((DEMO_DATA / "captions.json").read_text())
    rng = np.random.default_rng(seed)
    rows = []
    for name, caption in captions.items():
        width, height = Image.open(DEMO_DATA / name).size
        rows.append({"URL": f"{base_url}/{name}", "TEXT": caption, "WIDTH": width, "HEIGHT": height,
                     "punsafe": rng.uniform(0, 0.1), "pwatermark": rng.uniform(0, 0.3)})
    photos = len(rows)
    for index in range(UNSAFE_ROWS):
        rows.append({**rows[index], "punsafe": rng.uniform(0.9, 1.0)})
    for index in range(WATERMARKED_ROWS):  # copies of safe photo rows, so this rule alone drops them
        rows.append({**rows[photos - 1 - index], "pwatermark": rng.uniform(0.85, 1.0)})
    rows.append({**rows[0], "URL": f"{base_url}/{MISSING_PATH}", "TEXT": "a photo the server no longer has"})
    table = pa.Table.from_pylist(rows)
    table = table.append_column("similarity", pa.array(rng.uniform(0.28, 0.4, len(rows)), pa.float32()))
    table = table.append_column("AESTHETIC_SCORE", pa.array(rng.normal(5.5, 0.5, len(rows)), pa.float32()))
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)
    return len(rows)


def plot_metrics(metrics: Path, output: Path) -> None:
    """Loss and samples/s against step, from the run's metrics.jsonl (with the validation loss and its
    strata where the run has them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [record for record in records if "loss" in record]
    steps = [record["step"] for record in records]
    figure, (loss_axis, speed_axis) = plt.subplots(1, 2, figsize=(10, 3.5))
    loss_axis.plot(steps, [record["loss"] for record in records], label="train")
    validated = [record for record in records if record.get("val_loss") is not None]  # train --val-latents
    if validated:
        loss_axis.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], "o-", label="validation")
        stratified = [r for r in validated if r.get("val_loss_strata")]  # --val-strata N: one thin line per level
        strata = min((len(r["val_loss_strata"]) for r in stratified), default=0)
        strata = strata if strata > 1 else 0  # one stratum is val_loss itself
        for k in range(strata):
            loss_axis.plot([r["step"] for r in stratified], [r["val_loss_strata"][k] for r in stratified], "-",
                           linewidth=0.8, color=plt.cm.viridis(k / max(strata - 1, 1)),
                           label={0: "validation, least noise", strata - 1: "validation, most noise"}.get(k))
        loss_axis.legend(fontsize="small")
    loss_axis.set(xlabel="step", ylabel="loss", title="loss")
    speed_axis.plot(steps, [record.get("samples_per_s", float("nan")) for record in records])
    speed_axis.set(xlabel="step", ylabel="samples/s", title="throughput")
    figure.tight_layout()
    with atomic_output(output) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)


def write_models(output: Path, photos: Path, echo: Callable[[str], None]) -> None:
    """`laionkit models tiny`, its VAE made sharp and its decoder fitted to ``photos``, its CLIP made to tell
    captions apart, and the wide UNet's config (denoiser.json, what the recipe trains from scratch)."""
    from laionkit.common.learnable_models import WIDE_SD_UNET, fit_decoder, sharpen_text_encoder, sharpen_vae
    from laionkit.common.models import write_tiny_models

    echo(f"[models] laionkit models tiny --output {output}")
    write_tiny_models(output)
    echo(f"[models] its VAE made sharp and its decoder fitted to the {len(list(photos.iterdir()))} photos, "
         "as a trained VAE's is to images")
    sharpen_vae(output / "vae", photos)
    fit_decoder(output / "vae", photos)
    echo("[models] its CLIP made a bag of words, so that each caption's states differ from the others'")
    sharpen_text_encoder(output / "text_encoder")
    (output / "denoiser.json").write_text(json.dumps(WIDE_SD_UNET, indent=1))


def shard_photos(shards: Path) -> list[tuple[str, str, Image.Image]]:
    """(key, caption, image) of each sample packed in ``shards``, in key order: the photos trained on."""
    from PIL import Image

    found = {}
    for shard in sorted(shards.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, kind = member.name.partition(".")
                found.setdefault(key, {})[kind] = tar.extractfile(member).read()
    return [(key, sample["txt"].decode(), Image.open(io.BytesIO(sample["jpg"])).convert("RGB"))
            for key, sample in sorted(found.items())]


def draw(pipeline: Path, captions: list[str], seed: int = 0) -> list[Image.Image]:
    """Each caption's image from the run's exported pipeline (the diffusers folder a user loads), caption i
    from seed + i, guidance 1 (the caption alone decides: the run trained without caption dropout)."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(pipeline)
    pipe.set_progress_bar_config(disable=True)
    generators = [torch.Generator().manual_seed(seed + index) for index in range(len(captions))]
    return pipe(prompt=captions, num_inference_steps=SAMPLER_STEPS, guidance_scale=1.0, height=64, width=64,
                generator=generators).images


def save_pairs(pairs: list[tuple[str, Image.Image, Image.Image]], output: Path, columns: int = 4) -> None:
    """A PNG of (caption, photo trained on, generated) pairs, the two images side by side over their caption."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=13)
    lines, line_height = 3, 16
    cell_w, cell_h = 2 * TILE + 12, TILE + lines * line_height + 14
    header = 24
    rows = -(-len(pairs) // columns)
    grid = Image.new("RGB", (columns * cell_w, header + rows * cell_h), "white")
    pen = ImageDraw.Draw(grid)
    for column in range(columns):
        pen.text((column * cell_w + 6, 5), "trained on", fill="gray", font=font)
        pen.text((column * cell_w + 6 + TILE, 5), "generated", fill="gray", font=font)
    for index, (caption, photo, generated) in enumerate(pairs):
        x, y = (index % columns) * cell_w + 6, header + (index // columns) * cell_h
        grid.paste(photo.resize((TILE, TILE), Image.Resampling.LANCZOS), (x, y))
        grid.paste(generated.resize((TILE, TILE), Image.Resampling.LANCZOS), (x + TILE, y))
        text = textwrap.wrap(caption, width=38, max_lines=lines, placeholder=" ...")
        pen.multiline_text((x, y + TILE + 4), "\n".join(text), fill="black", font=font, spacing=3)
    with atomic_output(output) as tmp:
        grid.save(tmp, format="png")


def run(workdir: Path, run_recipe: Callable[[Path, dict[str, str]], None], echo: Callable[[str], None],
        until: str = "train") -> dict:
    """Serve, prepare, and run the recipe; `run_recipe(path, variables)` is `laionkit run` (up to ``until``:
    before encode, no models are written). Then draw each trained caption (the images also as
    WORKDIR/generated/KEY.png) beside its photo."""
    from laionkit.common.learnable_models import distinct_photos

    if until not in STAGES:
        raise LaionkitError(f"--until {until}: the demo's stages are {', '.join(STAGES)}")
    workdir.mkdir(parents=True, exist_ok=True)
    photos = distinct_photos(DEMO_DATA, workdir / "photos")  # two of the shipped photos are one, mirrored here
    models = workdir / "models"
    if not models.exists() and STAGES.index(until) >= STAGES.index("encode"):
        with atomic_output(models) as tmp:
            write_models(tmp, photos, echo)
    routes = folder_routes(photos)
    with serve(routes) as server:
        echo(f"[server] serving {len(routes)} real photos at {server.base_url}")
        rows = write_metadata(workdir / "metadata.parquet", server.base_url)
        echo(f"[metadata] {rows} rows -> {workdir / 'metadata.parquet'}")
        run_recipe(RECIPE, {"workdir": str(workdir)})
    if until != "train":
        return {"workdir": workdir}
    run_dir = workdir / "run"
    plot = workdir / "training.png"
    plot_metrics(run_dir / "metrics.jsonl", plot)
    trained = shard_photos(workdir / "shards")
    echo(f"[samples] {len(trained)} captions drawn by {run_dir / 'pipeline'}")
    generated = draw(run_dir / "pipeline", [caption for _, caption, _ in trained])
    (workdir / "generated").mkdir(exist_ok=True)
    for (key, _, _), image in zip(trained, generated, strict=True):
        image.save(workdir / "generated" / f"{key}.png")
    grid = workdir / "samples.png"
    save_pairs([(caption, photo, image) for (_, caption, photo), image in zip(trained, generated, strict=True)],
               grid)
    return {"workdir": workdir, "plot": plot, "grid": grid, "unet": run_dir / "unet"}
