"""The exports as ComfyUI loads them, through its own code (comfy.sd's loaders, comfy.lora's key maps and LoRA
math): RUN/lora's kohya file patches each family's weights to what diffusers' ``fuse_lora`` of the diffusers file
gives (at alpha / rank, not 1), and a v-prediction single file loads as a v-prediction model.

ComfyUI is not on PyPI: these tests import it from the folder ``LAIONKIT_COMFYUI`` names (a checkout of
Comfy-Org/ComfyUI with its requirements installed) and are skipped without it. ComfyUI's model detection assumes
the real models' widths (Flux's 3072, PixArt's 1152, SD's 320 channels, ...), which the tiny models here do not
have: ``tiny_sizes`` tells it the tiny ones and changes nothing else of its loading, key mapping or patching. SD3's
MMDiT is 64 wide per block in ComfyUI whatever its config says, so its tiny transformer is built that wide."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

COMFYUI = os.environ.get("LAIONKIT_COMFYUI")
pytestmark = pytest.mark.skipif(not COMFYUI, reason="LAIONKIT_COMFYUI (a ComfyUI checkout) is not set")
RANK, ALPHA = 4, 16.0
SD3_AS_COMFYUI = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 64, "caption_projection_dim": 128}
DEFAULT_TARGETS = "to_q,to_k,to_v,to_out.0"  # train's --lora-targets default
JOINT = "add_q_proj,add_k_proj,add_v_proj,to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2"
# --lora-targets beyond attention, onto layers ComfyUI fuses or renames otherwise
WIDE_TARGETS = {"sd": "proj_in,proj_out,ff.net.0.proj,ff.net.2,time_emb_proj", "sdxl": "proj_in,ff.net.2,time_emb_proj",
                "sd3": JOINT, "flux": f"{JOINT},proj_mlp,norm1.linear,norm1_context.linear,norm.linear",
                "pixart": "ff.net.0.proj,ff.net.2",
                "qwen-image": "add_q_proj,to_add_out,img_mlp.net.0.proj,txt_mlp.net.2,img_mod.1,txt_mod.1"}


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI's package, on the CPU (its argument parser's defaults, with --cpu). Imported by name: a checkout on
    sys.path, no installed distribution, which tests/test_packaging.py asks of every import statement's package."""
    sys.path.insert(0, COMFYUI)
    importlib.import_module("comfy.cli_args").args.cpu = True  # before comfy.model_management reads it
    for name in ("lora", "model_detection", "model_sampling", "sd", "supported_models", "utils"):
        importlib.import_module(f"comfy.{name}")
    return importlib.import_module("comfy")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny model folder (SD3's transformer as wide as ComfyUI's MMDiT is)."""
    from laionkit.common.models import write_tiny_models
    from laionkit.families import get_family

    root = tmp_path_factory.mktemp("comfyui-bases")
    found = {"sd": write_tiny_models(root / "sd")}
    for name in ("sdxl", "sd3", "flux", "pixart", "qwen-image"):
        found[name] = get_family(name).write_tiny(root / name, 0)
    import diffusers

    config = json.loads((found["sd3"] / "transformer" / "config.json").read_text())
    config = {key: value for key, value in config.items() if not key.startswith("_")}
    torch.manual_seed(0)
    shutil.rmtree(found["sd3"] / "transformer")
    diffusers.SD3Transformer2DModel(**{**config, **SD3_AS_COMFYUI}).save_pretrained(found["sd3"] / "transformer")
    return found


def denoiser(name: str, folder: Path):
    import diffusers

    from laionkit.families import get_family

    spec = get_family(name)
    return getattr(diffusers, spec.denoiser_class).from_pretrained(folder, subfolder=spec.denoiser_subfolder).eval()


def write_lora(name: str, folder: Path, run: Path, targets: str = DEFAULT_TARGETS) -> Path:
    """RUN/lora as training writes it (laionkit.trainer.lora), of rank-4 alpha-16 adapters on ``targets`` with
    random (nonzero) weights."""
    from peft import LoraConfig, inject_adapter_in_model

    from laionkit.trainer import lora

    model = denoiser(name, folder)
    model.requires_grad_(False)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights="gaussian",
                        target_modules=targets.split(","))
    model.add_adapter(config) if hasattr(model, "add_adapter") else inject_adapter_in_model(config, model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_B" in key:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    assert lora._save_lora(model, lora.adapters(model), run / "lora") is None
    return run / "lora"


def fused(name: str, folder: Path, lora_folder: Path) -> dict:
    """The denoiser's weights with the diffusers file fused by diffusers (PixArt: PEFT's folder merged by PEFT)."""
    from laionkit.families import get_family
    from laionkit.trainer.lora import EXPORT_FILE

    model = denoiser(name, folder)
    if name == "pixart":
        from peft import PeftModel

        return PeftModel.from_pretrained(model, str(lora_folder)).merge_and_unload().state_dict()
    model.load_lora_adapter(str(lora_folder), prefix=get_family(name).denoiser_subfolder, weight_name=EXPORT_FILE)
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    return model.state_dict()


def tiny_sizes(comfy, monkeypatch, name: str, folder: Path) -> None:
    """ComfyUI's detection of the tiny ``name`` (its model ``folder``): its own result with the widths it assumes
    replaced by the tiny ones (SD, SDXL: its supported model's signature, which names SD's and SDXL's widths)."""
    from laionkit.families import get_family
    from laionkit.trainer.singlefile import unet_to_ldm

    config = json.loads((folder / get_family(name).denoiser_subfolder / "config.json").read_text())
    detect = comfy.model_detection.detect_unet_config
    if name in ("sd", "sdxl"):
        found = detect(unet_to_ldm(dict(denoiser(name, folder).state_dict()), config), "")
        cls = comfy.supported_models.SD15 if name == "sd" else comfy.supported_models.SDXL
        monkeypatch.setattr(cls, "unet_config", {key: found[key] for key in cls.unet_config})
        return
    heads, width = config.get("num_attention_heads"), config.get("attention_head_dim")
    sizes = {}  # SD3: none (its transformer is ComfyUI's width)
    if name == "flux":
        sizes = {"hidden_size": heads * width, "num_heads": heads, "context_in_dim": config["joint_attention_dim"],
                 "axes_dim": list(config["axes_dims_rope"])}
    elif name == "pixart":
        sizes = {"hidden_size": heads * width, "num_heads": heads, "caption_channels": config["caption_channels"]}
    elif name == "qwen-image":
        sizes = {"attention_head_dim": width, "num_attention_heads": heads, "out_channels": config["out_channels"],
                 "joint_attention_dim": config["joint_attention_dim"], "axes_dims_rope": tuple(config["axes_dims_rope"])}

    def detected(*args, **kwargs):
        found = detect(*args, **kwargs)
        return found if found is None else {**found, **sizes}

    monkeypatch.setattr(comfy.model_detection, "detect_unet_config", detected)
    if name == "pixart":  # diffusers' PixArt keys -> ComfyUI's, at the width its LoRA map reads from the model config
        to_diffusers = comfy.utils.pixart_to_diffusers
        monkeypatch.setattr(comfy.utils, "pixart_to_diffusers", lambda config, output_prefix="": to_diffusers(
            {"hidden_size": sizes["hidden_size"], **config}, output_prefix=output_prefix))


def comfyui_keys(comfy, name: str, weights: dict, config: dict) -> dict:
    """A diffusers denoiser state dict in ComfyUI's keys: laionkit's single-file converters where a single file
    is what ComfyUI loads (SD, SDXL, SD3, Flux), ComfyUI's own conversion of diffusers' keys for PixArt;
    Qwen-Image's keys are diffusers'."""
    from laionkit.trainer.singlefile import flux_to_bfl, sd3_to_mmdit, unet_to_ldm

    weights = dict(weights)
    if name in ("sd", "sdxl"):
        return unet_to_ldm(weights, config)
    return {"sd3": sd3_to_mmdit, "flux": flux_to_bfl, "qwen-image": dict,
            "pixart": lambda w: comfy.model_detection.convert_diffusers_mmdit(w, "")}[name](weights)


@pytest.mark.parametrize("wide", [False, True], ids=["default-targets", "wide-targets"])
@pytest.mark.parametrize("name", ["sd", "sdxl", "sd3", "flux", "pixart", "qwen-image"])
def test_kohya_lora_patches_comfyui_weights_as_diffusers_fuses_them(comfy, bases, name, wide, tmp_path, monkeypatch,
                                                                     caplog):
    """comfy.sd.load_diffusion_model_state_dict of the base, comfy.sd.load_lora_for_models of RUN/lora's kohya
    file at strength 1, the patched weights: those of diffusers' fuse_lora of the diffusers file, every key, and
    every LoRA key loaded; with the default --lora-targets and with more. The numbers (max abs / rel difference)
    are printed for the record."""
    from laionkit.families import get_family
    from laionkit.trainer.lora import KOHYA_FILE

    spec = get_family(name)
    folder = bases[name]
    config = json.loads((folder / spec.denoiser_subfolder / "config.json").read_text())
    targets = f"{DEFAULT_TARGETS},{WIDE_TARGETS[name]}" if wide else DEFAULT_TARGETS
    lora_folder = write_lora(name, folder, tmp_path / "run", targets)
    tiny_sizes(comfy, monkeypatch, name, folder)
    base = comfyui_keys(comfy, name, denoiser(name, folder).state_dict(), config)
    want = comfyui_keys(comfy, name, fused(name, folder, lora_folder), config)

    patcher = comfy.sd.load_diffusion_model_state_dict(dict(base))
    caplog.set_level(logging.WARNING)
    lora = comfy.utils.load_torch_file(str(lora_folder / KOHYA_FILE), safe_load=True)
    patched_model, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    assert not [r.message for r in caplog.records if "lora key not loaded" in r.message]
    patched_model.patch_model()
    got = {key: value.float() for key, value in patched_model.model.diffusion_model.state_dict().items()}
    # ComfyUI's PixArt holds y_embedder.y_embedding, which diffusers' has not (so not patched either)
    assert set(want) <= set(got), sorted(set(want) - set(got))[:5]
    changed = [key for key in want if not torch.equal(want[key], base[key])]
    assert changed and {key.removeprefix("diffusion_model.") for key in patched_model.patches} == set(changed)
    worst_abs = max((got[key] - want[key]).abs().max().item() for key in want)
    worst_rel = max(((got[key] - want[key]).norm() / want[key].norm()).item() for key in changed)
    print(f"{name} {targets}: {len(changed)} weights patched, max abs {worst_abs:.2e}, max rel {worst_rel:.2e}")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["sd", "sd3", "flux"])
def test_the_diffusers_file_is_not_the_one_for_comfyui(comfy, bases, name, tmp_path, monkeypatch, caplog):
    """Why the kohya file exists (README's table): in ComfyUI the diffusers file's SD keys load not at all, and
    SD3's and Flux's at alpha = rank (ComfyUI reads no adapter metadata), here a quarter of the trained update."""
    from laionkit.families import get_family
    from laionkit.trainer.lora import EXPORT_FILE

    folder = bases[name]
    config = json.loads((folder / get_family(name).denoiser_subfolder / "config.json").read_text())
    lora_folder = write_lora(name, folder, tmp_path / "run")
    tiny_sizes(comfy, monkeypatch, name, folder)
    base = comfyui_keys(comfy, name, denoiser(name, folder).state_dict(), config)
    want = comfyui_keys(comfy, name, fused(name, folder, lora_folder), config)
    caplog.set_level(logging.WARNING)
    lora = comfy.utils.load_torch_file(str(lora_folder / EXPORT_FILE), safe_load=True)
    patched_model, _ = comfy.sd.load_lora_for_models(comfy.sd.load_diffusion_model_state_dict(dict(base)), None,
                                                     lora, 1.0, 0)
    missed = [r.message for r in caplog.records if "lora key not loaded" in r.message]
    if name == "sd":
        assert len(missed) == len(lora) and not patched_model.patches
        return
    assert not missed and patched_model.patches
    patched_model.patch_model()
    got = patched_model.model.diffusion_model.state_dict()
    for key in [key for key in want if not torch.equal(want[key], base[key])]:
        torch.testing.assert_close(got[key] - base[key], RANK / ALPHA * (want[key] - base[key]), rtol=1e-4,
                                   atol=1e-6, msg=key)


@pytest.mark.parametrize("prediction", ["v_prediction", "epsilon"])
@pytest.mark.parametrize("name", ["sdxl", "sd"])
def test_single_file_loads_with_its_prediction_type(comfy, bases, name, prediction, tmp_path, monkeypatch):
    """comfy.sd.load_checkpoint_guess_config of `laionkit export --format single-file` of a pipeline: an SDXL
    v-prediction one is a v-prediction model in ComfyUI (the file's ``v_pred`` key), an epsilon one epsilon. ComfyUI
    reads no key for SD 1.x: a v-prediction SD 1.x file loads as epsilon there whatever it holds (what README and
    FORMATS tell users to mend with a ModelSamplingDiscrete node)."""
    from safetensors import safe_open

    from laionkit.trainer.singlefile import write_single_files

    run = tmp_path / "run"
    shutil.copytree(bases[name], run / "pipeline")
    scheduler = run / "pipeline" / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "prediction_type": prediction}))
    [path] = write_single_files(run)
    with safe_open(str(path), "pt") as handle:
        assert ("v_pred" in handle.keys()) == (prediction == "v_prediction")
    tiny_sizes(comfy, monkeypatch, name, bases[name])
    model = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]
    want = "V_PREDICTION" if prediction == "v_prediction" and name == "sdxl" else "EPS"
    assert model.model.model_type.name == want
    assert isinstance(model.model.model_sampling, getattr(comfy.model_sampling, want))
