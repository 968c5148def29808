"""Sana end to end on CPU, through the same encode and train loops as the other families: the tiny pipeline
(AutoencoderDC, Gemma-2, SanaTransformer2DModel) -> encode the real photos (the DC-AE's latent itself, no
posterior; Gemma states behind the instruction prefix, selected and trimmed to each caption, plus the mask)
-> the flow-matching loss as Sana trains -> train -> kill -9 and resume exact -> export -> diffusers' own SanaPipeline,
with no laionkit, generates from the export; a LoRA export loads with pipe.load_lora_weights. One tiny
model and stored-text encode for the session (flow_latents("sana"), tests/fixtures.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
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
from laionkit.families.sana import COMPLEX_HUMAN_INSTRUCTION

# The reference run: fine-tunes the tiny transformer with caption dropout, EMA, validation images (through
# SanaPipeline) and the validation loss; checkpoints at step 2 of 4.
RUN = FAMILY_RUN
FREE_ENV = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def sana(flow_latents) -> FlowLatents:
    return flow_latents("sana")


@pytest.fixture(scope="module")
def reference(sana, tmp_path_factory) -> Path:
    return family_run(sana, tmp_path_factory.mktemp("sana-run") / "reference")


def load_pipeline(sana: FlowLatents):
    from diffusers import SanaPipeline

    return SanaPipeline.from_pretrained(sana.model)


def _captions(latents: Path, count: int) -> list[str]:
    import webdataset as wds

    shard = sorted(latents.glob("*.tar"))[0]
    return [json.loads(s["json"])["caption"] for s, _ in zip(wds.WebDataset(str(shard), shardshuffle=False),
                                                               range(count))]


def test_stored_states_and_latents_are_the_pipelines(sana):
    """Each sample stores the DC-AE's latent itself (32 channels: no posterior to draw from) and Gemma's
    states as SanaPipeline.encode_prompt builds them (instruction prefix, select_index), trimmed to the
    caption's last unmasked position: padded back they equal the pipeline's at every unmasked position, the
    mask equals the pipeline's, the caption "" included. The empty-caption files (caption dropout, validation's
    negative) are the pipeline's negative prompt "" (no instruction)."""
    from laionkit.trainer.latent_stream import collate

    manifest = json.loads((sana.latents / "manifest.json").read_text())
    assert manifest["family"] == "sana" and manifest["complete"] and manifest["empty_mask"] == "empty_mask.npy"
    assert manifest["vae"]["deterministic"] is True and manifest["vae"]["latent_channels"] == 32
    assert manifest["vae"]["downsample_factor"] == 8 and manifest["vae"]["scaling_factor"] == pytest.approx(0.41407)
    assert manifest["text"]["stored"] == {"states": [300, 32], "mask": [300]}
    assert manifest["text"]["trimmed"] == ["states", "mask"]
    rows = first_rows(sana.latents, 4)
    captions = _captions(sana.latents, 4)
    assert "" in captions  # 208_495.jpg: the unconditional caption
    pipe = load_pipeline(sana)
    with torch.no_grad():
        states, mask, negative, negative_mask = pipe.encode_prompt(
            captions, do_classifier_free_guidance=True, device="cpu", clean_caption=False,
            complex_human_instruction=list(COMPLEX_HUMAN_INSTRUCTION))
        pixels = torch.stack([torch.from_numpy(np.zeros((3, 64, 64), np.float32))])
        assert pipe.vae.encode(pixels).latent.shape == (1, 32, 8, 8)
    want_states, want_mask = states, mask
    lengths = want_mask.sum(dim=1).tolist()
    assert len(set(lengths)) > 1 and max(lengths) < 300 and lengths[captions.index("")] == 2  # <bos>, the prefix's end
    for row, want, keep, length in zip(rows, want_states, want_mask.bool(), lengths):
        assert row["moments"].shape == (32, 8, 8)  # the latent, not mean + log-variance
        assert tuple(row["text"].shape) == (length, 32) and row["mask"].dtype == torch.bool
        assert torch.equal(row["mask"], keep[:length])
        np.testing.assert_allclose(row["text"].float()[row["mask"]], want[keep], atol=3e-3, rtol=1e-2)
    batch = collate(rows)
    assert torch.equal(batch["mask"], want_mask[:, :max(lengths)].bool())
    assert not batch["text"][~batch["mask"]].any()  # the padding is zeros, masked out
    assert negative_mask[0].sum() == 1  # the negative prompt "": <bos> alone, no instruction
    np.testing.assert_allclose(np.load(sana.latents / "empty_caption.npy").astype(np.float32),
                               negative[0][:1].numpy(), atol=3e-3, rtol=1e-2)
    assert np.load(sana.latents / "empty_mask.npy").tolist() == [True]

    noisy, t = torch.randn(4, 32, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([10, 200, 500, 999])
    with torch.no_grad():
        full = pipe.transformer(noisy, timestep=t, encoder_hidden_states=want_states, encoder_attention_mask=want_mask)
        trimmed = pipe.transformer(noisy, timestep=t, encoder_hidden_states=batch["text"].float(),
                                   encoder_attention_mask=batch["mask"])
    torch.testing.assert_close(trimmed.sample, full.sample, rtol=1e-2, atol=2e-3)  # fp16 storage of the states


def test_flow_loss_is_sanas_objective(sana):
    """laionkit's loss on a batch equals the formula on the same draws: the stored latent x scaling factor
    (no posterior draw), noise, sigma = shift_3(sigmoid(N(0, 1))), x_t = (1 - sigma) x0 + sigma noise, the
    transformer called as SanaPipeline calls it (timestep sigma x 1000) and the plain MSE to noise - x0."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate
    from laionkit.trainer.objective import batch_conditioning, flow_loss, resolve_objective

    data = open_latents(sana.latents)
    assert data.deterministic and data.moments_per_channel == 1
    batch = collate(first_rows(sana.latents, 3))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=sana.latents, output=Path("unused"), unet=str(sana.model), max_steps=1)
    objective = resolve_objective(config, data.family)
    assert (objective.kind, objective.sigma_sampling, objective.shift, objective.weighting) == (
        "flow", "logit_normal", 3.0, "none")
    model = load_pipeline(sana).transformer
    with torch.no_grad():
        ours = flow_loss(model, batch["moments"], cond, data.empty, config, data, torch.Generator().manual_seed(7),
                         objective)

        generator = torch.Generator().manual_seed(7)
        x0 = batch["moments"].float() * 0.41407
        noise = torch.randn(x0.shape, generator=generator)
        u = torch.sigmoid(torch.normal(0.0, 1.0, size=(3,), generator=generator))
        sigma = 3.0 * u / (1 + 2.0 * u)
        s = sigma.view(-1, 1, 1, 1)
        output = model((1 - s) * x0 + s * noise, timestep=sigma * 1000, encoder_hidden_states=cond["states"],
                       encoder_attention_mask=cond["mask"]).sample
        theirs = ((output.float() - (noise - x0)) ** 2).mean()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_presets_and_the_real_size_configs(sana, tmp_path):
    from diffusers import SanaTransformer2DModel

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet

    spec = get_family("sana")
    assert detect_family("sana-1600m") is spec and detect_family(str(sana.model)) is spec
    assert spec.presets["sana-1600m"] == "Efficient-Large-Model/Sana_1600M_1024px_diffusers"
    assert spec.presets["sana-600m"] == "Efficient-Large-Model/Sana_600M_1024px_diffusers"
    with torch.device("meta"):
        big = SanaTransformer2DModel.from_config(dict(spec.configs["sana-1600m"]))
        small = SanaTransformer2DModel.from_config(dict(spec.configs["sana-600m"]))
        fitted = build_unet(TrainConfig(latents=sana.latents, output=tmp_path, unet_config="sana-600m",
                                        max_steps=1), open_latents(sana.latents))
    assert sum(p.numel() for p in big.parameters()) == pytest.approx(1.6e9, rel=0.02)
    assert sum(p.numel() for p in small.parameters()) == pytest.approx(0.59e9, rel=0.03)
    assert (fitted.config.caption_channels, fitted.config.in_channels, fitted.config.num_layers) == (32, 32, 28)


def test_train_kill9_resume_matches_an_uninterrupted_run(sana, reference, tmp_path):
    """`laionkit train` on Sana killed with SIGKILL right after its step-2 checkpoint landed, rerun with
    --resume latest: every step's loss, the validation losses, the validation grid and the exported
    transformer/ and transformer_ema/ equal the uninterrupted run's (the DC-AE's latents are used without a
    posterior draw, so nothing random of the VAE's enters the resumed state)."""
    run = tmp_path / "run"
    args = ["train", str(sana.latents), "--output", str(run), "--val-latents", str(sana.latents),
            "--transformer", str(sana.model), *train_flags(**RUN)]
    assert_kill9_resumes_like(reference, args, run, kill_at=2, steps=4)


GENERATE = """
import sys
import torch
from diffusers import DiffusionPipeline
folder, image = sys.argv[1:]
pipe = DiffusionPipeline.from_pretrained(folder)
lora = sys.argv[3] if len(sys.argv) > 3 else None
picture = pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2, use_resolution_binning=False,
               generator=torch.Generator().manual_seed(0), output_type="np").images[0]
assert picture.shape == (64, 64, 3) and bool(torch.isfinite(torch.from_numpy(picture)).all())
print(type(pipe).__name__, type(pipe.transformer).__name__, type(pipe.vae).__name__, type(pipe.scheduler).__name__)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def test_export_generates_in_diffusers_without_laionkit(sana, reference, tmp_path):
    """RUN/pipeline (the trained transformer, the encode's VAE, Gemma and tokenizer, Sana's scheduler) loads
    with DiffusionPipeline.from_pretrained as a SanaPipeline and generates a finite image, in a fresh
    interpreter that never imports laionkit."""
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), str(reference / "pipeline"),
                           str(tmp_path / "sana.png")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**FREE_ENV, "HOME": str(tmp_path)})
    assert free.returncode == 0, free.stderr[-3000:]
    assert "SanaPipeline SanaTransformer2DModel AutoencoderDC DPMSolverMultistepScheduler" in free.stdout


LOAD_LORA = """
import sys
import torch
from diffusers import SanaPipeline
model, lora = sys.argv[1:]
pipe = SanaPipeline.from_pretrained(model)
x, t = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500])
states = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
before = pipe.transformer(x, encoder_hidden_states=states, timestep=t).sample
pipe.load_lora_weights(lora)
after = pipe.transformer(x, encoder_hidden_states=states, timestep=t).sample
print("changed", float((after - before).abs().max()))
picture = pipe("a dog", height=64, width=64, num_inference_steps=2, use_resolution_binning=False,
               generator=torch.Generator().manual_seed(0), output_type="np").images[0]
assert bool(torch.isfinite(torch.from_numpy(picture)).all())
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def test_lora_resumes_exactly_and_loads_into_sana_pipeline(sana, tmp_path):
    """--lora-rank on Sana: checkpoints hold the adapters only; a resume from step 2 gives the uninterrupted
    run's losses and export; RUN/lora loads with SanaPipeline.load_lora_weights in a fresh interpreter (no
    laionkit), changing the transformer's output, and the pipeline generates."""
    from fixtures import assert_lora_resumed_like

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    options = dict(latents=sana.latents, unet=str(sana.model), lora_rank=4, max_steps=4, batch_size=4, lr=1e-2,
                   log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3, checkpoint_every=2)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(TrainConfig(output=whole, **options))
    train(TrainConfig(output=resumed, resume=whole / "checkpoints" / "step-00000002", **options))
    assert_lora_resumed_like(whole, resumed, [3, 4])
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD_LORA), str(sana.model), str(whole / "lora")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**FREE_ENV, "HOME": str(tmp_path)})
    assert free.returncode == 0, free.stderr[-3000:]
    assert float(free.stdout.split("changed")[1].split()[0]) > 0


def test_online_text_and_buckets_from_scratch(sana, reference, image_shards, tmp_path):
    """encode --text online keeps Gemma's ids at the instruction's width (-1 where masked) and train runs Gemma
    on them to the stored-text run's losses; aspect buckets train from scratch (--transformer-config tiny)."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    online = tmp_path / "online"
    run(EncodeConfig(shards=(str(image_shards),), output=online, model=str(sana.model), resolution=64,
                     batch_size=4, workers=0, quiet=True, text="online"))
    manifest = json.loads((online / "manifest.json").read_text())
    width = manifest["text"]["ids"]["ids_tokenizer.npy"]
    assert manifest["text"]["mode"] == "online" and width > 300
    train(TrainConfig(latents=online, val_latents=online, output=tmp_path / "run", unet=str(sana.model),
                      **{**RUN, "max_steps": 2, "validate_every": 0, "ema": False}))
    got, want = metrics(tmp_path / "run"), metrics(reference)
    for step in (1, 2):  # stored text is the same encoder's output rounded to float16
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-3), step

    bucketed = tmp_path / "bucketed"
    run(EncodeConfig(shards=(str(image_shards),), output=bucketed, model=str(sana.model), resolution=128,
                     buckets=True, batch_size=4, workers=0, quiet=True))
    train(TrainConfig(latents=bucketed, output=tmp_path / "scratch", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "scratch")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len([n for n in record["samples_per_bucket"].values() if n]) > 1, "one bucket only"


def test_a_32x_dc_ae_refuses_image_sides_off_its_grid(sana, image_shards, tmp_path):
    """Sana's real DC-AE downsamples 32x (6 stages; the tiny one 8x): encode refuses image sides that are not
    multiples of 32 px in one line, before encoding, as the patch families refuse theirs."""
    import shutil

    from conftest import run_cli
    from diffusers import AutoencoderDC

    model = Path(shutil.copytree(sana.model, tmp_path / "model"))
    shutil.rmtree(model / "vae")
    AutoencoderDC(latent_channels=32, attention_head_dim=8, encoder_block_out_channels=(8,) * 6,
                  decoder_block_out_channels=(8,) * 6, encoder_layers_per_block=(1,) * 6,
                  decoder_layers_per_block=(1,) * 6, encoder_block_types="ResBlock", decoder_block_types="ResBlock",
                  encoder_qkv_multiscales=((),) * 6, decoder_qkv_multiscales=((),) * 6, downsample_block_type="Conv",
                  upsample_block_type="interpolate", scaling_factor=0.41407).save_pretrained(model / "vae")
    result = run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", tmp_path / "out",
                     "--resolution", "80", "--batch-size", "4", "--workers", "0", "--quiet", check=False)
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "sana encodes with a 32x downsampling VAE" in line and "multiples of 32 px" in line, line
    assert not list((tmp_path / "out").glob("*.tar"))


def test_block_checkpointing_keeps_loss_and_gradients(sana):
    """--checkpointing blocks on SanaTransformerBlock (the FSDP wrap and checkpointing unit): the same loss and
    gradients as the plain forward, each block's forward recomputed in backward."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate
    from laionkit.trainer.objective import batch_conditioning, flow_loss, resolve_objective

    data = open_latents(sana.latents)
    batch = collate(first_rows(sana.latents, 2))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=sana.latents, output=Path("unused"), unet=str(sana.model), max_steps=1)
    objective = resolve_objective(config, data.family)
    model = load_pipeline(sana).transformer.train()

    def step():
        model.zero_grad(set_to_none=True)
        loss = flow_loss(model, batch["moments"], cond, data.empty, config, data, torch.Generator().manual_seed(3),
                         objective)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain_loss, plain = step()
    chosen = data.family.checkpoint_blocks(model, 1)
    assert len(chosen) == 2 and all(type(b).__name__ == "SanaTransformerBlock" for b in chosen)
    loss, grads = step()
    assert loss == plain_loss and len(grads) == len(plain)
    for a, b in zip(plain, grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
