"""encode's outputs say what went in: missing model components, captions under other names, the model
family of a folder without model_index.json, SD3's patch size, and img2dataset's parquet and files
output formats as inputs (issue "Faithful outputs")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import run_cli

ENCODE = ("--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet")


def one_line_error(result, *needles: str) -> str:
    """The CLI refused with its one-line error (exit 2, no traceback) containing every needle."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and all(needle in line for needle in needles), result.stderr
    return line


def model_copy(model: Path, folder: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a pipeline folder without the ``drop`` entries (component subfolders, model_index.json)."""
    return Path(shutil.copytree(model, folder, ignore=lambda _, names: [n for n in names if n in drop]
                                if _ == str(model) else []))


# --- 1. a component model_index.json names is missing: one line, in encode and in online-text train --------

@pytest.mark.parametrize("family, missing", [("sd", "tokenizer"), ("flux", "tokenizer_2"),
                                             ("flux", "text_encoder_2"), ("pixart", "tokenizer")])
def test_missing_component_subfolder_is_a_one_line_error(tmp_path, image_shards, tiny_models, flow_latents,
                                                         family, missing):
    """Before: SD / PixArt without tokenizer/ failed with OverflowError, Flux without text_encoder_2/ with
    join() ... NoneType, and Flux without tokenizer_2/ encoded every caption with an empty T5 tokenizer."""
    model = tiny_models if family == "sd" else flow_latents(family).model
    broken = model_copy(model, tmp_path / "model", drop=(missing,))
    result = run_cli("encode", image_shards / "00000.tar", "--model", broken, "--output", tmp_path / "out",
                     "--text", "stored", *ENCODE, check=False)
    one_line_error(result, f"{missing}/", str(broken))
    assert not list((tmp_path / "out").glob("*.tar"))


def test_online_text_train_refuses_a_model_folder_missing_a_tokenizer(tmp_path, image_shards, flow_latents):
    """train --text online latents load the text encoders from the manifest's model folder: a tokenizer lost
    since encode is the same one-line error, not a run conditioned on an empty tokenizer's ids."""
    model = model_copy(flow_latents("flux").model, tmp_path / "model")
    latents = tmp_path / "latents"
    run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", latents, "--text", "online", *ENCODE)
    shutil.rmtree(model / "tokenizer_2")
    result = run_cli("train", latents, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "1",
                     "--batch-size", "2", "--workers", "0", "--log-with", "none", "--quiet", check=False)
    one_line_error(result, "tokenizer_2/")
    assert not (tmp_path / "run" / "transformer").exists()
