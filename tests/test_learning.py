"""Proof of learning: a model trained from scratch by `laionkit encode` + `laionkit train` regenerates its data.

Plumbing tests show that a run trains, exports and loads; these show that what it trained learned the data.
On 8 real photos with 8 distinct captions at 64 px (sharp_models: a VAE whose latents carry the images), a
denoiser a few times wider than ``tiny`` trains on the whole set every step until, for each caption, the
family's own diffusers pipeline, loaded from RUN/pipeline in a fresh interpreter that never imports laionkit,
generates (its own scheduler, fixed seed, ``output_type="latent"``, guidance 1 so the caption alone decides)
a latent nearest that caption's own image's latent, for at least 7 of the 8 captions, and on average at less
than half the MSE to the other images', and at the data's spread (std within 20% of the images' latents').
The negative, at generation: the pipeline asked for the captions in a shuffled order (so each draws from
another seed) gives latents that fail the criterion against the images the shuffle puts the captions on,
and pass it against each caption's own image: the caption decides what is drawn, not the seed or the
position. Guidance 1 everywhere (no classifier-free guidance); Flux feeds guidance_scale to its guidance
embedding, so there it is the value train feeds that embedding (3.5). laionkit's validation sampler (what
train's validation grids draw with) passes the same criteria. With DDIM's clip_sample=True (the default that
scheduler configs without the key gave it, issue 32) its PixArt samples still fell nearest their own images
(x0 cut to [-1, 1] keeps most of a unit-spread latent's pattern), but at about 0.6 of the data's spread,
which the spread criterion refuses.

SD (one CLIP, no pooled vector: the caption reaches the UNet through cross-attention alone) uses the tiny
CLIP that `laionkit models tiny` writes, unchanged: its states differ between the 8 captions (mean squared
distance between two captions' states 0.33 of their variance; SDXL's concatenated states 0.51, and its pooled
vector 1.2), enough for a UNet laid out as SDXL's case (cross-attention at the 4x4 level, two transformer
layers).

LoRA: on an SD base the test trains as above, adapters trained on the same photos with each photo given the
next one's caption (rank 16, alpha = rank, which diffusers reads from the file's metadata; on the attention
projections and on the transformer blocks' proj_in / proj_out and feed-forward: on the attention projections
alone, the default, a base trained with --seed 1 drew 7 of 8, one caption's seed giving another image). The
base's own pipeline with RUN/lora loaded draws the new mapping (the criterion and its negative), and those
samples fail the old one; without the LoRA it draws the old mapping (criterion and negative). The same LoRA
trained on the base held in int8 (--base-dtype int8) draws the new mapping as well, loaded onto the full-precision
base. SD for LoRA:
its base trains as fast as SDXL's (the same UNet but SDXL's text_time embedding), and every path of its
caption into the UNet goes through the attention the adapters sit on, where SDXL's pooled vector enters
through add_embedding, which no target here adapts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_cli
from fixtures import CAPTIONS, write_image_shards
from learning import GENERATE, deterministic, retrieval, shard_latents, spread, stored_texts

from laionkit.common.learnable_models import WIDE_SD_UNET

try:  # train's validation sampling, before and after laionkit/train.py became the laionkit/trainer package
    from laionkit.trainer.evaluation import sample_latents
except ImportError:
    from laionkit.train import sample_latents

STEPS = 20  # sampler steps, in the pipeline and in validation
# Per family: the denoiser (a few times wider than `tiny`: room to hold 8 images), the run's length and the
# guidance_scale its pipeline draws with (Flux's guidance embedding: the value train fed it).
# SD's UNet is SDXL's without the text_time embedding. The note it replaces: a [64, 128] UNet of a layout it did
# not record needed 1,600 steps at lr 2e-3 and still drew 2 of 8 shuffled captions as another image; this one
# passes at 600 steps, also with train's --seed 1 and 2 (8 of 8 each, negatives passed).
# Shorter runs tried (2026-12-03, to cut the suite's time; same criterion): SD at 300 steps drew 6 of 8
# (--seed 0; 7 with --seed 1, the shuffled order following its own image 5 of 8); SDXL at 400 steps drew
# 8, 7, 8 of 8 (--seed 0, 1, 2) but the shuffled order followed its own image 7, 6, 6 of 8; PixArt at 1,000
# steps drew 8 of 8 (seeds 0-2) at own / other MSE 0.63, 0.64, 0.35 (limit 0.5) and spread 1.47, 1.46, 0.92 of
# the data's (limit 1.2). Kept as they are.
# Sana (2026-12-03): its DC-AE is deterministic (sharp_models rescales the encoder's last layer instead of
# sharpening a posterior: tests/learning.py, sharpen_dc_vae); the transformer takes sin-cos positions
# (interpolation_scale 1.0, as Sana's 2K config: the 1024 px ones have none, and two layers of the Mix-FFN's
# 3x3 convolutions cannot place an 8x8 image). 400 steps drew 8 of 8 with --seed 0, 1, 2 (own / other MSE
# 0.10, 0.09, 0.08; spread 0.94, 0.92, 0.94 of the data's; the shuffled order followed its own image 8 of 8),
# in 75 s against SD3's 212 s on the same loaded 2 cores.
FAMILIES = {
    "sd": dict(flag="--unet-config", steps=500, lr=2e-3, schedule="cosine", config=WIDE_SD_UNET),
    "sdxl": dict(flag="--unet-config", steps=450, lr=2e-3, schedule="cosine", config={
        **WIDE_SD_UNET, "addition_embed_type": "text_time", "addition_time_embed_dim": 8}),
    "sd3": dict(flag="--transformer-config", steps=600, lr=2e-3, schedule="cosine", config={
        "sample_size": 8, "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 128, "caption_projection_dim": 64,
        "pooled_projection_dim": 96, "out_channels": 16, "pos_embed_max_size": 16}),
    "flux": dict(flag="--transformer-config", steps=350, lr=2e-3, schedule="cosine", guidance=3.5, config={
        "patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 64, "pooled_projection_dim": 32, "guidance_embeds": True,
        "axes_dims_rope": [4, 6, 6]}),
    "pixart": dict(flag="--transformer-config", steps=1500, lr=2e-3, config={
        "sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 8, "num_layers": 2,
        "num_attention_heads": 4, "attention_head_dim": 16, "cross_attention_dim": 64, "caption_channels": 32,
        "norm_type": "ada_norm_single", "num_embeds_ada_norm": 1000, "use_additional_conditions": False}),
    # Z-Image: 400 steps pass with train's --seed 0, 1 and 2 (2026-12-03); at 300, seeds 1 and 2 passed and
    # seed 0's run hit the encode race fixed in laionkit/encode/reader.py, so 300 is not shown.
    "z-image": dict(flag="--transformer-config", steps=200, lr=2e-3, guidance=0.0, config={  # ZImagePipeline: 0 is no CFG
        "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 64, "n_layers": 2, "n_refiner_layers": 1,
        "n_heads": 4, "n_kv_heads": 4, "cap_feat_dim": 32, "axes_dims": [4, 6, 6], "axes_lens": [1536, 512, 512]}),
    "sana": dict(flag="--transformer-config", steps=400, lr=2e-3, config={
        "in_channels": 32, "out_channels": 32, "num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 2,
        "num_cross_attention_heads": 4, "cross_attention_head_dim": 16, "cross_attention_dim": 64,
        "caption_channels": 32, "mlp_ratio": 2.5, "sample_size": 8, "patch_size": 1, "norm_elementwise_affine": False,
        "norm_eps": 1e-6, "interpolation_scale": 1.0}),
}
# Qwen-Image: 300 steps pass with train's --seed 0 and 1 (2026-12-03; 500 passed too, at 2.7x the time).
FAMILIES["qwen-image"] = dict(flag="--transformer-config", steps=300, lr=2e-3, config={
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 4, "joint_attention_dim": 32, "guidance_embeds": False, "axes_dims_rope": [4, 6, 6]})
# FLUX.2 [klein] (2026-12-03): 200 steps drew 8 of 8 with train's --seed 0 and 1 (own / other MSE 0.28 / 1.85 and
# 0.30 / 1.83, spread 1.07 and 1.06 of the data's; 158 s and 177 s on the loaded 2 cores, the 512 text tokens
# dominating each step); 300 steps drew 8 of 8 too, in 233 s. Inner width 128 (4 heads of 32): at 64 (4 x 16, narrower than the 128 patchified
# channels) 300 and 400 steps both drew 8 of 8 but at 1.22 of the data's spread (own MSE 0.81), with any sampling
# shift (the pipeline's empirical mu, Flux's rule or none, 20 or 50 steps): capacity, not the schedule.
FAMILIES["flux2"] = dict(flag="--transformer-config", steps=200, lr=2e-3, config={
    "patch_size": 1, "in_channels": 128, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 32,
    "num_attention_heads": 4, "joint_attention_dim": 48, "timestep_guidance_channels": 64, "guidance_embeds": False,
    "axes_dims_rope": [8, 8, 8, 8]})
# FLUX.2 [dev] (2026-12-04): klein's case with the guidance embedding (train feeds 3.5, the pipeline draws at 3.5)
# and Mistral-3 states; 200 steps drew 8 of 8 with train's --seed 0 and 1.
FAMILIES["flux2-dev"] = dict(FAMILIES["flux2"], guidance=3.5, config={
    **FAMILIES["flux2"]["config"], "guidance_embeds": True})
# Caption windows (encode --max-sequence-length; the pipeline then draws with the same max_sequence_length): the
# 8 captions take at most 23 T5 tokens, 47 tokens of FLUX.2 klein's chat template, 105 of FLUX.2 dev's (its system
# message), 35 of Z-Image's template, and the long one (851 characters) is cut in every window, still unlike the
# others. Flux, SD3 and FLUX.2 attend to every padding token: at their default windows (512, 256, 512) the text
# tokens made up most of each step's work on these 16-token latents.
for family, window in {"flux": 32, "sd3": 32, "pixart": 32, "sana": 32, "z-image": 64, "qwen-image": 32,
                       "flux2": 64, "flux2-dev": 128}.items():
    FAMILIES[family]["window"] = window
# The LoRA case: its family (SD: why in the module docstring), the adapters and their run.
LORA = dict(family="sd", rank=16, targets="to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2",
            steps=400, lr=4e-3)


def train(family: str, latents: Path, run: Path, *flags) -> None:
    """`laionkit train` from scratch on the whole set each step (batch 8), fp32, no caption dropout; ``flags``
    in place of the from-scratch architecture and the family's length and lr (a LoRA run on a base). Train's
    --seed is 0, or $LEARNING_SEED: how the lengths above were checked at other seeds."""
    setup = FAMILIES[family]
    if not flags:
        arch = run.parent / f"{family}-arch.json"
        arch.write_text(json.dumps(setup["config"]))
        flags = (setup["flag"], arch, "--max-steps", setup["steps"], "--lr", setup["lr"],
                 "--lr-schedule", setup.get("schedule", "constant"))
    run_cli("train", latents, "--output", run, *flags, "--seed", os.environ.get("LEARNING_SEED", "0"),
            "--batch-size", 8, "--caption-dropout", 0,
            "--mixed-precision", "no", "--workers", 0, "--log-with", "none", "--log-every", 100, "--quiet")


def generate(family: str, pipeline: Path, orders: list, output: Path, lora: Path | None = None) -> list:
    """For each order of captions, each caption's latent from the family's pipeline (seed = the caption's
    index in its order), all in one fresh interpreter with no laionkit import, with RUN/lora loaded into it
    where given: [{caption: latent}] per order."""
    from safetensors.torch import load_file

    guidance = FAMILIES.get(family, {}).get("guidance", 1.0)
    result = subprocess.run([sys.executable, "-c", GENERATE, str(pipeline), json.dumps(orders), str(output),
                             str(STEPS), "64", str(guidance), str(lora or "-"),
                             str(FAMILIES.get(family, {}).get("window", 0))],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "False", result.stdout  # laionkit was never imported
    found = load_file(output)
    return [{caption: found[f"{order}.{index}"] for index, caption in enumerate(captions)}
            for order, captions in enumerate(orders)]


def assert_learned(family: str, pipeline: Path, own: dict, output: Path, lora: Path | None = None) -> dict:
    """The criterion, and its negative at generation; returns the generated latents {caption: latent}."""
    captions = list(own)
    # Negative: the captions asked for in another order (each caption the next image's place and seed).
    # Judged against the images they were shuffled onto they fail; against their own images they pass.
    shuffled = captions[1:] + captions[:1]
    generated, drawn = generate(family, pipeline, [captions, shuffled], output / "generated.safetensors", lora)
    found = retrieval(generated, own)
    assert found["nearest_own"] >= 7, found
    assert found["own_mse"] < 0.5 * found["other_mse"], found
    assert spread(generated) == pytest.approx(spread(own), rel=0.2)
    onto = retrieval(drawn, own, dict(zip(shuffled, captions, strict=True)))
    assert onto["nearest_own"] <= 2 and onto["own_mse"] > found["own_mse"] * 2, onto
    followed = retrieval(drawn, own)
    assert followed["nearest_own"] >= 7 and followed["own_mse"] < 0.5 * followed["other_mse"], followed
    return generated


def validation_samples(family: str, model: Path, latents: Path, run: Path, captions: list) -> dict:
    """Each caption's latent from train's validation sampler, with the run's exported denoiser, the stored
    text tensors and the noise schedule as a fine-tune of the export loads it (RUN/pipeline/scheduler:
    PixArt-Σ's DPMSolverMultistepScheduler config, which names no clip_sample)."""
    import diffusers
    import torch

    from laionkit.families import get_family

    spec = get_family(family)
    denoiser = getattr(diffusers, spec.denoiser_class).from_pretrained(run / spec.denoiser_subfolder)
    named = json.loads((model / "vae" / "config.json").read_text())["_class_name"]
    vae = getattr(diffusers, named).from_pretrained(model, subfolder="vae")
    stored = 1 if deterministic(model / "vae") else 2  # stored channels per latent channel
    scheduler = diffusers.DDPMScheduler.from_pretrained(run / "pipeline", subfolder="scheduler")
    texts = stored_texts(latents, captions)
    empty = {key: value[captions.index("")] for key, value in texts.items()}
    shape = next(iter(shard_latents(latents, model / "vae").values())).shape
    data = SimpleNamespace(family=spec, moments_shape=(stored * shape[0], *shape[1:]), moments_per_channel=stored)
    if spec.pipeline_denormalizes:  # FLUX.2: the pipeline's latents are normalised back as train's are
        from laionkit.trainer.data import open_latents

        data.normalize = open_latents(latents).normalize
    config = SimpleNamespace(seed=0, validation_steps=STEPS, guidance_scale=FAMILIES[family].get("guidance", 1.0))
    found = sample_latents(denoiser, vae, scheduler, texts, empty, data, config, torch.device("cpu")).float()
    return dict(zip(captions, found, strict=True))


def regenerates(family: str, sharp, tmp_path: Path, run: Path | None = None) -> Path:
    """Train ``family`` from scratch on ``sharp``'s encode (or take ``run``, a run of it trained so); its
    pipeline (criterion and negative) and train's validation sampler regenerate each caption's own image.
    Returns the run folder."""
    own = shard_latents(sharp.latents, sharp.model / "vae")
    captions = list(own)
    assert len(set(captions)) == 8  # 8 distinct captions for 8 distinct images
    assert sharp.vae_stats["pairwise_mse"] > 1.0  # the images' latents differ (unit spread)
    if run is None:
        run = tmp_path / "run"
        train(family, sharp.latents, run)

    assert_learned(family, run / "pipeline", own, tmp_path)

    samples = validation_samples(family, sharp.model, sharp.latents, run, captions)
    sampled = retrieval(samples, own)
    assert sampled["nearest_own"] >= 7, sampled
    assert sampled["own_mse"] < 0.5 * sampled["other_mse"], sampled
    assert spread(samples) == pytest.approx(spread(own), rel=0.2)  # DDIM's clip_sample=True: ~0.6
    return run


@pytest.fixture(scope="module")
def sd_base(sharp_models, tmp_path_factory) -> SimpleNamespace:
    """SD trained from scratch (the suite's longest run), once for the three tests of it below: its own case
    of the criterion, and the base of both LoRA tests. Also the photos each given the next photo's caption,
    encoded (``moved``), which the LoRAs train on."""
    import torch

    family = LORA["family"]
    sharp = sharp_models(family)
    folder = tmp_path_factory.mktemp("sd-base")
    train(family, sharp.latents, folder / "run")
    names = sorted(CAPTIONS)  # each photo (file name) gets the next photo's caption
    moved = {name: CAPTIONS[names[(index + 1) % len(names)]] for index, name in enumerate(names)}
    write_image_shards(sharp.photos, folder / "packed-moved", moved)
    run_cli("encode", folder / "packed-moved", "--model", sharp.model, "--output", folder / "moved",
            "--resolution", "64", "--batch-size", "8", "--workers", "0", "--text", "stored", "--quiet")
    own = shard_latents(sharp.latents, sharp.model / "vae")
    new = shard_latents(folder / "moved", sharp.model / "vae")
    assert set(new) == set(own) and not any(torch.equal(new[caption], own[caption]) for caption in own)
    return SimpleNamespace(sharp=sharp, run=folder / "run", moved=folder / "moved", own=own, new=new)


def test_trained_sd_regenerates_each_captions_image(sd_base, tmp_path):
    """SD's case of test_trained_model_regenerates_each_captions_image (below), on the base the LoRA tests
    train on: without a LoRA its pipeline draws the old mapping, with its negative. These three SD tests come
    first: their base is the suite's longest run, split so that each test is shorter than the run of all three."""
    regenerates(LORA["family"], sd_base.sharp, tmp_path, sd_base.run)


def lora_draws_the_new_mapping(sd_base, tmp_path: Path, *flags) -> dict:
    """A LoRA trained on ``sd_base``'s moved captions (``flags`` added to its train), loaded with
    pipe.load_lora_weights into the base's own full-precision pipeline: it draws the new mapping (the
    criterion and its negative). Returns those samples."""
    lora = tmp_path / "lora"
    train(LORA["family"], sd_base.moved, lora, "--unet", sd_base.run / "pipeline", "--lora-rank", LORA["rank"],
          "--lora-targets", LORA["targets"], "--max-steps", LORA["steps"], "--lr", LORA["lr"], *flags)
    assert not (lora / "unet").exists() and not (lora / "pipeline").exists()  # adapters only
    with_lora = tmp_path / "with-lora"
    with_lora.mkdir()
    return assert_learned(LORA["family"], sd_base.run / "pipeline", sd_base.new, with_lora, lora / "lora")


def test_a_lora_on_the_trained_sd_draws_a_new_mapping(sd_base, tmp_path):
    """On the base SD trained, a LoRA trained on the same photos with each photo given the next one's
    caption: with RUN/lora loaded the base's own pipeline draws the new mapping, with its negative, and
    those samples do not follow the old one."""
    drawn = lora_draws_the_new_mapping(sd_base, tmp_path)
    old = retrieval(drawn, sd_base.own)  # the same samples judged by the old mapping
    assert old["nearest_own"] <= 2 and old["own_mse"] > 2 * retrieval(drawn, sd_base.new)["own_mse"], old


def test_a_lora_trained_on_the_int8_sd_base_draws_the_new_mapping(sd_base, tmp_path):
    """The same LoRA trained on the base held in int8 (--base-dtype, laionkit/trainer/quantized_base.py): its
    export, loaded onto the base's own full-precision pipeline, draws the new mapping too."""
    lora_draws_the_new_mapping(sd_base, tmp_path, "--base-dtype", "int8")


@pytest.mark.parametrize("family", [family for family in FAMILIES if family != LORA["family"]])
def test_trained_model_regenerates_each_captions_image(family, sharp_models, tmp_path):
    regenerates(family, sharp_models(family, FAMILIES[family].get("window")), tmp_path)
