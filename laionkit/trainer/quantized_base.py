"""The frozen base of a LoRA run: stored quantized (``--base-dtype fp8 | int8 | nf4``) and/or multiplied in float8
(``--fp8 --lora-rank``).

The ``nn.Linear`` layers inside the family's repeated blocks (``FamilySpec.block_classes``) become ``FrozenLinear``;
embedders, norms and the final layers stay as they are (bf16 under bf16 mixed precision). A FrozenLinear is an
``nn.Linear`` whose weight is frozen and stored in one of ``FORMATS``:

- ``fp8``: float8 e4m3 with one fp32 scale per output channel (amax / 448): 1 byte a weight;
- ``int8``: int8 with one fp32 scale per output channel (amax / 127): 1 byte a weight;
- ``nf4``: QLoRA's 4-bit NormalFloat levels (``NF4``, the table torchao's ``to_nf4`` and bitsandbytes use), one
  bf16 absmax per block of 64 weights (no double quantization): 4.25 bits a weight;
- ``bf16``: the weight as loaded, for float8 compute on an unquantized base.

Everything quantized is held in integer dtypes (float8 and the scales as their bits, ``Tensor.view``), so the
``Module.to(torch.bfloat16)`` that lora.attach and MasterWeights apply to the whole model moves it but never casts
it. PEFT's ``lora.Linear`` wraps a FrozenLinear as its ``base_layer`` as it wraps any ``nn.Linear``.

The matmul is one autograd.Function (``FrozenMatmul``): the forward dequantizes the weight on the fly (or, with
float8 compute, casts the input to float8 and runs ``torch._scaled_mm`` against the stored float8 weight, with the
``--fp8-recipe`` scaling of the input: ``tensorwise`` one scale, ``rowwise`` one per token); the backward computes
the input's gradient alone (a frozen weight needs none), from the stored weight again and by other ops than the
forward's (so torch.compile's CSE cannot merge the two and save the dequantized weight), so no dequantized weight is
kept between forward and backward; the gradient goes to float8 as torchao's recipes cast it (e5m2 tensorwise, e4m3
rowwise). NF4 dequantizes in bitsandbytes' kernel where bitsandbytes is installed and the codes are on a CUDA
device (the same values, one kernel), else by torch ops. Float8 needs both sides of the layer and the token count
to be multiples of 16 (as laionkit/trainer/fp8.py explains); a call whose token count is not runs that matmul in
bf16.

A pretrained base loads block by block (``load``): the model is built on the meta device, the safetensors shards
are read one tensor at a time (common/models.py ``read_safetensors``), and each block linear's weight is quantized
on the training device as it arrives, so a 32B base never needs its 64 GB of bf16 at once on host or GPU.
Checkpoints hold the adapters alone (lora.py) and record the base dtype; the export merges into the bf16 base read
from disk, so what diffusers and ComfyUI load does not depend on the base dtype a run trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from laionkit.common import LaionkitError

FORMATS = ("bf16", "fp8", "int8", "nf4")
# QLoRA's NormalFloat4 levels (Dettmers et al. 2023), as torchao's to_nf4 and bitsandbytes store them.
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
NF4_BLOCK = 64
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QUANTIZE_SLICE = 1 << 20  # about as many weights as quantize converts at once


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (out, in) weight as ``fmt``'s stored tensors: (codes, scales as integer bits); bf16: (weight, None).
    Quantized a slice of rows of about QUANTIZE_SLICE weights at a time (whole NF4 blocks: a multiple of 64 rows),
    so its fp32 and index temporaries stay a few MB where the whole layer's are several times its bf16 size."""
    if fmt == "bf16":
        return weight.detach(), None
    rows = max(NF4_BLOCK, QUANTIZE_SLICE // weight.shape[1] // NF4_BLOCK * NF4_BLOCK)
    codes, scales = zip(*(_quantize_rows(part, fmt) for part in weight.detach().split(rows)))
    return torch.cat(codes), torch.cat(scales)


def _quantize_rows(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    if fmt in ("fp8", "int8"):
        top = torch.finfo(E4M3).max if fmt == "fp8" else 127.0
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / top
        scaled = (w / scale[:, None]).clamp(-top, top)
        codes = scaled.to(E4M3).view(torch.uint8) if fmt == "fp8" else scaled.round().to(torch.int8)
        return codes, scale.view(torch.int32)
    blocks = w.reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp(min=1e-12).to(torch.bfloat16)
    levels = torch.tensor(NF4, device=w.device)
    codes = torch.bucketize(blocks / absmax.float()[:, None], (levels[1:] + levels[:-1]) / 2, out_int32=True)
    codes = codes.to(torch.uint8).reshape(w.shape)
    return codes[:, 0::2] << 4 | codes[:, 1::2], absmax.view(torch.int16)


def dequantize(fmt: str, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight in ``dtype`` from ``quantize``'s tensors."""
    if fmt == "bf16":
        return codes.to(dtype)
    if fmt in ("fp8", "int8"):
        values = codes.view(E4M3) if fmt == "fp8" else codes
        return (values.float() * scale.view(torch.float32)[:, None]).to(dtype)
    kernel = _nf4_kernel(codes)
    if kernel is not None:
        return kernel.default(codes, scale.view(torch.bfloat16).float(), NF4_BLOCK, "nf4",
                              (codes.shape[0], codes.shape[1] * 2), dtype)
    pairs = torch.nn.functional.embedding(codes.int(), _nf4_pairs(codes.device))  # (out, in / 2, 2): a byte's two
    blocks = pairs.view(-1, NF4_BLOCK).mul_(scale.view(torch.bfloat16).float()[:, None])
    return blocks.view(codes.shape[0], -1).to(dtype)


def _nf4_pairs(device: torch.device) -> torch.Tensor:
    """The two NF4 levels of each of the 256 packed bytes (high nibble first), fp32: one gather a byte, where one a
    nibble through an int64 index reads and writes 8 bytes a weight more."""
    levels = torch.tensor(NF4, device=device)
    return torch.stack(torch.meshgrid(levels, levels, indexing="ij"), dim=-1).reshape(256, 2)


def _nf4_kernel(codes: torch.Tensor):
    """bitsandbytes' NF4 dequantize kernel, where installed, for codes on a CUDA device (else None): one kernel
    reading the packed bytes and writing the weight, the same values as the torch ops' (fp32 level x absmax, then
    cast); QLoRA's format is laionkit's (NF4 table, high nibble first, blocks of 64)."""
    if codes.device.type != "cuda":
        return None
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
    except ImportError:
        return None
    return torch.ops.bitsandbytes.dequantize_4bit


def _dequantize_apart(fmt: str, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize`` for the backward, the same weight by other ops: were they the forward's, torch.compile's CSE
    would merge the two into one dequantized weight (or unpacked NF4 codes, or float8 copy) that the forward then
    saves for the backward, a copy of every block weight held through the step."""
    if fmt == "bf16":
        return codes.to(dtype)
    if fmt in ("fp8", "int8"):  # both codes are exact in bf16
        values = codes.view(E4M3) if fmt == "fp8" else codes
        return (values.to(torch.bfloat16).float() * scale.view(torch.float32)[:, None]).to(dtype)
    kernel = _nf4_kernel(codes)
    if kernel is not None:  # the out= overload: another op than the forward's
        out = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=dtype, device=codes.device)
        kernel.out(codes, scale.view(torch.bfloat16).float(), NF4_BLOCK, "nf4", tuple(out.shape), dtype, out=out)
        return out
    table = torch.tensor(NF4, device=codes.device) * scale.view(torch.bfloat16).float()[:, None]  # a row a block
    shifts = torch.tensor((4, 0), dtype=torch.uint8, device=codes.device).repeat(codes.shape[1])
    unpacked = codes.repeat_interleave(2, dim=1) >> shifts & 15
    return table.gather(1, unpacked.reshape(-1, NF4_BLOCK).long()).reshape(unpacked.shape).to(dtype)


def _input_grad(fmt: str, codes: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``rows @ W`` for the backward, W apart from the forward's (``_dequantize_apart``); per-channel scales fold
    into the gradient, g @ (s * W) = (g * s^T) @ W, so the weight side is the codes cast alone (exact in bf16)."""
    if fmt in ("fp8", "int8"):
        values = codes.view(E4M3) if fmt == "fp8" else codes
        return (rows.float() * scale.view(torch.float32)).to(dtype) @ values.to(torch.bfloat16).to(dtype)
    return rows @ _dequantize_apart(fmt, codes, scale, dtype)


def storable(layer: torch.nn.Linear, fmt: str, compute: str) -> bool:
    """Whether ``layer`` can be held as ``fmt`` and multiplied in ``compute``: float8 wants both sides a multiple
    of 16, NF4 an even input width and whole blocks of 64."""
    out_features, in_features = layer.out_features, layer.in_features
    if (fmt == "fp8" or compute != "bf16") and (in_features % 16 or out_features % 16):
        return False
    return fmt != "nf4" or (in_features % 2 == 0 and in_features * out_features % NF4_BLOCK == 0)


def _float8(t: torch.Tensor, rowwise: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, columns) in float8 ``dtype`` and its fp32 scale: one per row (rowwise) or one in all."""
    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()
    scale = amax.float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (t.float() / scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), scale


def _float8_weight(fmt: str, codes: torch.Tensor, scale, rowwise: bool,
                   dequantized=dequantize) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight in e4m3 and its scale, (out, 1) per channel or one: the stored one as it is (fp8), else cast
    (from ``dequantized``: the backward's is ``_dequantize_apart``)."""
    if fmt == "fp8":
        return codes.view(E4M3), scale.view(torch.float32)[:, None]
    return _float8(dequantized(fmt, codes, scale, torch.float32), rowwise, E4M3)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: autocast's where it is on for ``x``'s device, else ``x``'s own. Meta tensors
    (train's FLOP count) have no autocast to ask. The test is a string comparison, not
    ``torch.amp.is_autocast_available``: torch 2.11's Dynamo cannot trace that builtin, so every FrozenLinear broke
    the compiled graph (``--fp8 --lora-rank`` ran slower than bf16 instead of faster)."""
    kind = x.device.type
    if kind == "meta":
        return x.dtype
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class FrozenMatmul(torch.autograd.Function):
    """``x @ W^T + b`` for a frozen stored weight and bias: the backward returns the input's gradient only and
    keeps no dequantized weight from the forward (the stored tensors are saved: they are the layer's own)."""

    @staticmethod
    def forward(ctx, x, fmt: str, compute: str, codes, scale, bias):
        ctx.fmt, ctx.compute, ctx.dtype = fmt, compute, _compute_dtype(x)
        ctx.save_for_backward(codes, scale)
        rows = x.reshape(-1, x.shape[-1]).to(ctx.dtype)
        bias = None if bias is None else bias.to(ctx.dtype)
        if compute == "bf16" or rows.shape[0] % 16:  # the bias in the GEMM's epilogue, as nn.Linear's addmm
            out = torch.nn.functional.linear(rows, dequantize(fmt, codes, scale, ctx.dtype), bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        rowwise = compute == "rowwise"
        x8, x_scale = _float8(rows, rowwise, E4M3)
        w8, w_scale = _float8_weight(fmt, codes, scale, rowwise)
        if rowwise:
            out = torch._scaled_mm(x8, w8.t(), x_scale, w_scale.reshape(1, -1), out_dtype=ctx.dtype)
        elif w_scale.numel() == 1:
            out = torch._scaled_mm(x8, w8.t(), x_scale, w_scale, out_dtype=ctx.dtype)
        else:  # tensorwise GEMM on a per-channel float8 weight: its scales multiply the output's columns
            out = torch._scaled_mm(x8, w8.t(), x_scale, torch.ones((), device=x.device), out_dtype=torch.float32)
            out = (out * w_scale.reshape(1, -1)).to(ctx.dtype)
        out = out if bias is None else out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        codes, scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        if ctx.compute == "bf16" or rows.shape[0] % 16:
            grad_x = _input_grad(ctx.fmt, codes, scale, rows, ctx.dtype)
        else:  # g @ (s * W8) = (g * s^T) @ W8 for per-channel s: the scale leaves the reduction
            rowwise = ctx.compute == "rowwise"
            w8, w_scale = _float8_weight(ctx.fmt, codes, scale, rowwise, _dequantize_apart)
            one = torch.ones((), device=grad.device)
            folded = rows.float() * w_scale.reshape(1, -1) if w_scale.numel() > 1 else rows
            g8, g_scale = _float8(folded, rowwise, E4M3 if rowwise else E5M2)  # sm90's rowwise GEMM: e4m3 only
            b_scale = one if w_scale.numel() > 1 else w_scale
            if rowwise:
                b_scale = b_scale.reshape(1, 1).expand(1, w8.shape[1]).contiguous()
            grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), g_scale, b_scale, out_dtype=ctx.dtype)
        return grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1]), None, None, None, None, None


class FrozenLinear(torch.nn.Linear):
    """A frozen ``nn.Linear`` whose weight is stored as ``fmt`` and multiplied in ``compute`` (bf16, tensorwise
    or rowwise float8); ``weight`` holds the codes (a parameter that requires no grad, where PEFT and diffusers
    look for it), ``scale`` their scales."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 in_features: int, fmt: str, compute: str = "bf16") -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features, self.fmt, self.compute = in_features, codes.shape[0], fmt, compute
        self.weight = torch.nn.Parameter(codes, requires_grad=False)
        self.register_buffer("scale", scale)
        self.register_parameter("bias", None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False))

    @classmethod
    def of(cls, layer: torch.nn.Linear, fmt: str, compute: str = "bf16") -> FrozenLinear:
        return cls(*quantize(layer.weight, fmt), layer.bias, layer.in_features, fmt, compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FrozenMatmul.apply(x, self.fmt, self.compute, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stored={self.fmt}, compute={self.compute}"


def block_linears(model: torch.nn.Module, block_classes, fmt: str, compute: str) -> list[str]:
    """The names of the blocks' nn.Linear layers that can be held as ``fmt`` and multiplied in ``compute``."""
    blocks = tuple(f"{name}." for name, module in model.named_modules() if type(module).__name__ in block_classes)
    return [name for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and name.startswith(blocks) and storable(module, fmt, compute)]


def swap(model: torch.nn.Module, names: list[str], make) -> None:
    """Replace each named submodule by ``make(module)``, in place."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, make(getattr(owner, child)))


def freeze(model: torch.nn.Module, config, accelerator, block_classes) -> None:
    """lora.attach's first step: the blocks' linear layers as FrozenLinear of --base-dtype, multiplied in float8
    under --fp8 (--fp8-recipe scaling). A base already loaded quantized (``load``) only gets its compute set; a
    bf16 base without --fp8 stays plain nn.Linear (what LoRA runs did before)."""
    from accelerate.utils import DistributedType

    from laionkit.trainer import fp8

    compute = config.fp8_recipe if config.fp8 else "bf16"
    loaded = [module for module in model.modules() if isinstance(module, FrozenLinear)]
    if config.base_dtype == "bf16" and compute == "bf16" and not loaded:
        return
    if accelerator.distributed_type == DistributedType.FSDP:
        raise LaionkitError(f"--base-dtype {config.base_dtype}{' --fp8' if config.fp8 else ''} with --lora-rank "
                            "runs on one device or DDP, not FSDP: launch with train/ddp.yaml, or drop it")
    if compute != "bf16":
        fp8.check_device(accelerator.device)
    names = block_linears(model, block_classes, config.base_dtype, compute)
    swap(model, names, lambda layer: FrozenLinear.of(layer, config.base_dtype, compute))
    for module in loaded:
        module.compute = compute if storable(module, module.fmt, compute) else "bf16"
    count = len(names) + len(loaded)
    if not count:
        raise LaionkitError(f"--base-dtype {config.base_dtype}: no linear layer of the {'/'.join(block_classes)} "
                            "blocks can be stored so (float8 needs both sides a multiple of 16)")
    accelerator.print(f"frozen base: {count} linear layers of the {'/'.join(block_classes)} blocks stored as "
                      f"{config.base_dtype}, matmuls in {'bf16' if compute == 'bf16' else 'float8 ' + compute}")


def load(cls, source: str, component: str, block_classes, fmt: str, device: torch.device):
    """``cls.from_pretrained`` of ``component`` with the blocks' linear weights stored as ``fmt``, loaded block by
    block: built on the meta device, then each tensor of the safetensors shards read alone and put on ``device``
    (block linears quantized there as they arrive; the rest in fp32, as from_pretrained loads it)."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from laionkit.common.models import _load_config, read_safetensors

    config = {key: value for key, value in _load_config(cls, source, component).items() if not key.startswith("_")}
    with init_empty_weights():
        model = cls.from_config(config)
    names = block_linears(model, block_classes, fmt, "bf16")
    swap(model, names, lambda layer: FrozenLinear(*quantize(layer.weight, fmt), layer.bias, layer.in_features, fmt))
    quantized = {f"{name}.weight" for name in names}
    state = set(model.state_dict())
    for path in weights_files(source, component):
        for key, tensor in read_safetensors(path):
            if key not in state:
                raise LaionkitError(f"{path}: {key} is no weight of {cls.__name__} (another model's file?)")
            state.discard(key)
            if key in quantized:
                layer = model.get_submodule(key.removesuffix(".weight"))
                codes, scale = quantize(tensor.to(device), fmt)
                layer.weight = torch.nn.Parameter(codes, requires_grad=False)
                layer.scale = scale
                state.discard(f"{key.removesuffix('.weight')}.scale")
            else:
                set_module_tensor_to_device(model, key, device, value=tensor.float() if tensor.is_floating_point()
                                            else tensor)
    if state:
        raise LaionkitError(f"{source}: its {component} weights lack {sorted(state)[0]} (and {len(state) - 1} more)")
    return model.to(device).eval()


def random_init(cls, config: dict, block_classes, fmt: str, device: torch.device):
    """``cls.from_config(config)`` built on ``device`` with the blocks' linear weights quantized as ``fmt`` as each
    is drawn (--lora-random-base: a 32B base never exists in bf16). Built on the meta device, then each module's
    own parameters are drawn in module order by its ``reset_parameters`` (nn.Linear's, LayerNorm's, ...; 1-D
    parameters of modules without one are norm scales: ones), on ``device``, in fp32 as from_config draws them:
    where the construction draws in that order too (Flux, FLUX.2), the weights are from_config's under the same
    seed, so a run's loss compares with the bf16 base's."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = cls.from_config(config)
    names = set(block_linears(model, block_classes, fmt, "bf16"))
    for name in [name for name, _ in model.named_modules()]:  # names, not modules: a drawn layer swapped out is freed
        module = model.get_submodule(name)
        if not any(t.is_meta for t in module.parameters(recurse=False)):
            continue
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                for param in module.parameters(recurse=False):
                    param.fill_(1.0) if param.dim() == 1 else param.normal_(0, 0.02)
        if name in names:  # one layer at a time: its fp32 weight lives only while it is quantized
            swap(model, [name], lambda layer: FrozenLinear.of(layer, fmt))
    return model.to(device)


def weights_files(source: str, component: str) -> list[Path]:
    """The safetensors files of a diffusers component (sharded: its index's shards)."""
    import json

    from laionkit.common.models import resolve_source

    where = resolve_source(source, component)
    root = Path(where.location)
    if not where.local:
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(where.location, allow_patterns=[f"{where.subfolder}/*"] if where.subfolder
                                      else None))
    folder = root / (where.subfolder or "")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    raise LaionkitError(f"--base-dtype loads safetensors weights block by block; {folder} has no "
                        "diffusion_pytorch_model.safetensors (nor its index)")
