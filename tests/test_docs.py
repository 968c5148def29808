"""Every shell command the docs show runs as written, offline: README.md, train/README.md and docs/**/*.md.

The rule (README's "Conventions" says it to readers): a block fenced ```bash is run; a block fenced ```console
is shown only, because it needs a GPU, the network, a cluster or credentials. A file's ```bash blocks run in
order as one bash script (`set -euo pipefail`: any failing command fails the test) in a fresh folder, which
holds links to the checkout's laionkit/, pipelines/, train/ and scripts/ because the docs' commands run from a
checkout's root, with this interpreter's bin/ first on PATH (laionkit, python, accelerate, torchrun) and the
Hugging Face hubs offline (README.md's blocks run so in tests/test_demo.py's fixture, which checks the demo they
make). So the offline walk-throughs name the tiny models (`laionkit models tiny`) and tiny sizes themselves,
and what runs is exactly what a reader copies; the real-model form of each walk-through is a ```console block
beside it.

A ```console block cannot run here, but its `laionkit` commands are checked against the CLI: each subcommand
and option must exist, so a renamed or removed flag fails here too. docs/BENCHMARKS.md is not collected: every
command there is a GPU measurement (its tables quote the results), nor docs/CLI.md: it is each command's --help,
written by scripts/cli_reference.py, whose examples tests/test_help.py parses through the real commands. That
every measured number README.md quotes is in a docs/BENCHMARKS.md table is tests/test_benchmarks.py's check.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

NOT_RUN_FILES = {"docs/BENCHMARKS.md", "docs/CLI.md"}
# Documents whose ```bash blocks another test runs, the same way (run_script), and checks what they made.
RUN_BY = {"README.md": "tests/test_demo.py's demo fixture (`laionkit demo`, whose output it checks)"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
CHECKOUT_FOLDERS = ("laionkit", "pipelines", "train", "scripts")
# A command in a block fenced neither bash nor console would dodge the rule: its lines look like these.
COMMAND_LINE = re.compile(r"^\s*(\$ |laionkit |accelerate |torchrun |python3? |pip |sbatch |kubectl )")


def documents() -> list[str]:
    found = [REPO / "README.md", REPO / "train" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [str(p.relative_to(REPO)) for p in found if str(p.relative_to(REPO)) not in NOT_RUN_FILES]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def script_of(text: str) -> str:
    return "\n".join(body for language, body in blocks(text) if language == "bash")


def commands(body: str) -> list[list[str]]:
    """The words of each `laionkit ...` (or `-m laionkit.cli ...`) command in a block: continuation lines joined,
    comments dropped, cut at `&&`, `;`, `|`; what follows `laionkit`, up to a bare `--` (plan's train flags)."""
    found = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        starts = [i for i, word in enumerate(words) if word in ("laionkit", "laionkit.cli") or word.endswith("/laionkit")]
        for start in starts:
            command = []
            for word in words[start + 1:]:
                if word in ("&&", "||", ";", "|", "--"):
                    break
                command.append(word)
            found.append(command)
    return found


def unknown_words(words: list[str]) -> list[str]:
    """The subcommands and options of `laionkit WORDS` that the CLI does not have."""
    import typer

    from laionkit.cli import app

    command = typer.main.get_command(app)
    while words and hasattr(command, "commands") and not words[0].startswith("-"):
        if words[0] not in command.commands:
            return [words[0]]
        command, words = command.commands[words[0]], words[1:]
    known = {name for param in command.params for name in (*param.opts, *param.secondary_opts)}
    return [word for word in (w.split("=")[0] for w in words) if word.startswith("--") and word not in known]


def run_script(script: str, folder: Path, timeout: float) -> subprocess.CompletedProcess:
    for name in CHECKOUT_FOLDERS:
        (folder / name).symlink_to(REPO / name, target_is_directory=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_rule_catches_a_failing_command_and_skips_console_blocks(tmp_path):
    text = "```console\nfalse  # needs a GPU\n```\n\n```bash\necho one > one.txt\n```\n\n```bash\nfalse\necho two\n```\n"
    assert [language for language, _ in blocks(text)] == ["console", "bash", "bash"]
    result = run_script(script_of(text), tmp_path, timeout=30)
    assert result.returncode != 0 and (tmp_path / "one.txt").read_text() == "one\n" and "two" not in result.stdout
    shown = "accelerate launch -m laionkit.cli train L --output R \\\n    --max-steps 2 --no-such-flag  # a GPU\n" \
            "laionkit models tiny --output m && laionkit plan L --output P -- --lora-rank 4\nlaionkit trian L\n"
    assert [unknown_words(words) for words in commands(shown)] == [["--no-such-flag"], [], [], ["trian"]]


@pytest.mark.parametrize("document", documents())
def test_every_command_is_fenced_bash_or_console(document):
    stray = [line for language, body in blocks((REPO / document).read_text()) if language not in ("bash", "console")
             for line in body.splitlines() if COMMAND_LINE.match(line)]
    assert not stray, f"{document}: commands outside ```bash (run) or ```console (shown) blocks: {stray}"


@pytest.mark.parametrize("document", documents())
def test_shown_commands_name_real_subcommands_and_options(document):
    shown = [words for language, body in blocks((REPO / document).read_text()) if language == "console"
             for words in commands(body)]
    wrong = {" ".join(words[:2]): unknown_words(words) for words in shown if unknown_words(words)}
    assert not wrong, f"{document}: ```console commands with words the CLI does not have: {wrong}"


@pytest.mark.parametrize("document", [d for d in documents() if script_of((REPO / d).read_text()) and d not in RUN_BY])
def test_the_documented_commands_run(document, tmp_path):
    result = run_script(script_of((REPO / document).read_text()), tmp_path, timeout=900)
    assert result.returncode == 0, f"{document}: a documented command failed\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
