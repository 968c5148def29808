"""Single-file checkpoints (opt-in: ``--export pipeline,single-file`` or ``laionkit export RUN --format
single-file``) are converted from RUN/pipeline into the layouts ComfyUI and A1111 load, the inverse of
diffusers' single_file_utils conversions: SD 1.x/2.x and SDXL as one CompVis/SGM checkpoint (UNet, VAE and
text encoders), SD3 and Flux as the denoiser alone (ComfyUI's diffusion_models/ file; Flux in BFL's key names).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from laionkit.common import LaionkitError, atomic_output
from laionkit.trainer.pipeline_folder import PIPELINE, SINGLE_FILE, VARIANT

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
    spec = single_file_family(pipeline)
    if spec is None:
        name = json.loads((pipeline / "model_index.json").read_text())["_class_name"]
        raise LaionkitError(f"{pipeline}: single-file checkpoints exist for {', '.join(SINGLE_FILE_FAMILIES)}; "
                            f"this is {name}: load the pipeline folder instead")
    from safetensors.torch import save_file

    tensors = single_file_state_dict(pipeline, spec.name)
    path = run / SINGLE_FILE / f"{run.name}-{spec.name}.safetensors"
    with atomic_output(path) as tmp:
        save_file({key: value.contiguous() for key, value in tensors.items()}, str(tmp),
                  metadata={"format": "pt", "laionkit_family": spec.name})
    return [path]


def single_file_family(pipeline: Path):
    """The FamilySpec of a pipeline folder whose family has a single-file layout (SINGLE_FILE_FAMILIES), else
    None: the others' pipelines are what ComfyUI and diffusers load."""
    from laionkit.families import families, get_family

    name = json.loads((pipeline / "model_index.json").read_text())["_class_name"]
    spec = next((get_family(f) for f in families() if get_family(f).pipeline_class == name), None)
    return spec if spec is not None and spec.name in SINGLE_FILE_FAMILIES else None


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
    out.update(prediction_keys(pipeline))
    return out


def prediction_keys(pipeline: Path) -> dict:
    """``v_pred`` (an empty tensor) for a v-prediction pipeline: a CompVis / SGM checkpoint has no scheduler, and
    ComfyUI's SDXL loader takes one without the key for epsilon-prediction. ComfyUI's SD 2.x loader guesses
    v-prediction from the weights instead, and its SD 1.x loader never does (docs/FORMATS.md §4a)."""
    import torch

    scheduler = pipeline / "scheduler" / "scheduler_config.json"
    config = json.loads(scheduler.read_text()) if scheduler.is_file() else {}
    return {"v_pred": torch.tensor([])} if config.get("prediction_type") == "v_prediction" else {}


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
