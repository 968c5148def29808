"""What RUN/lora holds is what training trained: loaded back by the family's own loader (diffusers'
``pipe.load_lora_weights``, PEFT's adapter folder for PixArt) from the tiny model folder, the denoiser gives
the output of the trained base merged at alpha / rank, with --lora-alpha != --lora-rank (alpha 16, rank 4:
scale 4, so a loader that assumes scale 1 is far off). The kohya / ComfyUI file beside it (every family ComfyUI
has a model of) loads to the same where diffusers reads it, and holds each trained update by kohya's rule."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from laionkit.families import flow as flow_math
from laionkit.families import get_family

RANK, ALPHA = 4, 16.0
FAMILIES = ("sd", "sdxl", "sd3", "flux", "pixart", "sana", "z-image")
FAMILIES += ("qwen-image", "flux2", "flux2-dev")


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, latent_shards, tiny_models, flow_latents, tmp_path_factory):
    """(family, model folder, run folder): 2 steps of --lora-rank 4 --lora-alpha 16 at a high lr, checkpointed
    at the last step (its adapter.safetensors is the trained model's state)."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    name = request.param
    latents, model = (latent_shards, tiny_models) if name == "sd" else (flow_latents(name).latents,
                                                                        flow_latents(name).model)
    output = tmp_path_factory.mktemp(f"lora-{name}") / "run"
    run(TrainConfig(latents=latents, output=output, unet=str(model), lora_rank=RANK, lora_alpha=ALPHA, max_steps=2,
                    batch_size=4, lr=1e-2, log_with="none", quiet=True, workers=0, shuffle_buffer=3,
                    checkpoint_every=2))
    return name, model, output


def base_denoiser(name, model):
    import diffusers

    spec = get_family(name)
    return getattr(diffusers, spec.denoiser_class).from_pretrained(model, subfolder=spec.denoiser_subfolder).eval()


def merged(name, model, run, keep=lambda module: True):
    """The trained model as plain weights: the base with each adapter merged at alpha / rank, W + s * B @ A,
    from the last checkpoint's adapters (PEFT names ``<module>.lora_A.default.weight``)."""
    denoiser = base_denoiser(name, model)
    adapters = load_file(run / "checkpoints" / "step-00000002" / "adapter.safetensors")
    modules = dict(denoiser.named_modules())
    names = {key.split(".lora_A.")[0] for key in adapters if ".lora_A." in key}
    assert names and len(adapters) == 2 * len(names)
    with torch.no_grad():
        for module in filter(keep, names):
            down, up = (adapters[f"{module}.lora_{part}.default.weight"].float() for part in "AB")
            modules[module].weight += ALPHA / RANK * up @ down
    return denoiser


def output(name, denoiser):
    """The denoiser's prediction on fixed inputs (an 8x8 latent, 7 text tokens) through the family's own call."""
    spec = get_family(name)
    config = denoiser.config
    generator = torch.Generator().manual_seed(0)
    channels = config.in_channels // 4 if name in ("flux", "qwen-image", "flux2", "flux2-dev") else config.in_channels  # packed 2x2
    noisy = torch.randn(2, channels, 8, 8, generator=generator)
    timestep = torch.tensor([10, 500])
    if name in ("sd", "sdxl"):
        cond = {"states": torch.randn(2, 7, config.cross_attention_dim, generator=generator)}
        if name == "sdxl":
            cond["pooled"] = torch.randn(2, config.projection_class_embeddings_input_dim
                                         - 6 * config.addition_time_embed_dim, generator=generator)
            cond["time_ids"] = torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)
    elif name in ("pixart", "sana"):
        cond = {"states": torch.randn(2, 7, config.caption_channels, generator=generator), "mask": torch.ones(2, 7)}
        if name == "sana":  # flow matching: sigma x 1000
            timestep = torch.tensor([0.2, 0.7]) * spec.objective.timestep_scale
    elif name == "z-image":  # a list of 7 caption rows per sample; timestep: sigma (denoise gives 1 - sigma)
        cond = {"states": torch.randn(2, 7, config.cap_feat_dim, generator=generator), "mask": torch.ones(2, 7)}
        timestep = torch.tensor([0.2, 0.7])
    elif name == "qwen-image":
        cond = {"states": torch.randn(2, 7, config.joint_attention_dim, generator=generator), "mask": torch.ones(2, 7)}
        timestep = torch.tensor([0.2, 0.7])
    elif name in ("flux2", "flux2-dev"):  # no pooled text, no mask; timestep: sigma; dev embeds guidance
        cond = {"states": torch.randn(2, 7, config.joint_attention_dim, generator=generator)}
        if config.guidance_embeds:
            cond["guidance"] = torch.full((2,), 3.5)
        timestep = torch.tensor([0.2, 0.7])
    else:
        cond = {"states": torch.randn(2, 7, config.joint_attention_dim, generator=generator),
                "pooled": torch.randn(2, config.pooled_projection_dim, generator=generator)}
        if getattr(config, "guidance_embeds", False):
            cond["guidance"] = torch.full((2,), 3.5)
        timestep = torch.tensor([0.2, 0.7]) * spec.objective.timestep_scale
        noisy = flow_math.interpolate(noisy, torch.randn(noisy.shape, generator=generator), torch.tensor([0.2, 0.7]))
    with torch.no_grad():
        return spec.predict(denoiser, noisy, timestep, cond)


def loaded(name, model, lora, **options):
    """The denoiser as a user gets it: the family's pipeline (PixArt: its transformer) from the model folder,
    with ``lora`` (a folder, or a state dict) loaded by the family's own LoRA loader."""
    import diffusers

    spec = get_family(name)
    if name == "pixart":  # PixArtSigmaPipeline loads no LoRA: PEFT's adapter folder onto its transformer
        from peft import PeftModel

        return PeftModel.from_pretrained(base_denoiser(name, model), str(lora)).eval()
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(model)
    pipe.load_lora_weights(lora, **options)
    return getattr(pipe, spec.denoiser_subfolder).eval()


def test_exported_lora_loads_at_the_trained_strength(trained):
    name, model, run = trained
    want = output(name, merged(name, model, run))
    base = output(name, base_denoiser(name, model))
    assert (want - base).abs().max() > 1e-3, "the adapters did not train: the test would prove nothing"
    got = output(name, loaded(name, model, run / "lora"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_kohya_file_loads_as_the_diffusers_file(trained):
    """RUN/lora/lora_kohya.safetensors (kohya / ComfyUI naming, an ``.alpha`` per module) through diffusers'
    own kohya converters (SD, SDXL, Qwen-Image) gives the denoiser the diffusers file gives, and the trained
    model's. The other transformers' file keeps diffusers' names, for ComfyUI, and holds each module's trained
    update by kohya's rule. Flux's single
    blocks fuse q, k, v and the MLP input into BFL's linear1, which diffusers' converter splits at FLUX.1's
    widths only (3072 / 12288, not the tiny model's): there the file is checked against kohya's rule itself,
    alpha / rank(lora_down) * up @ down = the trained parts' updates stacked (zeros for the MLP's rows), and
    diffusers loads the rest of the file."""
    from laionkit.trainer.lora import KOHYA_FILE

    name, model, run = trained
    path = run / "lora" / KOHYA_FILE
    kohya = load_file(path)
    prefix = "lora_unet_" if name in ("sd", "sdxl", "flux", "qwen-image") else "transformer."
    assert all(key.startswith(prefix) and key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
               for key in kohya)
    if prefix == "transformer.":  # diffusers names, which ComfyUI maps (tests/test_comfyui.py); diffusers reads
        # their diffusers file, so this one is checked against kohya's rule: each module's update as trained
        adapters = load_file(run / "checkpoints" / "step-00000002" / "adapter.safetensors")
        modules = dict(base_denoiser(name, model).named_modules())
        trained_modules = sorted(key.split(".lora_A.")[0] for key in adapters if ".lora_A." in key)
        assert sorted(key[len(prefix):-len(".alpha")] for key in kohya if key.endswith(".alpha")) == trained_modules
        for module in trained_modules:
            down, up, alpha = (kohya[f"{prefix}{module}.{part}"] for part in ("lora_down.weight", "lora_up.weight",
                                                                               "alpha"))
            a, b = (adapters[f"{module}.lora_{part}.default.weight"] for part in "AB")
            assert isinstance(modules[module], torch.nn.Linear) and alpha.item() == ALPHA
            torch.testing.assert_close(alpha / down.shape[0] * up @ down, ALPHA / RANK * b @ a, rtol=1e-6, atol=0)
        return
    if name != "flux":
        want = output(name, merged(name, model, run))
        torch.testing.assert_close(output(name, loaded(name, model, run / "lora", weight_name=KOHYA_FILE)), want,
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(output(name, loaded(name, model, run / "lora")), want, rtol=1e-4, atol=1e-5)
        return
    single = {key: value for key, value in kohya.items() if key.startswith("lora_unet_single_blocks_")}
    assert single and any(key.startswith("lora_unet_double_blocks_") for key in kohya)
    double = {key: value for key, value in kohya.items() if key not in single}
    not_single = lambda module: not module.startswith("single_transformer_blocks.")  # noqa: E731
    torch.testing.assert_close(output(name, loaded(name, model, double)),
                               output(name, merged(name, model, run, keep=not_single)), rtol=1e-4, atol=1e-5)
    adapters = load_file(run / "checkpoints" / "step-00000002" / "adapter.safetensors")
    base = base_denoiser(name, model)
    for key in [key for key in single if key.endswith(".alpha")]:
        block = int(key.split("_")[4])
        prefix = key[: -len(".alpha")]
        down, up = single[f"{prefix}.lora_down.weight"], single[f"{prefix}.lora_up.weight"]
        update = single[key] / down.shape[0] * up @ down
        if prefix.endswith("_linear1"):
            parts = []
            for inner in ("attn.to_q", "attn.to_k", "attn.to_v"):
                module = f"single_transformer_blocks.{block}.{inner}"
                a, b = (adapters[f"{module}.lora_{part}.default.weight"] for part in "AB")
                parts.append(ALPHA / RANK * b @ a)
            mlp = base.single_transformer_blocks[block].proj_mlp
            parts.append(torch.zeros(mlp.out_features, mlp.in_features))
            torch.testing.assert_close(update, torch.cat(parts), rtol=1e-5, atol=1e-7)
            assert parts[0].abs().max() > 0
        else:
            raise AssertionError(f"unexpected {key}: the default targets adapt only q, k, v in single blocks")


def test_flux_kohya_single_blocks_split_back_at_flux1_widths():
    """At FLUX.1's widths (3072 wide, 12288 MLP: what diffusers' converter assumes) diffusers' own kohya
    converter splits the block-diagonal linear1 / img_attn_qkv back into each part's adapters with alpha / rank
    folded in, the MLP's part zero. Only the adapters are real tensors: the transformer is built on the meta
    device (one block of each kind)."""
    import diffusers
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
    from peft import LoraConfig

    from laionkit.trainer.lora import kohya_layers

    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(num_layers=1, num_single_layers=1)
        model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q", "to_k", "to_v"]))
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for block in ("transformer_blocks.0", "single_transformer_blocks.0"):
        for inner in ("to_q", "to_k", "to_v"):
            layers[f"{block}.attn.{inner}.lora_A.weight"] = torch.randn(RANK, 3072, generator=generator)
            layers[f"{block}.attn.{inner}.lora_B.weight"] = torch.randn(3072, RANK, generator=generator)
    kohya, skipped = kohya_layers(model, layers)
    assert skipped is None and sorted(key for key in kohya if key.endswith(".alpha")) == [
        "lora_unet_double_blocks_0_img_attn_qkv.alpha", "lora_unet_single_blocks_0_linear1.alpha"]
    back = _convert_kohya_flux_lora_to_diffusers(dict(kohya))
    for module in sorted({key.split(".lora_A.")[0] for key in layers if ".lora_A." in key}):
        down, up = (back[f"transformer.{module}.lora_{part}.weight"] for part in "AB")
        assert down.shape == (RANK, 3072), module  # each part its own rank-4 adapter again
        want = ALPHA / RANK * layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"]
        torch.testing.assert_close(up @ down, want, rtol=1e-5, atol=1e-4, msg=module)
    mlp = "transformer.single_transformer_blocks.0.proj_mlp"
    assert back[f"{mlp}.lora_B.weight"].shape == (12288, RANK) and not back[f"{mlp}.lora_B.weight"].any()


def test_lora_beyond_attention_loads_whole(latent_shards, tiny_models, tmp_path):
    """--lora-targets naming layers besides attention's to_q / to_k / to_v / to_out.0: diffusers' converter to
    its older key names renames only those, and its loader takes the naming of the first key and silently
    drops the layers named the other way. The export loads whole: the pipeline's denoiser is the trained one."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    name, targets, latents, model = "sd", "to_q,to_k,to_v,to_out.0,time_emb_proj", latent_shards, tiny_models
    output_dir = tmp_path / "run"
    run(TrainConfig(latents=latents, output=output_dir, unet=str(model), lora_rank=RANK, lora_alpha=ALPHA,
                    lora_targets=targets, max_steps=2, batch_size=4, lr=1e-2, log_with="none", quiet=True, workers=0,
                    shuffle_buffer=3, checkpoint_every=2))
    adapters = load_file(output_dir / "checkpoints" / "step-00000002" / "adapter.safetensors")
    assert any(".to_q." in key for key in adapters) and any(key.split(".lora_A.")[0].endswith(
        targets.rsplit(",", 1)[1]) for key in adapters)  # both kinds of layer were trained
    want = output(name, merged(name, model, output_dir))
    torch.testing.assert_close(output(name, loaded(name, model, output_dir / "lora")), want, rtol=1e-4, atol=1e-5)
