"""`laionkit train`'s options come from TrainConfig alone (laionkit/common/options.py): every field is a flag
with the field's help and default, flags parse to the config values, a bad choice is one line, and
`train --config` files and recipes read keys through the same mapping."""

from __future__ import annotations

import dataclasses

import pytest
import typer
from conftest import run_cli

from laionkit.cli import app
from laionkit.common.options import command_keys
from laionkit.trainer.config import TrainConfig


def train_command():
    return typer.main.get_command(app).commands["train"]


def test_every_train_config_field_is_a_flag_with_its_help_and_default():
    params = {param.name: param for param in train_command().params}
    assert set(params) == {field.name for field in dataclasses.fields(TrainConfig)} | {"config"}
    for field in dataclasses.fields(TrainConfig):
        param, help_text = params[field.name], field.metadata.get("help")
        assert help_text and param.help == help_text, field.name
        assert param.default == (None if field.default is dataclasses.MISSING else field.default), field.name
        if field.metadata["flags"]:
            flags = [*param.opts, *param.secondary_opts]
            assert flags == [part for flag in field.metadata["flags"] for part in flag.split("/")], field.name
    assert params["latents"].param_type_name == "argument"


def parse(*argv: str) -> TrainConfig:
    context = train_command().make_context("train", list(argv))
    return TrainConfig(**{name: value for name, value in context.params.items() if name != "config"})


def test_flags_parse_to_the_config_values(tmp_path):
    config = parse(str(tmp_path / "latents"), "-o", str(tmp_path / "run"), "--transformer-config", "tiny",
                   "--max-steps", "5", "--lr", "3e-4", "--lr-schedule", "cosine", "--no-bf16-weights",
                   "--no-tf32", "--stage", "a:1", "--stage", "b:2", "--val-latents", str(tmp_path / "val"), "-q")
    assert config.latents == str(tmp_path / "latents") and config.output == str(tmp_path / "run")
    assert config.unet_config == "tiny" and config.unet is None
    assert config.max_steps == 5 and config.lr == 3e-4 and config.lr_schedule == "cosine"
    assert config.bf16_weights is False and config.tf32 is False and config.quiet is True
    assert list(config.stage) == ["a:1", "b:2"] and config.later_stages()[1][1] == 2
    assert config.val_latents == tmp_path / "val"
    defaults = parse("lat", "--output", "run", "--unet", "sd15", "--epochs", "1.5")
    assert defaults.unet == "sd15" and defaults.epochs == 1.5 and defaults.batch_size == 32
    assert defaults.bf16_weights is None and defaults.tf32 is True and defaults.export == "auto"


@pytest.mark.parametrize("flag, value, allowed", [
    ("--lr-schedule", "linear", "constant, cosine"),
    ("--mixed-precision", "fp8", "no, fp16, bf16"),
    ("--sigma-sampling", "normal", "logit_normal, logit-normal, uniform, mode"),
])
def test_a_value_outside_a_fields_choices_is_one_line(tmp_path, flag, value, allowed):
    result = run_cli("train", tmp_path / "missing", "--output", tmp_path / "run", "--unet-config", "tiny",
                     "--max-steps", "1", flag, value, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {flag} {value!r}: choose from {allowed}"
    assert not (tmp_path / "run").exists()


def test_config_file_and_recipe_keys_share_one_mapping(tmp_path):
    keys = command_keys(train_command())
    for spelling in ("max-steps", "max_steps"):
        assert keys[spelling].param.name == "max_steps" and keys[spelling].flag == "--max-steps"
    assert keys["transformer_config"].param.name == "unet_config"
    assert keys["transformer_config"].flag == "--transformer-config"
    assert keys["o"].flag == "-o" and keys["latents"].flag == "" and keys["no-bf16-weights"].negates
    # `train --config`: a switch's negation is not a key (it would set the switch on)
    file = tmp_path / "run.yaml"
    file.write_text("no-bf16-weights: true\n")
    refused = run_cli("train", tmp_path / "lat", "--output", tmp_path / "run", "--config", file, check=False)
    assert refused.returncode == 2 and "unknown key 'no-bf16-weights'" in refused.stderr
