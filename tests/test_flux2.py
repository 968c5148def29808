"""FLUX.2 [klein] end to end on CPU, through the same encode and train loops as the other families: the tiny
pipeline -> encode the real photos (Qwen3's hidden states 9, 18, 27 side by side for the chat-templated
captions, 512 rows, no mask) -> the latents normalised with the VAE's batch-norm statistics as the pipeline does
-> the flow loss is the step diffusers' FLUX.2 klein trainer takes -> train -> kill -9 -> resume exact ->
RUN/pipeline -> diffusers' own Flux2KleinPipeline, with no laionkit, generates from it; LoRA exported for
pipe.load_lora_weights. One tiny model and stored-text encode for the session (flow_latents("flux2"))."""

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
    stored_states_are_the_pipelines,
    train_flags,
)

from laionkit.families import detect_family, get_family

RUN = FAMILY_RUN


@pytest.fixture(scope="module")
def flux2(flow_latents) -> FlowLatents:
    return flow_latents("flux2")


@pytest.fixture(scope="module")
def reference(flux2, tmp_path_factory) -> Path:
    return family_run(flux2, tmp_path_factory.mktemp("flux2-run") / "reference")


def load_pipeline(flux2: FlowLatents):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(flux2.model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_stored_states_and_latents_are_the_pipelines(flux2):
    """Each sample stores exactly Flux2KleinPipeline.encode_prompt's [512, 3 x 16] states for its caption (and ""
    for the empty caption); the manifest records the VAE's batch-norm statistics (128 = 4 x 32), and laionkit's
    normalised [32, h, w] latent is the pipeline's patchified, normalised [128, h/2, w/2] one unpatchified; the
    family's prediction is the transformer called as the pipeline calls it (packed tokens, its ids)."""
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate

    manifest = json.loads((flux2.latents / "manifest.json").read_text())
    assert manifest["family"] == "flux2" and manifest["complete"]
    assert manifest["text"]["stored"] == {"states": [512, 48]} and "trimmed" not in manifest["text"]
    pipe = load_pipeline(flux2)
    vae = manifest["vae"]
    assert vae["latent_channels"] == 32 and vae["scaling_factor"] == 1.0 and len(vae["latents_mean"]) == 128
    np.testing.assert_allclose(vae["latents_mean"], pipe.vae.bn.running_mean, rtol=1e-6)
    np.testing.assert_allclose(vae["latents_std"], torch.sqrt(pipe.vae.bn.running_var + pipe.vae.config.batch_norm_eps),
                               rtol=1e-6)
    rows, want, text_ids = stored_states_are_the_pipelines(pipe, flux2.latents)

    data = open_latents(flux2.latents)
    batch = collate(rows)
    z = batch["moments"].float().chunk(2, dim=1)[0]
    theirs = pipe._patchify_latents(z)
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    theirs = (theirs - mean) / torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    ours = data.normalize(z)
    torch.testing.assert_close(pipe._patchify_latents(ours), theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(data.denormalize(ours), z, rtol=1e-5, atol=1e-5)

    spec = get_family("flux2")
    sigmas = torch.tensor([.1, .4, .7, 1.])
    with torch.no_grad():
        ids = pipe._prepare_latent_ids(theirs)
        out = pipe.transformer(hidden_states=pipe._pack_latents(theirs), timestep=sigmas, guidance=None,
                               encoder_hidden_states=want, txt_ids=text_ids, img_ids=ids, return_dict=False)[0]
        out = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(out, ids))
        mine = spec.predict(pipe.transformer, ours, sigmas, {"states": batch["text"].float()})
    torch.testing.assert_close(mine, out, rtol=1e-2, atol=2e-3)  # fp16 storage of the states


def test_flow_loss_is_diffusers_flux2_klein_training_step(flux2):
    """laionkit's loss on a batch equals the step diffusers' train_dreambooth_lora_flux2_klein.py takes with the
    same draws: the latent patchified and normalised with the batch-norm statistics, x_t = (1 - sigma) x0 +
    sigma noise, the transformer on _pack_latents' tokens at timesteps / 1000 = sigma with _prepare_latent_ids,
    unpacked with the ids, target noise - x0, unweighted. Sigma: logit-normal u shifted by Flux's resolution rule
    (laionkit's; the script's dynamic-shifting scheduler table leaves u unshifted: --shift 1 gives that)."""
    from diffusers import Flux2KleinPipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from laionkit.families import flow
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate
    from laionkit.trainer.objective import batch_conditioning, flow_loss, resolve_objective

    data = open_latents(flux2.latents)
    batch = collate(first_rows(flux2.latents, 3))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=flux2.latents, output=Path("unused"), unet=str(flux2.model), max_steps=1)
    objective = resolve_objective(config, data.family)
    pipe = load_pipeline(flux2)
    model = pipe.transformer
    with torch.no_grad():
        ours = flow_loss(model, batch["moments"], cond, data.empty, config, data, torch.Generator().manual_seed(7),
                         objective)

        generator = torch.Generator().manual_seed(7)
        mean, logvar = batch["moments"].float().chunk(2, dim=1)
        z = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * torch.randn(mean.shape, generator=generator)
        noise = pipe._patchify_latents(torch.randn(z.shape, generator=generator))  # drawn [32, h, w]: patchified
        bn_mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        x0 = (Flux2KleinPipeline._patchify_latents(z) - bn_mean) / bn_std
        ids = Flux2KleinPipeline._prepare_latent_ids(x0)
        u = compute_density_for_timestep_sampling("logit_normal", 3, logit_mean=0.0, logit_std=1.0,
                                                  generator=generator)
        shift = flow.resolution_shift(x0.shape[2] * x0.shape[3])  # Flux's mu on the packed sequence length
        sigmas = flow.shift_sigmas(u, shift)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1.0 - s) * x0 + s * noise
        pred = model(hidden_states=Flux2KleinPipeline._pack_latents(noisy), timestep=sigmas * 1000 / 1000,
                     guidance=None, encoder_hidden_states=cond["states"],
                     txt_ids=Flux2KleinPipeline._prepare_text_ids(cond["states"]), img_ids=ids, return_dict=False)[0]
        pred = Flux2KleinPipeline._unpack_latents_with_ids(pred, ids)
        theirs = torch.mean(((pred.float() - (noise - x0)) ** 2).reshape(3, -1), 1).mean()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_presets_and_the_real_size_config(flux2, tmp_path):
    from diffusers import Flux2Transformer2DModel

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet
    from laionkit.trainer.objective import resolve_objective

    spec = get_family("flux2")
    assert detect_family("flux2-klein-4b") is spec and detect_family(str(flux2.model)) is spec
    with torch.device("meta"):
        real = Flux2Transformer2DModel.from_config(dict(spec.configs["flux2-klein-4b"]))
        nine = Flux2Transformer2DModel.from_config(dict(spec.configs["flux2-klein-9b"]))
        fitted = build_unet(TrainConfig(latents=flux2.latents, output=tmp_path, unet_config="flux2-klein-4b",
                                        max_steps=1), open_latents(flux2.latents))
    assert sum(p.numel() for p in real.parameters()) == pytest.approx(3.88e9, rel=2e-2)  # klein 4B
    assert sum(p.numel() for p in nine.parameters()) == pytest.approx(9.1e9, rel=5e-2)  # klein 9B (with its text: 9B)
    assert (fitted.config.joint_attention_dim, fitted.config.in_channels, fitted.config.num_single_layers) == (48, 128, 20)
    objective = resolve_objective(TrainConfig(latents=flux2.latents, output=tmp_path, unet_config="tiny",
                                              max_steps=1), spec)
    assert (objective.kind, objective.dynamic_shift, objective.timestep_scale, objective.guidance) == (
        "flow", True, 1.0, None)


def test_train_kill9_resume_matches_an_uninterrupted_run(flux2, reference, tmp_path):
    """`laionkit train` on FLUX.2 klein killed with SIGKILL right after its step-2 checkpoint landed, rerun with
    --resume latest: every step's loss, the validation losses and the exported transformer/ and
    transformer_ema/ equal the uninterrupted run's."""
    run = tmp_path / "run"
    args = ["train", str(flux2.latents), "--output", str(run), "--val-latents", str(flux2.latents),
            "--transformer", str(flux2.model), *train_flags(**RUN)]
    assert_kill9_resumes_like(reference, args, run, kill_at=2, steps=4)


GENERATE = """
import sys
import torch
from diffusers import DiffusionPipeline
pipeline, image, lora = sys.argv[1:]
pipe = DiffusionPipeline.from_pretrained(pipeline)
draw = lambda: pipe(prompt="a dog running on the beach", height=64, width=64, num_inference_steps=2,
                    guidance_scale=4.0, generator=torch.Generator().manual_seed(0), output_type="np").images
before = draw()
assert before.shape == (1, 64, 64, 3) and bool(torch.isfinite(torch.from_numpy(before)).all())
if lora != "-":
    pipe.load_lora_weights(lora)
    print("changed", float(abs(draw() - before).max()))
pipe(prompt="a dog running on the beach", height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
     generator=torch.Generator().manual_seed(0)).images[0].save(image)
print(type(pipe).__name__, type(pipe.transformer).__name__)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def generate(pipeline: Path, image: Path, lora: Path | None = None) -> str:
    """Flux2KleinPipeline from ``pipeline`` (with ``lora`` loaded) in a fresh interpreter that never imports
    laionkit, with classifier-free guidance."""
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), str(pipeline), str(image), str(lora or "-")],
                          capture_output=True, text=True, timeout=300, cwd=image.parent,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(image.parent), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    assert "Flux2KleinPipeline Flux2Transformer2DModel" in free.stdout and image.stat().st_size > 0
    return free.stdout


def test_export_generates_in_diffusers_without_laionkit(reference, tmp_path):
    """RUN/pipeline (model_index.json, the trained transformer, the encode's VAE with its batch-norm statistics,
    Qwen3 and tokenizer, the scheduler) loads as Flux2KleinPipeline in a fresh interpreter that never imports
    laionkit and draws a finite image; the run's validation grid was drawn through the same pipeline."""
    index = json.loads((reference / "pipeline" / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["vae"] == ["diffusers", "AutoencoderKLFlux2"]
    assert (reference / "samples" / "step-000004.png").stat().st_size > 0
    generate(reference / "pipeline", tmp_path / "flux2.png")


def test_lora_resumes_exactly_and_exports_what_the_pipeline_loads(flux2, tmp_path):
    """--lora-rank on FLUX.2 klein (diffusers' add_adapter on the transformer): checkpoints hold the adapters only,
    a resume from step 2 gives the uninterrupted run's losses and adapters, and RUN/lora is what
    Flux2KleinPipeline.load_lora_weights reads in a fresh interpreter, changing what it draws."""
    from fixtures import assert_lora_resumed_like

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    options = dict(latents=flux2.latents, unet=str(flux2.model), lora_rank=4, max_steps=4, batch_size=4,
                   lr=1e-2, log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3,
                   checkpoint_every=2)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(TrainConfig(output=whole, **options))
    assert not (whole / "transformer").exists() and not (whole / "checkpoints" / "step-00000002" /
                                                          "model.safetensors").exists()
    train(TrainConfig(output=resumed, resume=whole / "checkpoints" / "step-00000002", **options))
    exported = assert_lora_resumed_like(whole, resumed, [3, 4])
    assert exported and all(key.startswith("transformer.") for key in exported)
    out = generate(flux2.model, tmp_path / "lora.png", whole / "lora")
    assert float(out.split("changed")[1].split()[0]) > 0


def test_buckets_from_scratch(flux2, image_shards, tmp_path):
    """Aspect-ratio buckets train from scratch (--transformer-config tiny: each bucket's latent shape, its
    statistics laid over the 2x2 pattern, its packed tokens and ids)."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(flux2.model), resolution=128,
                     buckets=True, batch_size=4, workers=0, quiet=True))
    train(TrainConfig(latents=latents, output=tmp_path / "run", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "run")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len([n for n in record["samples_per_bucket"].values() if n]) > 1, "one bucket only"


def test_validation_grid_with_guidance_and_bf16_weights(flux2):
    """train's validation sampler through Flux2KleinPipeline: the stored states as prompt_embeds and the empty
    caption's as negative_prompt_embeds with classifier-free guidance at --guidance-scale 4, none at 1; the
    pipeline's un-normalised output is normalised back (the shape of the denoiser's latents), and a validate
    with bf16 weights whose prepared forward returns fp32 decodes finite images."""
    from accelerate.utils import convert_outputs_to_fp32

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.evaluation import sample_latents, validate, validation_conditioning

    data = open_latents(flux2.latents)
    pipe = load_pipeline(flux2)
    _, texts = validation_conditioning(data, 2)
    config = TrainConfig(latents=flux2.latents, output=Path("unused"), unet=str(flux2.model), max_steps=1,
                         validation_steps=2, guidance_scale=4.0)
    guided = sample_latents(pipe.transformer, pipe.vae, None, texts, data.empty, data, config, torch.device("cpu"))
    plain = sample_latents(pipe.transformer, pipe.vae, None, texts, data.empty, data,
                           replace(config, guidance_scale=1.0), torch.device("cpu"))
    assert guided.shape == (2, 32, 8, 8) and (guided - plain).abs().max() > 1e-3
    start = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(config.seed))
    with torch.no_grad():
        theirs = pipe(prompt_embeds=texts["states"].float(), height=64, width=64, num_inference_steps=2,
                      guidance_scale=1.0, latents=pipe._patchify_latents(start), output_type="latent").images
    torch.testing.assert_close(data.denormalize(plain), theirs, rtol=1e-4, atol=1e-4)
    model = torch.nn.Module.to(pipe.transformer, torch.bfloat16)
    model.forward = convert_outputs_to_fp32(model.forward)
    empty = {key: value.to(torch.bfloat16) for key, value in data.empty.items()}
    images = validate(model, pipe.vae, None, texts, empty, data, config, torch.device("cpu"))
    assert images.shape == (2, 3, 64, 64) and torch.isfinite(images).all()


def test_online_text_trains_as_stored_text_does(flux2, reference, image_shards, tmp_path):
    """encode without --text writes the family's default, online text: the chat-templated captions' token ids
    (-1 where the mask is 0); train runs Qwen3 on them and gets the stored-text run's losses and validation loss."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    online = tmp_path / "online"
    run(EncodeConfig(shards=(str(image_shards),), output=online, model=str(flux2.model), resolution=64,
                     batch_size=4, workers=0, quiet=True))  # the family's default: online
    manifest = json.loads((online / "manifest.json").read_text())
    assert manifest["text"]["mode"] == "online" and manifest["text"]["ids"] == {"ids_tokenizer.npy": 512}
    train(TrainConfig(latents=online, val_latents=online, output=tmp_path / "run", unet=str(flux2.model),
                      **{**RUN, "max_steps": 2, "validate_every": 0, "ema": False}))
    got, want = metrics(tmp_path / "run"), metrics(reference)
    for step in (1, 2):  # stored text is the same encoder's output rounded to float16
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), step
    assert got[2]["val_loss"] == pytest.approx(want[2]["val_loss"], rel=1e-4)
