"""SD3 and Flux end to end on CPU, through the same encode and train loops as SD / SDXL: tiny models ->
encode the real photos -> the flow-matching loss is diffusers' training step -> train -> stop + resume
exact -> export transformer/ -> diffusers' own StableDiffusion3Pipeline / FluxPipeline, with no laionkit,
generates from the export. One encode per family (module-scoped)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from laionkit.common import LaionkitError
from laionkit.families import get_family

FAMILIES = ("sd3", "flux")
PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@dataclass(frozen=True)
class Flow:
    name: str
    model: Path  # the tiny pipeline folder
    latents: Path  # its encode of the 8 real photos at 64 px


@pytest.fixture(scope="module", params=FAMILIES)
def flow(request, tmp_path_factory, image_shards) -> Flow:
    from laionkit.encode import EncodeConfig, run

    root = tmp_path_factory.mktemp(request.param)
    model = get_family(request.param).write_tiny(root / "model", 0)
    run(EncodeConfig(shards=(str(image_shards),), output=root / "latents", model=str(model), resolution=64,
                     batch_size=4, workers=0, quiet=True))
    return Flow(request.param, model, root / "latents")


def load_pipeline(flow: Flow):
    import diffusers

    return getattr(diffusers, PIPELINES[flow.name]).from_pretrained(flow.model)


def first_rows(latents: Path, count: int) -> list[dict]:
    from laionkit.latents import Unit, decode, read_unit
    from laionkit.train import open_latents

    data = open_latents(latents)
    return [decode(sample) for sample, _ in zip(read_unit(Unit(data.shards[0])), range(count))]


def metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_encode_writes_the_family_text_and_shifted_16_channel_latents(flow):
    manifest = json.loads((flow.latents / "manifest.json").read_text())
    pipe = load_pipeline(flow)
    assert manifest["family"] == flow.name and manifest["complete"]
    assert manifest["vae"]["latent_channels"] == 16
    assert manifest["vae"]["scaling_factor"] == pytest.approx(pipe.vae.config.scaling_factor)
    assert manifest["vae"]["shift_factor"] == pytest.approx(pipe.vae.config.shift_factor)
    tokens = {"sd3": 77 + 256, "flux": 512}[flow.name]
    width = pipe.transformer.config.joint_attention_dim
    assert manifest["text"]["sequence_length"] == tokens
    assert manifest["text"]["stored"] == {"states": [tokens, width],
                                          "pooled": [pipe.transformer.config.pooled_projection_dim]}
    rows = first_rows(flow.latents, 2)
    assert tuple(rows[0]["moments"].shape) == (32, 8, 8)
    captions = [json.loads(s)["caption"] for s in _jsons(flow.latents, 2)]
    spec = get_family(flow.name)
    want = spec.encode_text([getattr(pipe, t) for t, _ in spec.text_encoders],
                            [getattr(pipe, e) for _, e in spec.text_encoders], captions)
    for row, index in zip(rows, range(2)):
        np.testing.assert_allclose(row["text"].float(), want["states"][index], atol=3e-3, rtol=1e-2)
        np.testing.assert_allclose(row["pooled"].float(), want["pooled"][index], atol=3e-3, rtol=1e-2)


def test_flux_refuses_sizes_it_cannot_pack(tmp_path, image_shards):
    from laionkit.encode import EncodeConfig, run

    model = get_family("flux").write_tiny(tmp_path / "model", 0)
    for resolution, buckets, odd in ((72, False, "72x72"), (64, True, "56x72, 72x56")):
        with pytest.raises(LaionkitError, match=f"multiples of 16 px; {odd} are not"):
            run(EncodeConfig(shards=(str(image_shards),), output=tmp_path / f"out{resolution}", model=str(model),
                             resolution=resolution, buckets=buckets, batch_size=4, workers=0, quiet=True))


def _jsons(latents: Path, count: int) -> list[bytes]:
    import webdataset as wds

    shard = sorted(latents.glob("*.tar"))[0]
    return [s["json"] for s, _ in zip(wds.WebDataset(str(shard), shardshuffle=False), range(count))]


def test_flow_loss_is_diffusers_training_step(flow):
    """laionkit's loss on a batch equals the step diffusers' train_dreambooth_sd3.py / _flux.py take with
    the same random draws: logit-normal u, the family's shift (SD3: the scheduler's static 3; Flux: the
    scheduler's time_shift at the pipeline's calculate_shift mu), x_t, the transformer called as the
    pipeline calls it (SD3: timestep sigma x 1000; Flux: packed latents, img_ids, txt_ids, guidance,
    timestep sigma) and the velocity target noise - x0."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from laionkit.train import TrainConfig, batch_conditioning, flow_loss, open_latents, resolve_objective

    data = open_latents(flow.latents)
    batch = torch.utils.data.default_collate(first_rows(flow.latents, 3))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=flow.latents, output=Path("unused"), unet=str(flow.model), max_steps=1)
    objective = resolve_objective(config, data.family)
    pipe = load_pipeline(flow)
    model = pipe.transformer
    with torch.no_grad():
        ours = flow_loss(model, batch["moments"], cond, data.empty, config, data,
                         torch.Generator().manual_seed(7), objective)

        generator = torch.Generator().manual_seed(7)
        mean, logvar = batch["moments"].float().chunk(2, dim=1)
        x0 = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * torch.randn(mean.shape, generator=generator)
        x0 = (x0 - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        noise = torch.randn(x0.shape, generator=generator)
        u = compute_density_for_timestep_sampling("logit_normal", 3, logit_mean=0.0, logit_std=1.0,
                                                  generator=generator)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(flow.model, subfolder="scheduler")
        b, c, h, w = x0.shape
        if flow.name == "sd3":
            shift = scheduler.config.shift
            sigmas = shift * u / (1 + (shift - 1) * u)
        else:
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift

            mu = calculate_shift((h // 2) * (w // 2), scheduler.config.base_image_seq_len,
                                 scheduler.config.max_image_seq_len, scheduler.config.base_shift,
                                 scheduler.config.max_shift)
            sigmas = scheduler.time_shift(mu, 1.0, u)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1.0 - s) * x0 + s * noise
        if flow.name == "sd3":
            pred = model(hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=cond["states"],
                         pooled_projections=cond["pooled"], return_dict=False)[0]
        else:
            packed = type(pipe)._pack_latents(noisy, b, c, h, w)
            img_ids = type(pipe)._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
            txt_ids = torch.zeros(cond["states"].shape[1], 3)
            pred = model(hidden_states=packed, timestep=sigmas, guidance=torch.full([b], 3.5),
                         pooled_projections=cond["pooled"], encoder_hidden_states=cond["states"],
                         txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
            pred = type(pipe)._unpack_latents(pred, h * 8, w * 8, 8)
        theirs = torch.mean(((pred.float() - (noise - x0)) ** 2).reshape(b, -1), 1).mean()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_real_size_configs_build_and_flags_are_checked(flow, tmp_path):
    from laionkit.train import TrainConfig, build_unet, open_latents, resolve_objective

    data = open_latents(flow.latents)
    preset = {"sd3": "sd3-medium", "flux": "flux-dev"}[flow.name]
    with torch.device("meta"):
        model = build_unet(TrainConfig(latents=flow.latents, output=tmp_path, unet_config=preset, max_steps=1), data)
    text, pooled = data.text_shape[-1], data.empty["pooled"].shape[-1]
    assert (model.config.joint_attention_dim, model.config.pooled_projection_dim) == (text, pooled)
    if flow.name == "sd3":
        assert (model.config.num_layers, model.config.caption_projection_dim, model.config.in_channels) == (24, 1536, 16)
    else:
        assert (model.config.num_layers, model.config.num_single_layers, model.config.in_channels) == (19, 38, 64)
        assert model.config.guidance_embeds
    other = {"sd3": "flux-dev", "flux": "sd3-medium"}[flow.name]
    with pytest.raises(LaionkitError, match=f"--transformer-config {other} is a"):
        build_unet(TrainConfig(latents=flow.latents, output=tmp_path, unet_config=other, max_steps=1), data)

    def objective(**flags):
        return resolve_objective(TrainConfig(latents=flow.latents, output=tmp_path, unet_config="tiny",
                                             max_steps=1, **flags), data.family)

    default = objective()
    assert default.kind == "flow" and default.sigma_sampling == "logit_normal" and default.weighting == "none"
    assert (default.shift, default.dynamic_shift) == ((3.0, False) if flow.name == "sd3" else (None, True))
    assert default.timestep_scale == (1000.0 if flow.name == "sd3" else 1.0)
    changed = objective(sigma_sampling="mode", shift="dynamic", weighting="cosmap", train_guidance=1.0)
    assert (changed.sigma_sampling, changed.dynamic_shift, changed.weighting, changed.guidance) == (
        "mode", True, "cosmap", 1.0)
    assert objective(shift="2.5").sigma_shift(64, 64) == 2.5 and objective(shift="none").sigma_shift(64, 64) == 1.0
    with pytest.raises(LaionkitError, match="--snr-gamma is a DDPM option"):
        objective(snr_gamma=5.0)
    with pytest.raises(LaionkitError, match="--shift 'x'"):
        objective(shift="x")
    with pytest.raises(LaionkitError, match="--shift is a flow-matching option; sd latents"):
        resolve_objective(TrainConfig(latents=flow.latents, output=tmp_path, unet_config="tiny", max_steps=1,
                                      shift="3"), get_family("sd"))
    # The CLI names: --transformer-config is --unet-config; a DDPM flag on flow latents is one line.
    result = run_cli("train", flow.latents, "--output", tmp_path / "cli", "--transformer-config", "tiny",
                     "--max-steps", "1", "--prediction-type", "epsilon", "--log-with", "none", check=False)
    assert result.returncode == 2 and "--prediction-type is a DDPM option" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_stop_resume_export_and_generate_without_laionkit(flow, tmp_path):
    """6 steps (SD3 fine-tunes the tiny transformer with cosmap weighting; Flux trains --transformer-config
    tiny from scratch, dynamic shift) with EMA, validation images and the validation loss; the run cut back
    to its step-3 checkpoint (as a stop leaves it) resumes to the same losses and exported weights;
    transformer/ loads into the family's pipeline."""
    from laionkit.train import TrainConfig, run

    model = {"unet": str(flow.model)} if flow.name == "sd3" else {"unet_config": "tiny"}
    extra = {"weighting": "cosmap"} if flow.name == "sd3" else {}
    config = TrainConfig(latents=flow.latents, output=tmp_path / "reference", **model, **extra, max_steps=6,
                         batch_size=4, lr=1e-3, log_with="none", quiet=True, log_every=1, workers=0,
                         shuffle_buffer=3, caption_dropout=0.5, checkpoint_every=3, validate_every=6,
                         validation_count=2, validation_steps=2, val_latents=flow.latents, val_samples=3,
                         val_every=3, ema=True, ema_decay=0.9)
    run(config)
    reference = tmp_path / "reference"
    assert (reference / "samples" / "step-000006.png").stat().st_size > 0
    assert (reference / "transformer" / "config.json").is_file() and not (reference / "unet").exists()

    stopped = tmp_path / "stopped"  # the run as a stop after step 3 leaves it: checkpoint and metrics
    shutil.copytree(reference, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step-00000006")
    shutil.rmtree(stopped / "transformer")
    shutil.rmtree(stopped / "transformer_ema")
    (stopped / "samples" / "step-000006.png").unlink()
    run(replace(config, output=stopped, resume="latest"))
    expected, got = metrics(reference), metrics(stopped)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7), step
    for step in (3, 6):  # the fixed-sigma validation loss: the same weights give the same number
        assert got[step]["val_loss"] == pytest.approx(expected[step]["val_loss"], rel=1e-6), step
    assert expected[6]["val_loss"] != expected[3]["val_loss"]
    from safetensors.torch import load_file

    for folder in ("transformer", "transformer_ema"):  # the resumed run exports what the whole run did
        want, have = (load_file(run_dir / folder / "diffusion_pytorch_model.safetensors")
                      for run_dir in (reference, stopped))
        assert want.keys() == have.keys(), folder
        for key in want:
            torch.testing.assert_close(have[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{folder} {key}")

    pipeline = PIPELINES[flow.name]
    transformer = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel"}[flow.name]
    script = textwrap.dedent(f"""
        import sys
        import torch
        from diffusers import {pipeline}, {transformer}
        transformer = {transformer}.from_pretrained({str(stopped / "transformer")!r})
        pipe = {pipeline}.from_pretrained({str(flow.model)!r}, transformer=transformer)
        image = pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2,
                     generator=torch.Generator().manual_seed(0)).images[0]
        image.save({str(tmp_path / "generated.png")!r})
        assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
        print(image.size, type(transformer).__name__)
    """)
    free = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    assert f"(64, 64) {transformer}" in free.stdout


def test_lora_on_the_transformer_exports_what_the_pipeline_loads(flow, tmp_path):
    from laionkit.train import TrainConfig, run

    output = tmp_path / "lora-run"
    run(TrainConfig(latents=flow.latents, output=output, unet=str(flow.model), lora_rank=4, max_steps=2,
                    batch_size=4, lr=1e-2, log_with="none", quiet=True, log_every=1, workers=0))
    assert (output / "lora" / "pytorch_lora_weights.safetensors").is_file() and not (output / "transformer").exists()
    pipe = load_pipeline(flow)
    pipe.set_progress_bar_config(disable=True)

    def draw():
        return pipe("a dog running on the beach", height=64, width=64, num_inference_steps=1, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images

    before = draw()
    pipe.load_lora_weights(output / "lora")
    assert (draw() - before).abs().max() > 1e-4  # the adapters change the pipeline's output


def test_flux_trains_on_buckets_with_a_shift_per_resolution(tmp_path, image_shards, monkeypatch):
    """Flux on aspect-ratio buckets: img_ids and the dynamic shift follow each micro-batch's latent shape."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.families import flow as flow_math
    from laionkit.train import TrainConfig
    from laionkit.train import run as train

    model = get_family("flux").write_tiny(tmp_path / "model", 0)
    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(model), resolution=128, buckets=True,
                     batch_size=4, workers=0, quiet=True))
    seen = []
    original = flow_math.shift_sigmas
    monkeypatch.setattr(flow_math, "shift_sigmas", lambda sigmas, shift: seen.append(shift) or original(sigmas, shift))
    shapes = []
    monkeypatch.setattr(flow_math, "image_seq_len", lambda h, w, p=2: shapes.append((h, w)) or (h // p) * (w // p))
    train(TrainConfig(latents=latents, output=tmp_path / "run", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "run")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len(set(shapes)) > 1, "one bucket only: the test data should span several"
    assert seen == [pytest.approx(flow_math.resolution_shift((h // 2) * (w // 2))) for h, w in shapes]


def test_fsdp_wraps_each_transformer_block():
    """On CPU accelerate runs FSDP as one process, so the wrap policy is what is tested: train/fsdp.yaml
    names the UNet's blocks; a transformer family gets one FSDP unit per transformer block instead, and a
    UNet keeps the configured units."""
    import diffusers
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from laionkit.families import sd3
    from laionkit.train import fsdp_wrap_units

    unet_units = "CrossAttnDownBlock2D,DownBlock2D,UNetMidBlock2DCrossAttn,CrossAttnUpBlock2D,UpBlock2D"
    for name in FAMILIES:
        spec = get_family(name)
        model = getattr(diffusers, spec.denoiser_class).from_config(dict(spec.configs["tiny"]))
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                                transformer_cls_names_to_wrap=unet_units)
        said = []
        assert fsdp_wrap_units(plugin, model, spec, said.append) == list(spec.block_classes)
        assert "wrapping each" in said[0]
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        wrapped = [m for m in model.modules() if policy(m)]
        assert wrapped == spec.blocks(model) and len(wrapped) == {"sd3": 2, "flux": 3}[name]
    unet = diffusers.UNet2DConditionModel.from_config(dict(get_family("sd").configs["tiny"]))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap="CrossAttnDownBlock2D,UpBlock2D")
    assert fsdp_wrap_units(plugin, unet, get_family("sd")) == ["CrossAttnDownBlock2D", "UpBlock2D"]
    assert sd3.SPEC.block_classes == ("JointTransformerBlock",)


@pytest.mark.parametrize("name", FAMILIES)
def test_gradient_checkpointing_per_block_changes_no_gradient(name):
    """diffusers' own per-block checkpointing (what --gradient-checkpointing called before --checkpointing, which
    does the same through the family's blocks: tests/test_scale.py) recomputes each block: same loss, same grads."""
    import diffusers

    from laionkit.families import flow as flow_math

    spec = get_family(name)
    model = getattr(diffusers, spec.denoiser_class).from_config(dict(spec.configs["tiny"]))
    generator = torch.Generator().manual_seed(0)
    text = model.config.joint_attention_dim
    cond = {"states": torch.randn(2, 7, text, generator=generator),
            "pooled": torch.randn(2, model.config.pooled_projection_dim, generator=generator)}
    if name == "flux":
        cond["guidance"] = torch.full((2,), 3.5)
    x0, noise = torch.randn(2, 2, 16, 8, 8, generator=generator)
    sigmas = torch.tensor([0.2, 0.7])
    scale = spec.objective.timestep_scale

    def grads():
        model.zero_grad()
        noisy = flow_math.interpolate(x0, noise, sigmas)
        loss = flow_math.loss(spec.predict(model, noisy, sigmas * scale, cond), x0, noise, sigmas)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain = grads()
    model.enable_gradient_checkpointing()
    checked_loss, checked = grads()
    assert checked_loss == plain_loss
    for a, b in zip(plain, checked):
        torch.testing.assert_close(a, b)


def test_online_text_stores_token_ids_and_trains_as_stored_text_does(flow, tmp_path, image_shards, tiny_models):
    """encode --text online keeps token ids only (int32, a fraction of the bytes); train runs the frozen
    text encoders on them and gets the losses and validation loss of the stored-text run."""
    import io

    import webdataset as wds
    from rich.console import Console

    from laionkit.encode import EncodeConfig, run, summarize
    from laionkit.train import TrainConfig
    from laionkit.train import run as train

    online = tmp_path / "online"
    run(EncodeConfig(shards=(str(image_shards),), output=online, model=str(flow.model), resolution=64,
                     batch_size=4, workers=0, quiet=True, text="online"))
    manifest = json.loads((online / "manifest.json").read_text())
    stored = json.loads((flow.latents / "manifest.json").read_text())
    assert manifest["text"]["mode"] == "online" and "mode" not in stored["text"]
    assert manifest["text"]["stored"] == stored["text"]["stored"]
    spec = get_family(flow.name)
    pipe = load_pipeline(flow)
    tokenizers = [getattr(pipe, tok) for tok, _ in spec.text_encoders]
    sample = next(iter(wds.WebDataset(str(sorted(online.glob("*.tar"))[0]), shardshuffle=False)))
    assert "text.npy" not in sample and "pooled.npy" not in sample
    want = spec.tokenize(tokenizers, [json.loads(sample["json"])["caption"]])
    for index, ids in enumerate(want):
        got = np.load(io.BytesIO(sample[spec.ids_member(index)]))
        assert got.dtype == np.int32 and np.array_equal(got, ids[0].numpy()), index
    sizes = [sum(p.stat().st_size for p in folder.glob("*.tar")) for folder in (online, flow.latents)]
    assert sizes[0] < sizes[1] / 3
    console = Console(record=True, width=200)
    console.print(summarize(online))
    shown = console.export_text()
    assert "online: token ids stored" in shown and "per billion samples" in shown

    runs = {}
    for name, latents in (("online", online), ("stored", flow.latents)):
        runs[name] = tmp_path / f"run-{name}"
        train(TrainConfig(latents=latents, output=runs[name], unet=str(flow.model), max_steps=3, batch_size=4,
                          lr=1e-3, log_with="none", quiet=True, log_every=1, workers=0, caption_dropout=0.5,
                          val_latents=latents, val_samples=3))
    got, expected = metrics(runs["online"]), metrics(runs["stored"])
    for step in (1, 2, 3):  # stored text is the same encoders' output rounded to float16
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-4), step
    assert got[3]["val_loss"] == pytest.approx(expected[3]["val_loss"], rel=1e-4)

    with pytest.raises(LaionkitError, match="--text online: family sd stores"):
        run(EncodeConfig(shards=(str(image_shards),), output=tmp_path / "sd", model=str(tiny_models), resolution=64,
                         workers=0, quiet=True, text="online"))
