"""The family layer: registry, the SDXL family against diffusers' own pipeline, and the tiny tokenizers."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from laionkit.common import LaionkitError
from laionkit.families import FamilySpec, families, get_family, register_family, sdxl
from laionkit.families import tokenizers as tiny_tokenizers

FAMILIES = ("sdxl", "sd3", "flux")


class _Lazy(dict):
    """name -> value, built on first use, so a test of one family writes and loads only that family."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def __missing__(self, name):
        self[name] = self.build(name)
        return self[name]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    return _Lazy(lambda name: get_family(name).write_tiny(tmp_path_factory.mktemp(name), 0))


@pytest.fixture(scope="module")
def pipelines(tiny_folders):
    import diffusers

    return _Lazy(lambda name: getattr(diffusers, get_family(name).pipeline_class).from_pretrained(
        tiny_folders[name]))


@pytest.fixture(scope="module")
def tiny_sdxl(tiny_folders):
    return tiny_folders["sdxl"]


@pytest.fixture(scope="module")
def sdxl_pipeline(pipelines):
    return pipelines["sdxl"]


def test_registry_names_known_families_and_refuses_duplicates():
    assert set(FAMILIES) <= set(families())
    with pytest.raises(LaionkitError, match=r"unknown model family 'sdxl2' \(known: .*sdxl"):
        get_family("sdxl2")
    with pytest.raises(ValueError, match="already registered"):
        register_family(dataclasses.replace(get_family("sdxl")))
    assert isinstance(get_family("sdxl"), FamilySpec)


def test_tiny_sdxl_has_the_real_layout(tiny_sdxl, sdxl_pipeline):
    assert {p.name for p in tiny_sdxl.iterdir()} == {
        "model_index.json", "vae", "unet", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"}
    vae, unet = sdxl_pipeline.vae.config, sdxl_pipeline.unet.config
    assert (vae.latent_channels, vae.scaling_factor, vae.force_upcast) == (4, 0.13025, True)
    assert unet.addition_embed_type == "text_time"
    assert unet.cross_attention_dim == (sdxl_pipeline.text_encoder.config.hidden_size
                                        + sdxl_pipeline.text_encoder_2.config.hidden_size)
    # SDXL's second tokenizer pads with "!" (id 0), the first with end-of-text, as in SDXL base.
    assert sdxl_pipeline.tokenizer_2("a cat", padding="max_length").input_ids[-1] == 0
    assert sdxl_pipeline.tokenizer("a cat", padding="max_length").input_ids[-1] == 49407
    assert type(sdxl_pipeline.scheduler).__name__ == "EulerDiscreteScheduler"


def _pipeline_prompt(pipe, name, captions, **window):
    """(states, pooled) from the family's own pipeline, run without autograd as encode runs (``window``:
    its max_sequence_length)."""
    with torch.no_grad():
        if name == "flux":
            states, pooled, _ = pipe.encode_prompt(captions, None, device="cpu", **window)
        else:
            args = (None,) if name == "sdxl" else (None, None)
            states, _, pooled, _ = pipe.encode_prompt(captions, *args, device="cpu", do_classifier_free_guidance=False,
                                                      **window)
    return states, pooled


@pytest.mark.parametrize("name", FAMILIES)
def test_encode_text_is_the_pipelines_encode_prompt(pipelines, name):
    pipe, spec = pipelines[name], get_family(name)
    captions = ["a dog running on the beach, golden hour", "", " ".join(["a very long caption"] * 30)]
    tokenizers = [getattr(pipe, tokenizer) for tokenizer, _ in spec.text_encoders]
    encoders = [getattr(pipe, encoder) for _, encoder in spec.text_encoders]
    ours = spec.encode_text(tokenizers, encoders, captions)
    states, pooled = _pipeline_prompt(pipe, name, captions)
    assert set(ours) == set(spec.stored)
    torch.testing.assert_close(ours["states"], states, rtol=0, atol=0)
    torch.testing.assert_close(ours["pooled"], pooled, rtol=0, atol=0)
    # The long caption is cut at each window, not an error; the empty one is encoded, not skipped.
    assert ours["states"].shape[0] == 3 and not torch.equal(ours["states"][0], ours["states"][1])


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_a_caption_window_is_the_pipelines_max_sequence_length(pipelines, name):
    """encode --max-sequence-length 16: the family's text equals its pipeline's encode_prompt with
    max_sequence_length=16 (T5's window; SD3's CLIP pair keeps 77), the long caption cut there."""
    pipe, spec = pipelines[name], get_family(name).with_max_sequence_length(16)
    captions = ["a dog running on the beach, golden hour", "", " ".join(["a very long caption"] * 30)]
    tokenizers = [getattr(pipe, tokenizer) for tokenizer, _ in spec.text_encoders]
    encoders = [getattr(pipe, encoder) for _, encoder in spec.text_encoders]
    ours = spec.encode_text(tokenizers, encoders, captions)
    states, pooled = _pipeline_prompt(pipe, name, captions, max_sequence_length=16)
    assert ours["states"].shape[1] == (77 if name == "sd3" else 0) + 16
    torch.testing.assert_close(ours["states"], states, rtol=0, atol=0)
    torch.testing.assert_close(ours["pooled"], pooled, rtol=0, atol=0)
    assert [ids.shape[-1] for ids in spec.empty_ids(tokenizers)][-1] == 16  # caption dropout's "" too


def test_a_caption_window_is_refused_where_fixed_or_beyond_the_pipelines():
    assert get_family("flux").with_max_sequence_length(512) is get_family("flux")  # its own: the family itself
    assert get_family("flux").with_max_sequence_length(None) is get_family("flux")
    for name in ("sd", "sdxl"):
        with pytest.raises(LaionkitError, match=f"family {name}'s caption window is fixed"):
            get_family(name).with_max_sequence_length(64)
    with pytest.raises(LaionkitError, match="family flux takes 1 to 512 tokens"):
        get_family("flux").with_max_sequence_length(513)
    with pytest.raises(LaionkitError, match="family pixart takes 1 to any number of tokens"):
        get_family("pixart").with_max_sequence_length(0)
    sana = get_family("sana").with_max_sequence_length(40)  # its tokenize, encode_tokens and unconditional
    assert [function.keywords for function in (sana.tokenize, sana.encode_tokens, sana.unconditional)] == [
        {"max_sequence_length": 40}] * 3
    assert sana.text_window == 40 and get_family("flux").with_max_sequence_length(40).text_window is None
    # what the manifest records and the export names: only a window that is not the family's own
    assert sana.given_max_sequence_length == 40 and get_family("sana").given_max_sequence_length is None


def test_sdxl_text_shapes(sdxl_pipeline):
    pipe, spec = sdxl_pipeline, get_family("sdxl")
    ours = spec.encode_text([pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2], ["a"])
    assert ours["states"].shape == (1, 77, sum(sdxl.TINY_HIDDEN))
    assert ours["pooled"].shape == (1, sdxl.TINY_HIDDEN[1])


def test_conditioning_drives_the_unet_and_time_ids_matter(sdxl_pipeline):
    spec = get_family("sdxl")
    pipe = sdxl_pipeline
    text = spec.encode_text([pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
                            ["a cat", "a dog"])
    latents = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([10, 500])

    def run(ids):
        with torch.no_grad():
            return pipe.unet(latents, timestep=timestep, **spec.conditioning({**text, "time_ids": ids})).sample

    square = run(sdxl.time_ids((64, 96), (0, 0), (64, 96)).expand(2, 6))
    cropped = run(sdxl.time_ids([[128, 96], [64, 200]], [[32, 0], [0, 52]], (64, 96)))
    assert square.shape == latents.shape and torch.isfinite(square).all()
    assert not torch.allclose(square, cropped)


def test_time_ids_crop_is_the_pixels_resize_and_center_crop_keep(realdata):
    from PIL import Image
    from torchvision.transforms import functional as F
    from torchvision.transforms import v2

    for name in ("123_456.jpg", "456_123.jpg", "524_316.jpg"):
        image = Image.open(realdata / "images" / name).convert("RGB")
        original_hw = (image.height, image.width)
        # Several sizes, so odd margins (where rounding half-way matters) are covered too.
        for resolution in range(56, 72):
            top, left = sdxl.center_crop_top_left(original_hw, resolution)
            resized = v2.Resize(resolution)(image)
            expected = F.pil_to_tensor(v2.CenterCrop(resolution)(resized))
            assert F.pil_to_tensor(F.crop(resized, top, left, resolution, resolution)).equal(expected)
            ids = sdxl.time_ids(original_hw, (top, left), (resolution, resolution))
            assert ids.tolist() == [image.height, image.width, top, left, resolution, resolution]
            assert max(top, left) > 0


@pytest.mark.parametrize("name, config, parameters", [
    ("sdxl", "sdxl", 2.567e9),
    ("sd3", "sd3-medium", 2.028e9),
    ("flux", "flux-dev", 11.90e9),
])
def test_real_size_configs_build_the_published_architectures(name, config, parameters):
    import diffusers

    spec = get_family(name)
    with torch.device("meta"):
        model = getattr(diffusers, spec.denoiser_class).from_config(spec.configs[config])
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx(parameters, rel=2e-3)
    blocks = spec.blocks(model)
    # The wrap units hold nearly all weights, so FSDP shards what matters, and none holds another.
    assert sum(p.numel() for block in blocks for p in block.parameters()) / total > 0.85
    assert not any(inner is not outer and inner in set(outer.modules()) for outer in blocks for inner in blocks)


def test_blocks_refuses_a_model_without_them():
    with pytest.raises(LaionkitError, match="no ResnetBlock2D/BasicTransformerBlock blocks"):
        get_family("sdxl").blocks(torch.nn.Linear(2, 2))


def test_every_tiny_family_generates_offline_without_laionkit(tiny_folders):
    script = textwrap.dedent("""
        import sys, numpy, torch
        from diffusers import DiffusionPipeline
        for folder, expected in zip(sys.argv[1::2], sys.argv[2::2]):
            pipe = DiffusionPipeline.from_pretrained(folder)
            assert type(pipe).__name__ == expected, (folder, type(pipe).__name__)
            image = pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np",
                         generator=torch.Generator().manual_seed(0)).images[0]
            assert image.shape == (64, 64, 3) and numpy.isfinite(image).all() and image.std() > 0, folder
        assert not any(name.startswith("laionkit") for name in sys.modules)
        print("ok")
    """)
    args = [str(item) for name in FAMILIES for item in (tiny_folders[name], get_family(name).pipeline_class)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                            cwd=tiny_folders["sdxl"], timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_flow_families_conditioning_drives_their_transformers(pipelines):
    from laionkit.families import flow, flux

    generator = torch.Generator().manual_seed(0)
    for name in ("sd3", "flux"):
        pipe, spec = pipelines[name], get_family(name)
        text = spec.encode_text([getattr(pipe, t) for t, _ in spec.text_encoders],
                                [getattr(pipe, e) for _, e in spec.text_encoders], ["a cat", "a dog"])
        latents = torch.randn(2, 16, 8, 12, generator=generator)
        sigmas = torch.tensor([0.3, 0.8])
        with torch.no_grad():
            if name == "sd3":
                out = pipe.transformer(latents, timestep=flow.timesteps(sigmas), **spec.conditioning(text)).sample
            else:
                batch = {**text, "img_ids": flux.image_ids(8, 12), "guidance": torch.full((2,), 3.5)}
                out = pipe.transformer(flux.pack(latents), timestep=sigmas, **spec.conditioning(batch)).sample
                out = flux.unpack(out, 8, 12)
        assert out.shape == latents.shape and torch.isfinite(out).all(), name


def test_flux_packing_and_ids_are_the_pipelines(pipelines):
    from laionkit.families import flux

    pipe = pipelines["flux"]
    latents = torch.randn(2, 16, 8, 12)
    assert torch.equal(flux.pack(latents), pipe._pack_latents(latents, 2, 16, 8, 12))
    assert torch.equal(flux.unpack(flux.pack(latents), 8, 12), latents)
    assert torch.equal(flux.image_ids(8, 12), pipe._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32))


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["t5", "gemma"])
def test_tiny_tokenizers_load_through_from_pretrained_and_round_trip(tmp_path, kind):
    from transformers import GemmaTokenizerFast, T5TokenizerFast

    write = {"t5": tiny_tokenizers.write_t5, "gemma": tiny_tokenizers.write_gemma}[kind]
    folder = write(tmp_path / "a")
    assert {p.name for p in folder.iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json"}
    assert _digest(folder) == _digest(write(tmp_path / "b"))
    tokenizer = {"t5": T5TokenizerFast, "gemma": GemmaTokenizerFast}[kind].from_pretrained(folder)
    caption = tiny_tokenizers.captions()[0]
    ids = tokenizer(caption).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == caption
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token_id not in ids
    if kind == "t5":
        assert ids[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    else:
        assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<bos>")
        # Byte fallback: text outside the trained alphabet still round-trips, nothing becomes <unk>.
        emoji = "🐱 Ωmega"
        assert tokenizer.decode(tokenizer(emoji).input_ids, skip_special_tokens=True) == emoji
    padded = tokenizer(["a cat", caption], padding="max_length", max_length=48, truncation=True)
    assert [len(row) for row in padded.input_ids] == [48, 48]
    assert padded.attention_mask[0].count(1) == len(tokenizer("a cat").input_ids)


def test_sd_family_encodes_as_its_pipeline_and_families_are_detected_from_folders(tiny_folders, tmp_path):
    """SD's spec is what StableDiffusionPipeline.encode_prompt computes (clip_skip=1 for the penultimate
    layer); a folder's family comes from its model_index.json, a bare component folder is SD."""
    from diffusers import StableDiffusionPipeline

    from laionkit.families import detect_family

    pipe = StableDiffusionPipeline.from_pretrained(tiny_folders["sd"])
    spec = get_family("sd")
    captions = ["a dog running on the beach", "", " ".join(["a very long caption"] * 30)]
    ours = spec.encode_text([pipe.tokenizer], [pipe.text_encoder], captions)
    with torch.no_grad():
        states, _ = pipe.encode_prompt(captions, "cpu", 1, False)
    torch.testing.assert_close(ours["states"], states, rtol=0, atol=0)
    # The penultimate layer through the final layer norm (what clip_skip=1 means; diffusers' own clip_skip
    # path reaches for text_model, which transformers 5 removed).
    ids = pipe.tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = pipe.text_encoder(ids, output_hidden_states=True).hidden_states[-2]
        expected = pipe.text_encoder.final_layer_norm(hidden)
    penultimate = spec.encode_text([pipe.tokenizer], [pipe.text_encoder], captions, layer="penultimate")
    torch.testing.assert_close(penultimate["states"], expected, rtol=0, atol=0)
    assert not torch.equal(penultimate["states"], ours["states"])
    assert [detect_family(str(tiny_folders[name])).name for name in ("sd", "sdxl")] == ["sd", "sdxl"]
    assert detect_family(str(tiny_folders["sd"] / "vae")).name == "sd"
    assert detect_family("sdxl").name == "sdxl" and detect_family("sd15").name == "sd"
    (tmp_path / "model_index.json").write_text('{"_class_name": "KandinskyPipeline"}')
    with pytest.raises(LaionkitError, match="names KandinskyPipeline, which no model family draws"):
        detect_family(str(tmp_path))
