"""Model sources resolve the way users write them, and the tiny models load through the real loaders."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from laionkit.common import LaionkitError
from laionkit.common.models import (
    COMPONENTS,
    PRESETS,
    fingerprint,
    load_scheduler,
    load_text_encoder,
    load_tokenizer,
    load_unet,
    load_unet_config,
    load_vae,
    resolve_source,
)


@pytest.mark.parametrize("source, component, location, subfolder", [
    ("sd15", "vae", "stable-diffusion-v1-5/stable-diffusion-v1-5", "vae"),
    ("sd2", "text_encoder", "stabilityai/stable-diffusion-2-base", "text_encoder"),
    ("stabilityai/stable-diffusion-2-base", "tokenizer", "stabilityai/stable-diffusion-2-base", "tokenizer"),
    ("stabilityai/sd-vae-ft-mse:root", "vae", "stabilityai/sd-vae-ft-mse", None),
    ("openai/clip-vit-large-patch14/text_model", "text_encoder", "openai/clip-vit-large-patch14", "text_model"),
])
def test_hub_and_preset_sources(source, component, location, subfolder):
    where = resolve_source(source, component)
    assert (where.location, where.subfolder, where.local) == (location, subfolder, False)


def test_local_sources_pipeline_folder_and_bare_component(tiny_models):
    assert resolve_source(str(tiny_models), "vae").subfolder == "vae"
    bare = resolve_source(str(tiny_models / "vae"), "vae")
    assert (bare.location, bare.subfolder, bare.local) == (str(tiny_models / "vae"), None, True)


@pytest.mark.parametrize("source, match", [
    ("sd9", "not a preset"),
    ("./no/such/folder", "no such folder"),
    ("tests/tiny-sd15x", "no such folder"),  # under a folder that exists: a path, though shaped like owner/name
    ("owner/name:main", "only ':root'"),
])
def test_bad_sources_name_the_problem(source, match):
    with pytest.raises(LaionkitError, match=match):
        resolve_source(source, "vae")


@pytest.mark.parametrize("stage", ["encode", "caption"])
def test_a_mistyped_model_folder_is_refused_at_once(tmp_path, image_shards, stage):
    """Before: tests/tiny-sd15x (its parent exists) was taken for a hub id, five retries of a download, then a hub
    error about a repo; now every stage that loads a model says there is no such folder, at once."""
    import time

    started = time.monotonic()
    result = run_cli(stage, image_shards, "--model", "tests/tiny-sd15x", "--output", tmp_path / "out", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--model tests/tiny-sd15x: no such folder" in result.stderr.strip().splitlines()[-1]
    assert time.monotonic() - started < 30


def test_folder_without_the_component_is_refused(tmp_path):
    with pytest.raises(LaionkitError, match="neither a vae/ subfolder"):
        resolve_source(str(tmp_path), "vae")


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_preset_resolves_every_component_and_a_typo_lists_them(component):
    for name, preset in PRESETS.items():
        where = resolve_source(name, component)
        assert (where.location, where.subfolder, where.local) == (preset.repo, component, False)
    with pytest.raises(LaionkitError) as error:
        resolve_source("sd51", component)
    assert f"not a preset ({', '.join(PRESETS)})" in str(error.value)


def test_tiny_tokenizer_is_openai_clip(tiny_models):
    tokenizer = load_tokenizer(str(tiny_models))
    # openai/clip-vit-large-patch14 gives these ids (the same as open_clip.tokenize).
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tokenizer.model_max_length == 77
    import open_clip

    caption = "An Astronaut riding a horse, photorealistic — 4K, café"
    ids = tokenizer(caption).input_ids
    assert ids == open_clip.tokenize([caption])[0][: len(ids)].tolist()


def test_tiny_models_load_and_fit_together(tiny_models):
    vae = load_vae(str(tiny_models))
    text_encoder = load_text_encoder(str(tiny_models))
    unet = load_unet(str(tiny_models))
    scheduler = load_scheduler(str(tiny_models))
    assert vae.config.latent_channels == 4 and vae.config.scaling_factor == pytest.approx(0.18215)
    moments = vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.parameters
    assert moments.shape == (1, 8, 8, 8)  # SD's 8x downsampling, mean + log-variance
    hidden = text_encoder(torch.tensor([[49406, 320, 49407]])).last_hidden_state
    assert hidden.shape == (1, 3, unet.config.cross_attention_dim)
    out = unet(torch.zeros(1, 4, 8, 8), 10, encoder_hidden_states=hidden).sample
    assert out.shape == (1, 4, 8, 8)
    assert scheduler.config.beta_schedule == "scaled_linear"
    assert load_unet_config(str(tiny_models))["cross_attention_dim"] == text_encoder.config.hidden_size


def test_tiny_models_are_a_diffusers_pipeline_folder(tiny_models):
    index = json.loads((tiny_models / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert {"vae", "unet", "text_encoder", "tokenizer", "scheduler"} <= set(index)


def test_fingerprint_hashes_local_files(tiny_models):
    record = fingerprint(str(tiny_models), "vae")
    assert record["subfolder"] == "vae" and record["local"]
    assert set(record["files"]) == {"config.json", "diffusion_pytorch_model.safetensors"}


def test_models_tiny_command_is_seeded(tmp_path, tiny_models):
    run_cli("models", "tiny", "--output", tmp_path / "a")
    run_cli("models", "tiny", "--output", tmp_path / "b", "--seed", "1")
    weights = "vae/diffusion_pytorch_model.safetensors"
    assert (tmp_path / "a" / weights).read_bytes() == (tiny_models / weights).read_bytes()  # seed 0 both
    assert (tmp_path / "a" / weights).read_bytes() != (tmp_path / "b" / weights).read_bytes()
    assert not list(tmp_path.glob(".*"))  # no temporaries left behind
