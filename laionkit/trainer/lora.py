"""LoRA for `laionkit train --lora-rank N`: PEFT adapters on a frozen denoiser, checkpointed and exported alone.

Why its own module: the loop (loop.py) stays one loop for full and adapter training; the differences live here and
it calls them at four marked points (after the model is built, checkpoint hooks, resume check,
export). The invariants:

- only adapter parameters require grad, so the optimizer, clipping, EMA, the rank fingerprint and
  MasterWeights (which copies exactly the parameters that require grad) cover the adapters alone;
- the frozen base runs in the mixed-precision dtype: MasterWeights casts the whole model to bf16 and
  keeps fp32 copies of the adapters; under autocast the base is cast here and the adapters stay fp32,
  as diffusers' train_text_to_image_lora.py does;
- a checkpoint holds the adapters (``adapter.safetensors``, with the LoRA settings and the base's identity,
  the sha256 of its weights files, as metadata) and no base weights: accelerate's model file is suppressed
  by a save hook and its load replaced by ours, so a resume reads data only, and a run with other LoRA
  settings or onto another base is refused before anything loads; a from-scratch base (random, never
  saved) takes no adapters unless ``--lora-random-base`` asks for it (throughput measurements);
- under FSDP the frozen base is sharded with the adapters (in bf16 under bf16 mixed precision; the adapters
  stay fp32, which FSDP2 allows: only trainable parameters must share a dtype). accelerate then saves and
  loads the model itself, as sharded distributed checkpoints, before and regardless of the hooks, so the
  denoiser's ``state_dict`` is made its adapters (``expose_adapters_only``): ``pytorch_model_fsdp_0/``
  holds the adapters' shards and is what a resume loads; ``adapter.safetensors`` (gathered) is written too,
  for the settings check and for users;
- the export is what diffusers' ``pipe.load_lora_weights(RUN/lora)`` reads: the pipeline class's own
  ``save_lora_weights`` on ``convert_state_dict_to_diffusers(get_peft_model_state_dict(denoiser))``, with
  whole adapter tensors (gathered from the ranks' shards under FSDP), and the LoRA config (rank, alpha,
  targets) as its ``lora_adapter_metadata``, without which the loader takes alpha = rank; beside it
  ``lora_kohya.safetensors``, the same adapters in kohya / ComfyUI naming with an ``.alpha`` per module, every
  family (``kohya_layers``): ComfyUI reads no adapter metadata, and its key maps read none of the diffusers
  file's SD / SDXL names. Each export folder names the run's newest checkpoint (exportrecord.record_export).
  (Sana's SanaPipeline loads its RUN/lora the same way.) PixArt's transformer has no ``add_adapter`` and its pipeline loads no LoRA: PEFT injects the adapters
  (``inject_adapter_in_model``, as PixArt's own LoRA script wraps the transformer in PEFT), and RUN/lora is
  PEFT's adapter folder, which ``PeftModel.from_pretrained(transformer, RUN/lora)`` loads. ``--export pipeline``
  adds RUN/pipeline, RUN/lora merged into a copy of the base through those loaders (laionkit/trainer/pipeline_folder.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from laionkit.common import LaionkitError, atomic_output, refuse_other_settings
from laionkit.trainer import quantized_base
from laionkit.trainer.trainchecks import targets
from laionkit.trainer.wrappers import unwrap

ADAPTER_FILE = "adapter.safetensors"
EXPORT_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "lora_kohya.safetensors"  # the same adapters in kohya's sd-scripts / ComfyUI naming (kohya_layers)


def settings(config) -> dict:
    """The LoRA settings a checkpoint records and a resume must match (they shape or change the adapters)."""
    found = {"lora_rank": config.lora_rank, "lora_alpha": alpha(config), "lora_dropout": config.lora_dropout,
             "lora_targets": targets(config)}
    if config.base_dtype != "bf16":  # the adapters learned the quantized base's error; bf16 checkpoints lack the key
        found["base_dtype"] = config.base_dtype
    return found


def alpha(config) -> float:
    return float(config.lora_alpha if config.lora_alpha is not None else config.lora_rank)



@contextlib.contextmanager
def drawn_in_low_precision(config, accelerator):
    """While a --lora-random-base run's bf16 base is drawn (under bf16 mixed precision, no --base-dtype
    quantization): floats default to bf16, so the frozen base is drawn as it will train and never exists in
    fp32 (a 20B model's fp32 is 76 GiB, nearly a whole 80 GB card, for the moment before the cast)."""
    low = accelerator.mixed_precision == "bf16" and config.lora_rank is not None and config.lora_random_base \
        and config.unet is None and config.base_dtype == "bf16"
    previous = torch.get_default_dtype()
    if low:
        torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def attach(unet, config, accelerator, family) -> None:
    """Freeze ``unet`` and add the adapters (in place), with the dtype policy of the module docstring; the base's
    block linears first become quantized_base.FrozenLinear under --base-dtype / --fp8."""
    from accelerate.utils import DistributedType
    from peft import LoraConfig

    from laionkit.trainer.precision import MasterWeights

    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_GPU,
                                            DistributedType.MULTI_CPU, DistributedType.FSDP):
        raise LaionkitError(f"--lora-rank runs on one device, DDP or FSDP, not {accelerator.distributed_type.value}: "
                            "launch with train/ddp.yaml or train/fsdp.yaml")
    unet.requires_grad_(False)
    quantized_base.freeze(unet, config, accelerator, family.block_classes)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if low is not None and not MasterWeights.wanted(config, accelerator):
        torch.nn.Module.to(unet, low)  # not diffusers' .to, which warns to use from_pretrained
    lora = LoraConfig(r=config.lora_rank, lora_alpha=alpha(config), lora_dropout=config.lora_dropout,
                      init_lora_weights="gaussian", target_modules=targets(config))
    try:
        if hasattr(unet, "add_adapter"):  # diffusers' PEFT integration: what its pipelines' LoRA loaders read
            unet.add_adapter(lora)
        else:  # PixArt's transformer has none: PEFT injects the same layers (PixArt's own LoRA recipe)
            from peft import inject_adapter_in_model

            inject_adapter_in_model(lora, unet)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        raise LaionkitError(f"--lora-targets {config.lora_targets}: {str(error).splitlines()[0]}") from None
    for param in unet.parameters():
        if param.requires_grad:
            param.data = param.data.float()


def seed_dropout(config, rank: int, step: int) -> None:
    """LoRA dropout draws its masks from torch's global RNG, which a resume does not bring back to the
    same point (the data loader, built after the checkpoint loads, draws from it too). Seeding it per
    (seed, rank, step) makes the masks a function of the step, so a resumed run draws what the
    uninterrupted one drew. Nothing else in the loop uses the global RNG."""
    if config.lora_rank is not None and config.lora_dropout:
        torch.manual_seed(hash((config.seed, rank, step)) & (2**63 - 1))


def trainable(unet) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in unet.named_parameters() if p.requires_grad]


@torch.no_grad()
def adapters(unet) -> dict[str, torch.Tensor]:
    """The adapter weights by name as whole tensors. Under FSDP each rank holds a shard of each (a DTensor),
    gathered here: a collective, so every rank calls it, and all get the whole tensors."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in trainable(unet)}


def expose_adapters_only(unet) -> None:
    """The denoiser's ``state_dict`` becomes its adapters, and loading one forgives the missing frozen base:
    under FSDP this is what accelerate's sharded checkpoint writes and reads (see the module docstring)."""
    names = {name for name, _ in trainable(unet)}

    def keep_adapters(_module, state, prefix, _metadata) -> None:
        for key in [key for key in state if key[len(prefix):] not in names]:
            del state[key]

    def base_is_not_missing(_module, incompatible) -> None:
        incompatible.missing_keys[:] = [key for key in incompatible.missing_keys if key in names]

    unet.register_state_dict_post_hook(keep_adapters)
    unet.register_load_state_dict_post_hook(base_is_not_missing)


def register_checkpoint_hooks(accelerator, unet, config, family) -> None:
    """accelerate saves and loads the optimizer, scheduler and RNG states; the model's part is ours (under FSDP:
    accelerate's sharded model checkpoint, of the adapters only, and adapter.safetensors beside it)."""
    from accelerate.utils import DistributedType
    from safetensors.torch import load_file, save_file

    if accelerator.distributed_type == DistributedType.FSDP:
        expose_adapters_only(unwrap(accelerator, unet))

    def save(models, weights, output_dir) -> None:
        weights.clear()  # no model.safetensors: the frozen base is not part of the checkpoint
        named = adapters(unwrap(accelerator, models[0]))  # every rank: gathers FSDP shards
        if accelerator.is_main_process:
            recorded = {"laionkit_lora": json.dumps(settings(config)),
                        BASE_KEY: json.dumps(base_identity(config, family))}
            save_file({name: p.contiguous().cpu() for name, p in named.items()},
                      str(Path(output_dir) / ADAPTER_FILE), metadata=recorded)

    def load(models, input_dir) -> None:
        if accelerator.distributed_type == DistributedType.FSDP:  # accelerate loaded the adapters' shards
            return
        model = unwrap(accelerator, models.pop(0))
        path = Path(input_dir) / ADAPTER_FILE
        stored = load_file(str(path))
        named = dict(trainable(model))
        if set(stored) != set(named) or any(stored[n].shape != p.shape for n, p in named.items()):
            raise LaionkitError(f"{path}: its adapters do not fit this model (another --unet or --unet-config?)")
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(stored[name])

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


BASE_KEY = "laionkit_lora_base"  # adapter.safetensors metadata: base_identity of the frozen base it trained on
BASE_SUFFIXES = (".safetensors", ".bin")  # the weights files; configs may differ for the same weights


_HASHED: dict[tuple, dict | None] = {}


def _weights_hashes(source: str, component: str) -> dict | None:
    """sha256 per weights file of the component, hashed once per process and file version (a local file is
    hashed again when its size or mtime changes; hub cache files never change)."""
    from laionkit.common.models import fingerprint, resolve_source

    where = resolve_source(source, component)
    key: tuple = (source, component)
    if where.local:
        folder = Path(where.location, where.subfolder or "")
        key += tuple((file.name, file.stat().st_size, file.stat().st_mtime_ns) for file in sorted(folder.iterdir())
                     if file.name.endswith(BASE_SUFFIXES))
    if key not in _HASHED:
        files = fingerprint(source, component).get("files")
        _HASHED[key] = {name: sha for name, sha in files.items() if name.endswith(BASE_SUFFIXES)} if files else None
    return _HASHED[key]


def base_identity(config, family) -> dict | None:
    """The frozen base the adapters train on: --unet / --transformer as given and the sha256 of its denoiser's
    weights files (adapters are deltas to one set of weights; on another base they mean something else).
    None where the files cannot be found (a hub model missing from the local cache)."""
    if config.unet is None:
        return None
    hashes = _weights_hashes(family.presets.get(config.unet, config.unet), family.denoiser_subfolder)
    return {"source": config.unet, "files": hashes} if hashes else None


def _refuse_other_base(folder: Path, found: dict | None, config, family) -> None:
    """Same base: the weights files both record agree, and there is one at least. A checkpoint from before
    the base was recorded, or a base whose files cannot be found, is not checked."""
    have = base_identity(config, family) if found else None
    if not found or not have:
        return
    common = sorted(set(found["files"]) & set(have["files"]))
    differ = [name for name in common if found["files"][name] != have["files"][name]]
    if common and not differ:
        return
    name = (differ or sorted(found["files"]))[0]
    other = differ[0] if differ else sorted(have["files"])[0]
    flag = f"--{family.denoiser_subfolder}"
    raise LaionkitError(
        f"--resume {folder}: its adapters were trained on the base {found['source']} ({name} sha256 "
        f"{found['files'][name][:12]}), this run's {flag} {config.unet} is another ({other} sha256 "
        f"{have['files'][other][:12]}); adapters only fit the base they trained on: resume with {flag} "
        f"{found['source']} or start a new run")


def check_resume(folder: Path, config, family) -> None:
    """A full-model checkpoint and an adapter checkpoint are not interchangeable, nor adapters of other
    LoRA settings or trained on another base: say so in one line, before anything loads."""
    from safetensors import safe_open

    has_adapters = (folder / ADAPTER_FILE).is_file()
    if config.lora_rank is not None and not has_adapters:
        raise LaionkitError(f"--resume {folder}: it holds no {ADAPTER_FILE} (written by a run without "
                            "--lora-rank); resume it without --lora-rank or start a new run")
    if config.lora_rank is None and has_adapters:
        raise LaionkitError(f"--resume {folder}: it holds LoRA adapters only (written with --lora-rank); "
                            "give the same --lora-rank to resume it")
    if has_adapters:
        with safe_open(str(folder / ADAPTER_FILE), "pt") as handle:
            metadata = handle.metadata() or {}
        found = json.loads(metadata.get("laionkit_lora", "{}"))
        refuse_other_settings(folder, found, settings(config), "trained",
                              "exact resume needs the same --lora-rank, --lora-alpha, --lora-dropout, --lora-targets, "
                              "--base-dtype")
        _refuse_other_base(folder, json.loads(metadata.get(BASE_KEY, "null")), config, family)


def export(accelerator, unet, ema, master, output: Path) -> None:
    """RUN/lora (and RUN/lora_ema with --ema) in diffusers' LoRA format, the fp32 adapter weights (the
    master copies with MasterWeights, not their bf16 rounding; under FSDP gathered from the ranks' shards)."""
    model = unwrap(accelerator, unet)
    named = adapters(model) if master is None else dict(zip(master.names, master.master))  # every rank
    if accelerator.is_main_process:
        names = list(named)
        skipped = _save_lora(model, named, output / "lora")
        if ema is not None:
            _save_lora(model, dict(zip(names, ema.shadow_params)), output / "lora_ema")
        if skipped:
            accelerator.print(f"{output / 'lora'}: no {KOHYA_FILE}: {skipped}")
    accelerator.wait_for_everyone()


# The transformers whose pipeline loads LoRA (its save_lora_weights writes RUN/lora), by class name. FLUX.2's
# klein and dev pipelines share Flux2LoraLoaderMixin (one file format); Flux2Pipeline is in diffusers 0.36 too.
TRANSFORMER_LORA_PIPELINES = {"SD3Transformer2DModel": "StableDiffusion3Pipeline", "FluxTransformer2DModel": "FluxPipeline",
                              "QwenImageTransformer2DModel": "QwenImagePipeline", "ZImageTransformer2DModel": "ZImagePipeline",
                              "SanaTransformer2DModel": "SanaPipeline",
                              "Flux2Transformer2DModel": "Flux2Pipeline"}


def _save_lora(model, named: dict, folder: Path) -> str | None:
    """Write ``folder``; returns why the kohya file was left out, where one was expected but cannot be."""
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    from laionkit.trainer.exportrecord import record_export

    state = {name: value.detach().float().cpu().contiguous() for name, value in named.items()}
    peft_layers = get_peft_model_state_dict(model, state_dict=state)
    kohya, skipped = kohya_layers(model, peft_layers)
    # isinstance, not the class name: FSDP2 swaps the model's class for a subclass named FSDP<class>.
    if isinstance(model, diffusers.UNet2DConditionModel):
        pipeline, keyword = diffusers.StableDiffusionPipeline, "unet_lora_layers"
    elif isinstance(model, tuple(getattr(diffusers, name) for name in TRANSFORMER_LORA_PIPELINES)):
        # their pipelines name the denoiser "transformer"
        pipeline = next(getattr(diffusers, pipeline) for name, pipeline in TRANSFORMER_LORA_PIPELINES.items()
                        if isinstance(model, getattr(diffusers, name)))
        keyword = "transformer_lora_layers"
    else:  # PixArt: its pipeline loads no LoRA; PEFT's own adapter folder, for PeftModel.from_pretrained
        _save_peft_adapter(model, peft_layers, folder, kohya)
        return skipped
    layers = convert_state_dict_to_diffusers(peft_layers)
    if any(".lora_A." in key or ".lora_B." in key for key in layers):
        # --lora-targets beyond attention (time_emb_proj, add_k_proj, ...): diffusers' converter renames only
        # attention layers, and its loader picks one naming from the first key and drops the other's layers
        # without an error, so the whole file keeps PEFT's names, which the loader reads as they are.
        layers = peft_layers
    with atomic_output(folder) as tmp:
        pipeline.save_lora_weights(str(tmp), **{keyword: layers},
                                   **{keyword.replace("_layers", "_adapter_metadata"): adapter_metadata(model)},
                                   weight_name=EXPORT_FILE)
        _save_kohya(model, kohya, tmp)
        record_export(tmp, folder.parent)
    return skipped


def _save_kohya(model, kohya: dict | None, folder: Path) -> None:
    """KOHYA_FILE in ``folder``, with the rank and alpha in kohya's metadata keys too (where one was made)."""
    from safetensors.torch import save_file

    if kohya:
        config = model.peft_config["default"]
        save_file(kohya, str(folder / KOHYA_FILE), metadata={
            "format": "pt", "ss_network_module": "networks.lora", "ss_network_dim": str(config.r),
            "ss_network_alpha": str(config.lora_alpha)})


def adapter_metadata(model) -> dict:
    """The LoraConfig diffusers' loader rebuilds the adapters with (the safetensors metadata key
    ``lora_adapter_metadata``, under the denoiser's prefix): without it, it infers the rank from the tensors and
    takes alpha = rank, so a run with --lora-alpha != --lora-rank would load at the wrong strength. Only the
    fields that shape the adapters, not PEFT's whole ``to_dict()``: the loader passes them to ``LoraConfig(**...)``,
    and an older PEFT than the trainer's refuses the fields it does not know. The (empty) rank and alpha patterns
    too: diffusers 0.36's loader reads ``rank_pattern`` from the metadata unguarded (a KeyError without it)."""
    config = model.peft_config["default"]
    return {"r": config.r, "lora_alpha": config.lora_alpha, "target_modules": sorted(config.target_modules),
            "rank_pattern": dict(config.rank_pattern or {}), "alpha_pattern": dict(config.alpha_pattern or {})}


# Flux's modules in BFL's layout (what kohya's sd-scripts and ComfyUI name), per diffusers module of a block:
# (BFL module, part, parts). BFL fuses q, k, v (and, in single blocks, the MLP's input) into one linear layer
# whose output rows are the parts in this order; diffusers' _convert_kohya_flux_lora_to_diffusers splits them.
FLUX_DOUBLE = {"attn.to_q": ("img_attn_qkv", 0, 3), "attn.to_k": ("img_attn_qkv", 1, 3),
               "attn.to_v": ("img_attn_qkv", 2, 3), "attn.to_out.0": ("img_attn_proj", 0, 1),
               "attn.add_q_proj": ("txt_attn_qkv", 0, 3), "attn.add_k_proj": ("txt_attn_qkv", 1, 3),
               "attn.add_v_proj": ("txt_attn_qkv", 2, 3), "attn.to_add_out": ("txt_attn_proj", 0, 1),
               "ff.net.0.proj": ("img_mlp_0", 0, 1), "ff.net.2": ("img_mlp_2", 0, 1),
               "norm1.linear": ("img_mod_lin", 0, 1), "ff_context.net.0.proj": ("txt_mlp_0", 0, 1),
               "ff_context.net.2": ("txt_mlp_2", 0, 1), "norm1_context.linear": ("txt_mod_lin", 0, 1)}
FLUX_SINGLE = {"attn.to_q": ("linear1", 0, 4), "attn.to_k": ("linear1", 1, 4), "attn.to_v": ("linear1", 2, 4),
               "proj_mlp": ("linear1", 3, 4), "proj_out": ("linear2", 0, 1), "norm.linear": ("modulation_lin", 0, 1)}
FLUX_BLOCKS = {"transformer_blocks": ("double_blocks", FLUX_DOUBLE),
               "single_transformer_blocks": ("single_blocks", FLUX_SINGLE)}


def kohya_layers(model, layers: dict) -> tuple[dict | None, str | None]:
    """The adapters in kohya's sd-scripts / ComfyUI naming (``KOHYA_FILE``): per module ``.lora_down.weight`` (A),
    ``.lora_up.weight`` (B) and ``.alpha``, the update being alpha / rank(lora_down) * up @ down, as diffusers'
    kohya loaders and ComfyUI read it (ComfyUI reads no LoRA metadata: without ``.alpha`` it takes alpha = rank).
    SD 1.x/2.x and SDXL name the diffusers UNet's modules ``lora_unet_<name>`` (``.`` -> ``_``: kohya's own SD 1.x
    names, and what ComfyUI and diffusers map for SDXL too), and so does Qwen-Image (its original names are
    diffusers', as musubi-tuner writes them; diffusers' Qwen-Image loader reads them too). Flux names BFL's modules
    (``double_blocks_N_img_attn_qkv``, ``single_blocks_N_linear1``, ...), where fused modules get the parts'
    adapters block-diagonally (A stacked, B on the diagonal, zeros for a part not trained): the same update per
    part, and a layout diffusers splits back into the parts' own adapters; None (with why) for a Flux module BFL's
    layout has no place for (the file would miss adapters). The other transformers (SD3, PixArt, Sana, Z-Image,
    FLUX.2) keep diffusers' names under ``transformer.``, which ComfyUI maps onto its own (fused) layers for SD3
    and PixArt (tests/test_comfyui.py); diffusers reads their diffusers file instead."""
    import diffusers

    config = model.peft_config["default"]
    rank, alpha = config.r, float(config.lora_alpha)
    names = sorted({key.split(".lora_A.")[0] for key in layers if ".lora_A." in key})

    def adapter(name):
        return layers[f"{name}.lora_A.weight"], layers[f"{name}.lora_B.weight"]

    if not isinstance(model, diffusers.FluxTransformer2DModel):
        kohya_names = isinstance(model, (diffusers.UNet2DConditionModel, diffusers.QwenImageTransformer2DModel))
        out = {}
        for name in names:
            key = "lora_unet_" + name.replace(".", "_") if kohya_names else f"transformer.{name}"
            out[f"{key}.lora_down.weight"], out[f"{key}.lora_up.weight"] = adapter(name)
            out[f"{key}.alpha"] = torch.tensor(alpha)
        return out, None
    groups: dict[str, dict] = {}  # BFL module -> {"parts": [diffusers module per part], "block": prefix}
    for name in names:
        blocks, index, inner = (name.split(".", 2) + ["", ""])[:3]
        found = FLUX_BLOCKS.get(blocks, (None, {}))
        if not index.isdigit() or inner not in found[1]:
            return None, f"the adapter on {name} has no BFL (kohya / ComfyUI) module name"
        module, part, parts = found[1][inner]
        group = groups.setdefault(f"lora_unet_{found[0]}_{index}_{module}", {"parts": [None] * parts})
        group["parts"][part] = name
        group["prefix"], group["table"], group["module"] = f"{blocks}.{index}.", found[1], module
    out = {}
    for key, group in groups.items():
        inners = [inner for inner, (module, _, _) in group["table"].items() if module == group["module"]]
        inners.sort(key=lambda inner: group["table"][inner][1])  # the parts' order in the fused module
        downs, ups = [], []
        for inner, name in zip(inners, group["parts"]):
            layer = model.get_submodule(group["prefix"] + inner)
            if name is None:  # a part not trained: zero adapters keep the block-diagonal layout
                downs.append(torch.zeros(rank, layer.in_features))
                ups.append(torch.zeros(layer.out_features, rank))
            else:
                down, up = adapter(name)
                downs.append(down)
                ups.append(up)
        out[f"{key}.lora_down.weight"] = torch.cat(downs).contiguous()
        out[f"{key}.lora_up.weight"] = torch.block_diag(*ups).contiguous()
        out[f"{key}.alpha"] = torch.tensor(alpha * len(downs))  # alpha / rank(lora_down) stays alpha / rank
    return out, None


def _save_peft_adapter(model, layers: dict, folder: Path, kohya: dict | None) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` writes them (keys
    under ``base_model.model.``): ``PeftModel.from_pretrained(transformer, folder)`` loads them, and
    ``merge_and_unload()`` gives a plain transformer for the family's pipeline. Beside them ``kohya`` (KOHYA_FILE):
    ComfyUI reads PEFT's names too, but PEFT's file has no ``.alpha``, so ComfyUI would take alpha = rank."""
    from safetensors.torch import save_file

    from laionkit.trainer.exportrecord import record_export

    with atomic_output(folder) as tmp:
        tmp.mkdir(parents=True)
        save_file({f"base_model.model.{name}": value for name, value in layers.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config["default"].save_pretrained(str(tmp))
        _save_kohya(model, kohya, tmp)
        record_export(tmp, folder.parent)
