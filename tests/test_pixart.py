"""PixArt-Σ end to end on CPU, through the same encode and train loops as the other families: the tiny
pipeline -> encode the real photos (T5 states trimmed to each caption, plus the mask) -> the DDPM loss is
the epsilon half of the learned-variance output -> train -> kill -9 -> resume exact -> export
transformer/ -> diffusers' own PixArtSigmaPipeline, with no laionkit, generates from the export. One
tiny model and stored-text encode for the session (flow_latents("pixart"), tests/fixtures.py)."""

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
    CAPTIONS,
    FAMILY_RUN,
    FlowLatents,
    assert_kill9_resumes_like,
    family_run,
    first_rows,
    metrics,
    train_flags,
    write_image_shards,
)
from test_encode import read_shard

from laionkit.common import LaionkitError
from laionkit.families import detect_family, get_family

# The reference run: fine-tunes the tiny transformer with caption dropout, EMA, validation images (DDIM
# through PixArtSigmaPipeline) and the validation loss; checkpoints at step 2 of 4.
RUN = FAMILY_RUN


@pytest.fixture(scope="module")
def pixart(flow_latents) -> FlowLatents:
    return flow_latents("pixart")


@pytest.fixture(scope="module")
def reference(pixart, tmp_path_factory) -> Path:
    return family_run(pixart, tmp_path_factory.mktemp("pixart-run") / "reference")


def load_pipeline(pixart: FlowLatents):
    from diffusers import PixArtSigmaPipeline

    return PixArtSigmaPipeline.from_pretrained(pixart.model)


def test_stored_states_are_trimmed_losslessly(pixart):
    """Each sample stores T5's states up to its caption's last token and the mask (all ones); padded back
    (the loader's batch) they equal PixArtSigmaPipeline.encode_prompt's states at every unmasked position,
    the mask equals the pipeline's, and the transformer gives the same output as on the 300-token padding."""
    from laionkit.trainer.latent_stream import collate

    manifest = json.loads((pixart.latents / "manifest.json").read_text())
    assert manifest["family"] == "pixart" and manifest["complete"] and manifest["empty_mask"] == "empty_mask.npy"
    assert manifest["text"]["stored"] == {"states": [300, 32], "mask": [300]}
    assert manifest["text"]["trimmed"] == ["states", "mask"]
    assert manifest["vae"]["latent_channels"] == 4 and manifest["vae"]["scaling_factor"] == pytest.approx(0.13025)
    rows = first_rows(pixart.latents, 4)
    captions = [json.loads(s)["caption"] for s in _jsons(pixart.latents, 4)]
    pipe = load_pipeline(pixart)
    with torch.no_grad():
        states, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, clean_caption=False,
                                                device="cpu")
    lengths = mask.sum(dim=1).tolist()
    assert len(set(lengths)) > 1 and max(lengths) < 300  # captions of several lengths, all padded
    for row, want, length in zip(rows, states, lengths):
        assert tuple(row["text"].shape) == (length, 32) and row["mask"].dtype == torch.bool and row["mask"].all()
        np.testing.assert_allclose(row["text"].float(), want[:length], atol=3e-3, rtol=1e-2)
    batch = collate(rows)
    assert batch["text"].shape == (4, max(lengths), 32)
    assert torch.equal(batch["mask"], mask[:, :max(lengths)].bool())
    assert not batch["text"][~batch["mask"]].any()  # the padding is zeros, masked out
    assert np.load(pixart.latents / "empty_caption.npy").shape == (1, 32)  # "" is "</s>"
    assert np.load(pixart.latents / "empty_mask.npy").tolist() == [True]
    # encode records what a sample costs on disk, measured: below the padded states alone
    size = sum(path.stat().st_size for path in pixart.latents.glob("*.tar"))
    assert manifest["bytes"] == {"total": size, "per_sample": size / 8, "per_billion_samples": size / 8 * 1e9}
    assert size / 8 < 300 * 32 * 2

    noisy, t = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([10, 200, 500, 999])
    extra = {"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    with torch.no_grad():
        full = pipe.transformer(noisy, timestep=t, encoder_hidden_states=states, encoder_attention_mask=mask, **extra)
        trimmed = pipe.transformer(noisy, timestep=t, encoder_hidden_states=batch["text"].float(),
                                   encoder_attention_mask=batch["mask"], **extra)
        unmasked = pipe.transformer(noisy, timestep=t, encoder_hidden_states=states, **extra)
    torch.testing.assert_close(trimmed.sample, full.sample, rtol=1e-2, atol=2e-3)  # fp16 storage of the states
    assert (unmasked.sample - full.sample).abs().max() > 1e-2  # the mask matters: padding would carry content


def test_a_caption_past_the_pipelines_window_is_counted_as_cut(pixart, realdata, tmp_path):
    """PixArtSigmaPipeline reads 300 T5 tokens whatever the tokenizer's model_max_length (T5's own says
    512): encode counts a caption's tokens and flags it ``truncated`` in that window, so a caption of 300-512
    tokens is recorded as cut, as its states are."""
    import shutil

    from laionkit.encode import EncodeConfig, run

    model = tmp_path / "model"
    shutil.copytree(pixart.model, model)
    config = model / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 512}))
    long = " ".join(["a very detailed photo of a mountain lake at dusk"] * 16)
    write_image_shards(realdata / "images", tmp_path / "images", {**CAPTIONS, "416_264.jpg": long})
    run(EncodeConfig(shards=(str(tmp_path / "images"),), output=tmp_path / "latents", model=str(model),
                     resolution=64, batch_size=4, workers=0, quiet=True))
    records = [sample for shard in sorted((tmp_path / "latents").glob("*.tar")) for sample in read_shard(shard)]
    long_one = next(record for record in records if record["json"]["caption"] == long)
    assert 300 < len(load_pipeline(pixart).tokenizer(long).input_ids) <= 512
    assert long_one["json"]["num_tokens"] == 300 and long_one["json"]["truncated"] is True
    assert long_one["text"].shape[0] == 300  # the states stop at the window too
    assert len(records) == len(CAPTIONS) and sum(record["json"]["truncated"] for record in records) == 1
    manifest = json.loads((tmp_path / "latents" / "manifest.json").read_text())
    assert manifest["counts"]["truncated_captions"] == 1


def _jsons(latents: Path, count: int) -> list[bytes]:
    import webdataset as wds

    shard = sorted(latents.glob("*.tar"))[0]
    return [s["json"] for s, _ in zip(wds.WebDataset(str(shard), shardshuffle=False), range(count))]


def test_ddpm_loss_is_the_epsilon_half_of_the_learned_variance_output(pixart):
    """laionkit's loss on a batch equals diffusers' PixArt fine-tuning step with the same draws: PixArt's
    linear betas (from the pipeline folder, and the same from scratch), x_t, the transformer called as
    the pipeline calls it, and the MSE of the first half of its 8 output channels to the noise."""
    import torch.nn.functional as F

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate
    from laionkit.trainer.objective import batch_conditioning, diffusion_loss, load_noise_scheduler

    data = open_latents(pixart.latents)
    batch = collate(first_rows(pixart.latents, 3))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=pixart.latents, output=Path("unused"), unet=str(pixart.model), max_steps=1)
    scheduler = load_noise_scheduler(config, data.family)
    assert (scheduler.config.beta_schedule, scheduler.config.beta_start, scheduler.config.beta_end) == (
        "linear", 0.0001, 0.02)
    scratch = load_noise_scheduler(replace(config, unet=None, unet_config="tiny"), data.family)
    torch.testing.assert_close(scratch.alphas_cumprod, scheduler.alphas_cumprod)
    model = load_pipeline(pixart).transformer
    with torch.no_grad():
        ours = diffusion_loss(model, batch["moments"], cond, data.empty, scheduler, config, data,
                              torch.Generator().manual_seed(7))

        generator = torch.Generator().manual_seed(7)
        mean, logvar = batch["moments"].float().chunk(2, dim=1)
        x0 = (mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * torch.randn(mean.shape, generator=generator)) * 0.13025
        noise = torch.randn(x0.shape, generator=generator)
        timesteps = torch.randint(0, 1000, (3,), generator=generator)
        output = model(scheduler.add_noise(x0, noise, timesteps), timestep=timesteps,
                       encoder_hidden_states=cond["states"], encoder_attention_mask=cond["mask"],
                       added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
        assert output.shape[1] == 8  # learned variance: epsilon and variance halves
        theirs = F.mse_loss(output.chunk(2, dim=1)[0].float(), noise.float())
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_presets_and_the_real_size_config(pixart, tmp_path):
    from diffusers import PixArtTransformer2DModel

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet
    from laionkit.trainer.objective import resolve_objective

    spec = get_family("pixart")
    assert detect_family("pixart-sigma-xl") is spec and detect_family(str(pixart.model)) is spec
    assert spec.presets["pixart-sigma-xl"] == "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
    with torch.device("meta"):
        real = PixArtTransformer2DModel.from_config(dict(spec.configs["pixart-sigma-xl"]))
        fitted = build_unet(TrainConfig(latents=pixart.latents, output=tmp_path, unet_config="pixart-sigma-xl",
                                        max_steps=1), open_latents(pixart.latents))
    assert sum(p.numel() for p in real.parameters()) == pytest.approx(0.611e9, rel=1e-3)  # PixArt-Σ XL/2
    assert (real.config.num_layers, real.config.num_attention_heads, real.config.attention_head_dim) == (28, 16, 72)
    assert (real.config.caption_channels, real.config.cross_attention_dim, real.out_channels) == (4096, 1152, 8)
    assert not real.use_additional_conditions
    # fitted to the tiny latents: 32-wide T5, 8x8 latents, learned variance kept
    assert (fitted.config.caption_channels, fitted.config.sample_size, fitted.config.out_channels) == (32, 8, 8)
    assert fitted.config.num_layers == 28 and fitted.config.interpolation_scale == 8 / 64
    objective = resolve_objective(TrainConfig(latents=pixart.latents, output=tmp_path, unet_config="tiny",
                                              max_steps=1), spec)
    assert (objective.kind, objective.prediction) == ("ddpm", "epsilon")
    with pytest.raises(LaionkitError, match="--shift is a flow-matching option; pixart latents"):
        resolve_objective(TrainConfig(latents=pixart.latents, output=tmp_path, unet_config="tiny", max_steps=1,
                                      shift="3"), spec)


def test_train_kill9_resume_matches_an_uninterrupted_run(pixart, reference, tmp_path):
    """`laionkit train` on PixArt killed with SIGKILL right after its step-2 checkpoint landed, rerun with
    --resume latest: every step's loss, the validation losses and the exported transformer/ and
    transformer_ema/ equal the uninterrupted run's."""
    run = tmp_path / "run"
    args = ["train", str(pixart.latents), "--output", str(run), "--val-latents", str(pixart.latents),
            "--transformer", str(pixart.model), *train_flags(**RUN)]
    assert_kill9_resumes_like(reference, args, run, kill_at=2, steps=4)


GENERATE = """
import sys
import torch
from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel
model, exported, image = sys.argv[1:]
pipe = PixArtSigmaPipeline.from_pretrained(model, transformer=PixArtTransformer2DModel.from_pretrained(exported))
picture = pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2, clean_caption=False,
               use_resolution_binning=False, generator=torch.Generator().manual_seed(0)).images[0]
picture.save(image)
print(picture.size, type(pipe.transformer).__name__)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def test_export_generates_in_diffusers_without_laionkit(pixart, reference, tmp_path):
    """transformer/ of the run loads into PixArtSigmaPipeline (the tiny model folder's other components)
    and generates, in a fresh interpreter that never imports laionkit."""
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), str(pixart.model),
                           str(reference / "transformer"), str(tmp_path / "pixart.png")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    assert "(64, 64) PixArtTransformer2DModel" in free.stdout
    assert (tmp_path / "pixart.png").stat().st_size > 0


def test_online_text_trains_as_stored_text_does(pixart, reference, image_shards, tmp_path):
    """encode --text online keeps the token ids (-1 where the mask is 0: ids and mask in one int32 array);
    train runs T5 with the mask on them and gets the stored-text run's losses and validation loss."""
    import io

    import webdataset as wds

    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    online = tmp_path / "online"
    run(EncodeConfig(shards=(str(image_shards),), output=online, model=str(pixart.model), resolution=64,
                     batch_size=4, workers=0, quiet=True, text="online"))
    manifest = json.loads((online / "manifest.json").read_text())
    assert manifest["text"]["mode"] == "online" and manifest["text"]["ids"] == {"ids_tokenizer.npy": 300}
    sample = next(iter(wds.WebDataset(str(sorted(online.glob("*.tar"))[0]), shardshuffle=False)))
    assert "text.npy" not in sample and "mask.npy" not in sample
    ids = np.load(io.BytesIO(sample["ids_tokenizer.npy"]))
    found = load_pipeline(pixart).tokenizer(json.loads(sample["json"])["caption"].lower(), padding="max_length",
                                            max_length=300, truncation=True)
    assert ids.dtype == np.int32 and ids.tolist() == [i if m else -1 for i, m in zip(found.input_ids,
                                                                                   found.attention_mask)]
    train(TrainConfig(latents=online, val_latents=online, output=tmp_path / "run", unet=str(pixart.model),
                      **{**RUN, "max_steps": 2, "validate_every": 0, "ema": False}))
    got, want = metrics(tmp_path / "run"), metrics(reference)
    for step in (1, 2):  # stored text is the same encoder's output rounded to float16
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), step
    assert got[2]["val_loss"] == pytest.approx(want[2]["val_loss"], rel=1e-4)


def test_buckets_from_scratch(pixart, image_shards, tmp_path):
    """Aspect-ratio buckets train from scratch (--transformer-config tiny: each bucket's latent shape,
    captions padded per batch)."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(pixart.model), resolution=128,
                     buckets=True, batch_size=4, workers=0, quiet=True))
    train(TrainConfig(latents=latents, output=tmp_path / "run", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "run")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len([n for n in record["samples_per_bucket"].values() if n]) > 1, "one bucket only"


LOAD_LORA = """
import sys
import torch
from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel
from peft import PeftModel
model, lora, image = sys.argv[1:]
base = PixArtTransformer2DModel.from_pretrained(model, subfolder="transformer")
x, t = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500])
states = torch.randn(1, 5, base.config.caption_channels, generator=torch.Generator().manual_seed(1))
cond = {"resolution": None, "aspect_ratio": None}
before = base(x, encoder_hidden_states=states, timestep=t, added_cond_kwargs=cond).sample
adapted = PeftModel.from_pretrained(base, lora).merge_and_unload()
after = adapted(x, encoder_hidden_states=states, timestep=t, added_cond_kwargs=cond).sample
print("changed", float((after - before).abs().max()))
pipe = PixArtSigmaPipeline.from_pretrained(model, transformer=adapted)
picture = pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2, clean_caption=False,
               use_resolution_binning=False, generator=torch.Generator().manual_seed(0)).images[0]
picture.save(image)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def test_lora_trains_adapters_only_resumes_exactly_and_exports_a_peft_adapter(pixart, tmp_path):
    """--lora-rank on PixArt: diffusers' PixArt transformer has no add_adapter (and its pipeline no LoRA
    loader), so PEFT injects the adapters, as PixArt's own LoRA recipe does. Checkpoints hold the adapters
    only; a resume from step 2 gives the uninterrupted run's losses and export; RUN/lora is PEFT's adapter
    folder, which PeftModel.from_pretrained loads in a fresh interpreter (no laionkit), changing the
    transformer's output, and the merged transformer generates in PixArtSigmaPipeline."""
    from safetensors.torch import load_file

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    options = dict(latents=pixart.latents, unet=str(pixart.model), lora_rank=4, max_steps=4, batch_size=4,
                   lr=1e-2, log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3,
                   checkpoint_every=2)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(TrainConfig(output=whole, **options))
    checkpoint = whole / "checkpoints" / "step-00000002"
    adapters = load_file(checkpoint / "adapter.safetensors")
    assert adapters and all("lora_" in name for name in adapters) and not (checkpoint / "model.safetensors").exists()
    train(TrainConfig(output=resumed, resume=checkpoint, **options))
    want, got = metrics(whole), metrics(resumed)
    assert sorted(got) == [3, 4] and all(got[s]["loss"] == want[s]["loss"] for s in (3, 4))
    exported = {name: load_file(run / "lora" / "adapter_model.safetensors") for name, run in
                (("whole", whole), ("resumed", resumed))}
    assert exported["whole"].keys() == exported["resumed"].keys()
    assert all(torch.equal(exported["whole"][k], exported["resumed"][k]) for k in exported["whole"])
    assert all(k.startswith("base_model.model.transformer_blocks.") for k in exported["whole"])
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD_LORA), str(pixart.model), str(whole / "lora"),
                           str(tmp_path / "lora.png")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    assert float(free.stdout.split("changed")[1].split()[0]) > 0
    assert (tmp_path / "lora.png").stat().st_size > 0


def test_validation_grid_with_bf16_weights_and_fp32_outputs(pixart):
    """With --mixed-precision bf16 the weights are bf16 and accelerate's prepared forward returns fp32, so a
    scheduler step promotes the latents to fp32; PixArtSigmaPipeline has no callback_on_step_end, so
    validate casts them back in place through its per-step callback (else: 'Input type (float) and bias
    type (c10::BFloat16) should be the same')."""
    from accelerate.utils import convert_outputs_to_fp32

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.evaluation import validate, validation_conditioning
    from laionkit.trainer.objective import load_noise_scheduler

    data = open_latents(pixart.latents)
    pipe = load_pipeline(pixart)
    model = torch.nn.Module.to(pipe.transformer, torch.bfloat16)
    model.forward = convert_outputs_to_fp32(model.forward)
    config = TrainConfig(latents=pixart.latents, output=Path("unused"), unet=str(pixart.model), max_steps=1,
                         validation_steps=2)
    _, texts = validation_conditioning(data, 2)
    empty = {key: value.to(torch.bfloat16) for key, value in data.empty.items()}
    images = validate(model, pipe.vae, load_noise_scheduler(config, data.family), texts, empty, data, config,
                      torch.device("cpu"))
    assert images.shape == (2, 3, 64, 64) and torch.isfinite(images).all()
