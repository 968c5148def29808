"""Z-Image end to end on CPU, through the same encode and train loops as the other families: the tiny
pipeline -> encode the real photos (Qwen3's second to last states of the chat-templated captions, trimmed to
each caption, plus the mask) -> the flow loss is the step diffusers' Z-Image trainer takes (t = 1 - sigma,
the negated prediction) and a denoising step is the pipeline's -> train -> kill -9 -> resume exact -> RUN/pipeline
-> diffusers' own ZImagePipeline, with no laionkit, generates from it; LoRA exported for pipe.load_lora_weights.
One tiny model and stored-text encode for the session (flow_latents("z-image"), tests/fixtures.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import (
    FAMILY_RUN,
    FlowLatents,
    assert_kill9_resumes_like,
    family_run,
    first_rows,
    metrics,
    train_flags,
)

from laionkit.families import detect_family, get_family

# The reference run: fine-tunes the tiny transformer with caption dropout, EMA, validation images (through
# ZImagePipeline) and the validation loss; checkpoints at step 2 of 4.
RUN = FAMILY_RUN


@pytest.fixture(scope="module")
def zimage(flow_latents) -> FlowLatents:
    return flow_latents("z-image")


@pytest.fixture(scope="module")
def reference(zimage, tmp_path_factory) -> Path:
    return family_run(zimage, tmp_path_factory.mktemp("zimage-run") / "reference")


def load_pipeline(zimage: FlowLatents):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(zimage.model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _jsons(latents: Path, count: int) -> list[bytes]:
    import webdataset as wds

    shard = sorted(latents.glob("*.tar"))[0]
    return [s["json"] for s, _ in zip(wds.WebDataset(str(shard), shardshuffle=False), range(count))]


def test_stored_states_are_the_pipelines_prompt_embeds(zimage):
    """Each sample stores exactly ZImagePipeline.encode_prompt's tensor for its caption (the chat template,
    Qwen3's hidden_states[-2], the rows its mask selects: lengths differ), trimmed; the loader's padded batch
    and the family's conditioning give the pipeline's list back, and the transformer's output on it."""
    from laionkit.trainer.latent_stream import collate

    manifest = json.loads((zimage.latents / "manifest.json").read_text())
    assert manifest["family"] == "z-image" and manifest["complete"] and manifest["empty_mask"] == "empty_mask.npy"
    assert manifest["text"]["stored"] == {"states": [512, 32], "mask": [512]}
    assert manifest["text"]["trimmed"] == ["states", "mask"] and manifest["text"]["layer"] == "penultimate"
    assert manifest["vae"]["latent_channels"] == 16 and manifest["vae"]["shift_factor"] == pytest.approx(0.1159)
    rows = first_rows(zimage.latents, 4)
    captions = [json.loads(s)["caption"] for s in _jsons(zimage.latents, 4)]
    pipe = load_pipeline(zimage)
    with torch.no_grad():
        want, negative = pipe.encode_prompt(list(captions), device="cpu", do_classifier_free_guidance=True)
    lengths = [len(each) for each in want]
    assert len(set(lengths)) > 1 and max(lengths) < 512  # captions of several lengths, all padded
    for row, states, length in zip(rows, want, lengths):
        assert tuple(row["text"].shape) == (length, 32) and row["mask"].dtype == torch.bool and row["mask"].all()
        np.testing.assert_allclose(row["text"].float(), states, atol=3e-3, rtol=1e-2)
    empty = np.load(zimage.latents / "empty_caption.npy")
    np.testing.assert_allclose(empty, negative[0], atol=3e-3, rtol=1e-2)  # "" in the chat template: 9 tokens
    assert np.load(zimage.latents / "empty_mask.npy").all() and len(empty) == len(negative[0])

    spec = get_family("z-image")
    batch = collate(rows)
    cond = spec.conditioning({"states": batch["text"].float(), "mask": batch["mask"]})["cap_feats"]
    assert [len(each) for each in cond] == lengths
    noisy, sigmas = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([.1, .4, .7, 1.])
    with torch.no_grad():
        theirs = pipe.transformer(list(noisy.unsqueeze(2).unbind(0)), 1 - sigmas, want, return_dict=False)[0]
        ours = spec.predict(pipe.transformer, noisy, sigmas, {"states": batch["text"].float(), "mask": batch["mask"]})
    torch.testing.assert_close(ours, -torch.stack(theirs).squeeze(2), rtol=1e-2, atol=2e-3)  # fp16 storage


def test_flow_loss_is_diffusers_z_image_training_step(zimage):
    """laionkit's loss on a batch equals the step diffusers' train_dreambooth_lora_z_image.py takes with the same
    draws: logit-normal u shifted by the scheduler's static shift, x_t = (1 - sigma) x0 + sigma noise, the
    transformer on the list of frames at (1000 - timestep) / 1000 = 1 - sigma with the list of caption states,
    its output negated, and the target noise - x0."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate
    from laionkit.trainer.objective import batch_conditioning, flow_loss, resolve_objective

    data = open_latents(zimage.latents)
    batch = collate(first_rows(zimage.latents, 3))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=zimage.latents, output=Path("unused"), unet=str(zimage.model), max_steps=1)
    objective = resolve_objective(config, data.family)
    pipe = load_pipeline(zimage)
    model = pipe.transformer
    with torch.no_grad():
        ours = flow_loss(model, batch["moments"], cond, data.empty, config, data, torch.Generator().manual_seed(7),
                         objective)

        generator = torch.Generator().manual_seed(7)
        mean, logvar = batch["moments"].float().chunk(2, dim=1)
        x0 = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * torch.randn(mean.shape, generator=generator)
        x0 = (x0 - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        noise = torch.randn(x0.shape, generator=generator)
        u = compute_density_for_timestep_sampling("logit_normal", 3, logit_mean=0.0, logit_std=1.0,
                                                  generator=generator)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(zimage.model, subfolder="scheduler")
        shift = scheduler.config.shift
        assert shift == 6.0 and not scheduler.config.use_dynamic_shifting
        sigmas = shift * u / (1 + (shift - 1) * u)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1.0 - s) * x0 + s * noise
        timesteps = sigmas * 1000
        caps = [states[mask.bool()] for states, mask in zip(cond["states"], cond["mask"])]
        out = model(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, caps, return_dict=False)[0]
        pred = -torch.stack(out).squeeze(2)
        theirs = torch.mean(((pred.float() - (noise - x0)) ** 2).reshape(3, -1), 1).mean()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_the_prediction_steps_as_the_pipeline_samples(zimage):
    """The sampling direction: ZImagePipeline's own denoising loop (its scheduler, its timestep reversal and
    sign flip) over 3 steps equals Euler steps x + (sigma' - sigma) * v with laionkit's prediction v of sigma,
    and each step moves x_t toward the x0 that v implies (x0 = x_t - sigma v)."""
    pipe = load_pipeline(zimage)
    spec = get_family("z-image")
    seen = []

    def keep(_pipe, _i, _t, found):
        seen.append(found["latents"].clone())
        return {}

    start = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    caption = "a dog running on the beach"
    with torch.no_grad():
        out = pipe(caption, height=64, width=64, num_inference_steps=3, guidance_scale=0.0, latents=start.clone(),
                   output_type="latent", callback_on_step_end=keep).images
        (states,) = pipe.encode_prompt(caption, device="cpu", do_classifier_free_guidance=False)[0]
        cond = {"states": states[None], "mask": torch.ones(1, len(states), dtype=torch.bool)}
        sigmas = pipe.scheduler.sigmas.tolist()
        assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and len(sigmas) == 4
        x = start
        for step, (sigma, following) in enumerate(zip(sigmas, sigmas[1:])):
            v = spec.predict(pipe.transformer, x, torch.tensor([sigma]), cond)
            x0 = x - sigma * v
            x_next = x + (following - sigma) * v
            torch.testing.assert_close(x_next, seen[step], rtol=1e-4, atol=1e-5)
            assert ((x_next - x0).norm() < (x - x0).norm()) or following == 0.0
            x = x_next
    torch.testing.assert_close(x, out, rtol=1e-4, atol=1e-5)


def test_presets_and_the_real_size_config(zimage, tmp_path):
    from diffusers import ZImageTransformer2DModel

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet
    from laionkit.trainer.objective import resolve_objective

    spec = get_family("z-image")
    assert detect_family("z-image-turbo") is spec and detect_family(str(zimage.model)) is spec
    assert spec.presets == {"z-image": "Tongyi-MAI/Z-Image", "z-image-turbo": "Tongyi-MAI/Z-Image-Turbo"}
    with torch.device("meta"):
        real = ZImageTransformer2DModel.from_config(dict(spec.configs["z-image"]))
        fitted = build_unet(TrainConfig(latents=zimage.latents, output=tmp_path, unet_config="z-image",
                                        max_steps=1), open_latents(zimage.latents))
    assert sum(p.numel() for p in real.parameters()) == pytest.approx(6.15e9, rel=1e-2)  # Z-Image's 6B
    assert (real.config.dim, real.config.n_layers, real.config.n_heads, real.config.cap_feat_dim) == (3840, 30, 30, 2560)
    assert list(real.config.axes_lens) == [1536, 512, 512]
    assert (fitted.config.cap_feat_dim, fitted.config.in_channels, fitted.config.n_layers) == (32, 16, 30)
    objective = resolve_objective(TrainConfig(latents=zimage.latents, output=tmp_path, unet_config="tiny",
                                              max_steps=1), spec)
    assert (objective.kind, objective.shift, objective.timestep_scale) == ("flow", 6.0, 1.0)


def test_train_kill9_resume_matches_an_uninterrupted_run(zimage, reference, tmp_path):
    """`laionkit train` on Z-Image killed with SIGKILL right after its step-2 checkpoint landed, rerun with
    --resume latest: every step's loss, the validation losses and the exported transformer/ and
    transformer_ema/ equal the uninterrupted run's."""
    run = tmp_path / "run"
    args = ["train", str(zimage.latents), "--output", str(run), "--val-latents", str(zimage.latents),
            "--transformer", str(zimage.model), *train_flags(**RUN)]
    assert_kill9_resumes_like(reference, args, run, kill_at=2, steps=4)


GENERATE = """
import sys
import torch
from diffusers import DiffusionPipeline
pipeline, image, lora = sys.argv[1:]
pipe = DiffusionPipeline.from_pretrained(pipeline)
draw = lambda: pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2, guidance_scale=0.0,
                    generator=torch.Generator().manual_seed(0), output_type="np").images
before = draw()
assert before.shape == (1, 64, 64, 3) and bool(torch.isfinite(torch.from_numpy(before)).all())
if lora != "-":
    pipe.load_lora_weights(lora)
    print("changed", float(abs(draw() - before).max()))
pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2, guidance_scale=0.0,
     generator=torch.Generator().manual_seed(0)).images[0].save(image)
print(type(pipe).__name__, type(pipe.transformer).__name__)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def generate(pipeline: Path, image: Path, lora: Path | None = None) -> str:
    """ZImagePipeline from ``pipeline`` (with ``lora`` loaded) in a fresh interpreter that never imports laionkit."""
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), str(pipeline), str(image), str(lora or "-")],
                          capture_output=True, text=True, timeout=300, cwd=image.parent,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(image.parent), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    assert "ZImagePipeline ZImageTransformer2DModel" in free.stdout and image.stat().st_size > 0
    return free.stdout


def test_export_generates_in_diffusers_without_laionkit(reference, tmp_path):
    """RUN/pipeline (model_index.json, the trained transformer, the encode's VAE, Qwen3 and tokenizer, the
    scheduler) loads as ZImagePipeline in a fresh interpreter that never imports laionkit and draws a finite
    image; the run's validation grid was drawn through the same pipeline."""
    index = json.loads((reference / "pipeline" / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline" and index["text_encoder"] == ["transformers", "Qwen3Model"]
    assert (reference / "samples" / "step-000004.png").stat().st_size > 0
    generate(reference / "pipeline", tmp_path / "zimage.png")


def test_lora_resumes_exactly_and_exports_what_the_pipeline_loads(zimage, tmp_path):
    """--lora-rank on Z-Image (diffusers' add_adapter on the transformer): checkpoints hold the adapters only, a
    resume from step 2 gives the uninterrupted run's losses and adapters, and RUN/lora is what
    ZImagePipeline.load_lora_weights reads in a fresh interpreter, changing what it draws."""
    from fixtures import assert_lora_resumed_like

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    options = dict(latents=zimage.latents, unet=str(zimage.model), lora_rank=4, max_steps=4, batch_size=4,
                   lr=1e-2, log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3,
                   checkpoint_every=2)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(TrainConfig(output=whole, **options))
    assert not (whole / "transformer").exists() and not (whole / "checkpoints" / "step-00000002" /
                                                          "model.safetensors").exists()
    train(TrainConfig(output=resumed, resume=whole / "checkpoints" / "step-00000002", **options))
    exported = assert_lora_resumed_like(whole, resumed, [3, 4])
    assert exported and all(key.startswith("transformer.") for key in exported)
    out = generate(zimage.model, tmp_path / "lora.png", whole / "lora")
    assert float(out.split("changed")[1].split()[0]) > 0


def test_buckets_from_scratch(zimage, image_shards, tmp_path):
    """Aspect-ratio buckets train from scratch (--transformer-config tiny: each bucket's latent shape, the
    per-sample lists of frames and captions of one batch)."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(zimage.model), resolution=128,
                     buckets=True, batch_size=4, workers=0, quiet=True))
    train(TrainConfig(latents=latents, output=tmp_path / "run", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "run")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len([n for n in record["samples_per_bucket"].values() if n]) > 1, "one bucket only"


def test_tiny_qwen_tokenizer_is_reproducible_and_renders_qwen3s_prompt(tmp_path):
    """The tiny Qwen2Tokenizer: the same files from the same captions, byte-level (any text round-trips), no
    bos or eos added, and the chat template renders a user turn and the generation prompt as Qwen3's does."""
    from transformers import Qwen2Tokenizer

    from laionkit.families import tokenizers as tiny_tokenizers
    from laionkit.families.zimage import prompts

    folder = tiny_tokenizers.write_qwen(tmp_path / "a")
    again = tiny_tokenizers.write_qwen(tmp_path / "b")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {p.name: p.read_bytes() for p in again.iterdir()}
    tokenizer = Qwen2Tokenizer.from_pretrained(folder)
    for text in (tiny_tokenizers.captions()[0], "🐱 Ωmega — café"):
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text and tokenizer.pad_token_id not in ids
    assert prompts(tokenizer, ["a cat"]) == ["<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.convert_ids_to_tokens(tokenizer(prompts(tokenizer, ["a cat"])[0]).input_ids)[0] == "<|im_start|>"
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token) == ("<|endoftext|>", "<|im_end|>", None)


def test_validation_grid_with_guidance_and_bf16_weights(zimage):
    """train's validation sampler through ZImagePipeline: the stored states as its lists of prompt_embeds and
    the empty caption's as negative_prompt_embeds, --guidance-scale 5 as the pipeline's 4 (pos + 4 (pos - neg) is
    neg + 5 (pos - neg)), with bf16 weights whose prepared forward returns fp32 (the scheduler's fp32 latents go
    back to bf16 between steps); at --guidance-scale 1 the pipeline gets 0, no guidance, and draws otherwise."""
    from accelerate.utils import convert_outputs_to_fp32

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.evaluation import sample_latents, validate, validation_conditioning

    data = open_latents(zimage.latents)
    pipe = load_pipeline(zimage)
    _, texts = validation_conditioning(data, 2)
    config = TrainConfig(latents=zimage.latents, output=Path("unused"), unet=str(zimage.model), max_steps=1,
                         validation_steps=2)
    guided = sample_latents(pipe.transformer, pipe.vae, None, texts, data.empty, data, config, torch.device("cpu"))
    plain = sample_latents(pipe.transformer, pipe.vae, None, texts, data.empty, data,
                           replace(config, guidance_scale=1.0), torch.device("cpu"))
    assert guided.shape == (2, 16, 8, 8) and (guided - plain).abs().max() > 1e-3
    model = torch.nn.Module.to(pipe.transformer, torch.bfloat16)
    model.forward = convert_outputs_to_fp32(model.forward)
    empty = {key: value.to(torch.bfloat16) if value.is_floating_point() else value for key, value in data.empty.items()}
    images = validate(model, pipe.vae, None, texts, empty, data, config, torch.device("cpu"))
    assert images.shape == (2, 3, 64, 64) and torch.isfinite(images).all()


def test_online_text_trains_as_stored_text_does(zimage, reference, image_shards, tmp_path):
    """encode --text online keeps the chat-templated captions' token ids (-1 where the mask is 0); train runs
    Qwen3 on them and gets the stored-text run's losses and validation loss."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    online = tmp_path / "online"
    run(EncodeConfig(shards=(str(image_shards),), output=online, model=str(zimage.model), resolution=64,
                     batch_size=4, workers=0, quiet=True, text="online"))
    manifest = json.loads((online / "manifest.json").read_text())
    assert manifest["text"]["mode"] == "online" and manifest["text"]["ids"] == {"ids_tokenizer.npy": 512}
    train(TrainConfig(latents=online, val_latents=online, output=tmp_path / "run", unet=str(zimage.model),
                      **{**RUN, "max_steps": 2, "validate_every": 0, "ema": False}))
    got, want = metrics(tmp_path / "run"), metrics(reference)
    for step in (1, 2):  # stored text is the same encoder's output rounded to float16
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), step
    assert got[2]["val_loss"] == pytest.approx(want[2]["val_loss"], rel=1e-4)
