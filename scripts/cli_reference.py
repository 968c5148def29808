"""Write docs/CLI.md, the command-line reference, from the commands themselves: each command's help, its
examples and its options panel by panel, as `laionkit CMD --help` shows them (the options come from the
config dataclasses' fields and the typer options), so the reference is never copied by hand and cannot drift.

    python scripts/cli_reference.py           # rewrite docs/CLI.md
    python scripts/cli_reference.py --check   # exit 1, naming the command to run, if docs/CLI.md is stale
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import typer

from laionkit.cli import app

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"
HEADER = """# laionkit command-line reference

Every command, its examples and its options grouped as `laionkit COMMAND --help` groups them. Written by
`python scripts/cli_reference.py` from the commands' definitions (the config dataclasses' fields and the typer
options); do not edit it by hand: tests/test_help.py fails when it differs from what the script writes.
"""


def commands(group, prefix: str = "laionkit"):
    """(``laionkit NAME``, command) for every command, in the order `laionkit --help` lists them."""
    for name, command in group.commands.items():
        if command.hidden:
            continue
        if hasattr(command, "commands"):
            yield from commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def panels(command, name: str) -> dict[str, list[tuple[str, str]]]:
    """Panel title -> (flags and type, help with its default) per parameter, in --help's order; --help
    itself left out."""
    ctx = typer.Context(command, info_name=name)
    found: dict[str, list[tuple[str, str]]] = {}
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is None or param.name == "help":
            continue
        default = "Arguments" if param.param_type_name == "argument" else "Options"
        found.setdefault(param.rich_help_panel or default, []).append(record)
    return found


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section(name: str, command) -> str:
    """One command's Markdown: its help (summary, then examples), its epilog, a table per panel."""
    lines = [f"## {name}", "", inspect.cleandoc(command.help or ""), ""]
    if command.epilog:
        lines += [command.epilog.strip(), ""]
    for title, rows in panels(command, name).items():
        lines += [f"### {title}", "", "| Option | Description |", "| --- | --- |"]
        lines += [f"| `{cell(flags)}` | {cell(help_text)} |" for flags, help_text in rows]
        lines.append("")
    return "\n".join(lines)


def reference() -> str:
    group = typer.main.get_command(app)
    return "\n".join([HEADER, inspect.cleandoc(group.help), "",
                      *(section(name, command) for name, command in commands(group))])


def main() -> None:
    text = reference()
    if sys.argv[1:] == ["--check"]:
        if not REFERENCE.is_file() or REFERENCE.read_text() != text:
            sys.exit(f"{REFERENCE} is not what the commands say: run `python scripts/cli_reference.py`")
        return
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")


if __name__ == "__main__":
    main()
