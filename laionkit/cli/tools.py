"""`laionkit doctor`, `models`, `configs`, `run` (recipes) and `demo`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from laionkit.cli.app import CONFIG_ONLY, app
from laionkit.cli.stages import stats_command
from laionkit.common import LaionkitError


@app.command(epilog="""More examples:

    # between nodes: on each node, through torchrun's rendezvous (rank 0 prints)
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $MAIN_HOST:29500 -m laionkit.cli doctor --allreduce
""")
def doctor(
    allreduce: Annotated[bool, typer.Option(help="Time an all-reduce across GPUs (NCCL bus bandwidth); under "
                                                 "torchrun across all its ranks and nodes.")] = False,
    processes: Annotated[Optional[int], typer.Option(help="Processes for --allreduce (default: GPUs).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="nccl or gloo (default: nccl when GPUs).")] = None,
    megabytes: Annotated[int, typer.Option(help="All-reduce message size in MB.")] = 256,
    shards: Annotated[Optional[Path], typer.Option(help="Time reading the tar shards in this folder.")] = None,
    min_busbw: Annotated[float, typer.Option(help="GB/s under which the link verdict is 'slow'.")] = 40.0,
    min_read: Annotated[float, typer.Option(help="MB/s under which the shard-read verdict is 'slow'.")] = 200.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Versions, GPUs, and optional NCCL all-reduce and shard-read checks, each with a plain verdict.

    Examples:

    ```
    laionkit doctor

    laionkit doctor --allreduce   # NCCL bus bandwidth across all visible GPUs

    laionkit doctor --shards data/latents --json
    ```
    """
    from dataclasses import asdict

    from rich.table import Table

    from laionkit import doctor as doctor_stage

    rows = doctor_stage.run(allreduce, processes, backend, megabytes, shards, min_busbw, min_read)
    if not doctor_stage.reporting():  # a launched check: rank 0 reports for all
        return
    if as_json:
        typer.echo(json.dumps([asdict(row) for row in rows], indent=2))
        return
    table = Table("check", "value", "verdict", title="laionkit doctor")
    for row in rows:
        style = "green" if row.verdict.startswith("ok") else "yellow"
        table.add_row(Text(row.name), Text(row.value), Text(row.verdict, style=style))
    Console().print(table)


models_app = typer.Typer(help="""Model folders: tiny random-init models for offline tests and demos.

Examples:

```
laionkit models tiny --output models/tiny

laionkit models tiny-vlm --output models/vlm
```""", no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("tiny", epilog="""More examples:

    laionkit encode shards/ --model models/tiny --output latents/ --resolution 64
""")
def models_tiny(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (a diffusers pipeline layout).")],
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
    family: Annotated[str, typer.Option(help="Model family: sd (SD 1.x/2.x), sdxl, sd3, flux, pixart (PixArt-Σ), sana, z-image, qwen-image, flux2 (FLUX.2 [klein]) or flux2-dev (FLUX.2 [dev]).")] = "sd",
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace --output if it is not empty (refused otherwise: it is replaced whole).")] = False,
) -> None:
    """Write a tiny random-init pipeline of a model family (SD: vae/, unet/, text_encoder/, tokenizer/,
    scheduler/; SDXL adds text_encoder_2/ and tokenizer_2/) in the real diffusers / transformers formats,
    with the real CLIP BPE vocabulary, so everything runs offline.

    Examples:

    ```
    laionkit models tiny --output models/tiny

    laionkit models tiny --family sdxl --output models/tiny-sdxl
    ```
    """
    from laionkit.common import atomic_output, storage
    from laionkit.families import get_family

    spec = get_family(family)
    if not overwrite:
        storage.refuse_nonempty(output, "models tiny")
    with atomic_output(output) as tmp:
        spec.write_tiny(tmp, seed)
    typer.echo(f"wrote tiny {spec.name} models to {output}")


@models_app.command("tiny-vlm")
def models_tiny_vlm(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (a transformers model + processor).")],
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace --output if it is not empty (refused otherwise: it is replaced whole).")] = False,
) -> None:
    """Write a tiny random-init Qwen2-VL in the real layout (config.json, model.safetensors, a Qwen2VLProcessor
    with a chat template and a BPE tokenizer trained on laionkit's shipped LAION captions), which AutoProcessor +
    AutoModelForImageTextToText load offline, for `laionkit caption`. It generates gibberish: for tests.

    Examples:

    ```
    laionkit models tiny-vlm --output models/vlm

    laionkit caption shards/ --model models/vlm --output captioned/ --max-new-tokens 8
    ```
    """
    from laionkit.caption.tiny import write_tiny_vlm
    from laionkit.common import atomic_output, storage

    if not overwrite:
        storage.refuse_nonempty(output, "models tiny-vlm")
    with atomic_output(output) as tmp:
        write_tiny_vlm(tmp, seed)
    typer.echo(f"wrote a tiny Qwen2-VL to {output}")


@models_app.command("tiny-eval")
def models_tiny_eval(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the two models into.")],
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
) -> None:
    """Random-init scorers for `laionkit eval` offline: the FID Inception-v3 in the real weights file's layout
    (inception.pth, the same keys and shapes) and a tiny open_clip model in open_clip's config + weights
    layout. Their scores mean nothing; the code path is the one real weights take.

    Examples:

    ```
    laionkit models tiny-eval --output models/eval   # inception.pth, tiny-clip.json, tiny-clip.safetensors
    ```
    """
    from laionkit.evaluate.clipscore import write_tiny_clip
    from laionkit.evaluate.inception import write_random_inception

    write_random_inception(output / "inception.pth", seed)
    write_tiny_clip(output, seed)
    typer.echo(f"wrote inception.pth, tiny-clip.json and tiny-clip.safetensors to {output}")


configs_app = typer.Typer(help="""The launcher configs (train/*.yaml, *.json) and pipeline files shipped with laionkit.

Examples:

```
laionkit configs copy my-configs
```""", no_args_is_help=True)
app.add_typer(configs_app, name="configs")


@configs_app.command("copy")
def configs_copy(
    output: Annotated[Path, typer.Argument(help="Folder to copy train/ and pipelines/ into.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace files that already exist there.")] = False,
) -> None:
    """Copy the accelerate / DeepSpeed configs (train/) and the Slurm, Kubernetes, torchrun and Docker files
    (pipelines/) out of the installed package, to edit for a cluster.

    Examples:

    ```
    laionkit configs copy my-configs   # my-configs/train/ddp.yaml, my-configs/pipelines/slurm/...

    accelerate launch --config_file my-configs/train/ddp.yaml --num_processes 8 -m laionkit.cli train latents/ \\
        --output runs/a
    ```
    """
    from laionkit import configs

    names = configs.copy(output, overwrite)
    typer.echo(f"copied {len(names)} files to {output} (train/, pipelines/)")


@app.command("run")
def run_recipe(
    recipe: Annotated[Path, typer.Argument(help="A recipe YAML (see pipelines/).")],
    var: Annotated[Optional[list[str]], typer.Option(help="KEY=VALUE substituted for {KEY} in the recipe.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Validate, print the commands and build each stage's config as the "
                                                "stage would (its option checks); run nothing.")] = False,
    until: Annotated[Optional[str], typer.Option(help="Stop after this stage (its recipe key: pack, "
                                                      "filter@scores, ...).")] = None,
) -> None:
    """Run the stages of one recipe in order (filter, pack, score, dedup, caption, encode, train; STAGE@NAME for
    another run of one), skipping stages already complete.

    Examples:

    ```
    laionkit run pipelines/demo.yaml

    laionkit run pipelines/sd15-finetune-512.yaml --var workdir=/data/sd15 \\
        --var metadata=/data/laion2B-en-aesthetic --dry-run

    laionkit run pipelines/curate.yaml --var metadata=laion-part-00000.parquet --until dedup
    ```
    """
    variables = {}
    for item in var or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise LaionkitError(f"--var {item!r}: expected KEY=VALUE")
        variables[key] = value
    _run_recipe_file(recipe, variables, dry_run, until)


def _run_recipe_file(recipe: Path, variables: dict[str, str], dry_run: bool = False,
                     last: str | None = None) -> None:
    """Validate then run a recipe (up to its stage ``last``), each stage through this CLI in-process (or
    `accelerate launch`)."""
    import shlex

    from laionkit import recipe as recipes

    cli_group = typer.main.get_command(app)
    workdir, steps = recipes.load(recipe, cli_group.commands, variables)
    steps = recipes.until(steps, last)

    def invoke(argv: list[str]) -> None:
        try:
            code = cli_group.main(argv, prog_name="laionkit", standalone_mode=False)
        except typer.TyperException as error:  # a usage error: typer vendors click, so not click's class
            raise LaionkitError(error.format_message()) from None
        if isinstance(code, int) and code != 0:
            raise LaionkitError(f"exited with {code}")

    if dry_run:
        def configure(argv: list[str]) -> None:
            token = CONFIG_ONLY.set(True)
            try:
                invoke(argv)
            finally:
                CONFIG_ONLY.reset(token)

        for step in steps:
            typer.echo(shlex.join(recipes.command_line(step)))
            recipes.check_options(step, configure)
        return
    recipes.execute(steps, workdir, invoke, typer.echo)


@app.command(epilog="""
Offline and on 2 CPU cores in a few minutes: real photos from a loopback web server, tiny models.
""")
def demo(
    workdir: Annotated[Path, typer.Option(help="Where every stage's output goes.")] = Path("laionkit-demo"),
    until: Annotated[str, typer.Option(help="Stop after this stage: filter, pack, encode or train (pack: the image "
                                            "shards alone, without the models or the training).")] = "train",
) -> None:
    """The whole chain on embedded real photos: filter -> pack -> encode -> train, then each photo beside what
    the trained pipeline draws from its caption, and a loss / throughput plot. Runs pipelines/demo.yaml through
    `laionkit run`.

    Examples:

    ```
    laionkit demo

    laionkit demo --workdir /tmp/laionkit-demo

    laionkit demo --workdir demo --until pack     # only the image shards, for docs/guides/curate.md
    ```
    """
    from laionkit import demo as demo_stage

    result = demo_stage.run(workdir, lambda recipe, variables: _run_recipe_file(recipe, variables, last=until),
                            typer.echo, until)
    for stage in ("filtered", "shards", "latents")[:demo_stage.STAGES.index(until) + 1]:
        typer.echo(f"\n== laionkit stats {workdir / stage}")
        stats_command(workdir / stage)
    if until != "train":
        return
    typer.echo(f"\ntrained UNet (diffusers folder): {result['unet']}")
    typer.echo(f"loss / throughput plot:        {result['plot']}")
    typer.echo(f"photos and what it draws:      {result['grid']}")
