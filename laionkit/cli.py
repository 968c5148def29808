"""The `laionkit` command: thin typer wrappers that build each stage's config and call its run()."""

from __future__ import annotations

import sys
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


def main() -> None:
    """Entry point: user mistakes (LaionkitError) become one red line and exit code 2, not a traceback."""
    try:
        app()
    except LaionkitError as error:
        err_console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
