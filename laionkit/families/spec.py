"""The family protocol: ``FamilySpec`` (the contract laionkit/families/__init__.py describes), ``Objective`` and
the registry that the family modules register into."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import MethodType
from typing import Any

from laionkit.common.errors import LaionkitError


@dataclass(frozen=True)
class Objective:
    """A family's training objective defaults; train flags override them."""

    kind: str  # "ddpm" (noise-prediction schedulers) or "flow" (rectified flow / flow matching)
    prediction: str = "epsilon"  # ddpm: "epsilon" or "v_prediction"; flow: "velocity" (target noise - x0)
    sigma_sampling: str = "logit_normal"  # flow: logit_normal | uniform | mode
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float | None = None  # flow: static shift s; None with dynamic_shift means per-resolution
    dynamic_shift: bool = False  # flow: Flux's rule on the image sequence length, per bucket
    # flow, dynamic_shift: the rule's anchors (base_seq_len, max_seq_len, base_shift, max_shift), where they
    # are not Flux's (256, 4096, 0.5, 1.15): the family's scheduler config's (Qwen-Image: 256, 8192, 0.5, 0.9)
    shift_anchors: tuple[int, int, float, float] | None = None
    weighting: str = "none"  # flow: none | sigma_sqrt | cosmap
    timestep_scale: float = 1000.0  # flow: the denoiser's timestep input is sigma * this (Flux: 1, SD3: 1000)
    guidance: float | None = None  # flow: the guidance embedding's input in training (Flux-dev: 3.5)
    # ddpm: the noise schedule of a run from scratch (a pretrained --unet / --transformer brings its
    # scheduler/): SD's scaled-linear betas unless the family trained on others (PixArt: linear)
    beta_schedule: str = "scaled_linear"
    beta_start: float = 0.00085
    beta_end: float = 0.012

    def sigma_shift(self, latent_height: int, latent_width: int, patch_size: int = 2) -> float:
        """The shift s for a latent of this size: the static one, Flux's per-resolution one, or 1."""
        from laionkit.families import flow

        if self.dynamic_shift:
            anchors = dict(zip(("base_seq_len", "max_seq_len", "base_shift", "max_shift"), self.shift_anchors or ()))
            return flow.resolution_shift(flow.image_seq_len(latent_height, latent_width, patch_size), **anchors)
        return self.shift or 1.0


def _encode_from_tokens(tokenize, encode_tokens, tokenizers, text_encoders, captions) -> dict[str, Any]:
    """A tokenizing family's encode_text: its stored tensors from its own token ids."""
    return encode_tokens(text_encoders, tokenize(tokenizers, captions))


@dataclass(frozen=True)
class FamilySpec:
    """What encode and train need to know about one model family (see the module docstring)."""

    name: str
    pipeline_class: str
    denoiser_class: str
    denoiser_subfolder: str
    text_encoders: tuple[tuple[str, str], ...]  # (tokenizer subfolder, text encoder subfolder) pairs
    stored: tuple[str, ...]
    conditioning: Callable[[Mapping[str, Any]], dict[str, Any]]
    objective: Objective
    block_classes: tuple[str, ...]
    write_tiny: Callable[[str | Path, int], Path]
    presets: Mapping[str, str] = field(default_factory=dict)
    configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    vae_shift: bool = False  # latents = (z - shift_factor) * scaling_factor (SD3 / Flux VAEs)
    encode_ids: Callable[..., dict[str, Any]] | None = None
    text_layer: str | None = None
    vae_upcast: bool = False
    denoise: Callable[..., Any] | None = None
    fit_config: Callable[..., dict[str, Any]] | None = None
    expects: Callable[[Any], tuple] | None = None
    sampler: Mapping[str, Any] | None = None
    pack_latents: Callable[[Any], Any] | None = None
    unpack_latents: Callable[[Any, int, int], Any] | None = None
    embedded_guidance: bool = False
    regional_compile: bool = False  # --compile each block (compile time independent of depth), not the whole denoiser
    # encode --text online: tokenize(tokenizers, captions) -> ids [B, T_i] per text encoder (stored as
    # ids_<tokenizer subfolder>.npy), encode_tokens(text_encoders, ids) -> the ``stored`` tensors (train).
    tokenize: Callable[..., list] | None = None
    encode_tokens: Callable[..., dict[str, Any]] | None = None
    patch_size: int = 1  # latent sides must be multiples of this (SD3, Flux, PixArt: 2x2 patches)
    text_mask: str | None = None  # the stored key of the text attention mask the denoiser takes (PixArt)
    # False where cuDNN's SDPA kernels fail on this family's attention: train then runs without them
    # (process-wide, as --tf32), and PyTorch picks flash / memory-efficient attention instead.
    cudnn_attention: bool = True
    # encode's --text when none is given, chosen per family from the stored-vs-online benchmark
    # (docs/BENCHMARKS.md: what online text costs the train step against what stored text costs on disk).
    default_text: str = "stored"
    # encode_text(tokenizers, text_encoders, captions) -> the ``stored`` tensors; by default
    # encode_tokens(text_encoders, tokenize(tokenizers, captions)), for families that give those two.
    encode_text: Callable[..., dict[str, Any]] | None = None
    # pipeline_text(texts) -> the pipeline's prompt keywords for stored text tensors (by stored key, padded),
    # where they are not the states / pooled / mask -> prompt_embeds / pooled_prompt_embeds /
    # prompt_attention_mask of the other pipelines (Z-Image: a list of each prompt's unmasked states).
    pipeline_text: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    # The pipeline's guidance_scale is the classifier-free scale less this (Z-Image: pos + s (pos - neg)).
    cfg_offset: float = 0.0
    # The caption window of the pipeline where the tokenizer's model_max_length is not it: encode's token counts,
    # ``truncated`` flags and id buffers use it (Z-Image: 512 tokens, Qwen-Image: 512, Sana: 300, PixArt: 300;
    # Qwen's tokenizers say 131,072, Gemma's 1e30, T5's 512 or nothing).
    text_window: int | None = None
    # The VAE is a video VAE (Qwen-Image's AutoencoderKLQwenImage): it takes [B, C, frames, H, W]; encode gives
    # it one frame and stores frame-free moments [2C, h, w], validation decodes with the frame axis put back.
    vae_frames: bool = False
    # The pipeline normalises latents per channel with the VAE config's latents_mean / latents_std (Qwen-Image):
    # encode records them in the manifest, and train's latents are (z - shift - mean) * scaling / std.
    latent_stats: bool = False
    # vae_stats(vae) -> (mean, std): where latent_stats come from the VAE's weights, not its config's latents_mean /
    # latents_std (FLUX.2: its batch-norm running statistics, sqrt(var + eps)). Statistics of 2x2-patchified
    # channels (4C values for C latent channels) apply over the 2x2 pattern: see LatentSet.normalize.
    vae_stats: Callable[[Any], tuple[Sequence[float], Sequence[float]]] | None = None
    # The pipeline's output_type="latent" is already what the VAE decodes (FLUX.2's pipelines un-normalise and
    # unpatchify before returning), so validation normalises it back to the denoiser's scale instead of taking it
    # as the denoiser's latents; the loop's latents and the pipeline's input stay normalised as for every family.
    pipeline_denormalizes: bool = False
    # The pipeline's keyword of each stored key where it is not PixArt's / SD3's (evaluation.PIPELINE_KEYWORDS):
    # Qwen-Image's mask is prompt_embeds_mask.
    pipeline_keywords: Mapping[str, str] = field(default_factory=dict)
    # unconditional(tokenizers) -> the token ids (as ``tokenize`` gives them) of the unconditional text that
    # caption dropout and validation's negative use, where the family's pipeline encodes its negative prompt
    # otherwise than a caption "" (Sana: "" without the instruction prefix every caption gets); None: the
    # caption "" is the unconditional text.
    unconditional: Callable[[Any], list] | None = None
    # The text encoder classes (config "architectures") of the family's pipelines: which family a folder without
    # model_index.json is where several families share the denoiser class (FLUX.2 dev: Mistral-3; klein: Qwen3).
    text_encoder_classes: tuple[str, ...] = ()
    # The caption window of the family's pipelines, their ``max_sequence_length`` keyword's default (Flux 512, SD3's
    # T5 256, PixArt and Sana 300, Qwen-Image's __call__ 512), which ``encode --max-sequence-length`` replaces
    # (with_max_sequence_length); None: a fixed window (SD, SDXL: CLIP's 77). ``max_sequence_limit``: the most the
    # pipelines or the denoiser take (Flux and SD3 refuse more than 512, Qwen-Image more than 1,024).
    max_sequence_length: int | None = None
    max_sequence_limit: int | None = None
    # Pipeline parallelism (laionkit/trainer/pipeline_parallel.py): the module that cuts this family's denoiser
    # into stages, imported on use. It gives ``stage(denoiser, blocks, first, last)`` (an nn.Module that runs
    # those blocks as the denoiser's forward does, the embedders on the first stage and the final layers on
    # the last), ``inputs(noisy, timestep, conditioning)`` (the first stage's positional inputs and every
    # stage's keyword inputs) and ``layout(latents)`` (a latent in the last stage's output layout). None: the
    # family is not cut (train --pipeline-stages refuses it in one line).
    pipeline_cut: str | None = None

    def __post_init__(self) -> None:
        if self.encode_text is None:
            if self.tokenize is None or self.encode_tokens is None:
                raise TypeError(f"family {self.name}: give encode_text, or tokenize and encode_tokens")
            object.__setattr__(self, "encode_text", partial(_encode_from_tokens, self.tokenize, self.encode_tokens))

    @property
    def trimmed(self) -> tuple[str, ...]:
        """The stored keys encode trims to each caption's length: the states and the mask (``text_mask``)."""
        return ("states", self.text_mask) if self.text_mask else ()

    def text_lengths(self, found: Mapping[str, Any]):
        """Each sample's stored length of the ``trimmed`` tensors of a batch ``found`` (the family's text
        tensors): up to its last unmasked position, at least 1. None for a family without a text mask."""
        if self.text_mask is None:
            return None
        import torch

        mask = found[self.text_mask].bool()
        positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
        return (mask * positions).amax(dim=-1).clamp(min=1)

    def with_max_sequence_length(self, length: int | None) -> FamilySpec:
        """This family with a caption window of ``length`` tokens, as its pipelines give it for
        ``max_sequence_length=length``: each of tokenize / encode_tokens / unconditional that takes a
        ``max_sequence_length`` gets ``length`` (so encode's ids and states, train's online text and its caption
        dropout all use it). Itself for None or the family's own window."""
        if length is None or length == self.max_sequence_length:
            return self
        if self.max_sequence_length is None:
            raise LaionkitError(f"--max-sequence-length {length}: family {self.name}'s caption window is fixed "
                                "(CLIP's 77 tokens); leave the flag out")
        most = self.max_sequence_limit
        if length < 1 or (most is not None and length > most):
            raise LaionkitError(f"--max-sequence-length {length}: family {self.name} takes 1 to "
                                f"{most or 'any number of'} tokens (its pipelines' default is {self.max_sequence_length})")
        windowed = {name: partial(function, max_sequence_length=length) for name in
                    ("tokenize", "encode_tokens", "unconditional")
                    if (function := getattr(self, name)) is not None
                    and "max_sequence_length" in inspect.signature(function).parameters}
        # encode counts a caption's tokens with the first tokenizer: the windowed one where it is the only one
        return replace(self, **windowed, encode_text=None, max_sequence_length=length,
                       text_window=length if len(self.text_encoders) == 1 else self.text_window)

    @property
    def given_max_sequence_length(self) -> int | None:
        """The caption window where it is not the registered family's own (``with_max_sequence_length``, from
        encode --max-sequence-length), else None: what the manifest records and the export names."""
        own = _FAMILIES[self.name].max_sequence_length if self.name in _FAMILIES else None
        return self.max_sequence_length if self.max_sequence_length != own else None

    def empty_ids(self, tokenizers) -> list:
        """The unconditional text's token ids per text encoder (a tokenizing family): ``unconditional``'s, else
        the caption ""'s."""
        return self.unconditional(tokenizers) if self.unconditional else self.tokenize(tokenizers, [""])

    def ids_member(self, index: int) -> str:
        """The per-sample member of the token ids of text encoder ``index`` (``--text online``)."""
        return f"ids_{self.text_encoders[index][0]}.npy"

    def predict(self, model, noisy, timestep, cond: Mapping[str, Any]):
        """The denoiser's output for ``noisy`` [B, C, h, w] in the same layout: the one call train, the
        validation loss and the FLOP count make, whatever the family."""
        if self.denoise is not None:
            return self.denoise(model, noisy, timestep, self.conditioning(cond))
        return model(noisy, timestep=timestep, **self.conditioning(cond), return_dict=False)[0]

    def cut(self):
        """The module of ``pipeline_cut``: how pipeline parallelism cuts this family's denoiser into stages."""
        import importlib

        if self.pipeline_cut is None:
            raise LaionkitError(f"--pipeline-stages: family {self.name}'s denoiser has no pipeline cut (built for "
                                f"{', '.join(n for n, s in _FAMILIES.items() if s.pipeline_cut) or 'none'}); "
                                "train it with one pipeline stage (FSDP or DDP)")
        return importlib.import_module(self.pipeline_cut)

    def member(self, key: str) -> str:
        """The per-sample tar member of a stored key (``states`` keeps SD's ``text.npy``)."""
        return "text.npy" if key == "states" else f"{key}.npy"

    def empty_file(self, key: str) -> str:
        """The folder's empty-caption file of a stored key (``states`` keeps SD's ``empty_caption.npy``)."""
        return "empty_caption.npy" if key == "states" else f"empty_{key}.npy"

    def blocks(self, denoiser) -> list:
        """The denoiser's modules of ``block_classes``: FSDP wrap units and checkpointing units, in order."""
        found = [m for m in denoiser.modules() if type(m).__name__ in self.block_classes]
        if not found:
            raise LaionkitError(
                f"family {self.name}: {type(denoiser).__name__} has no {'/'.join(self.block_classes)} blocks"
            )
        return found

    def checkpoint_blocks(self, denoiser, every: int) -> list:
        """Activation checkpointing per block (``--checkpointing blocks`` is ``every=1``, ``every-N`` is
        ``every=N``): the N-th, 2N-th, ... block (counted from 1, in ``blocks()`` order, as torchtitan counts)
        runs its forward under non-reentrant ``torch.utils.checkpoint``, keeping only its inputs and
        recomputing its activations in backward. Without grad (validation, the validation loss, export) a
        block runs plainly. The module tree and state dict are unchanged (the forward is replaced on the
        instance, by a bound method, so a deepcopy stays checkpointed on its own blocks). The other blocks
        run plainly again (``every=0``: none; ``--checkpointing auto`` tries several). Returns the
        checkpointed blocks."""
        chosen = []
        for index, block in enumerate(self.blocks(denoiser), 1):
            wrapped = "_plain_forward" in vars(block)
            if every and index % every == 0:
                chosen.append(block)
                if not wrapped:  # checkpointing twice wraps once
                    block._plain_forward = block.forward
                    block.forward = MethodType(_checkpointed_forward, block)
            elif wrapped:
                plain = vars(block).pop("_plain_forward")
                if getattr(plain, "__func__", None) is type(block).forward:
                    del block.forward  # the class's own forward again
                else:
                    block.forward = plain
        return chosen

    def compile_blocks(self, denoiser, **options) -> list:
        """Regional compilation: ``torch.compile`` each block in place (``nn.Module.compile``, as diffusers'
        ``compile_repeated_blocks`` does): blocks of one class share one graph per input shape, so compile
        time does not grow with depth; the glue between blocks stays eager. Returns the compiled blocks."""
        found = self.blocks(denoiser)
        for block in found:
            block.compile(**options)
        return found


def _checkpointed_forward(block, *args, **kwargs):
    import torch
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return block._plain_forward(*args, **kwargs)
    return checkpoint(block._plain_forward, *args, use_reentrant=False, **kwargs)


_FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add a family under its name; registering a second one under the same name is a programming error."""
    if spec.name in _FAMILIES:
        raise ValueError(f"model family {spec.name!r} is already registered")
    _FAMILIES[spec.name] = spec
    return spec


def get_family(name: str) -> FamilySpec:
    """The registered family ``name``; an unknown name (from a flag or a manifest) is a user error."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise LaionkitError(
            f"unknown model family {name!r} (known: {', '.join(sorted(_FAMILIES)) or 'none'})"
        ) from None


def families() -> list[str]:
    return sorted(_FAMILIES)


DEFAULT_FAMILY = "sd"  # what a latent manifest without a family field, or a bare model folder, is


def detect_family(source: str) -> FamilySpec:
    """The family of a model source: a preset's, else the pipeline class its model_index.json names.

    A folder without model_index.json is known by its components (``_family_of_components``); a hub repo
    without one (a standalone VAE) is SD, as it always was; a model_index.json naming a pipeline no family
    draws is refused rather than guessed.
    """
    import json

    from laionkit.common.models import refuse_missing_folder

    for spec in _FAMILIES.values():
        if source in spec.presets:
            return spec
    refuse_missing_folder(source)
    path = Path(source).expanduser()
    index = None
    if path.is_dir():
        if (path / "model_index.json").is_file():
            index = path / "model_index.json"
    elif source.count("/") == 1 and not source.startswith((".", "/", "~")):
        try:  # a hub pipeline repo: its model_index.json, from the cache or the hub
            from huggingface_hub import hf_hub_download

            index = Path(hf_hub_download(source.partition(":")[0], "model_index.json"))
        except Exception:  # noqa: BLE001 - no index reachable: loading the components says what is wrong
            index = None
    if index is None:
        return _family_of_components(path) if path.is_dir() else get_family(DEFAULT_FAMILY)
    try:
        name = json.loads(index.read_text())["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LaionkitError(f"{index}: not a diffusers model_index.json ({error})") from None
    for spec in _FAMILIES.values():
        if spec.pipeline_class == name:
            return spec
    raise LaionkitError(f"{source}: model_index.json names {name}, which no model family draws (known: "
                        + ", ".join(f"{s.name} = {s.pipeline_class}" for s in _FAMILIES.values()) + ")")


def _read_class(config: Path, key: str) -> str | None:
    """The class a component's config names (``_class_name``, or transformers' first ``architectures``)."""
    import json

    try:
        found = json.loads(config.read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found[0] if isinstance(found, list) and found else found if isinstance(found, str) else None


def _family_of_components(path: Path) -> FamilySpec:
    """The family of a pipeline folder without model_index.json, from its component subfolders.

    A denoiser in transformer/ is one of the transformer families (its config's ``_class_name``, else its
    text encoders: SD3 alone has text_encoder_3, Flux's second is T5, PixArt has T5 alone, Qwen-Image Qwen2.5-VL, Sana Gemma-2); a second text
    encoder beside a UNet is SDXL; anything else (bare component folders) is SD, as it always was. Taking a
    transformer folder for SD encoded SD-style text and latents that no transformer trains on. Sana's text
    encoder is Gemma-2 alone.
    """
    transformer = path / "transformer"
    if transformer.is_dir():
        name = _read_class(transformer / "config.json", "_class_name")
        by_class = [spec for spec in _FAMILIES.values() if spec.denoiser_subfolder == "transformer"
                    and spec.denoiser_class == name]
        if len(by_class) > 1:  # one transformer class, several families (FLUX.2 dev / klein): the text encoder
            encoder = _read_class(path / "text_encoder" / "config.json", "architectures")
            by_class = [spec for spec in by_class if encoder in spec.text_encoder_classes] or by_class
        if by_class:
            return by_class[0]
        if name is None:  # no readable transformer config: the text encoders tell the families apart
            t5 = [sub for sub in ("text_encoder", "text_encoder_2")
                  if _read_class(path / sub / "config.json", "architectures") == "T5EncoderModel"]
            if (path / "text_encoder_3").is_dir():
                return get_family("sd3")
            if t5 == ["text_encoder_2"]:
                return get_family("flux")
            if t5 == ["text_encoder"]:
                return get_family("pixart")
            if _read_class(path / "text_encoder" / "config.json", "architectures") == "Qwen2_5_VLForConditionalGeneration":
                return get_family("qwen-image")
            if _read_class(path / "text_encoder" / "config.json", "architectures") == "Gemma2Model":
                return get_family("sana")
        raise LaionkitError(
            f"{path} has no model_index.json and its transformer/ ({name or 'no readable config.json'}) is "
            "none of " + ", ".join(f"{s.name} = {s.denoiser_class}" for s in _FAMILIES.values()
                                   if s.denoiser_subfolder == "transformer")
            + ": add the pipeline's model_index.json")
    if (path / "unet").is_dir() and (path / "text_encoder_2").is_dir():
        return get_family("sdxl")
    return get_family(DEFAULT_FAMILY)
