"""The denoiser: built from a pretrained folder or an architecture of the latents' family (build_unet,
build_transformer), its FSDP wrap units from the family spec, and its model FLOPs per sample (for MFU)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from laionkit.common import (
    LaionkitError,
)
from laionkit.families import FamilySpec, Objective, families, get_family
from laionkit.trainer import trainchecks
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.data import LatentSet
from laionkit.trainer.latent_stream import (
    SIZE_FIELDS,
)
from laionkit.trainer.objective import guidance_input


def build_unet(config: TrainConfig, data: LatentSet, device: torch.device | None = None):
    """A pretrained denoiser (--unet) or a fresh one of the family's configs / a config file (--unet-config),
    fitted to the data: latent channels, sample size, text width and (SDXL) the pooled width. Under --base-dtype
    a pretrained one loads block by block onto ``device``, its block linears quantized (quantized_base.load)."""
    import diffusers

    from laionkit.common.models import load_unet, load_unet_config

    spec = data.family
    channels, height, _ = data.moments_shape
    latent_channels, text_dim = channels // data.moments_per_channel, data.text_shape[-1]
    pooled_dim = data.empty["pooled"].shape[-1] if "pooled" in data.empty else None
    if spec.fit_config is not None:
        return build_transformer(config, data, latent_channels, text_dim, pooled_dim, device)
    if config.unet is not None:
        trainchecks.check_denoiser_folder(config.unet, spec, "--unet")  # another family's model: one line
        unet = _pretrained(config, spec, device) or load_unet(spec.presets.get(config.unet, config.unet))
        expects = (unet.config.in_channels, unet.config.cross_attention_dim, _pooled_width(unet.config))
        if expects != (latent_channels, text_dim, pooled_dim):
            raise LaionkitError(
                f"--unet {config.unet}: expects {expects[0]} latent channels, {expects[1]}-dim text and "
                f"{expects[2] or 'no'} pooled text; the {spec.name} latents have {latent_channels}, {text_dim} "
                f"and {pooled_dim or 'no'}"
            )
        return unet
    arch = _architecture(config, spec, "--unet-config", load_unet_config)
    arch.update(in_channels=latent_channels, out_channels=latent_channels, sample_size=height,
                cross_attention_dim=text_dim)
    if arch.get("addition_embed_type") == "text_time" or pooled_dim is not None:
        if arch.get("addition_embed_type") != "text_time" or pooled_dim is None:
            raise LaionkitError(f"--unet-config {config.unet_config}: {spec.name} latents "
                                f"{'carry' if pooled_dim else 'lack'} pooled text, the architecture "
                                f"{'lacks' if pooled_dim else 'needs'} it (addition_embed_type text_time)")
        arch["projection_class_embeddings_input_dim"] = 6 * arch["addition_time_embed_dim"] + pooled_dim
    return getattr(diffusers, spec.denoiser_class).from_config(arch)


def build_transformer(config: TrainConfig, data: LatentSet, latent_channels: int, text_dim: int,
                      pooled_dim: int | None, device: torch.device | None = None):
    """The transformer families' denoiser: from_pretrained on --transformer (a preset, a pipeline folder
    or hub repo: its transformer/ subfolder), or from_config on a family config / a config file
    (--transformer-config), fitted to the data by the family."""
    import diffusers

    from laionkit.common.models import _from_pretrained, _load_config

    spec = data.family
    cls = getattr(diffusers, spec.denoiser_class)
    if config.unet is not None:
        trainchecks.check_denoiser_folder(config.unet, spec, "--transformer")  # another family's model: one line
        model = (_pretrained(config, spec, device)
                 or _from_pretrained(cls, spec.presets.get(config.unet, config.unet), spec.denoiser_subfolder))
        found = spec.expects(model.config)
        if tuple(found) != (latent_channels, text_dim, pooled_dim):
            raise LaionkitError(
                f"--transformer {config.unet}: expects {found[0]} latent channels, {found[1]}-dim text and "
                f"{found[2]}-dim pooled text; the {spec.name} latents have {latent_channels}, {text_dim} and "
                f"{pooled_dim}")
        return model
    arch = _architecture(config, spec, "--transformer-config",
                         lambda source: _load_config(cls, source, spec.denoiser_subfolder))
    largest = max(max(shape[1:]) for shape in data.bucket_shapes)
    fitted = spec.fit_config(arch, latent_channels, largest, text_dim, pooled_dim)
    if config.lora_rank is not None and config.base_dtype != "bf16":  # --lora-random-base, quantized as it is drawn
        from laionkit.trainer import quantized_base

        return quantized_base.random_init(cls, fitted, spec.block_classes, config.base_dtype,
                                          device or torch.device("cpu"))
    return cls.from_config(fitted)


def _pretrained(config: TrainConfig, spec: FamilySpec, device: torch.device | None):
    """The pretrained denoiser loaded block by block with its block linears quantized, under --base-dtype
    fp8 / int8 / nf4 (a LoRA run's frozen base: laionkit/trainer/quantized_base.py); else None."""
    import diffusers

    from laionkit.trainer import quantized_base

    if config.base_dtype == "bf16" or config.lora_rank is None:
        return None
    return quantized_base.load(getattr(diffusers, spec.denoiser_class), spec.presets.get(config.unet, config.unet),
                               spec.denoiser_subfolder, spec.block_classes, config.base_dtype,
                               device or torch.device("cpu"))


def _architecture(config: TrainConfig, spec, flag: str, load) -> dict:
    """The from-scratch architecture: one of the family's named configs, or a config file / folder read
    by ``load``; another family's config name is refused, naming the family of the latents."""
    if config.unet_config in spec.configs:
        return dict(spec.configs[config.unet_config])
    owners = [name for name in families() if config.unet_config in get_family(name).configs]
    if owners:
        raise LaionkitError(f"{flag} {config.unet_config} is a {'/'.join(owners)} architecture; these latents "
                            f"are {spec.name} (from {config.latents}/manifest.json), whose configs are "
                            f"{', '.join(spec.configs)}")
    loaded = load(config.unet_config)
    trainchecks.check_denoiser_class(loaded.get("_class_name"), spec, flag, config.unet_config)
    return {k: v for k, v in loaded.items() if not k.startswith("_")}


def _pooled_width(unet_config) -> int | None:
    """The pooled text width a text_time UNet's add_embedding takes (6 time ids besides it), else None."""
    if unet_config.get("addition_embed_type") != "text_time":
        return None
    return unet_config["projection_class_embeddings_input_dim"] - 6 * unet_config["addition_time_embed_dim"]


def flops_per_sample(unet, data: LatentSet, device: torch.device, shape: tuple[int, ...],
                     objective: Objective | None = None) -> float:
    """Model FLOPs of one sample's forward + backward at moments ``shape`` (a bucket's: attention grows
    faster than the pixel count, so buckets differ), counted once by torch's flop counter.

    Counted on a weightless copy of the denoiser (meta tensors, the same modules, LoRA layers and
    requires_grad): a real one-sample step at full size runs before the precision policy and activation
    checkpointing apply, and for Flux-12B at 1024 px (fp32 weights, gradients and activations) that needs
    more memory than an H200 has. Where a model cannot run on meta tensors, the count runs on ``device`` as before,
    and where that runs out of memory the count is 0 (no MFU)."""
    try:
        return count_flops(_weightless(unet), data, torch.device("meta"), shape, objective)
    except Exception:  # noqa: BLE001 - a data-dependent forward (.item() and the like) needs real tensors
        pass
    try:
        return count_flops(unet, data, device, shape, objective)
    except torch.OutOfMemoryError:  # one sample unchecked at full size: a 20B+ model's fills an 80 GB card
        return 0.0  # no MFU rather than no run
    finally:
        unet.zero_grad(set_to_none=True)
        if device.type == "cuda":  # the count's peak is not the training's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def count_flops(model, data: LatentSet, device: torch.device, shape: tuple[int, ...],
                objective: Objective | None = None) -> float:
    """torch's flop counter over one sample's forward + backward of ``model`` on ``device``."""
    channels, height, width = shape
    dtype = next(model.parameters()).dtype  # a LoRA run's frozen base may already be bf16 (lora.attach)
    sample = torch.zeros(1, channels // data.moments_per_channel, height, width, device=device, dtype=dtype)
    cond = {key: torch.zeros(1, *value.shape, device=device, dtype=dtype) for key, value in data.empty.items()}
    cond.update({name: torch.tensor([[height * 8, width * 8]], device=device) for name in SIZE_FIELDS})
    if objective is not None:
        cond = guidance_input(objective, cond, 1, device)
    counter = flop_counter()
    with counter:
        data.family.predict(model, sample, torch.tensor([500], device=device), cond).sum().backward()
    return float(counter.get_total_flops())


def flop_counter():
    """torch's FlopCounterMode (no display), with grouped convolutions' backward counted per group.

    torch's formula for ``convolution_backward`` (torch 2.11-2.14) counts the weight gradient of a grouped
    convolution as if it were dense: for a depthwise 3x3 over C channels it counts C times its FLOPs. Sana's
    Mix-FFN has one such convolution per block (11,200 channels in Sana-1600M), so one 1024 px sample's
    forward + backward was counted as 55.1 TFLOP where it costs 8.9 (its forward: 2.97), and MFU came out
    above 1. The input gradient is already counted per group (the weight's shape carries C_in / groups)."""
    from torch.ops import aten
    from torch.utils.flop_counter import FlopCounterMode, conv_backward_flop

    dense = getattr(conv_backward_flop, "__wrapped__", conv_backward_flop)  # the formula on shapes

    def grouped_conv_backward_flop(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                                   output_padding, groups, output_mask, out_shape, **kwargs) -> int:
        def part(mask):
            return dense(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                         output_padding, groups, mask, out_shape=out_shape, **kwargs)

        return part([output_mask[0], False, False]) + part([False, output_mask[1], False]) // groups

    return FlopCounterMode(display=False, custom_mapping={aten.convolution_backward: grouped_conv_backward_flop})


def _weightless(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors of the same shapes, dtypes
    and requires_grad: no memory, no copy of the weights."""
    import copy

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, torch.nn.Parameter) else empty)
    return copy.deepcopy(module, memo)


def fsdp_wrap_units(plugin, model, spec: FamilySpec, say=print) -> list[str] | None:
    """FSDP's wrap units for ``model``: the accelerate config's transformer-based wrap classes when the
    model has them all (train/fsdp.yaml names the UNet's down / mid / up blocks), else the family's
    ``block_classes`` (SD3's JointTransformerBlock, Flux's double- and single-stream blocks: one FSDP unit
    per transformer block), instead of accelerate failing on a class the model lacks. Returns the names
    set on the plugin, or None where the policy is not transformer-based (left as configured)."""
    policy = plugin.auto_wrap_policy
    if policy is None or getattr(policy, "__name__", str(policy)).lower() not in (
            "transformer_auto_wrap_policy", "transformer_based_wrap"):
        return None
    present = {type(module).__name__ for module in model.modules()}
    configured = plugin.transformer_cls_names_to_wrap
    if isinstance(configured, str):
        configured = configured.split(",")
    if configured and all(name in present for name in configured):
        return list(configured)
    units = [block for block in spec.block_classes if block in present]
    if not units:
        raise LaionkitError(f"FSDP: {type(model).__name__} has none of the family's blocks "
                            f"({', '.join(spec.block_classes)}) to wrap")
    if configured:
        say(f"FSDP: {type(model).__name__} has no {', '.join(n for n in configured if n not in present)}; "
            f"wrapping each {' / '.join(units)} (the {spec.name} family's blocks) instead")
    plugin.transformer_cls_names_to_wrap = units
    return units
