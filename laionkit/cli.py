"""The `laionkit` command: thin typer wrappers that build each stage's config and call its run()."""

from __future__ import annotations

import inspect
import json
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from laionkit import __version__
from laionkit.common import LaionkitError, available_cpus
from laionkit.common.options import QUIET_HELP, RANK_HELP, STORAGE_HELP, WORLD_SIZE_HELP, typer_parameters
from laionkit.trainer.config import TrainConfig

app = typer.Typer(
    name="laionkit",
    help="From LAION parquet metadata to a trained latent-diffusion model: filter -> pack -> encode -> train.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
# User text (paths, model names, SQL, error messages) is printed as data: with markup on, `owner/name[/sub]`
# raises MarkupError, `[red]` in a path vanishes and `:x:` turns into an emoji. Styled parts use rich.text.Text.
err_console = Console(stderr=True, markup=False, emoji=False, highlight=False)

# Options every rank-sharded command shares; resolved by laionkit.common.ranks.resolve_rank.
RankOption = Annotated[Optional[int], typer.Option("--rank", help=RANK_HELP)]
WorldSizeOption = Annotated[Optional[int], typer.Option("--world-size", help=WORLD_SIZE_HELP)]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)]
# Paths may be URLs of any fsspec filesystem (s3://, gs://, hf://, https:// to read); credentials come from
# AWS_* / fsspec config, and this JSON (flat, or keyed by protocol) adds filesystem options.
StorageOption = Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_HELP)]


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"laionkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """From LAION parquet metadata to a trained latent-diffusion model: filter -> pack -> encode -> train."""


@app.command(epilog="""Examples:

    laionkit doctor

    laionkit doctor --allreduce                 # NCCL bus bandwidth across all visible GPUs

    laionkit doctor --shards data/latents --json
""")
def doctor(
    allreduce: Annotated[bool, typer.Option(help="Time an all-reduce across GPUs (NCCL bus bandwidth).")] = False,
    processes: Annotated[Optional[int], typer.Option(help="Processes for --allreduce (default: GPUs).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="nccl or gloo (default: nccl when GPUs).")] = None,
    megabytes: Annotated[int, typer.Option(help="All-reduce message size in MB.")] = 256,
    shards: Annotated[Optional[Path], typer.Option(help="Time reading the tar shards in this folder.")] = None,
    min_busbw: Annotated[float, typer.Option(help="GB/s under which the link verdict is 'slow'.")] = 40.0,
    min_read: Annotated[float, typer.Option(help="MB/s under which the shard-read verdict is 'slow'.")] = 200.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Versions, GPUs, and optional NCCL all-reduce and shard-read checks, each with a plain verdict."""
    from dataclasses import asdict

    from rich.table import Table

    from laionkit import doctor as doctor_stage

    rows = doctor_stage.run(allreduce, processes, backend, megabytes, shards, min_busbw, min_read)
    if as_json:
        typer.echo(json.dumps([asdict(row) for row in rows], indent=2))
        return
    table = Table("check", "value", "verdict", title="laionkit doctor")
    for row in rows:
        style = "green" if row.verdict.startswith("ok") else "yellow"
        table.add_row(Text(row.name), Text(row.value), Text(row.verdict, style=style))
    Console().print(table)


models_app = typer.Typer(help="Model folders: tiny random-init models for offline tests and demos.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("tiny", epilog="""Examples:

    laionkit models tiny --output models/tiny

    laionkit encode shards/ --model models/tiny --output latents/ --resolution 64

    laionkit models tiny --family sdxl --output models/tiny-sdxl
""")
def models_tiny(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (a diffusers pipeline layout).")],
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
    family: Annotated[str, typer.Option(help="Model family: sd (SD 1.x/2.x), sdxl, sd3, flux or pixart (PixArt-Σ).")] = "sd",
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace --output if it is not empty (refused otherwise: it is replaced whole).")] = False,
) -> None:
    """Write a tiny random-init pipeline of a model family (SD: vae/, unet/, text_encoder/, tokenizer/,
    scheduler/; SDXL adds text_encoder_2/ and tokenizer_2/) in the real diffusers / transformers formats,
    with the real CLIP BPE vocabulary, so everything runs offline."""
    from laionkit.common import atomic_output, storage
    from laionkit.families import get_family

    spec = get_family(family)
    if not overwrite:
        storage.refuse_nonempty(output, "models tiny")
    with atomic_output(output) as tmp:
        spec.write_tiny(tmp, seed)
    typer.echo(f"wrote tiny {spec.name} models to {output}")


@models_app.command("tiny-eval", epilog="""Examples:

    laionkit models tiny-eval --output models/eval   # inception.pth, tiny-clip.json, tiny-clip.safetensors
""")
def models_tiny_eval(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the two models into.")],
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
) -> None:
    """Random-init scorers for `laionkit eval` offline: the FID Inception-v3 in the real weights file's layout
    (inception.pth, the same keys and shapes) and a tiny open_clip model in open_clip's config + weights
    layout. Their scores mean nothing; the code path is the one real weights take."""
    from laionkit.evaluate.clipscore import write_tiny_clip
    from laionkit.evaluate.inception import write_random_inception

    write_random_inception(output / "inception.pth", seed)
    write_tiny_clip(output, seed)
    typer.echo(f"wrote inception.pth, tiny-clip.json and tiny-clip.safetensors to {output}")


configs_app = typer.Typer(help="The launcher configs (train/*.yaml, *.json) and pipeline files shipped with laionkit.",
                          no_args_is_help=True)
app.add_typer(configs_app, name="configs")


@configs_app.command("copy", epilog="""Examples:

    laionkit configs copy my-configs      # my-configs/train/ddp.yaml, my-configs/pipelines/slurm/...

    accelerate launch --config_file my-configs/train/ddp.yaml -m laionkit.cli train latents/ --output runs/a
""")
def configs_copy(
    output: Annotated[Path, typer.Argument(help="Folder to copy train/ and pipelines/ into.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace files that already exist there.")] = False,
) -> None:
    """Copy the accelerate / DeepSpeed configs (train/) and the Slurm, Kubernetes, torchrun and Docker files
    (pipelines/) out of the installed package, to edit for a cluster."""
    from laionkit import configs

    names = configs.copy(output, overwrite)
    typer.echo(f"copied {len(names)} files to {output} (train/, pipelines/)")


@app.command("run", epilog="""Examples:

    laionkit run pipelines/demo.yaml

    laionkit run pipelines/sd15-finetune-512.yaml --var workdir=/data/sd15 --dry-run
""")
def run_recipe(
    recipe: Annotated[Path, typer.Argument(help="A recipe YAML (see pipelines/).")],
    var: Annotated[Optional[list[str]], typer.Option(help="KEY=VALUE substituted for {KEY} in the recipe.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Validate and print the commands; run nothing.")] = False,
) -> None:
    """Run filter -> pack -> encode -> train from one recipe, skipping stages already complete."""
    variables = {}
    for item in var or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise LaionkitError(f"--var {item!r}: expected KEY=VALUE")
        variables[key] = value
    _run_recipe_file(recipe, variables, dry_run)


def _run_recipe_file(recipe: Path, variables: dict[str, str], dry_run: bool = False) -> None:
    """Validate then run a recipe, each stage through this CLI in-process (or `accelerate launch`)."""
    import shlex

    from laionkit import recipe as recipes

    cli_group = typer.main.get_command(app)
    workdir, steps = recipes.load(recipe, cli_group.commands, variables)

    def invoke(argv: list[str]) -> None:
        try:
            code = cli_group.main(argv, prog_name="laionkit", standalone_mode=False)
        except typer.TyperException as error:  # a usage error: typer vendors click, so not click's class
            raise LaionkitError(error.format_message()) from None
        if isinstance(code, int) and code != 0:
            raise LaionkitError(f"exited with {code}")

    if dry_run:
        for step in steps:
            typer.echo(shlex.join(recipes.command_line(step)))
        return
    recipes.execute(steps, workdir, invoke, typer.echo)


@app.command(epilog="""Examples:

    laionkit demo

    laionkit demo --workdir /tmp/laionkit-demo

Offline and on 2 CPU cores in a few minutes: real photos from a loopback web server, tiny models.
""")
def demo(
    workdir: Annotated[Path, typer.Option(help="Where every stage's output goes.")] = Path("laionkit-demo"),
) -> None:
    """The whole chain on embedded real photos: filter -> pack -> encode -> train, then a validation grid
    and a loss / throughput plot. Runs pipelines/demo.yaml through `laionkit run`."""
    from laionkit import demo as demo_stage

    result = demo_stage.run(workdir, _run_recipe_file, typer.echo)
    for stage in ("filtered", "shards", "latents"):
        typer.echo(f"\n== laionkit stats {workdir / stage}")
        stats_command(workdir / stage)
    typer.echo(f"\ntrained UNet (diffusers folder): {result['unet']}")
    typer.echo(f"loss / throughput plot:        {result['plot']}")
    typer.echo(f"validation grid:               {result['grid']}")


@app.command(epilog="""Examples:

    laionkit pack filtered/ --output shards/

    laionkit pack laion2B-en-part-00000.parquet --output shards/ --image-size 256 --resize-mode keep_ratio

    srun --ntasks 4 laionkit pack filtered/ --output shards/   # 4 ranks (SLURM_PROCID / SLURM_NTASKS)

    laionkit pack local-urls.parquet --output shards/ --allow-private-hosts   # URLs on 127.0.0.1 / 10.x

    laionkit pack s3://bucket/filtered/ --output s3://bucket/shards/   # AWS_* credentials / AWS_ENDPOINT_URL

Rerun the same command after a crash: finished shards are kept, the rest are downloaded.
""")
def pack(
    inputs: Annotated[list[str], typer.Argument(help="Parquet files or folders of them (filter's output); paths or URLs.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Folder for the WebDataset tar shards (a path or URL).")],
    image_size: Annotated[int, typer.Option(help="Output image side in pixels.")] = 512,
    resize_mode: Annotated[str, typer.Option(help="center_crop, keep_ratio, border or no.")] = "center_crop",
    min_image_size: Annotated[int, typer.Option(help="Drop images whose shorter side is smaller.")] = 0,
    max_aspect_ratio: Annotated[
        Optional[float], typer.Option(help="Drop images with a longer/shorter side ratio above this.")
    ] = None,
    max_image_area: Annotated[
        int, typer.Option(help="Refuse images with more pixels, from their header (decompression bombs); 0: off.")
    ] = 89_478_485,
    encode_format: Annotated[str, typer.Option(help="jpg or webp.")] = "jpg",
    encode_quality: Annotated[int, typer.Option(help="Encoder quality, 0-100.")] = 95,
    processes: Annotated[Optional[int], typer.Option(help="Download processes (default: CPU count).")] = None,
    threads: Annotated[int, typer.Option(help="Download threads per process.")] = 64,
    timeout: Annotated[
        float, typer.Option(help="Seconds one download may take in all (connect, redirects, body).")
    ] = 10.0,
    max_bytes: Annotated[int, typer.Option(help="Refuse a response body larger than this many bytes.")] = 64 * 2**20,
    allow_private_hosts: Annotated[bool, typer.Option(
        "--allow-private-hosts",
        help="Also fetch URLs that resolve to loopback, private or link-local addresses (off: refused).")] = False,
    retries: Annotated[int, typer.Option(help="Extra attempts per failed download.")] = 0,
    shard_size: Annotated[int, typer.Option(help="Input rows per tar shard.")] = 10_000,
    url_column: Annotated[Optional[str], typer.Option(help="URL column (default: URL or url).")] = None,
    caption_column: Annotated[
        Optional[str], typer.Option(help="Caption column (default: TEXT, caption or text).")
    ] = None,
    respect_optout: Annotated[
        bool, typer.Option(help="Skip images whose X-Robots-Tag says noai/noimageai/noindex/noimageindex.")
    ] = True,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Write into --output even if it holds another stage's outputs (e.g. latents); "
        "files of the same name are replaced.")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Download the URLs of parquet rows with img2dataset into WebDataset shards (`key.jpg/.txt/.json`),
    keeping every input column in each sample's json; writes DIR/manifest.json."""

    from laionkit.pack import PackConfig, run

    config = PackConfig(
        inputs=tuple(inputs), output=output, image_size=image_size, resize_mode=resize_mode,
        min_image_size=min_image_size, max_aspect_ratio=max_aspect_ratio, max_image_area=max_image_area,
        encode_format=encode_format, encode_quality=encode_quality, processes=processes or available_cpus(),
        threads=threads, timeout=timeout, max_bytes=max_bytes, allow_private_hosts=allow_private_hosts,
        retries=retries, shard_size=shard_size, url_column=url_column,
        caption_column=caption_column, respect_optout=respect_optout, rank=rank, world_size=world_size,
        quiet=quiet, storage_options=storage_options, overwrite=overwrite,
    )
    manifest = run(config)
    if not quiet:
        typer.echo(
            f"{output}: {len(manifest['shards'])}/{manifest['planned_shards']} shards, "
            f"{manifest['samples']:,} samples of {manifest['rows']:,} rows ({manifest['success_rate']:.1%})"
        )


@app.command("filter", epilog="""Examples:

    laionkit filter laionkit/data/laion-sample.parquet --preset laion-safe --output out/filtered

    laionkit filter laion2B-en-aesthetic/ --preset sd1 --where "WIDTH / HEIGHT <= 2" --output out/sd1

    laionkit filter metadata/ --embeddings img_emb/ --score aes=aesthetic-v2:sac+logos+ava1-l14-linearMSE.pth --where "aes >= 6" --output out/aes6

    laionkit filter metadata/ --embeddings img_emb/ --score anime="prompt:an anime drawing|a manga page" --where "anime > 0.3" --output out/anime

    torchrun --nproc-per-node 8 -m laionkit.cli filter laion/ --preset sd2 --output out/sd2   # 8 ranks, no coordinator

    torchrun --nproc-per-node 8 -m laionkit.cli filter laion/ --dedup URL --output out/unique   # exact, ranks meet via files

    laionkit filter s3://bucket/laion/ --preset sd2 --output s3://bucket/sd2   # AWS_* credentials / AWS_ENDPOINT_URL

    laionkit filter datacomp/metadata/ --preset datacomp-basic --top 0.3:clip_l14_similarity_score --output out/dc
""")
def filter_command(
    inputs: Annotated[list[str], typer.Argument(help="Parquet files or folders (searched for *.parquet).")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output folder.")],
    where: Annotated[Optional[list[str]], typer.Option(
        "--where", help="One DuckDB SQL true/false expression over the input's columns, e.g. 'punsafe < 0.5' or "
        "'length(caption) >= 5' (no subqueries or file access); repeatable, AND-ed.")] = None,
    preset: Annotated[Optional[list[str]], typer.Option(
        "--preset", help="Rule set: laion-safe, sd1, sd2 (LAION; sd1/sd2 also on COYO-700M's columns), coyo-safe, "
        "datacomp-basic, datacomp-clip-l14-30, datacomp-clip-b32-30; combines with --where.")] = None,
    top: Annotated[Optional[list[str]], typer.Option(
        "--top", help="FRACTION:COLUMN: keep the rows whose COLUMN is in the top FRACTION of all inputs' rows with a "
        "value, exactly over all ranks (ties: earlier input row first), e.g. 0.3:clip_l14_similarity_score; "
        "repeatable, AND-ed with the other rules.")] = None,
    rename: Annotated[Optional[list[str]], typer.Option(
        "--rename", help="OLD=NEW: rename an input column (in rules and in the output).")] = None,
    dedup: Annotated[Optional[str], typer.Option(
        help="Drop rows whose COLUMN value was already kept (global first occurrence, exact with any number of ranks).")] = None,
    dedup_wait: Annotated[float, typer.Option(
        help="--dedup: seconds a rank waits for the other ranks' partition / resolve outputs before it stops.")] = 3600.0,
    dedup_bucket_rows: Annotated[int, typer.Option(
        help="--dedup: input rows per hash bucket; one bucket is what a rank holds in memory to resolve it.")] = 4_000_000,
    embeddings: Annotated[Optional[list[str]], typer.Option(
        "--embeddings", help="CLIP image embeddings (.npy, N x D) aligned with the inputs: a file or a folder, a path or URL.")] = None,
    score: Annotated[Optional[list[str]], typer.Option(
        "--score", help="NAME=KIND:ARG, KIND = aesthetic-v2, aesthetic-v1, head (weights path) or prompt (text, a|b).")] = None,
    clip_model: Annotated[str, typer.Option(help="open_clip model for prompt scores.")] = "ViT-L-14",
    clip_pretrained: Annotated[str, typer.Option(
        help="open_clip weights tag or file for prompt scores; 'none' = seeded random init (tests).")] = "openai",
    unit_rows: Annotated[int, typer.Option(
        help="Merge row groups into work units of at least this many rows.")] = 1_000_000,
    threads: Annotated[Optional[int], typer.Option(
        help="CPU threads for this rank (default: the CPUs it may use); units run in parallel, one thread each.")] = None,
    skip_bad: Annotated[bool, typer.Option(
        "--skip-bad", help="Skip unreadable inputs (counted in stats) instead of stopping.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Redo finished units instead of resuming; also write into a folder that holds another stage's outputs.")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Keep the LAION rows that pass SQL rules, presets and custom CLIP scores; parquet parts + per-rule stats."""
    from laionkit import filter as filter_stage

    config = filter_stage.FilterConfig(
        inputs=tuple(inputs), output=output, where=tuple(where or ()), presets=tuple(preset or ()), top=tuple(top or ()),
        rename=tuple(rename or ()), dedup=dedup, embeddings=tuple(embeddings or ()), scores=tuple(score or ()),
        clip_model=clip_model, clip_pretrained=clip_pretrained, unit_rows=unit_rows, threads=threads, rank=rank,
        world_size=world_size, dedup_wait=dedup_wait, dedup_bucket_rows=dedup_bucket_rows,
        skip_bad=skip_bad, overwrite=overwrite, quiet=quiet, storage_options=storage_options,
    )
    stats = filter_stage.run(config)
    if not quiet:
        err_console.print(f"filter: kept {stats['rows_out']:,} of {stats['rows_in']:,} rows -> {output}")


@app.command("stats", epilog="""Examples:

    laionkit stats out/filtered        # a filter folder: rows in/out per rank, drops and nulls per rule
    laionkit stats out/shards          # pack or plain img2dataset output; plain WebDataset tars too (read-only)
    laionkit stats s3://bucket/shards  # any fsspec URL; credentials from AWS_* / --storage-options
""")
def stats_command(
    folder: Annotated[str, typer.Argument(help="An output folder of a laionkit stage (a path or URL).")],
    storage_options: StorageOption = None,
) -> None:
    """Print a readable summary of a stage's output folder, merged across ranks."""
    from laionkit import stats as stats_stage

    stats_stage.run(stats_stage.StatsConfig(folder=folder, storage_options=storage_options))


@app.command("export", epilog="""Examples:

    laionkit export runs/sdxl --format single-file   # RUN/single_file/sdxl-sdxl.safetensors for ComfyUI / A1111

    laionkit export runs/old --format pipeline,single-file --export-files hardlink

A run trained with --export none (or before pipelines were exported) gets RUN/pipeline rebuilt from its newest
checkpoint's record (latents, base model, noise schedule); a LoRA run's (trained with the default --export auto)
gets RUN/lora merged into a copy of its base at alpha / rank. Single files: SD 1.x/2.x and SDXL as one CompVis/SGM
checkpoint (models/checkpoints/), SD3 and Flux as the denoiser alone (models/diffusion_models/).
""")
def export_command(
    run: Annotated[Path, typer.Argument(help="A finished run folder (RUN/unet or RUN/transformer, checkpoints/).")],
    format: Annotated[str, typer.Option("--format", help="pipeline, single-file, or both comma-separated.")] = "single-file",
    export_files: Annotated[str, typer.Option(help="RUN/pipeline's base files: copy or hardlink.")] = "copy",
) -> None:
    """Export a finished run: a diffusers pipeline folder, or single-file checkpoints for ComfyUI / A1111."""
    from laionkit.trainer.export import export_run

    for path in export_run(run, format, export_files):
        typer.echo(str(path))


@app.command("eval", epilog="""Examples:

    laionkit eval runs/sd15/pipeline --reference data/shards --val-latents data/val-latents --count 1000
    --output runs/sd15    # appends fid, kid, clip_score to runs/sd15/metrics.jsonl, plots runs/sd15/eval.png

    laionkit eval runs/a/pipeline --reference coco-val/ --prompts coco-captions.txt --count 5000
    --output evals/a --inception weights-inception-2015-12-05-6726825d.pth --clip-pretrained laion2b_s32b_b82k

    laionkit models tiny-eval --output models/eval && laionkit eval runs/tiny/pipeline --reference photos/
    --prompts prompts.txt --count 16 --output evals/tiny --inception models/eval/inception.pth
    --clip-model models/eval/tiny-clip.json --clip-pretrained models/eval/tiny-clip.safetensors

Writes OUTPUT/eval.json and OUTPUT/eval-grid.png. Image i uses seed + i, so two pipelines evaluated with the same
prompts, seed and reference are compared on the same noise (compare runs of different settings or data filters).
""")
def eval_command(
    pipeline: Annotated[Path, typer.Argument(help="An exported diffusers pipeline folder (RUN/pipeline; any family).")],
    reference: Annotated[Path, typer.Option(help="Reference images: a folder of image files, or pack's webdataset tars (a folder of *.tar or one tar).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for eval.json and eval-grid.png; a run folder (with metrics.jsonl) also gets a metrics record and eval.png.")],
    prompts: Annotated[Optional[Path], typer.Option(help="A text file of prompts, one per line.")] = None,
    val_latents: Annotated[Optional[Path], typer.Option(help="Or: an encode output folder whose captions are the prompts (shards by name, tar order).")] = None,
    count: Annotated[int, typer.Option(help="Images to generate: the first N prompts, cycled if fewer (FID is biased upward at small N; KID is unbiased, so compare runs at one N).")] = 1000,
    seed: Annotated[int, typer.Option(help="Image i is generated from seed + i.")] = 0,
    steps: Annotated[int, typer.Option(help="Sampling steps per image.")] = 25,
    guidance_scale: Annotated[Optional[float], typer.Option(help="Classifier-free guidance scale (default: the pipeline's).")] = None,
    resolution: Annotated[Optional[int], typer.Option(help="Square side of the generated images (default: the pipeline's); references are centre-cropped and resized to it.")] = None,
    batch_size: Annotated[int, typer.Option(help="Images per generation / feature batch.")] = 8,
    reference_count: Annotated[int, typer.Option(help="Use at most this many reference images (0: all).")] = 0,
    inception: Annotated[Optional[str], typer.Option(help="FID Inception-v3 weights (torch-fidelity's / pytorch-fid's state dict): a .pth or .safetensors file, a URL, or a hub id owner/name[/FILE] (default: torch-fidelity's release URL, cached by torch.hub).")] = None,
    clip_model: Annotated[str, typer.Option(help="open_clip model: a name (ViT-L-14), hf-hub:ORG/REPO, or a model config .json file.")] = "ViT-L-14",
    clip_pretrained: Annotated[Optional[str], typer.Option(help="open_clip weights: a tag (openai, laion2b_s32b_b82k) or a .safetensors / state-dict file.")] = "openai",
    kid_subsets: Annotated[int, typer.Option(help="KID: random subsets averaged (torchmetrics: 100).")] = 100,
    kid_subset_size: Annotated[int, typer.Option(help="KID: images per subset (torchmetrics: 1000; cut to the smaller set).")] = 1000,
    device: Annotated[Optional[str], typer.Option(help="torch device (default: cuda if available, else cpu).")] = None,
    dtype: Annotated[str, typer.Option(help="Pipeline dtype: auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16.")] = "auto",
    quiet: QuietOption = False,
) -> None:
    """Score an exported pipeline: FID and KID against reference images, CLIP score against the prompts."""
    from laionkit import evaluate

    config = evaluate.EvalConfig(
        pipeline=pipeline, reference=reference, output=output, prompts=prompts, val_latents=val_latents,
        count=count, seed=seed, steps=steps, guidance_scale=guidance_scale, resolution=resolution,
        batch_size=batch_size, reference_count=reference_count, inception=inception or "", clip_model=clip_model,
        clip_pretrained=clip_pretrained, kid_subsets=kid_subsets, kid_subset_size=kid_subset_size, device=device,
        dtype=dtype, quiet=quiet)
    evaluate.run(config, log=typer.echo)


@app.command("train", epilog="""Examples:

    laionkit train latents/ --output runs/tiny --unet-config tiny --max-steps 200 --batch-size 8

    accelerate launch --config_file train/ddp.yaml -m laionkit.cli train latents/ --output runs/sd15
    --unet-config sd15 --epochs 10 --batch-size 64 --mixed-precision bf16 --compile --channels-last
    --snr-gamma 5 --ema --checkpoint-every 2000 --resume latest

    laionkit train latents/ --output runs/ft --unet stable-diffusion-v1-5/stable-diffusion-v1-5
    --max-steps 10000 --lr 1e-5 --validate-every 500

    laionkit train latents/ --output runs/lora --unet stable-diffusion-v1-5/stable-diffusion-v1-5
    --lora-rank 16 --lr 1e-4 --max-steps 2000 --val-latents val-latents/ --val-every 200

    laionkit train latents-256/ --output runs/multires --unet-config sd15 --max-steps 50000
    --stage latents-512-buckets/:20000 --resume latest

    laionkit train s3://bucket/latents --output runs/tiny --unet-config tiny --cache-dir /scratch/cache --cache-size 200000000000

    laionkit train s3://bucket/latents --output s3://bucket/runs/sd15 --unet-config sd15 --max-steps 50000
    --resume latest   # checkpoints staged in $LAIONKIT_STAGING, uploaded with done records; AWS_* credentials

    laionkit train latents-flux/ --output runs/flux --transformer flux-dev --lora-rank 16 --max-steps 2000

    laionkit train latents-sd3/ --output runs/sd3 --transformer-config sd3-medium --shift 3 --weighting none
    --max-steps 100000 --mixed-precision bf16

    laionkit train latents-flux/ --output runs/flux-full --transformer flux-dev --mixed-precision bf16
    --compile --checkpointing blocks --resume latest

    laionkit train latents-sdxl/ --output runs/sdxl --unet sdxl --checkpointing every-2 --batch-size 16

    laionkit train --config runs/sd15.yaml --resume latest   # the file's flags; the command line overrides them

Every rank runs exactly --max-steps optimizer steps (or --epochs converted to steps with the manifest's
sample count). SIGTERM / SIGINT / SIGHUP save a checkpoint within two steps and exit 128+signal; under
torchrun or accelerate launch set TORCH_ELASTIC_SHUTDOWN_TIMEOUT (docs/CLUSTER.md, "Preemption").
""")
def train_command(ctx: typer.Context, **options) -> None:
    """Train a latent-diffusion UNet on latent shards with Accelerate (one process, DDP, FSDP or DeepSpeed)."""
    from laionkit.trainer import trainfile
    from laionkit.trainer.loop import run

    options = trainfile.merge(ctx, options, options.pop("config"))
    for name, flag in (("latents", "LATENTS"), ("output", "--output")):
        if options[name] is None:
            raise LaionkitError(f"give {flag} (or {name}: in the --config file)")
    result = run(TrainConfig(**options))
    if result.stopped_by:
        typer.echo(f"stopped by signal {result.stopped_by} at step {result.step}; checkpoint {result.checkpoint}; "
                   "rerun with --resume latest")
        raise typer.Exit(128 + result.stopped_by)


# train's options are TrainConfig's fields (their help, flags and defaults: laionkit/common/options.py), with
# --config after LATENTS and --output.
_train_options = typer_parameters(TrainConfig)
_train_options.insert([option.name for option in _train_options].index("output") + 1, inspect.Parameter(
    "config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[Path], typer.Option(
        "--config", help="A YAML or TOML file of train flags (keys: flag or TrainConfig field names, e.g. max-steps: "
        "1000, latents: data/latents); flags given here override it.")]))
train_command.__signature__ = inspect.Signature(
    [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context), *_train_options])


@app.command(epilog="""Examples:

    laionkit encode data/shards --model sd15 --output data/latents --resolution 512

    laionkit encode 'data/shards/{00000..00999}.tar' --model sd2 --buckets --compile --output data/latents

    laionkit encode data/shards --model sdxl --resolution 1024 --output data/latents-sdxl

    laionkit encode data/shards --model flux-dev --resolution 1024 --buckets --output data/latents-flux

    accelerate launch -m laionkit.cli encode data/shards --model sd15 --output data/latents   # one rank per GPU

    laionkit models tiny --output models/tiny && laionkit encode data/shards --model models/tiny --output lat --resolution 64

    laionkit encode s3://bucket/shards --model sd15 --output s3://bucket/latents   # AWS_* credentials / AWS_ENDPOINT_URL

    laionkit encode i2d-parquet/ --model sd15 --output lat --caption-key TEXT   # img2dataset parquet (or files) output
""")
def encode(
    shards: Annotated[list[str], typer.Argument(help="pack's shard folder(s), tar files, globs or {a..b} patterns; img2dataset's parquet and files output formats too.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output folder (a path or URL): one latent tar per input tar.")],
    model: Annotated[str, typer.Option(help="Preset (sd15, sd2, sdxl, sd3-medium, flux-dev, pixart-sigma-xl), diffusers folder or hub id for all components; its model_index.json decides the family (sd, sdxl, sd3, flux or pixart), recorded in the manifest.")] = "sd15",
    vae: Annotated[Optional[str], typer.Option(help="VAE source (default: --model).")] = None,
    text_encoder: Annotated[Optional[str], typer.Option(help="Text encoder source (default: --model).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer source (default: --model).")] = None,
    text_layer: Annotated[Optional[str], typer.Option(help="last or penultimate hidden state (default: the preset's, else last).")] = None,
    resolution: Annotated[int, typer.Option(help="Square side in pixels, or the bucket area's side with --buckets.")] = 512,
    buckets: Annotated[bool, typer.Option(help="Aspect-ratio buckets of equal pixel area instead of square crops.")] = False,
    batch_size: Annotated[int, typer.Option(help="Images per GPU batch.")] = 32,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes (each reads whole shards).")] = 4,
    decode: Annotated[str, typer.Option(help="Where JPEGs are decoded: cpu (workers), gpu (nvjpeg) or auto (gpu if CUDA and --workers < 4).")] = "auto",
    dtype: Annotated[str, typer.Option(help="Encoder compute dtype: auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16.")] = "auto",
    compile: Annotated[bool, typer.Option(help="torch.compile the encoders (one shape per graph).")] = False,
    device: Annotated[Optional[str], typer.Option(help="torch device (default: cuda:LOCAL_RANK, else cpu).")] = None,
    text: Annotated[Optional[str], typer.Option(help="stored: the text encoders' outputs per sample; online (sd3, flux, pixart): token ids only, train runs the frozen text encoders. Default: the family's (online for flux, stored for the others; docs/BENCHMARKS.md).")] = None,
    caption_key: Annotated[Optional[str], typer.Option(help="Where captions are: a member (txt, caption) or a json key (e.g. TEXT). Default: the first non-empty of .txt, .caption, json caption, text, TEXT.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Write into --output even if it holds another stage's outputs (e.g. image shards); same names are replaced.")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Encode pack's image shards into VAE posterior moments + text-encoder hidden states (float16), one
    latent shard per image shard, resumable and rank-sharded; see docs/FORMATS.md section 3."""
    from laionkit import encode as encode_stage

    config = encode_stage.EncodeConfig(
        shards=tuple(shards), output=output, model=model, vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, text_layer=text_layer, resolution=resolution, buckets=buckets,
        batch_size=batch_size, workers=workers, decode=decode, dtype=dtype, compile=compile, device=device,
        rank=rank, world_size=world_size, quiet=quiet, storage_options=storage_options, text=text,
        caption_key=caption_key, overwrite=overwrite,
    )
    summary = encode_stage.run(config, log=lambda line: err_console.print(line, highlight=False))
    if not quiet:
        err_console.print(f"encoded {summary['samples_out']} samples ({summary['skipped']} skipped, "
                          f"{summary['empty_captions']} with an empty caption) "
                          f"from {summary['shards']} shards into {output}", highlight=False)


# A failed CUDA context ("sticky" errors: every later CUDA call fails too). Seen on an H200: after a cuBLAS
# failure the traceback was printed, then the process never exited (interpreter teardown frees CUDA memory
# and joins loader threads) until its launcher killed it minutes later.
@app.command("plan", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog="""Examples:

    laionkit plan latents-flux/ --output plans/flux -- --transformer flux-dev --lora-rank 64 --mixed-precision bf16

    laionkit plan latents/ --output plans/sd15 --batch-sizes 16,32,64 --checkpointing none,every-2,auto -- --unet sd15 --mixed-precision bf16

Everything after -- is passed to every candidate's `laionkit train` as given (model, precision, LoRA,
objective...). Each candidate runs in its own process: --steps steps to warm up, --steps measured.
""")
def plan_command(
    ctx: typer.Context,
    latents: Annotated[str, typer.Argument(help="An encode output folder, as train takes it.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for plan.json, each candidate's log and its throwaway run.")],
    batch_sizes: Annotated[str, typer.Option(help="Per-GPU batch sizes to try, comma-separated.")] = "1,2,4",
    checkpointing: Annotated[str, typer.Option(help="--checkpointing values to try, comma-separated (none, every-N, blocks, auto).")] = "none,blocks",
    compile: Annotated[str, typer.Option(help="off, on or both: --compile for each candidate.")] = "both",
    steps: Annotated[int, typer.Option(help="Steps per window: one window warms up, the next is measured.")] = 5,
    timeout: Annotated[float, typer.Option(help="Seconds a candidate may take (compile included).")] = 1800.0,
    quiet: QuietOption = False,
) -> None:
    """Measure candidate train configurations (batch, checkpointing, compile) and print the fastest that fits."""
    from laionkit import plan

    def numbers(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise LaionkitError(f"--batch-sizes {text!r}: comma-separated positive integers, e.g. 1,2,4")
        return values

    modes = {"off": (False,), "on": (True,), "both": (False, True)}
    if compile not in modes:
        raise LaionkitError(f"--compile {compile!r}: off, on or both")
    config = plan.PlanConfig(latents=latents, output=output, batch_sizes=numbers(batch_sizes),
                             checkpointing=tuple(v.strip() for v in checkpointing.split(",") if v.strip()),
                             compile=modes[compile], steps=steps, timeout=timeout, train_args=tuple(ctx.args),
                             quiet=quiet)
    found = plan.run(config)
    for candidate in found:
        typer.echo(f"{candidate.name:32s} {plan.describe(candidate)}")
    best = plan.fastest(found)
    if best is None:
        raise LaionkitError(f"plan: no candidate fits (see {output / 'plan.json'})")
    typer.echo(f"fastest that fits: {json.loads((output / 'plan.json').read_text())['command']}")


DEVICE_FAILURES = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "illegal memory access", "NCCL error")


def device_failed(error: BaseException) -> bool:
    """Whether ``error`` says the accelerator itself failed (not a user mistake, not an out-of-memory)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in DEVICE_FAILURES)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the accelerator running out of memory (torch.OutOfMemoryError; the CUDA context
    stays usable, so the normal exit runs)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ()))


def memory_advice(error: BaseException) -> str:
    """One line for an out-of-memory: where in laionkit it happened, what the allocator said first, and the
    settings that lower memory."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "laionkit" in Path(frame.filename).parts]
    where = f" in {frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    said = ". ".join(str(error).split(". ")[:2]).strip() or type(error).__name__
    return (f"out of device memory{where}: {said.rstrip('.')}. Lower --batch-size (--grad-accum keeps the global "
            "batch), or add --checkpointing blocks, --full-bf16 or --lora-rank, or shard with FSDP (train/fsdp.yaml)")


def main() -> None:
    """Entry point: user mistakes (LaionkitError) become one red line and exit code 2, not a traceback; so
    does an out-of-memory (exit code 1), with the settings that lower memory. A failed device prints its
    traceback and exits 1 at once, skipping the teardown that can hang on a failed CUDA context (a launcher
    or a Slurm step then sees the failure instead of a silent hang)."""
    try:
        app()
    except LaionkitError as error:
        err_console.print(Text.assemble(("error:", "bold red"), f" {error}"), soft_wrap=True)
        sys.exit(2)
    except Exception as error:
        if out_of_memory(error):  # a batch too large for the device: a setting to change, not a bug to trace
            err_console.print(Text.assemble(("error:", "bold red"), f" {memory_advice(error)}"), soft_wrap=True)
            sys.exit(1)
        if not device_failed(error):
            raise
        import os

        traceback.print_exc()
        err_console.print(Text.assemble(("error:", "bold red"), " the accelerator failed (above); exiting "
                                        "without interpreter teardown, which can hang on a failed device"),
                          soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
