"""What a finished run hands to other tools: a complete diffusers pipeline folder and single-file checkpoints.

``RUN/unet`` (or ``RUN/transformer``) alone needs the base model at hand to generate; ``RUN/pipeline`` is the
family's whole pipeline (``model_index.json``, the trained denoiser, the VAE, text encoders, tokenizers and a
scheduler), so ``DiffusionPipeline.from_pretrained(RUN/pipeline)`` generates with no model id. Its parts come
from, in order: the trained denoiser (its EMA weights under --ema, as diffusers' train_text_to_image.py saves
them into its final pipeline); the encoders the latents were encoded with (the latent manifest's ``models``),
where they are local folders; else the base model (--unet / --transformer); else the manifest's hub ids. The
scheduler is the base's (or the family's sampler) with the noise schedule training used (betas, prediction
type), so a run with --prediction-type v_prediction samples as it was trained.

Files: the denoiser is hard-linked from RUN/unet(_ema) (both are this run's outputs of the same weights);
the base's components are copied by default (``--export-files copy``): a hard link into a base folder or the
hub cache would let a later in-place write into RUN/pipeline (save_pretrained overwrites files in place)
change the base model of every other run. ``--export-files hardlink`` saves the space (GBs for SDXL, SD3,
Flux) where the base lies on the same filesystem, and copies where it does not. No symlinks: a pipeline
folder copied, archived or uploaded elsewhere must stay whole.

Single-file checkpoints (opt-in: ``--export pipeline,single-file`` or ``laionkit export RUN --format
single-file``) are converted from RUN/pipeline into the layouts ComfyUI and A1111 load, the inverse of
diffusers' single_file_utils conversions: SD 1.x/2.x and SDXL as one CompVis/SGM checkpoint (UNet, VAE and
text encoders), SD3 and Flux as the denoiser alone (ComfyUI's diffusion_models/ file; Flux in BFL's key names).

LoRA runs (``--lora-rank``) write no pipeline by default (``--export auto``): the base is unchanged, RUN/lora
loads onto it (laionkit/lora.py), and a merged copy of the base costs its whole size again (a Flux transformer:
48 GB in fp32). ``--export pipeline`` (or ``laionkit export RUN --format pipeline``) writes one with the adapters
merged into the denoiser at the trained strength (alpha / rank): the base's denoiser in fp32, RUN/lora (RUN/lora_ema
under --ema) loaded as users load it (diffusers' ``load_lora_adapter``, what ``pipe.load_lora_weights`` calls, with
the file's alpha metadata; PixArt: PEFT's ``PeftModel.from_pretrained``), fused (``fuse_lora`` / ``merge_and_unload``)
and saved as a plain model, so the pipeline generates as the trained model with no LoRA loader at hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from laionkit.common import LaionkitError, atomic_output
from laionkit.trainer.trainchecks import FILE_MODES, FORMATS, parse_formats

PIPELINE = "pipeline"
SINGLE_FILE = "single_file"  # RUN/single_file/<name>.safetensors
# Files a component folder needs: configs, tokenizer files, safetensors weights (no pickles, no other
# frameworks' weights, no precision variants when the plain file is there).
KEEP_SUFFIXES = (".json", ".txt", ".model", ".safetensors")
VARIANT = re.compile(r"\.(fp16|bf16|fp32|non_ema|ema)\.(safetensors|json)$|\.index\.(fp16|bf16)\.json$")
# The sampler a family's pipeline gets when no base model brings one (DDPM families; flow families use
# FamilySpec.sampler).
DEFAULT_SAMPLERS = {"sd": "EulerDiscreteScheduler", "sdxl": "EulerDiscreteScheduler",
                    "pixart": "DPMSolverMultistepScheduler"}
# The trained noise schedule, carried into the pipeline's scheduler.
SCHEDULE_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas", "prediction_type",
                 "steps_offset")



def after_training(accelerator, config, data, noise_scheduler) -> None:
    """train's finish hook (rank 0 writes, every rank waits): RUN/pipeline and the single files asked for."""
    formats = parse_formats(config.export, config.lora_rank is not None)
    if formats and accelerator.is_main_process:
        run, base = Path(config.output), _base(config, data.family)
        merged = merge_lora(run, data.family, base, config.ema) if config.lora_rank is not None else None
        folder = write_pipeline(run, data.family, data.models, base=base, noise_scheduler=noise_scheduler,
                                use_ema=config.ema, files=config.export_files, denoiser=merged)
        accelerator.print(f"pipeline: {folder} (DiffusionPipeline.from_pretrained loads it)")
        if "single-file" in formats:
            for path in write_single_files(Path(config.output)):
                accelerator.print(f"single file: {path}")
    accelerator.wait_for_everyone()


def _base(config, spec) -> str | None:
    return spec.presets.get(config.unet, config.unet) if config.unet else None


# --- the pipeline folder ---------------------------------------------------------------------------

def write_pipeline(run: Path, spec, models: dict, base: str | None, noise_scheduler=None, use_ema: bool = False,
                   files: str = "copy", denoiser=None) -> Path:
    """RUN/pipeline: ``spec``'s pipeline with the run's denoiser, the latents' encoders (``models``, the latent
    manifest's record) or ``base``'s, and a scheduler with the trained schedule; written atomically.
    ``denoiser`` writes the denoiser folder it is given (a LoRA run's merge); by default RUN/unet (or its EMA)."""
    import diffusers

    trained = run / (f"{spec.denoiser_subfolder}_ema" if use_ema else spec.denoiser_subfolder)
    if denoiser is None and not (trained / "config.json").is_file():
        raise LaionkitError(f"{trained} holds no exported denoiser (config.json): is {run} a finished run?")
    pipeline_class = getattr(diffusers, spec.pipeline_class)
    components, config_keys = pipeline_class._get_signature_keys(pipeline_class)
    base_index = _read_index(base)
    index = {"_class_name": spec.pipeline_class, "_diffusers_version": diffusers.__version__}
    index.update({key: value for key, value in base_index.items() if key in config_keys})
    with atomic_output(run / PIPELINE) as tmp:
        tmp.mkdir()
        for name in components:
            if name == spec.denoiser_subfolder:
                if denoiser is None:
                    _place(trained, tmp / name, "hardlink")
                else:
                    denoiser(tmp / name)
                index[name] = ["diffusers", spec.denoiser_class]
            elif name == "scheduler":
                index[name] = _write_scheduler(tmp / name, spec, base, noise_scheduler)
            else:
                found = _component(name, models, base, base_index)
                if found is None:
                    if name not in pipeline_class._optional_components:
                        raise LaionkitError(f"{spec.pipeline_class} needs a {name}, found neither in the latent "
                                            f"manifest's models nor in the base model {base}")
                    index[name] = [None, None]
                    continue
                folder, entry = found
                _place(folder, tmp / name, files)
                index[name] = entry or _entry(tmp / name)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return run / PIPELINE


def _read_index(source: str | None) -> dict:
    """A base pipeline's model_index.json (local folder, or a hub repo through the cache / the hub); {} if none."""
    if not source:
        return {}
    path = Path(source).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        return json.loads(index.read_text()) if index.is_file() else {}
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        return {}
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(source, "model_index.json")).read_text())
    except Exception:  # noqa: BLE001 - a repo without an index (a bare component repo): no base pipeline
        return {}


def _component(name: str, models: dict, base: str | None, base_index: dict) -> tuple[Path, list | None] | None:
    """Where component ``name`` comes from: the latent manifest's local folder, the base's, the manifest's hub id."""
    record = models.get(name) or {}
    if record.get("local") and record.get("location"):
        folder = Path(record["location"]) / (record.get("subfolder") or "")
        if folder.is_dir():
            entry = _read_index(record["location"]).get(name) if record.get("subfolder") == name else None
            return folder, entry
    if base and (base_index.get(name) or [None])[0] is not None:
        return _fetch(base, name), base_index[name]
    if record.get("location"):
        return _fetch(record["location"], record.get("subfolder")), None
    return None


def _fetch(location: str, subfolder: str | None) -> Path:
    """A local folder's component, or a hub repo's from the cache (downloaded if missing, unless offline)."""
    path = Path(location).expanduser()
    if path.is_dir():
        folder = path / (subfolder or "")
    else:
        from huggingface_hub import snapshot_download

        prefix = f"{subfolder}/" if subfolder else ""
        try:
            root = snapshot_download(location, allow_patterns=[prefix + "*" + suffix for suffix in KEEP_SUFFIXES])
        except Exception as error:  # noqa: BLE001 - offline, gated, missing: say which component
            raise LaionkitError(f"cannot fetch {prefix or 'the root of '}{location} for the pipeline: {error}") from None
        folder = Path(root) / (subfolder or "")
    if not folder.is_dir():
        raise LaionkitError(f"{folder} not found: the pipeline's {subfolder} cannot be assembled")
    return folder


def _place(source: Path, target: Path, files: str) -> None:
    """The component's files (KEEP_SUFFIXES, no variants where the plain file exists) into ``target``, hard
    linked where ``files`` says so and the filesystem allows, else copied (symlinks followed)."""
    target.mkdir(parents=True)
    names = {path.name for path in source.iterdir() if path.is_file()}
    for name in sorted(names):
        if not name.endswith(KEEP_SUFFIXES):
            continue
        if VARIANT.search(name) and VARIANT.sub(lambda m: f".{m.group(2)}" if m.group(2) else ".index.json", name) in names:
            continue
        real = (source / name).resolve()
        if files == "hardlink":
            try:
                os.link(real, target / name)
                continue
            except OSError:  # another filesystem (or no hard links there): a copy
                pass
        shutil.copyfile(real, target / name)


def _entry(folder: Path) -> list:
    """model_index.json's [library, class] of a component folder, from its own config."""
    config = folder / "config.json"
    if (folder / "tokenizer_config.json").is_file() and not config.is_file():
        import transformers

        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class") or "CLIPTokenizer"
        return ["transformers", named if hasattr(transformers, named) else named.removesuffix("Fast")]
    found = json.loads(config.read_text()) if config.is_file() else {}
    if "_class_name" in found:
        return ["diffusers", found["_class_name"]]
    if found.get("architectures"):
        return ["transformers", found["architectures"][0]]
    raise LaionkitError(f"{folder}: no config names the component's class (config.json / tokenizer_config.json)")


def _write_scheduler(target: Path, spec, base: str | None, noise_scheduler) -> list:
    """The base's scheduler (or the family's sampler) with the trained noise schedule."""
    import diffusers

    config, name = {}, None
    if base and (_read_index(base).get("scheduler") or [None])[0] is not None:
        folder = _fetch(base, "scheduler")
        config = json.loads((folder / "scheduler_config.json").read_text())
        name = config.get("_class_name")
    if name is None:
        if spec.sampler is not None:
            config, name = dict(spec.sampler), "FlowMatchEulerDiscreteScheduler"
        else:
            name = DEFAULT_SAMPLERS.get(spec.name, "EulerDiscreteScheduler")
    if noise_scheduler is not None:
        config.update({key: noise_scheduler.config[key] for key in SCHEDULE_KEYS if key in noise_scheduler.config})
    config = {key: value for key, value in config.items() if not key.startswith("_")}
    getattr(diffusers, name).from_config(config).save_pretrained(target)
    return ["diffusers", name]


def merge_lora(run: Path, spec, base: str | None, use_ema: bool = False):
    """A LoRA run's denoiser writer for write_pipeline: the base's denoiser (fp32) with RUN/lora (RUN/lora_ema)
    loaded by the family's own loader and fused, saved as a plain model (see the module docstring)."""
    from laionkit.trainer.lora import EXPORT_FILE

    folder = run / ("lora_ema" if use_ema else "lora")
    peft_folder = (folder / "adapter_config.json").is_file()
    if not base:
        raise LaionkitError(f"{run} is a LoRA run without a recorded base (--unet / --transformer): its adapters "
                            "cannot be merged into a pipeline")
    if not (peft_folder or (folder / EXPORT_FILE).is_file()):
        raise LaionkitError(f"{folder} holds no LoRA export ({EXPORT_FILE} or adapter_config.json): is {run} a "
                            "finished LoRA run?")

    def write(target: Path) -> None:
        import diffusers
        import torch
        from peft.tuners.tuners_utils import BaseTunerLayer

        from laionkit.common.models import _from_pretrained

        model = _from_pretrained(getattr(diffusers, spec.denoiser_class), base, spec.denoiser_subfolder,
                                 torch_dtype=torch.float32)
        if peft_folder:  # PixArt: PEFT's adapter folder (its pipeline loads no LoRA)
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(folder))
            layers = sum(isinstance(module, BaseTunerLayer) for module in model.modules())
            model = model.merge_and_unload()
        else:
            model.load_lora_adapter(str(folder), prefix=spec.denoiser_subfolder, weight_name=EXPORT_FILE)
            layers = sum(isinstance(module, BaseTunerLayer) for module in model.modules())
            model.fuse_lora(lora_scale=1.0)
            model.unload_lora()
        _check_all_merged(folder, layers, peft_folder)
        model.save_pretrained(target, safe_serialization=True)

    return write


def _check_all_merged(folder: Path, layers: int, peft_folder: bool) -> None:
    """Every adapter of the file found its module in the base (a loader skips the ones that do not fit, with a
    warning at most: the merged model would silently lack them)."""
    from safetensors import safe_open

    from laionkit.trainer.lora import EXPORT_FILE

    path = folder / ("adapter_model.safetensors" if peft_folder else EXPORT_FILE)
    with safe_open(str(path), "pt") as handle:
        adapters = sum(key.endswith((".lora_A.weight", ".lora.down.weight")) for key in handle.keys())
    if layers != adapters:
        raise LaionkitError(f"{path}: {adapters} adapters, of which {layers} found their module in the base: "
                            "the base is not the one they were trained on")


# --- single-file checkpoints -------------------------------------------------------------------------

SINGLE_FILE_FAMILIES = ("sd", "sdxl", "sd3", "flux")
RESNET_PARTS = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
                "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
            "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
            "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
            "class_embedding.linear_1": "label_emb.0.0", "class_embedding.linear_2": "label_emb.0.2"}


def write_single_files(run: Path) -> list[Path]:
    """RUN/single_file/<family>.safetensors from RUN/pipeline (the weights the pipeline holds: EMA under --ema)."""
    pipeline = run / PIPELINE
    if not (pipeline / "model_index.json").is_file():
        raise LaionkitError(f"{pipeline}/model_index.json not found: export the pipeline first "
                            f"(laionkit export {run} --format pipeline)")
    from laionkit.families import families, get_family

    name = json.loads((pipeline / "model_index.json").read_text())["_class_name"]
    spec = next((get_family(f) for f in families() if get_family(f).pipeline_class == name), None)
    if spec is None or spec.name not in SINGLE_FILE_FAMILIES:
        raise LaionkitError(f"{pipeline}: single-file checkpoints exist for {', '.join(SINGLE_FILE_FAMILIES)}; "
                            f"this is {name}: load the pipeline folder instead")
    from safetensors.torch import save_file

    tensors = single_file_state_dict(pipeline, spec.name)
    path = run / SINGLE_FILE / f"{run.name}-{spec.name}.safetensors"
    with atomic_output(path) as tmp:
        save_file({key: value.contiguous() for key, value in tensors.items()}, str(tmp),
                  metadata={"format": "pt", "laionkit_family": spec.name})
    return [path]


def _load(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = sorted(path for path in folder.glob("*.safetensors") if not VARIANT.search(path.name))
    if not found:
        raise LaionkitError(f"{folder} holds no .safetensors weights to convert")
    tensors = {}
    for path in found:
        tensors.update(load_file(str(path)))
    return tensors


def single_file_state_dict(pipeline: Path, family: str) -> dict:
    """The family's original-layout state dict: CompVis / SGM keys for SD and SDXL (UNet, VAE, text
    encoders), ``model.diffusion_model.`` SD3 (MMDiT) keys, BFL's Flux keys (the transformer alone)."""
    if family == "flux":
        return flux_to_bfl(_load(pipeline / "transformer"))
    if family == "sd3":
        return {"model.diffusion_model." + k: v for k, v in sd3_to_mmdit(_load(pipeline / "transformer")).items()}
    unet_config = json.loads((pipeline / "unet" / "config.json").read_text())
    vae_config = json.loads((pipeline / "vae" / "config.json").read_text())
    out = {"model.diffusion_model." + k: v for k, v in unet_to_ldm(_load(pipeline / "unet"), unet_config).items()}
    out.update({"first_stage_model." + k: v for k, v in vae_to_ldm(_load(pipeline / "vae"), vae_config).items()})
    if family == "sdxl":
        out.update(clip_to_hf_layout(_load(pipeline / "text_encoder"), "conditioner.embedders.0.transformer."))
        out.update(clip_to_open_clip(_load(pipeline / "text_encoder_2"), "conditioner.embedders.1.model."))
    elif json.loads((pipeline / "text_encoder" / "config.json").read_text()).get("hidden_act") == "gelu":
        out.update(clip_to_open_clip(_load(pipeline / "text_encoder"), "cond_stage_model.model."))  # SD 2.x: OpenCLIP
    else:
        out.update(clip_to_hf_layout(_load(pipeline / "text_encoder"), "cond_stage_model.transformer."))
    return out


def _rename_resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{RESNET_PARTS.get(head, head)}.{tail}"


def unet_to_ldm(tensors: dict, config: dict) -> dict:
    """diffusers UNet2DConditionModel -> CompVis ``input_blocks / middle_block / output_blocks`` keys, for any
    block count and layers_per_block (the inverse of single_file_utils.convert_ldm_unet_checkpoint)."""
    per = config["layers_per_block"]
    if not isinstance(per, int):
        raise LaionkitError(f"layers_per_block {per!r} per block has no CompVis layout: export the pipeline folder")
    step = per + 1
    attended = {int(k.split(".")[1]) for k in tensors if k.startswith("up_blocks.") and ".attentions." in k}
    out = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[0] in ("down_blocks", "up_blocks"):
            block, kind, index, rest = int(parts[1]), parts[2], int(parts[3]), ".".join(parts[4:])
            if parts[0] == "down_blocks":
                if kind == "downsamplers":
                    new = f"input_blocks.{step * (block + 1)}.0.op.{rest.removeprefix('conv.')}"
                else:
                    new = f"input_blocks.{step * block + index + 1}.{0 if kind == 'resnets' else 1}."
                    new += _rename_resnet(rest) if kind == "resnets" else rest
            elif kind == "upsamplers":
                new = f"output_blocks.{step * block + per}.{2 if block in attended else 1}.{rest}"
            else:
                new = f"output_blocks.{step * block + index}.{0 if kind == 'resnets' else 1}."
                new += _rename_resnet(rest) if kind == "resnets" else rest
        elif parts[0] == "mid_block":
            kind, index, rest = parts[1], int(parts[2]), ".".join(parts[3:])
            new = (f"middle_block.{2 * index}.{_rename_resnet(rest)}" if kind == "resnets"
                   else f"middle_block.1.{rest}")
        else:
            module, _, leaf = key.rpartition(".")
            if module not in UNET_TOP:
                raise LaionkitError(f"UNet weight {key} has no CompVis name: export the pipeline folder instead")
            new = f"{UNET_TOP[module]}.{leaf}"
        out[new] = value
    return out


VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_to_ldm(tensors: dict, config: dict) -> dict:
    """diffusers AutoencoderKL -> CompVis ``encoder.down.N.block.M`` keys (attention as 1x1 convolutions)."""
    blocks = len(config["up_block_types"])
    out = {}
    for key, value in tensors.items():
        new = key
        match = re.match(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(resnets|downsamplers|upsamplers)\.(\d+)\.(.*)", key)
        mid = re.match(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.*)", key)
        if match:
            side, way, block, kind, index, rest = match.groups()
            block = int(block) if way == "down" else blocks - 1 - int(block)
            if kind == "resnets":
                new = f"{side}.{way}.{block}.block.{index}.{rest.replace('conv_shortcut', 'nin_shortcut')}"
            else:
                new = f"{side}.{way}.{block}.{'downsample' if way == 'down' else 'upsample'}.{rest}"
        elif mid:
            side, kind, index, rest = mid.groups()
            if kind == "resnets":
                new = f"{side}.mid.block_{int(index) + 1}.{rest.replace('conv_shortcut', 'nin_shortcut')}"
            else:
                module, _, leaf = rest.rpartition(".")
                new = f"{side}.mid.attn_1.{VAE_ATTENTION.get(module, module)}.{leaf}"
                if leaf == "weight" and value.ndim == 2:
                    value = value[:, :, None, None]
        else:
            new = key.replace("conv_norm_out", "norm_out")
        out[new] = value
    return out


def _text_model_keys(tensors: dict) -> dict:
    """transformers' CLIP keys with their ``text_model.`` prefix (CLIPTextModel lost it in transformers 5)."""
    return {k if k.startswith(("text_model.", "text_projection")) else "text_model." + k: v
            for k, v in tensors.items() if not k.endswith("position_ids")}


def clip_to_hf_layout(tensors: dict, prefix: str) -> dict:
    """CLIP ViT-L as SD 1.x / SDXL checkpoints hold it: transformers' own keys under ``prefix``."""
    return {prefix + k: v for k, v in _text_model_keys(tensors).items()}


OPEN_CLIP = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}


def clip_to_open_clip(tensors: dict, prefix: str) -> dict:
    """OpenCLIP (SD 2.x's ViT-H, SDXL's bigG) under ``prefix``: fused in_proj q/k/v, projection transposed."""
    import torch

    tensors, out, fused = _text_model_keys(tensors), {}, {}
    for key, value in tensors.items():
        if key == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()
        elif key == "text_model.embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif key == "text_model.embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif key.startswith("text_model.final_layer_norm."):
            out["ln_final." + key.rpartition(".")[2]] = value
        else:
            match = re.match(r"text_model\.encoder\.layers\.(\d+)\.(.*)\.(weight|bias)$", key)
            if not match:
                raise LaionkitError(f"text encoder weight {key} has no OpenCLIP name")
            layer, module, leaf = match.groups()
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                fused.setdefault((layer, leaf), {})[module[10]] = value
                continue
            out[f"transformer.resblocks.{layer}.{OPEN_CLIP.get(module, module)}.{leaf}"] = value
    for (layer, leaf), qkv in fused.items():
        out[f"transformer.resblocks.{layer}.attn.in_proj_{leaf}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    return {prefix + k: v for k, v in out.items()}


def _swap_halves(value):
    """AdaLayerNormContinuous: diffusers' (scale, shift) halves are the originals' (shift, scale)."""
    import torch

    first, second = value.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def flux_to_bfl(tensors: dict) -> dict:
    """diffusers FluxTransformer2DModel -> BFL's flux1 keys (``double_blocks.N.img_attn.qkv.weight`` ...), the
    inverse of single_file_utils.convert_flux_transformer_checkpoint_to_diffusers."""
    import torch

    t, out = dict(tensors), {}
    embedders = {"time_text_embed.timestep_embedder": "time_in", "time_text_embed.text_embedder": "vector_in",
                 "time_text_embed.guidance_embedder": "guidance_in"}
    for source, target in embedders.items():
        for leaf in ("weight", "bias"):
            for a, b in (("linear_1", "in_layer"), ("linear_2", "out_layer")):
                if f"{source}.{a}.{leaf}" in t:
                    out[f"{target}.{b}.{leaf}"] = t.pop(f"{source}.{a}.{leaf}")
    doubles = sorted({int(k.split(".")[1]) for k in t if k.startswith("transformer_blocks.")})
    singles = sorted({int(k.split(".")[1]) for k in t if k.startswith("single_transformer_blocks.")})
    for leaf in ("weight", "bias"):
        out[f"txt_in.{leaf}"] = t.pop(f"context_embedder.{leaf}")
        out[f"img_in.{leaf}"] = t.pop(f"x_embedder.{leaf}")
        out[f"final_layer.linear.{leaf}"] = t.pop(f"proj_out.{leaf}")
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = _swap_halves(t.pop(f"norm_out.linear.{leaf}"))
        for i in doubles:
            p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
            out[f"{q}img_mod.lin.{leaf}"] = t.pop(f"{p}norm1.linear.{leaf}")
            out[f"{q}txt_mod.lin.{leaf}"] = t.pop(f"{p}norm1_context.linear.{leaf}")
            out[f"{q}img_attn.qkv.{leaf}"] = torch.cat([t.pop(f"{p}attn.to_{x}.{leaf}") for x in "qkv"])
            out[f"{q}txt_attn.qkv.{leaf}"] = torch.cat([t.pop(f"{p}attn.add_{x}_proj.{leaf}") for x in "qkv"])
            out[f"{q}img_attn.proj.{leaf}"] = t.pop(f"{p}attn.to_out.0.{leaf}")
            out[f"{q}txt_attn.proj.{leaf}"] = t.pop(f"{p}attn.to_add_out.{leaf}")
            for side, ff in (("img", "ff"), ("txt", "ff_context")):
                out[f"{q}{side}_mlp.0.{leaf}"] = t.pop(f"{p}{ff}.net.0.proj.{leaf}")
                out[f"{q}{side}_mlp.2.{leaf}"] = t.pop(f"{p}{ff}.net.2.{leaf}")
        for i in singles:
            p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
            out[f"{q}modulation.lin.{leaf}"] = t.pop(f"{p}norm.linear.{leaf}")
            out[f"{q}linear1.{leaf}"] = torch.cat([t.pop(f"{p}attn.to_{x}.{leaf}") for x in "qkv"]
                                                  + [t.pop(f"{p}proj_mlp.{leaf}")])
            out[f"{q}linear2.{leaf}"] = t.pop(f"{p}proj_out.{leaf}")
    for i in doubles:
        p, q = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        for a, b in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                     ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            out[f"{q}{b}.scale"] = t.pop(f"{p}{a}.weight")
    for i in singles:
        p, q = f"single_transformer_blocks.{i}.attn.", f"single_blocks.{i}.norm."
        out[f"{q}query_norm.scale"] = t.pop(f"{p}norm_q.weight")
        out[f"{q}key_norm.scale"] = t.pop(f"{p}norm_k.weight")
    if t:
        raise LaionkitError(f"Flux weights without a BFL name: {', '.join(sorted(t)[:5])}")
    return out


def sd3_to_mmdit(tensors: dict) -> dict:
    """diffusers SD3Transformer2DModel -> the MMDiT keys of SD3's own checkpoints (``joint_blocks.N.x_block``),
    the inverse of single_file_utils.convert_sd3_transformer_checkpoint_to_diffusers."""
    import torch

    t, out = dict(tensors), {}
    out["pos_embed"] = t.pop("pos_embed.pos_embed")
    blocks = sorted({int(k.split(".")[1]) for k in t if k.startswith("transformer_blocks.")})
    last = blocks[-1]
    for leaf in ("weight", "bias"):
        out[f"x_embedder.proj.{leaf}"] = t.pop(f"pos_embed.proj.{leaf}")
        for a, b in (("timestep_embedder", "t_embedder"), ("text_embedder", "y_embedder")):
            out[f"{b}.mlp.0.{leaf}"] = t.pop(f"time_text_embed.{a}.linear_1.{leaf}")
            out[f"{b}.mlp.2.{leaf}"] = t.pop(f"time_text_embed.{a}.linear_2.{leaf}")
        out[f"context_embedder.{leaf}"] = t.pop(f"context_embedder.{leaf}")
        out[f"final_layer.linear.{leaf}"] = t.pop(f"proj_out.{leaf}")
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = _swap_halves(t.pop(f"norm_out.linear.{leaf}"))
        for i in blocks:
            p, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
            out[f"{x}attn.qkv.{leaf}"] = torch.cat([t.pop(f"{p}attn.to_{n}.{leaf}") for n in "qkv"])
            out[f"{c}attn.qkv.{leaf}"] = torch.cat([t.pop(f"{p}attn.add_{n}_proj.{leaf}") for n in "qkv"])
            out[f"{x}attn.proj.{leaf}"] = t.pop(f"{p}attn.to_out.0.{leaf}")
            out[f"{x}adaLN_modulation.1.{leaf}"] = t.pop(f"{p}norm1.linear.{leaf}")
            context = t.pop(f"{p}norm1_context.linear.{leaf}")
            out[f"{c}adaLN_modulation.1.{leaf}"] = _swap_halves(context) if i == last else context
            out[f"{x}mlp.fc1.{leaf}"] = t.pop(f"{p}ff.net.0.proj.{leaf}")
            out[f"{x}mlp.fc2.{leaf}"] = t.pop(f"{p}ff.net.2.{leaf}")
            if i != last:
                out[f"{c}attn.proj.{leaf}"] = t.pop(f"{p}attn.to_add_out.{leaf}")
                out[f"{c}mlp.fc1.{leaf}"] = t.pop(f"{p}ff_context.net.0.proj.{leaf}")
                out[f"{c}mlp.fc2.{leaf}"] = t.pop(f"{p}ff_context.net.2.{leaf}")
            if f"{p}attn2.to_q.{leaf}" in t:
                out[f"{x}attn2.qkv.{leaf}"] = torch.cat([t.pop(f"{p}attn2.to_{n}.{leaf}") for n in "qkv"])
                out[f"{x}attn2.proj.{leaf}"] = t.pop(f"{p}attn2.to_out.0.{leaf}")
    for i in blocks:
        p, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        for a, b in (("attn.norm_q", f"{x}attn.ln_q"), ("attn.norm_k", f"{x}attn.ln_k"),
                     ("attn.norm_added_q", f"{c}attn.ln_q"), ("attn.norm_added_k", f"{c}attn.ln_k"),
                     ("attn2.norm_q", f"{x}attn2.ln_q"), ("attn2.norm_k", f"{x}attn2.ln_k")):
            if f"{p}{a}.weight" in t:
                out[f"{b}.weight"] = t.pop(f"{p}{a}.weight")
    if t:
        raise LaionkitError(f"SD3 weights without an MMDiT name: {', '.join(sorted(t)[:5])}")
    return out


# --- `laionkit export RUN`: the same exports of a finished run folder --------------------------------------

def export_run(run: Path, formats: str, files: str = "copy") -> list[Path]:
    """The exports ``formats`` asks for, of a finished run folder: the pipeline rebuilt from the run's own
    record (its newest checkpoint's trainer.json: latents, base, schedule; a LoRA run's adapters merged into that
    base), single files from RUN/pipeline."""
    names = [part.strip() for part in formats.split(",") if part.strip()]
    bad = [name for name in names if name not in FORMATS]
    if bad or not names:
        raise LaionkitError(f"--format {formats!r}: a comma-separated list of {', '.join(FORMATS)}")
    if files not in FILE_MODES:
        raise LaionkitError(f"--export-files {files!r}: choose from {', '.join(FILE_MODES)}")
    written = []
    if "pipeline" in names:
        written.append(_rebuild_pipeline(run, files))
    if "single-file" in names:
        written += write_single_files(run)
    return written


def _rebuild_pipeline(run: Path, files: str) -> Path:
    from dataclasses import fields

    from laionkit.trainer.checkpoint import complete_checkpoints
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.objective import load_noise_scheduler

    found = complete_checkpoints(run)
    if not found:
        raise LaionkitError(f"{run}/checkpoints holds no complete checkpoint whose trainer.json records the run")
    recorded = json.loads((found[-1] / "trainer.json").read_text())["config"]
    known = {f.name for f in fields(TrainConfig)}
    kept = {k: v for k, v in recorded.items() if k in known and k not in ("resume", "overwrite", "export")}
    config = TrainConfig(**kept)  # its --export was what train wrote then; this is what is asked for now
    data = open_latents(config.latents)
    schedule = None if data.family.objective.kind == "flow" else load_noise_scheduler(config, data.family)
    base = _base(config, data.family)
    merged = None
    if config.lora_rank is not None:  # the adapters merged into the base they trained on
        _check_lora_base(found[-1], config, data.family)
        merged = merge_lora(run, data.family, base, config.ema)
    return write_pipeline(run, data.family, data.models, base, schedule, config.ema, files, denoiser=merged)


def _check_lora_base(checkpoint: Path, config, spec) -> None:
    """The base a LoRA run's adapters trained on (its checkpoint's record) is the base now at hand: the sha256
    of its denoiser's weights files agree (adapters merged into another base give another model)."""
    from safetensors import safe_open

    from laionkit.trainer.lora import ADAPTER_FILE, BASE_KEY, base_identity

    with safe_open(str(checkpoint / ADAPTER_FILE), "pt") as handle:
        found = json.loads((handle.metadata() or {}).get(BASE_KEY, "null"))
    have = base_identity(config, spec) if found else None
    common = set(found["files"]) & set(have["files"]) if found and have else None
    if common is not None and (not common or any(found["files"][name] != have["files"][name] for name in common)):
        raise LaionkitError(f"{checkpoint / ADAPTER_FILE}: its adapters were trained on another {found['source']} "
                            "than the one now there (the sha256 of its weights files differ): merging them into "
                            "it would give another model")
