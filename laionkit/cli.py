"""The `laionkit` command: thin typer wrappers that build each stage's config and call its run()."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from laionkit import __version__
from laionkit.common import LaionkitError

app = typer.Typer(
    name="laionkit",
    help="From LAION parquet metadata to a trained latent-diffusion model: filter -> pack -> encode -> train.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)

# Options every rank-sharded command shares; resolved by laionkit.common.ranks.resolve_rank.
RankOption = Annotated[
    Optional[int], typer.Option("--rank", help="This process's rank (default: RANK, SLURM_PROCID, else 0).")
]
WorldSizeOption = Annotated[
    Optional[int],
    typer.Option("--world-size", help="Number of processes (default: WORLD_SIZE, SLURM_NTASKS, else 1)."),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]


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
        table.add_row(row.name, row.value, f"[{style}]{row.verdict}[/]")
    Console().print(table)


models_app = typer.Typer(help="Model folders: tiny random-init models for offline tests and demos.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("tiny", epilog="""Examples:

    laionkit models tiny --output models/tiny

    laionkit encode shards/ --model models/tiny --output latents/ --resolution 64
""")
def models_tiny(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (a diffusers pipeline layout).")],
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
) -> None:
    """Write tiny random-init SD-style models (vae/, unet/, text_encoder/, tokenizer/, scheduler/) in the
    real diffusers / transformers formats, with the real CLIP BPE vocabulary, so everything runs offline."""
    from laionkit.common import atomic_output
    from laionkit.common.models import write_tiny_models

    with atomic_output(output) as tmp:
        write_tiny_models(tmp, seed=seed)
    typer.echo(f"wrote tiny models to {output}")


def main() -> None:
    """Entry point: user mistakes (LaionkitError) become one red line and exit code 2, not a traceback."""
    try:
        app()
    except LaionkitError as error:
        err_console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
