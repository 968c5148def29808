"""The `laionkit` command: thin typer wrappers that build each stage's config and call its run().

``app`` (laionkit/cli/app.py) holds the shared options; the commands register on it from ``stages`` (filter,
pack, encode, score, dedup, stats), ``training`` (train, plan, export, eval) and ``tools`` (doctor, models, configs, run,
demo), imported here in the order `laionkit --help` lists them; ``main`` is the entry point.
"""

from __future__ import annotations

import os
import sys
import traceback

from rich.text import Text

from laionkit.cli import stages, tools, training  # noqa: F401 - registers the commands on app
from laionkit.cli.app import app, err_console
from laionkit.cli.errors import (
    collective_timed_out,
    device_failed,
    memory_advice,
    out_of_memory,
    timeout_advice,
)
from laionkit.cli.quiet import drop_library_noise
from laionkit.common import LaionkitError
from laionkit.common.errors import write_refused, write_refused_line

__all__ = ["app", "device_failed", "main", "memory_advice", "out_of_memory"]


def main() -> None:
    """Entry point: user mistakes (LaionkitError) become one red line and exit code 2, not a traceback; so
    does an out-of-memory (exit code 1), with the settings that lower memory, and a collective that timed out
    waiting for another rank (exit code 1); a file system that refuses a write (full, read-only: exit code 2). A
    failed device prints its
    traceback and exits 1 at once, skipping the teardown that can hang on a failed CUDA context (a launcher
    or a Slurm step then sees the failure instead of a silent hang). Libraries' noise is dropped
    first (laionkit/cli/quiet.py)."""
    drop_library_noise()
    try:
        app()
    except LaionkitError as error:
        err_console.print(Text.assemble(("error:", "bold red"), f" {error}"), soft_wrap=True)
        sys.exit(2)
    except Exception as error:
        if out_of_memory(error):  # a batch too large for the device: a setting to change, not a bug to trace
            err_console.print(Text.assemble(("error:", "bold red"), f" {memory_advice(error)}"), soft_wrap=True)
            sys.exit(1)
        if write_refused(error):  # a full or read-only disk: one line naming the file, as train's checkpoints say it
            err_console.print(Text.assemble(("error:", "bold red"), f" {write_refused_line(error)}"), soft_wrap=True)
            sys.exit(2)
        if collective_timed_out(error):  # a peer that stopped answering: the run is to restart, not to debug
            err_console.print(Text.assemble(("error:", "bold red"), f" {timeout_advice(error)}"), soft_wrap=True)
            sys.exit(1)
        if not device_failed(error):
            raise
        traceback.print_exc()
        err_console.print(Text.assemble(("error:", "bold red"), " the accelerator failed (above); exiting "
                                        "without interpreter teardown, which can hang on a failed device"),
                          soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

