"""`laionkit run RECIPE` at its seams: values the stage's own command would refuse, and a skipped stage
whose input changed."""

from __future__ import annotations

from pathlib import Path

from conftest import run_cli


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
