"""The `laionkit` typer app and the options that several commands share; the commands register on it
(laionkit/cli/stages.py, training.py, tools.py)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Annotated, Optional

import typer
from rich.console import Console

from laionkit import __version__
from laionkit.common.options import (
    ALLOW_INCOMPLETE_HELP,
    QUIET_HELP,
    RANK_HELP,
    STORAGE_HELP,
    WORLD_SIZE_HELP,
)

app = typer.Typer(
    name="laionkit",
    help="""From LAION parquet metadata to a trained latent-diffusion model: filter -> pack -> (score, dedup,
caption: curation from the pixels) -> encode -> train.

Examples:

```
laionkit demo   # the whole chain offline on shipped photos and tiny models, in minutes

laionkit models tiny --output models/tiny && laionkit encode shards/ --model models/tiny \\
    --output latents/ --resolution 64

laionkit train latents/ --output runs/tiny --unet-config tiny --max-steps 200
```

`laionkit COMMAND --help`: a command's examples, then its options by concern; docs/CLI.md: every command.""",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
# User text (paths, model names, SQL, error messages) is printed as data: with markup on, `owner/name[/sub]`
# raises MarkupError, `[red]` in a path vanishes and `:x:` turns into an emoji. Styled parts use rich.text.Text.
err_console = Console(stderr=True, markup=False, emoji=False, highlight=False)

# Options every rank-sharded command shares; resolved by laionkit.common.ranks.resolve_rank.
RankOption = Annotated[Optional[int], typer.Option("--rank", help=RANK_HELP, rich_help_panel="Distribution")]
WorldSizeOption = Annotated[Optional[int], typer.Option("--world-size", help=WORLD_SIZE_HELP, rich_help_panel="Distribution")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP, rich_help_panel="Logging")]
# Stages that read another stage's output folder (laionkit.common.upstream.refuse_incomplete).
AllowIncompleteOption = Annotated[bool, typer.Option("--allow-incomplete", help=ALLOW_INCOMPLETE_HELP,
                                                                rich_help_panel="Input and output")]
# Paths may be URLs of any fsspec filesystem (s3://, gs://, hf://, https:// to read); credentials come from
# AWS_* / fsspec config, and this JSON (flat, or keyed by protocol) adds filesystem options.
StorageOption = Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_HELP,
                                                                rich_help_panel="Input and output")]


# `laionkit run --dry-run`: each stage command builds its config (the checks a run makes of its options, so a
# recipe fails its dry run where it would fail running) and returns before the stage runs.
CONFIG_ONLY: ContextVar[bool] = ContextVar("laionkit_config_only", default=False)


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
