"""SD3 and Flux end to end on CPU, through the same encode and train loops as SD / SDXL: tiny models ->
encode the real photos -> the flow-matching loss is diffusers' training step -> train -> stop + resume
exact -> export transformer/ -> diffusers' own StableDiffusion3Pipeline / FluxPipeline, with no laionkit,
generates from the export. One encode per family for the session (flow_latents, tests/fixtures.py); Flux's
kill -9 + resume of flux_run is tests/test_scale.py's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from fixtures import FlowLatents, assert_resumed_like, assert_same_exports, metrics

from laionkit.common import LaionkitError
from laionkit.families import get_family

FAMILIES = ("sd3", "flux")
PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
TRANSFORMERS = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel"}


@pytest.fixture(scope="module", params=FAMILIES)
def flow(request, flow_latents) -> FlowLatents:
    return flow_latents(request.param)


def load_pipeline(flow: FlowLatents):
    import diffusers

    return getattr(diffusers, PIPELINES[flow.name]).from_pretrained(flow.model)


def first_rows(latents: Path, count: int) -> list[dict]:
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import Unit, decode, read_unit

    data = open_latents(latents)
    return [decode(sample) for sample, _ in zip(read_unit(Unit(data.shards[0])), range(count))]



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


def test_flux_refuses_sizes_it_cannot_pack(tmp_path, image_shards, flow_latents):
    from laionkit.encode import EncodeConfig, run

    model = flow_latents("flux").model
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

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.objective import batch_conditioning, flow_loss, resolve_objective

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
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet
    from laionkit.trainer.objective import resolve_objective

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
    # A config file of one's own: a real-width Flux / SD3 at a depth of choice, as bench_train_flow's fractions.
    spec = get_family(flow.name)
    depth = {"sd3": {"num_layers": 3}, "flux": {"num_layers": 1, "num_single_layers": 2}}[flow.name]
    (tmp_path / "arch.json").write_text(json.dumps({**spec.configs[preset], **depth}))
    with torch.device("meta"):
        model = build_unet(TrainConfig(latents=flow.latents, output=tmp_path, unet_config=str(tmp_path / "arch.json"),
                                       max_steps=1), data)
    assert {key: model.config[key] for key in depth} == depth
    assert model.config.attention_head_dim == spec.configs[preset]["attention_head_dim"]  # the real width
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(LaionkitError, match="cannot read the transformer config .*bad.json"):
        build_unet(TrainConfig(latents=flow.latents, output=tmp_path, unet_config=str(tmp_path / "bad.json"),
                               max_steps=1), data)
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


@pytest.fixture(scope="module")
def sd3_run(flow_latents, tmp_path_factory) -> tuple[Path, Path]:
    """4 steps fine-tuning the tiny SD3 transformer with cosmap weighting, EMA, validation images and the
    validation loss (reference/); the run cut back to its step-2 checkpoint (as a stop leaves it) and resumed
    (stopped/)."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    sd3 = flow_latents("sd3")
    root = tmp_path_factory.mktemp("sd3-run")
    config = TrainConfig(latents=sd3.latents, output=root / "reference", unet=str(sd3.model), weighting="cosmap",
                         max_steps=4, batch_size=4, lr=1e-3, log_with="none", quiet=True, log_every=1, workers=0,
                         shuffle_buffer=3, caption_dropout=0.5, checkpoint_every=2, validate_every=4,
                         validation_count=2, validation_steps=2, val_latents=sd3.latents, val_samples=3,
                         val_every=2, ema=True, ema_decay=0.9)
    run(config)
    reference, stopped = root / "reference", root / "stopped"
    shutil.copytree(reference, stopped)  # the run as a stop after step 2 leaves it: checkpoint and metrics
    shutil.rmtree(stopped / "checkpoints" / "step-00000004")
    shutil.rmtree(stopped / "transformer")
    shutil.rmtree(stopped / "transformer_ema")
    (stopped / "samples" / "step-000004.png").unlink()
    run(replace(config, output=stopped, resume="latest"))
    return reference, stopped


def test_sd3_train_stop_resume_exactly_and_export_the_transformer(sd3_run):
    """The resumed SD3 run reproduces the losses, validation losses and exported weights (transformer/,
    transformer_ema/) of the uninterrupted one. Flux (from scratch, dynamic shift) does the same through a
    real kill -9: tests/test_scale.py."""

    reference, stopped = sd3_run
    for output in (reference, stopped):
        assert (output / "samples" / "step-000004.png").stat().st_size > 0
        assert (output / "transformer" / "config.json").is_file() and not (output / "unet").exists()
    assert_resumed_like(reference, stopped, steps=4, val_steps=(2, 4))
    assert_same_exports(reference, stopped)  # the resumed run exports what the whole run did


GENERATE = """
import sys
import torch
import diffusers
for pipeline, transformer, exported, model, image in zip(*[iter(sys.argv[1:])] * 5):
    weights = getattr(diffusers, transformer).from_pretrained(exported)
    pipe = getattr(diffusers, pipeline).from_pretrained(model, transformer=weights)
    picture = pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0)).images[0]
    picture.save(image)
    print(picture.size, type(weights).__name__)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def test_exports_generate_in_diffusers_without_laionkit(sd3_run, flux_run, flow_latents, tmp_path):
    """transformer/ of the resumed SD3 run and of flux_run load into StableDiffusion3Pipeline / FluxPipeline
    and generate, in one fresh interpreter that never imports laionkit."""
    exports = {"sd3": sd3_run[1], "flux": flux_run.output}
    args = []
    for name in FAMILIES:
        args += [PIPELINES[name], TRANSFORMERS[name], str(exports[name] / "transformer"),
                 str(flow_latents(name).model), str(tmp_path / f"{name}.png")]
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    for name in FAMILIES:
        assert f"(64, 64) {TRANSFORMERS[name]}" in free.stdout, name
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_lora_on_the_transformer_exports_what_the_pipeline_loads(flow, tmp_path):
    """LoRA adapters on the transformer with EMA, validation images and the validation loss: lora/ and
    lora_ema/ exported (no transformer/), and lora/ changes what the family's pipeline draws. On Flux, the
    adapters inside checkpointed blocks (--checkpointing blocks; validation runs no-grad forwards through
    them) give the same losses, val_loss and adapters as without."""
    from safetensors.torch import load_file

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    base = dict(latents=flow.latents, unet=str(flow.model), lora_rank=2, max_steps=2, batch_size=4, lr=1e-2,
                log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3, ema=True, ema_decay=0.5,
                validate_every=2, validation_count=1, validation_steps=1, val_latents=flow.latents, val_samples=2,
                val_every=2)
    output = tmp_path / "plain"
    run(TrainConfig(output=output, **base))
    assert (output / "lora" / "pytorch_lora_weights.safetensors").is_file() and not (output / "transformer").exists()
    assert (output / "lora_ema" / "pytorch_lora_weights.safetensors").is_file()
    if flow.name == "flux":
        run(TrainConfig(output=tmp_path / "checked", checkpointing="blocks", **base))
        want, got = metrics(output), metrics(tmp_path / "checked")
        for step in (1, 2):
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-6), step
        assert got[2]["val_loss"] == pytest.approx(want[2]["val_loss"], rel=1e-6)
        assert (tmp_path / "checked" / "samples" / "step-000002.png").is_file()
        for folder in ("lora", "lora_ema"):
            a, b = (load_file(tmp_path / name / folder / "pytorch_lora_weights.safetensors")
                    for name in ("plain", "checked"))
            assert a.keys() == b.keys() and a
            for key in a:
                torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=f"{folder} {key}")

    pipe = load_pipeline(flow)
    pipe.set_progress_bar_config(disable=True)

    def draw():
        return pipe("a dog running on the beach", height=64, width=64, num_inference_steps=1, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images

    before = draw()
    pipe.load_lora_weights(output / "lora")
    assert (draw() - before).abs().max() > 1e-4  # the adapters change the pipeline's output


def test_flux_trains_on_buckets_with_a_shift_per_resolution(tmp_path, image_shards, flow_latents, monkeypatch):
    """Flux on aspect-ratio buckets: img_ids and the dynamic shift follow each micro-batch's latent shape; with
    Flux's default text (online), train runs the text encoders per bucket."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.families import flow as flow_math
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    model = flow_latents("flux").model
    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(model), resolution=128, buckets=True,
                     batch_size=4, workers=0, quiet=True))
    # no --text: Flux's default, online (T5's states would be 4x the latent; BENCHMARKS), so train runs T5
    assert json.loads((latents / "manifest.json").read_text())["text"]["mode"] == "online"
    seen, cudnn = [], []
    original = flow_math.shift_sigmas

    def shift_sigmas(sigmas, shift):
        seen.append(shift)
        cudnn.append(torch.backends.cuda.cudnn_sdp_enabled())  # the family's attention policy, in the step
        return original(sigmas, shift)

    monkeypatch.setattr(flow_math, "shift_sigmas", shift_sigmas)
    shapes = []
    monkeypatch.setattr(flow_math, "image_seq_len", lambda h, w, p=2: shapes.append((h, w)) or (h // p) * (w // p))
    train(TrainConfig(latents=latents, output=tmp_path / "run", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "run")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len(set(shapes)) > 1, "one bucket only: the test data should span several"
    assert seen == [pytest.approx(flow_math.resolution_shift((h // 2) * (w // 2))) for h, w in shapes]
    # cuDNN's SDPA backward fails on Flux's attention on an H200: off while Flux trains, restored after.
    assert cudnn and not any(cudnn) and torch.backends.cuda.cudnn_sdp_enabled()


def test_fsdp_wraps_each_transformer_block():
    """The wrap policy, in process: train/fsdp.yaml names the UNet's blocks; a transformer family gets one
    FSDP unit per transformer block instead, and a UNet keeps the configured units. Training under it
    with 2 real ranks: tests/test_fsdp.py."""
    import diffusers
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from laionkit.families import sd3
    from laionkit.trainer.model import fsdp_wrap_units

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


def test_online_text_stores_token_ids_and_trains_as_stored_text_does(flow, tmp_path, image_shards, tiny_models):
    """encode --text online keeps token ids only (int32, a fraction of the bytes); train runs the frozen
    text encoders on them and gets the losses and validation loss of the stored-text run."""
    import io

    import webdataset as wds
    from rich.console import Console

    from laionkit.encode import EncodeConfig, run, summarize
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

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


def test_a_rerun_without_text_resumes_in_the_folders_text_mode(flow_latents, image_shards, tmp_path):
    """Flux encodes online text by default; a folder begun with stored text (with --text stored, or before that
    default) resumes stored when rerun without --text: no refusal, no shards of two modes."""
    import tarfile

    from laionkit.encode import EncodeConfig, run

    flux = flow_latents("flux")
    latents = tmp_path / "latents"
    shutil.copytree(flux.latents, latents)
    before = (latents / "00001.tar").read_bytes()
    for name in ("00001.tar", "00001.stats.json"):  # as if killed before its last shard was done
        (latents / name).unlink()
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(flux.model), resolution=64,
                     batch_size=4, workers=0, quiet=True))
    with tarfile.open(latents / "00001.tar") as tar:
        members = tar.getnames()
    assert any(name.endswith(".text.npy") for name in members) and not any(".ids_" in name for name in members)
    assert (latents / "00001.tar").read_bytes() == before
    assert "mode" not in json.loads((latents / "manifest.json").read_text())["text"]
