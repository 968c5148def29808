"""`laionkit run RECIPE` at its seams: values the stage's own command would refuse, and a skipped stage
whose input changed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_cli

from laionkit.common.storage import Location


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_a_list_for_a_single_valued_option_is_one_line(tmp_path, realdata):
    """`unit_rows: [1000, 2]` passed --unit-rows twice and the last won; --where takes a list."""
    sample = realdata / "laion-sample" / "test_1000.parquet"
    recipe = _recipe(tmp_path, f"stages: {{filter: {{input: {sample}, output: {tmp_path / 'out'}, "
                               "unit_rows: [1000, 2], where: [WIDTH > 1, HEIGHT > 1]}}")
    result = run_cli("run", recipe, "--dry-run", check=False)
    assert result.returncode == 2, result.stderr
    message = result.stderr.replace("\n", "")
    assert "stages.filter: `unit_rows` takes one value, not a list ([1000, 2])" in message, message
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    recipe.write_text(recipe.read_text().replace("unit_rows: [1000, 2]", "unit_rows: 1000"))
    line = run_cli("run", recipe, "--dry-run").stdout
    assert "--unit-rows 1000 --where 'WIDTH > 1' --where 'HEIGHT > 1'" in line, line


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_a_complete_stage_whose_input_changed_runs_and_its_own_check_refuses(tmp_path, realdata, request, where):
    """Same options, same input path, other rows: run skipped filter ("complete with these options") where
    `laionkit filter` itself refuses the changed input. An unchanged input is still skipped."""
    import pyarrow.parquet as pq

    table = pq.read_table(realdata / "laion-sample" / "test_1000.parquet")
    local = tmp_path / "metadata.parquet"

    def put(rows) -> str:
        pq.write_table(rows, local)
        if where == "disk":
            return str(local)
        s3 = request.getfixturevalue("s3")
        target = Location.parse(s3.url("metadata.parquet"))
        target.fs.put_file(str(local), target.path)
        return str(target)

    metadata = put(table)
    recipe = _recipe(tmp_path, f"""
workdir: {tmp_path}
stages:
  filter: {{input: "{metadata}", output: "{{workdir}}/filtered", where: ["length(TEXT) >= 10"], quiet: true}}
""")
    run_cli("run", recipe)
    assert "complete with these options; skipped" in run_cli("run", recipe).stdout
    put(table.slice(0, 500))
    result = run_cli("run", recipe, check=False)
    assert result.returncode == 2, result.stdout
    message = result.stderr.replace("\n", "")
    assert "stage `filter` failed" in message and f"{metadata} changed since" in message, message
    assert "skipped" not in result.stdout


def test_dry_run_builds_each_stages_config_so_it_fails_where_the_run_would(tmp_path, realdata):
    """Before: --dry-run printed the commands and passed a train stage its config refuses, which then failed after
    every stage before it ran. Now each command builds its stage's config (the checks a run makes first)."""
    sample = realdata / "laion-sample" / "test_1000.parquet"
    recipe = _recipe(tmp_path, f"""workdir: {tmp_path}
stages:
  filter: {{input: {sample}, output: "{{workdir}}/filtered", where: ["length(TEXT) > 5"]}}
  train: {{input: "{{workdir}}/filtered", output: "{{workdir}}/run", max_steps: 10}}
""")
    result = run_cli("run", recipe, "--dry-run", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())
    assert "stage `train` would fail: give exactly one of --unet / --transformer" in message, message
    assert result.stdout.splitlines()[0].startswith(f"laionkit filter {sample}")  # filter's config passed
    assert not (tmp_path / "filtered").exists() and not (tmp_path / ".laionkit-run").exists()
    recipe.write_text(recipe.read_text().replace("max_steps: 10", "max_steps: 10, unet-config: tiny"))
    assert len(run_cli("run", recipe, "--dry-run").stdout.splitlines()) == 2
    assert not (tmp_path / "filtered").exists()


def test_a_variable_the_recipe_uses_and_no_var_gives_is_named(tmp_path, realdata):
    """`laionkit run --help`'s example left {metadata} unset: the error was "input `{metadata}` does not exist"."""
    result = run_cli("run", REPO / "pipelines" / "sd15-finetune-512.yaml", "--var", f"workdir={tmp_path}", "--dry-run",
                     check=False)
    assert result.returncode == 2
    assert "{metadata} not given: add --var metadata=VALUE" in " ".join(result.stderr.split())
    # the help's example as written, with the metadata at hand
    import typer

    from laionkit.cli import app

    text = typer.main.get_command(app).commands["run"].help.replace("\\\n", " ")  # a continued line is one
    example = next(line.split() for line in text.splitlines() if "sd15-finetune" in line)
    assert example[-1] == "--dry-run" and "--var" in example
    variables = {"workdir": str(tmp_path), "metadata": str(realdata / "laion-sample" / "test_1000.parquet")}
    result = run_cli("run", REPO / example[2], *(f"--var={key}={value}" for key, value in variables.items()),
                     "--dry-run")
    assert f"laionkit filter {variables['metadata']}" in result.stdout
