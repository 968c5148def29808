"""Qwen-Image end to end on CPU, through the same encode and train loops as the other families: the tiny
pipeline -> encode the real photos (Qwen2.5-VL states of the pipeline's template, template tokens dropped,
trimmed to each caption, plus the mask; VAE moments without the frame axis, normalised per channel in train)
-> the flow-matching target on Qwen-Image's shift -> train -> resume exact -> export -> diffusers' own
QwenImagePipeline, with no laionkit, generates from the export and loads the LoRA. One tiny model and
stored-text encode for the session (flow_latents("qwen-image"), tests/fixtures.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import FAMILY_RUN, FlowLatents, family_run, first_rows, metrics

from laionkit.families import detect_family, get_family

# The reference run: fine-tunes the tiny transformer with caption dropout, EMA, validation images (through
# QwenImagePipeline) and the validation loss; checkpoints at step 2 of 4.
RUN = FAMILY_RUN


@pytest.fixture(scope="module")
def qwen(flow_latents) -> FlowLatents:
    return flow_latents("qwen-image")


@pytest.fixture(scope="module")
def reference(qwen, tmp_path_factory) -> Path:
    return family_run(qwen, tmp_path_factory.mktemp("qwen-run") / "reference")


def load_pipeline(qwen: FlowLatents):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(qwen.model)


def _captions(latents: Path, count: int) -> list[str]:
    import webdataset as wds

    shard = sorted(latents.glob("*.tar"))[0]
    return [json.loads(s["json"])["caption"] for s, _ in zip(wds.WebDataset(str(shard), shardshuffle=False),
                                                             range(count))]


def test_stored_states_are_encode_prompts_trimmed(qwen):
    """Each sample stores Qwen2.5-VL's states of the pipeline's template after its 34 template tokens, up to
    the caption's end, and the mask (all ones); padded back (the loader's batch) they equal
    QwenImagePipeline.encode_prompt's states at every unmasked position, and the masks are equal. The tiny
    tokenizer splits the template's system part into exactly the 34 tokens the pipeline drops."""
    from laionkit.families.qwenimage import DROP_IDX, PROMPT_TEMPLATE
    from laionkit.trainer.latent_stream import collate

    manifest = json.loads((qwen.latents / "manifest.json").read_text())
    assert manifest["family"] == "qwen-image" and manifest["complete"] and manifest["empty_mask"] == "empty_mask.npy"
    assert manifest["text"]["trimmed"] == ["states", "mask"] and manifest["text"]["stored"]["states"][1] == 32
    pipe = load_pipeline(qwen)
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == DROP_IDX == pipe.prompt_template_encode_start_idx
    assert PROMPT_TEMPLATE == pipe.prompt_template_encode
    rows = first_rows(qwen.latents, 4)
    captions = _captions(qwen.latents, 4)
    with torch.no_grad():
        states, mask = pipe.encode_prompt(captions, device="cpu")
    lengths = mask.sum(dim=1).tolist()
    assert len(set(lengths)) > 1  # captions of several lengths, padded to the longest
    direct = get_family("qwen-image").encode_text([pipe.tokenizer], [pipe.text_encoder], captions)
    torch.testing.assert_close(direct["states"], states, rtol=1e-6, atol=1e-6)  # before float16 storage
    assert torch.equal(direct["mask"], mask.bool())
    for row, want, length in zip(rows, states, lengths):
        assert tuple(row["text"].shape) == (length, 32) and row["mask"].dtype == torch.bool and row["mask"].all()
        np.testing.assert_allclose(row["text"].float(), want[:length], atol=3e-3, rtol=1e-2)
    batch = collate(rows)
    assert torch.equal(batch["mask"], mask.bool())
    assert not batch["text"][~batch["mask"]].any()  # the padding is zeros, masked out
    with torch.no_grad():
        empty, _ = pipe.encode_prompt([""], device="cpu")
    np.testing.assert_allclose(np.load(qwen.latents / "empty_caption.npy").astype(np.float32), empty[0],
                               atol=3e-3, rtol=1e-2)


def test_a_caption_beyond_the_window_keeps_what_the_pipelines_call_keeps(qwen):
    """QwenImagePipeline.__call__ cuts encode_prompt's states at its max_sequence_length, 512 (encode_prompt
    alone keeps 1024): a caption of 700 tokens trains on the 512 its generation sees. laionkit tokenizes only
    as far as those reach (Qwen2.5-VL is causal: the states of the first tokens do not depend on later ones);
    --max-sequence-length 600 keeps 600, as the pipeline called with max_sequence_length=600."""
    pipe = load_pipeline(qwen)
    captions = [" ".join(["photo"] * 700), "a cat"]
    assert len(pipe.tokenizer(captions[0]).input_ids) == 700
    for spec, window in ((get_family("qwen-image"), 512), (get_family("qwen-image").with_max_sequence_length(600), 600)):
        ours = spec.encode_text([pipe.tokenizer], [pipe.text_encoder], captions)
        with torch.no_grad():
            states, mask = pipe.encode_prompt(captions, device="cpu", max_sequence_length=window)
        assert ours["states"].shape[1] == window and ours["mask"][0].all()
        torch.testing.assert_close(ours["states"], states, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours["mask"], mask.bool())
    with torch.no_grad():
        assert pipe.encode_prompt(captions, device="cpu")[0].shape[1] > 600  # encode_prompt's own default: 1024


def test_latents_are_normalised_as_the_pipeline_normalises(qwen):
    """encode stores the VAE's moments without the frame axis; train's latents (LatentSet.normalize) equal
    QwenImageImg2ImgPipeline's own normalisation of a VAE sample ((z - mean) / std per channel), and the
    pipeline's unnormalisation before its decode gives z back (the decode round trip validation uses)."""
    from diffusers import QwenImageImg2ImgPipeline

    from laionkit.trainer.data import open_latents

    data = open_latents(qwen.latents)
    manifest = json.loads((qwen.latents / "manifest.json").read_text())
    vae = load_pipeline(qwen).vae
    assert manifest["vae"]["latents_mean"] == list(vae.config.latents_mean) and data.latents_std == tuple(
        vae.config.latents_std)
    assert (manifest["vae"]["scaling_factor"], manifest["vae"]["shift_factor"]) == (1.0, None)
    assert first_rows(qwen.latents, 1)[0]["moments"].shape == (32, 8, 8)  # [2C, h, w]: one frame, dropped
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    i2i = QwenImageImg2ImgPipeline(vae=vae, scheduler=None, text_encoder=None, tokenizer=None, transformer=None)
    with torch.no_grad():
        theirs = i2i._encode_vae_image(pixels[:, :, None], generator=torch.Generator().manual_seed(0))[:, :, 0]
        posterior = vae.encode(pixels[:, :, None]).latent_dist  # encode stores its parameters, frame axis dropped
        z = posterior.sample(generator=torch.Generator().manual_seed(0))[:, :, 0]
    assert posterior.parameters.squeeze(2).shape == (2, 32, 8, 8)
    ours = data.normalize(z)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert abs(float(ours.mean()) - float(z.mean())) > 1e-3  # the statistics matter
    # QwenImagePipeline.__call__'s unnormalisation before its decode
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(ours / std + torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1), z)
    torch.testing.assert_close(data.denormalize(ours), z)


def test_flow_target_is_the_formula_on_fixed_seeds(qwen):
    """laionkit's loss on a batch equals the flow-matching loss written out with the same draws: the latent
    from the moments, normalised per channel, logit-normal sigma shifted by exp(mu) with mu from the
    pipeline's calculate_shift on the packed sequence length and Qwen-Image's scheduler anchors, x_t, the
    transformer called as the pipeline calls it (packed, img_shapes, timestep = sigma, the mask), and the MSE
    of the unpacked output to noise - x0."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate
    from laionkit.trainer.objective import batch_conditioning, flow_loss, resolve_objective

    data = open_latents(qwen.latents)
    batch = collate(first_rows(qwen.latents, 3))
    cond = batch_conditioning(batch, data, "cpu", torch.float32)
    config = TrainConfig(latents=qwen.latents, output=Path("unused"), unet=str(qwen.model), max_steps=1)
    objective = resolve_objective(config, data.family)
    pipe = load_pipeline(qwen)
    model, scheduler = pipe.transformer, pipe.scheduler.config
    with torch.no_grad():
        ours = flow_loss(model, batch["moments"], cond, data.empty, config, data, torch.Generator().manual_seed(7),
                         objective)
        generator = torch.Generator().manual_seed(7)
        mean, logvar = batch["moments"].float().chunk(2, dim=1)
        z = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * torch.randn(mean.shape, generator=generator)
        x0 = (z - torch.tensor(vae_stats(pipe)[0]).view(1, -1, 1, 1)) / torch.tensor(
            vae_stats(pipe)[1]).view(1, -1, 1, 1)
        noise = torch.randn(x0.shape, generator=generator)
        sigmas = torch.sigmoid(torch.normal(0.0, 1.0, size=(3,), generator=generator))
        b, c, h, w = x0.shape
        mu = calculate_shift((h // 2) * (w // 2), scheduler["base_image_seq_len"], scheduler["max_image_seq_len"],
                             scheduler["base_shift"], scheduler["max_shift"])
        sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))  # the exponential time shift
        noisy = (1 - sigmas.view(-1, 1, 1, 1)) * x0 + sigmas.view(-1, 1, 1, 1) * noise
        packed = pipe._pack_latents(noisy, b, c, h, w)
        out = model(hidden_states=packed, timestep=sigmas, encoder_hidden_states=cond["states"],
                    encoder_hidden_states_mask=cond["mask"], img_shapes=[[(1, h // 2, w // 2)]] * b).sample
        prediction = pipe._unpack_latents(out, h * 8, w * 8, 8)[:, :, 0]
        theirs = ((prediction - (noise - x0)) ** 2).mean()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def vae_stats(pipe) -> tuple[list, list]:
    return list(pipe.vae.config.latents_mean), list(pipe.vae.config.latents_std)


def test_presets_and_the_real_size_config(qwen, tmp_path):
    from diffusers import QwenImageTransformer2DModel

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.model import build_unet

    spec = get_family("qwen-image")
    assert detect_family("qwen-image") is spec and detect_family(str(qwen.model)) is spec
    assert spec.presets["qwen-image"] == "Qwen/Qwen-Image"
    with torch.device("meta"):
        real = QwenImageTransformer2DModel.from_config(dict(spec.configs["qwen-image"]))
        fitted = build_unet(TrainConfig(latents=qwen.latents, output=tmp_path, unet_config="qwen-image",
                                        max_steps=1), open_latents(qwen.latents))
    assert sum(p.numel() for p in real.parameters()) == pytest.approx(20.43e9, rel=1e-2)  # Qwen-Image: 20B
    assert (real.config.num_layers, real.config.num_attention_heads, real.config.joint_attention_dim) == (60, 24, 3584)
    assert (fitted.config.in_channels, fitted.config.out_channels, fitted.config.joint_attention_dim) == (64, 16, 32)


def test_train_resume_matches_an_uninterrupted_run(qwen, reference, tmp_path):
    """A run resumed from the reference's step-2 checkpoint logs the reference's losses and validation loss
    and exports the same transformer/ (exact resume)."""
    from safetensors.torch import load_file

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    resumed = tmp_path / "resumed"
    run(TrainConfig(latents=qwen.latents, val_latents=qwen.latents, output=resumed, unet=str(qwen.model),
                    resume=reference / "checkpoints" / "step-00000002", **RUN))
    want, got = metrics(reference), metrics(resumed)
    assert sorted(s for s in got if "loss" in got[s]) == [3, 4]
    for step in (3, 4):
        assert got[step]["loss"] == want[step]["loss"], step
    assert got[4]["val_loss"] == want[4]["val_loss"]
    for folder in ("transformer", "transformer_ema"):
        a = load_file(reference / folder / "diffusion_pytorch_model.safetensors")
        b = load_file(resumed / folder / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(a[key], b[key]) for key in a), folder
    assert (reference / "samples" / "step-000004.png").stat().st_size > 0  # the validation grid


GENERATE = """
import sys
import numpy as np
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
pipeline, exported, image = sys.argv[1:]
for pipe in (QwenImagePipeline.from_pretrained(pipeline),
             QwenImagePipeline.from_pretrained(pipeline, transformer=QwenImageTransformer2DModel.from_pretrained(exported))):
    out = pipe("a dog running on the beach", negative_prompt="", true_cfg_scale=4.0, height=64, width=64,
               num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np.isfinite(out).all() and out.shape == (1, 64, 64, 3), out.shape
print(type(pipe.transformer).__name__, type(pipe.vae).__name__)
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def _fresh(script: str, *args, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})


def test_export_generates_in_diffusers_without_laionkit(reference, tmp_path):
    """RUN/pipeline (QwenImagePipeline's whole folder) and RUN/transformer loaded into it generate finite
    images with classifier-free guidance, in a fresh interpreter that never imports laionkit."""
    free = _fresh(GENERATE, reference / "pipeline", reference / "transformer", tmp_path / "qwen.png", tmp_path=tmp_path)
    assert free.returncode == 0, free.stderr[-3000:]
    assert "QwenImageTransformer2DModel AutoencoderKLQwenImage" in free.stdout


LOAD_LORA = """
import sys
import numpy as np
import torch
from diffusers import QwenImagePipeline
model, lora = sys.argv[1:]
pipe = QwenImagePipeline.from_pretrained(model)
def draw():
    return pipe("a dog running on the beach", height=64, width=64, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="latent").images
before = draw()
pipe.load_lora_weights(lora, weight_name="pytorch_lora_weights.safetensors")
after = draw()
print("changed", float((after - before).abs().max()))
assert torch.isfinite(after).all()
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
"""


def test_lora_resumes_exactly_and_its_export_loads(qwen, tmp_path):
    """--lora-rank on Qwen-Image: a resume from step 2 logs the uninterrupted run's losses; RUN/lora is
    diffusers' LoRA file, which QwenImagePipeline.load_lora_weights loads in a fresh interpreter (no
    laionkit), changing what it draws."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train
    from laionkit.trainer.lora import EXPORT_FILE

    options = dict(latents=qwen.latents, unet=str(qwen.model), lora_rank=4, max_steps=4, batch_size=4, lr=1e-2,
                   log_with="none", quiet=True, log_every=1, workers=0, shuffle_buffer=3, checkpoint_every=2)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(TrainConfig(output=whole, **options))
    train(TrainConfig(output=resumed, resume=whole / "checkpoints" / "step-00000002", **options))
    want, got = metrics(whole), metrics(resumed)
    assert sorted(got) == [3, 4] and all(got[s]["loss"] == want[s]["loss"] for s in (3, 4))
    assert EXPORT_FILE == "pytorch_lora_weights.safetensors" and (whole / "lora" / EXPORT_FILE).is_file()
    free = _fresh(LOAD_LORA, qwen.model, whole / "lora", tmp_path=tmp_path)
    assert free.returncode == 0, free.stderr[-3000:]
    assert float(free.stdout.split("changed")[1].split()[0]) > 0


def test_buckets_from_scratch(qwen, image_shards, tmp_path):
    """Aspect-ratio buckets train from scratch (--transformer-config tiny: each bucket's img_shapes and shift,
    captions padded per batch)."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards),), output=latents, model=str(qwen.model), resolution=128,
                     buckets=True, batch_size=4, workers=0, quiet=True))
    train(TrainConfig(latents=latents, output=tmp_path / "run", unet_config="tiny", max_steps=4, batch_size=2,
                      log_with="none", quiet=True, log_every=4, workers=0, shuffle_buffer=0))
    record = metrics(tmp_path / "run")[4]
    assert sum(record["samples_per_bucket"].values()) == 8 and np.isfinite(record["loss"])
    assert len([n for n in record["samples_per_bucket"].values() if n]) > 1, "one bucket only"


def test_online_text_trains_as_stored_text_does(qwen, reference, image_shards, tmp_path):
    """encode without --text writes the family's default, online text: the template's token ids (-1 where the mask
    is 0; 34 template tokens and the 512 of the window); train runs Qwen2.5-VL on them, drops the template as the
    pipeline does, and gets the stored-text run's losses and validation loss."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run as train

    online = tmp_path / "online"
    run(EncodeConfig(shards=(str(image_shards),), output=online, model=str(qwen.model), resolution=64,
                     batch_size=4, workers=0, quiet=True))  # the family's default: online
    manifest = json.loads((online / "manifest.json").read_text())
    assert manifest["text"]["mode"] == "online" and manifest["text"]["ids"] == {"ids_tokenizer.npy": 34 + 512}
    train(TrainConfig(latents=online, val_latents=online, output=tmp_path / "run", unet=str(qwen.model),
                      **{**RUN, "max_steps": 2, "validate_every": 0, "ema": False}))
    got, want = metrics(tmp_path / "run"), metrics(reference)
    for step in (1, 2):  # stored text is the same encoder's output rounded to float16
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), step
    assert got[2]["val_loss"] == pytest.approx(want[2]["val_loss"], rel=1e-4)
