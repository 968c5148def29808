"""Launch scripts and manifests parse, and every laionkit option they pass exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import typer
import yaml

from laionkit.cli import app

REPO = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted([*REPO.glob("pipelines/**/*.sh"), *REPO.glob("pipelines/**/*.sbatch")])
YAML_FILES = sorted([*REPO.glob("pipelines/**/*.yaml"), *REPO.glob("train/**/*.yaml")])
COMMANDS = typer.main.get_command(app).commands


def _options(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def _invocations(text: str) -> list[tuple[str, list[str]]]:
    """(command, --options) for each `laionkit CMD ...` / `laionkit.cli CMD ...` in a script."""
    text = re.sub(r"\\\n", " ", text)  # join continued lines
    found = []
    for match in re.finditer(r"laionkit(?:\.cli)?\s+([a-z]+)\b(.*)", text):
        command, rest = match.groups()
        if command in COMMANDS:
            found.append((command, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)))
    return found


def test_there_are_launchers_for_every_stage():
    launched = {command for path in [*SHELL_SCRIPTS, *YAML_FILES]
                for command, _ in _invocations(_command_lines(path))}
    assert {"filter", "pack", "encode", "train"} <= launched


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_loads(path):
    assert list(yaml.safe_load_all(path.read_text()))


def _command_lines(path: Path) -> str:
    """Shell text as is; for YAML, each `args:` / `command:` list joined into one line."""
    if path.suffix != ".yaml":
        return path.read_text()
    lines = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("args", "command") and isinstance(value, list):
                    lines.append(" ".join(map(str, value)))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for document in yaml.safe_load_all(path.read_text()):
        walk(document)
    return "\n".join(lines)


@pytest.mark.parametrize("path", [*SHELL_SCRIPTS, *YAML_FILES], ids=lambda p: str(p.relative_to(REPO)))
def test_laionkit_options_in_launchers_exist(path):
    for command, options in _invocations(_command_lines(path)):
        unknown = set(options) - _options(COMMANDS[command])
        assert not unknown, f"{path.name}: laionkit {command} has no option {sorted(unknown)}"
