"""What a newcomer reads first (issue 60): `--help` grouped by concern and opening with examples that parse,
and docs/CLI.md written from the commands."""

from __future__ import annotations

import functools
import os
import re
import shlex
from unittest import mock

import pytest
import typer
from conftest import REPO, run_cli, run_script_in_process

from laionkit.cli import app

# The panels of each command of a dozen options or more: train's are the concerns the issue names.
PANELS = {
    "filter": {"Input and output", "Rules", "CLIP scores", "Distribution", "Logging"},
    "pack": {"Input and output", "Images", "Download", "Distribution", "Logging"},
    "score": {"Input and output", "Model", "Performance", "Distribution", "Logging"},
    "dedup": {"Input and output", "Layers", "Distribution", "Logging"},
    "caption": {"Input and output", "Model", "Captions", "Performance", "Distribution", "Logging"},
    "encode": {"Input and output", "Model", "Captions", "Images", "Performance", "Distribution", "Logging"},
    "train": {"Model", "Data", "Optimization", "Precision and memory", "Checkpointing and resume",
              "Validation and evaluation", "Export", "Logging", "Distribution"},
    "plan": {"Input and output", "Candidates", "Measurement", "Logging"},
    "eval": {"Input and output", "Generation", "Scores", "Performance", "Logging"},
}



def commands(group, prefix: tuple[str, ...] = ()):
    """(argv prefix, command) for every command of `laionkit`, subcommands of `models` and `configs` included."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


GROUP = typer.main.get_command(app)
COMMANDS = dict(commands(GROUP))
# `laionkit --help` and the groups' (`models`, `configs`) open with examples too.
WITH_EXAMPLES = {(): GROUP, **{(name,): group for name, group in GROUP.commands.items() if hasattr(group, "commands")},
                 **COMMANDS}


@functools.cache
def shown_help(argv: tuple[str, ...]) -> str:
    """`laionkit ARGV --help` as printed, wide enough that no option name is cut short."""
    with mock.patch.dict(os.environ, {"COLUMNS": "250"}):
        return run_cli(*argv, "--help").stdout


def help_panels(text: str) -> dict[str, list[str]]:
    """Panel title -> the flags listed in it, read from rich's boxes in --help's output."""
    panels: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if title := re.match(r"╭─ (.+?) ─", line):
            current = panels.setdefault(title[1], [])
        elif line.startswith("╰"):
            current = None
        elif current is not None and (flag := re.match(r"│\s+(?:\*\s+)?(-[-\w]+)", line)):
            current.append(flag[1])
    return panels


def test_commands_of_many_options_are_the_grouped_ones():
    many = {" ".join(argv) for argv, command in COMMANDS.items()
            if sum(param.param_type_name == "option" for param in command.params) >= 12}
    assert many == set(PANELS)


@pytest.mark.parametrize("name", sorted(PANELS))
def test_help_lists_every_option_in_a_named_panel(name):
    panels = help_panels(shown_help((name,)))
    assert set(panels) - {"Arguments", "Options"} == PANELS[name]
    assert panels["Options"] == ["--help"]  # typer's own; every other option sits in a concern's panel
    listed = {flag for flags in panels.values() for flag in flags}
    options = [param for param in COMMANDS[(name,)].params if param.param_type_name == "option"]
    assert [param.opts for param in options if not listed & set(param.opts)] == []


def example_lines(text: str) -> list[str]:
    """The commands of a help text's example blocks (indented, or fenced with ```), one line each: lines
    continued with a backslash or on a line of their own starting with a flag are joined; comments dropped."""
    found: list[str] = []
    continued = fenced = False
    for line in text.splitlines():
        code = line.strip()
        if code.startswith("```"):
            fenced, continued = not fenced, False
            continue
        if not (fenced or line.startswith("    ")) or not code or code.startswith("#"):
            continued = False
            continue
        if found and (continued or code.startswith("-")):
            found[-1] += " " + code.rstrip("\\")
        else:
            found.append(code.rstrip("\\"))
        continued = code.endswith("\\")
    return found


def laionkit_argvs(line: str) -> list[list[str]]:
    """The `laionkit` command lines in one example: each side of `&&`, `laionkit ARGS` or a launcher's
    `-m laionkit.cli ARGS` (torchrun, accelerate launch, srun)."""
    argvs, words = [], shlex.split(line, comments=True)
    parts = [[]]
    for word in words:
        if word == "&&":
            parts.append([])
        else:
            parts[-1].append(word)
    for part in parts:
        if "laionkit.cli" in part:
            argvs.append(part[part.index("laionkit.cli") + 1:])
        elif "laionkit" in part:
            argvs.append(part[part.index("laionkit") + 1:])
    return argvs


def parse(argv: list[str]) -> None:
    """Parse ``argv`` as `laionkit` would, running nothing: an unknown flag or a bad value raises."""
    command = GROUP.commands[argv[0]]
    rest = argv[1:]
    if hasattr(command, "commands"):
        command, rest = command.commands[rest[0]], rest[1:]
    command.make_context(" ".join(argv[:1]), rest)


@pytest.mark.parametrize("argv", [pytest.param(argv, id=" ".join(argv) or "laionkit") for argv in WITH_EXAMPLES])
def test_help_opens_with_examples_that_parse(argv):
    command = WITH_EXAMPLES[argv]
    before_panels = shown_help(argv).split("╭")[0]
    summary, examples = command.help.split("Examples:", 1)
    top = example_lines(examples)
    assert 1 <= len(top) <= 3, command.help
    assert "Examples:" in before_panels and top[0][:40] in before_panels
    for line in top + example_lines(command.epilog or ""):
        argvs = laionkit_argvs(line)
        assert argvs, f"not a laionkit command: {line}"
        for example in argvs:
            try:
                parse(example)
            except Exception as error:  # noqa: BLE001 - the example is what failed, whatever the parser raised
                pytest.fail(f"{' '.join(argv)} --help example does not parse: {line}\n{error}")


def test_cli_reference_is_what_the_commands_say():
    result = run_script_in_process(REPO / "scripts" / "cli_reference.py", "--check")
    assert result.returncode == 0, result.stderr
