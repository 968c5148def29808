"""`laionkit demo`: the whole chain, offline, on real photos served from a loopback web server.

It does only what a user would do by hand: serve the shipped photos (laionkit/data/demo), write a
LAION-style metadata parquet pointing at them, write tiny models with `laionkit models tiny`, then run
the demo recipe (pipelines/demo.yaml) through `laionkit run`, so every stage is the real command. It
ends with the validation grid and a loss / throughput plot.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common import atomic_output
from laionkit.common.imageserver import folder_routes, serve

DEMO_DATA = Path(__file__).parent / "data" / "demo"
RECIPE = DEMO_DATA / "recipe.yaml"

# Rows the recipe's filter must drop, and one it keeps that the server cannot deliver: the demo shows
# each stage's accounting, not only its happy path.
UNSAFE_ROWS = 2
WATERMARKED_ROWS = 2
MISSING_PATH = "gone.jpg"


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


def run(workdir: Path, run_recipe: Callable[[Path, dict[str, str]], None], echo: Callable[[str], None]) -> dict:
    """Serve, prepare, and run the recipe; `run_recipe(path, variables)` is `laionkit run`."""
    from laionkit.common.models import write_tiny_models

    workdir.mkdir(parents=True, exist_ok=True)
    models = workdir / "models"
    if not models.exists():
        echo(f"[models] laionkit models tiny --output {models}")
        with atomic_output(models) as tmp:
            write_tiny_models(tmp)
    routes = folder_routes(DEMO_DATA)
    with serve(routes) as server:
        echo(f"[server] serving {len(routes)} real photos at {server.base_url}")
        rows = write_metadata(workdir / "metadata.parquet", server.base_url)
        echo(f"[metadata] {rows} rows -> {workdir / 'metadata.parquet'}")
        run_recipe(RECIPE, {"workdir": str(workdir)})
    run_dir = workdir / "run"
    plot = workdir / "training.png"
    plot_metrics(run_dir / "metrics.jsonl", plot)
    samples = sorted((run_dir / "samples").glob("step-*.png"))
    grid = workdir / "samples.png"
    if samples:
        shutil.copyfile(samples[-1], grid)
    return {"workdir": workdir, "plot": plot, "grid": grid if samples else None, "unet": run_dir / "unet"}

