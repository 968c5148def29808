"""Model loading shared by encode and train: presets, hub ids and local folders, all through from_pretrained.

A model *source* is one string, resolved per component (``vae``, ``text_encoder``, ``tokenizer``,
``unet``, ``scheduler``, and the second / third encoders of SDXL and SD3) in this order:

1. a preset name (``sd15``, ``sd2``, ``sdxl``): a hub pipeline repo, component in its subfolder;
2. a local folder: ``DIR/<component>/`` if it exists (a pipeline folder such as the one
   ``laionkit models tiny`` writes), else ``DIR`` itself (a bare component folder);
3. a hub id: ``owner/name`` is a pipeline repo (component in its subfolder) unless the component is
   given explicitly as ``owner/name/subfolder``; ``owner/name:root`` means the repo root
   (e.g. ``stabilityai/sd-vae-ft-mse:root`` for a standalone VAE repo).

``write_tiny_models`` saves tiny random-init models in the same formats, so tests and the offline demo
go through exactly the loading code users run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from laionkit.common.errors import LaionkitError

COMPONENTS = ("vae", "text_encoder", "tokenizer", "unet", "scheduler", "text_encoder_2", "tokenizer_2",
              "text_encoder_3", "tokenizer_3", "transformer")
# Text encoder classes a component's config may name (its "architectures"); anything else loads as
# CLIPTextModel, as SD's always did.
TEXT_ENCODER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel", "Qwen3Model",
                        "Qwen2_5_VLForConditionalGeneration", "Gemma2Model", "Mistral3ForConditionalGeneration")
# Checkpoints saved from a language model whose pipelines load its base model (Z-Image: Qwen3-4B's weights
# under a Qwen3ForCausalLM config, loaded as Qwen3Model, as its model_index.json names it).
TEXT_ENCODER_ALIASES = {"Qwen3ForCausalLM": "Qwen3Model"}
# VAE classes a vae/ config may name (its "_class_name"); anything else loads as AutoencoderKL, as it always did.
# AutoencoderDC (Sana's DC-AE) is deterministic: encode(x).latent is the latent itself, with no posterior
# (AutoencoderKL's encode(x).latent_dist) to draw from; ``vae_is_deterministic`` tells encode and train which.
# AutoencoderKLQwenImage is a video VAE (a frame axis; FamilySpec.vae_frames).
# AutoencoderKLFlux2 (FLUX.2's) has no scaling factor: its latents are normalised with its batch-norm statistics.
VAE_CLASSES = ("AutoencoderKL", "AutoencoderKLQwenImage", "AutoencoderDC", "AutoencoderKLFlux2")
DETERMINISTIC_VAES = ("AutoencoderDC",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model", ".jinja")  # .jinja: a chat template


@dataclass(frozen=True)
class Preset:
    """A known model family: where its components live and how its text conditioning is taken."""

    repo: str
    text_layer: str
    resolution: int
    note: str


# The SD2 checkpoint on the hub already drops OpenCLIP ViT-H's last block (23 of 24 layers), so its
# "last" hidden state is the penultimate layer SD2 was trained on.
PRESETS = {
    "sd15": Preset("stable-diffusion-v1-5/stable-diffusion-v1-5", "last", 512,
                   "SD 1.5 VAE + CLIP ViT-L/14 text encoder, last hidden state"),
    "sd2": Preset("stabilityai/stable-diffusion-2-base", "last", 512,
                  "SD 2 VAE + OpenCLIP ViT-H text encoder, penultimate layer (the hub checkpoint has 23 layers)"),
    "sdxl": Preset("stabilityai/stable-diffusion-xl-base-1.0", "penultimate", 1024,
                   "SDXL base: fp32-upcast VAE, CLIP ViT-L + OpenCLIP ViT-bigG penultimate states, pooled bigG"),
}


@dataclass(frozen=True)
class ComponentSource:
    """Where one component is loaded from: ``from_pretrained(location, subfolder=subfolder)``."""

    given: str
    location: str
    subfolder: str | None
    local: bool

    def describe(self) -> dict:
        return {"source": self.given, "location": self.location, "subfolder": self.subfolder,
                "local": self.local}


def refuse_missing_folder(source: str, role: str = "--model") -> None:
    """A source written as a path (``./``, ``../``, ``/``, ``~``, or under a folder that exists) that is no folder
    is a typo, refused at once: tried as a hub id it costs minutes of retries, then a hub error about a repo."""
    if source in PRESETS:
        return
    path = Path(source).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise LaionkitError(f"{role} {source}: not a folder (a model is a folder, a preset or a hub id)")
    parent = path.parent
    if source.startswith((".", "/", "~")) or (str(parent) != "." and parent.is_dir()):
        raise LaionkitError(f"{role} {source}: no such folder (written as a path, so not tried as a hub id)")


def resolve_source(source: str, component: str) -> ComponentSource:
    """Turn a user's ``--model``/``--vae``/... string into a from_pretrained location for one component."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}")
    if not source:
        raise LaionkitError(f"empty model source for {component}")
    if source in PRESETS:
        return ComponentSource(source, PRESETS[source].repo, component, local=False)
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / component).is_dir():
            return ComponentSource(source, str(path.resolve()), component, local=True)
        if (path / "model_index.json").is_file():
            raise LaionkitError(_missing_component(path, component))
        if any(path.glob("*.json")):
            return ComponentSource(source, str(path.resolve()), None, local=True)
        raise LaionkitError(
            f"model folder {path} has neither a {component}/ subfolder nor a config file for {component}"
        )
    refuse_missing_folder(source, "model")
    repo, _, root = source.partition(":")
    if root and root != "root":
        raise LaionkitError(f"model source {source!r}: only ':root' may follow a hub id")
    parts = repo.split("/")
    if len(parts) < 2 or not all(parts):
        raise LaionkitError(
            f"model source {source!r} for {component} is not a preset ({', '.join(PRESETS)}), "
            "an existing folder, or a hub id owner/name[/subfolder]"
        )
    if root:
        return ComponentSource(source, repo, None, local=False)
    if len(parts) > 2:
        return ComponentSource(source, "/".join(parts[:2]), "/".join(parts[2:]), local=False)
    return ComponentSource(source, repo, component, local=False)


def _missing_component(path: Path, component: str) -> str:
    """Why a pipeline folder (one with model_index.json) cannot give ``component``: its subfolder is missing.

    The folder root is never a component's fallback there: from_pretrained on it found no vocabulary and
    built an empty tokenizer (every caption the same ids), or failed deep inside transformers.
    """
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError):
        index = None
    index = index if isinstance(index, dict) else {}
    named = index.get(component)
    if isinstance(named, list) and any(named):
        return (f"model folder {path}: model_index.json names {component} ({named[-1]}) but its subfolder "
                f"{component}/ is missing (copy the whole pipeline folder)")
    return (f"model folder {path} ({index.get('_class_name', 'a pipeline')}) has no {component}/ subfolder, "
            f"and its model_index.json names no {component}")


def refused_pickle(error: BaseException) -> str | None:
    """Where ``error``, or an error it was raised from (diffusers and transformers wrap it), is torch's
    weights-only loader refusing a pickle: the line naming what the pickle asked for (``GLOBAL posix.system``),
    for a one-line error; None for any other error. torch's own message spans paragraphs."""
    import pickle

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, pickle.UnpicklingError):
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            named = ([line for line in lines if "GLOBAL" in line] or lines or [type(error).__name__])[0]
            return named.split(" Please use ")[0][:300]  # torch's advice to allowlist the global is not ours
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def weights_error(error: BaseException) -> str:
    """``error`` of reading a weights file, in one line: a pickle that torch's weights-only loader refused
    says so and names what it asked for; any other error gives its type and first line."""
    refused = refused_pickle(error)
    if refused is not None:
        return f"a pickle that is not plain tensor data, refused to load it (weights are data, never code): {refused}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _from_pretrained(cls, source: str, component: str, **kwargs):
    """``cls.from_pretrained`` of ``component``; a pickled weights file there (``.bin``) is read by the library
    with torch's weights-only loader, whose refusal of one that would run code is one line here."""
    where = resolve_source(source, component)
    sub = f" (subfolder {where.subfolder})" if where.subfolder else ""
    try:
        return cls.from_pretrained(where.location, subfolder=where.subfolder, **kwargs)
    except Exception as error:
        if refused_pickle(error) is not None:
            raise LaionkitError(f"cannot load {component} from {where.location}{sub}: a weights file there is "
                                f"{weights_error(error)}") from None
        if isinstance(error, OSError):
            raise LaionkitError(f"cannot load {component} from {where.location}{sub}: {error}") from error
        raise


def load_vae(source: str, dtype=None):
    """The diffusers VAE of the class its config names: AutoencoderKL (SD-style: 4 latent channels, 8x
    downsampling for the SD VAEs; 16 channels for SD3 / Flux), AutoencoderDC (Sana's deterministic 32x DC-AE) or
    AutoencoderKLQwenImage (Qwen-Image's, whose latents have a frame axis)."""
    import diffusers

    named = load_vae_config(source).get("_class_name")
    cls = getattr(diffusers, named if named in VAE_CLASSES else "AutoencoderKL")
    return _from_pretrained(cls, source, "vae", torch_dtype=dtype).eval().requires_grad_(False)


def vae_facts(config) -> dict:
    """What the latent manifest records of a VAE config (AutoencoderKL's and AutoencoderDC's, or
    AutoencoderKLQwenImage's, which names its channels z_dim, downsamples once per temperal_downsample entry
    and has no scaling factor: its latents are normalised per channel with latents_mean / latents_std
    instead, scaling 1, no shift)."""
    if "z_dim" in config:
        return {"scaling_factor": 1.0, "shift_factor": None, "latent_channels": config["z_dim"],
                "downsample_factor": 2 ** len(config["temperal_downsample"])}
    if "batch_norm_eps" in config:  # AutoencoderKLFlux2: normalised by its batch-norm statistics (FamilySpec.vae_stats)
        return {"scaling_factor": 1.0, "shift_factor": None, "latent_channels": config["latent_channels"],
                "downsample_factor": vae_downsample(config)}
    return {"scaling_factor": config["scaling_factor"], "shift_factor": config.get("shift_factor"),
            "latent_channels": config["latent_channels"], "downsample_factor": vae_downsample(config)}

def vae_is_deterministic(vae) -> bool:
    """Whether a VAE (a loaded model, or its config.json as a dict) encodes to the latent itself, with no
    posterior to draw from (AutoencoderDC), rather than to a diagonal Gaussian's moments (AutoencoderKL)."""
    named = vae.get("_class_name") if isinstance(vae, dict) else type(vae).__name__
    return named in DETERMINISTIC_VAES


def vae_downsample(config) -> int:
    """A VAE's pixels per latent side: 2 ** (stages - 1) of its encoder (AutoencoderKL's block_out_channels,
    AutoencoderDC's encoder_block_out_channels)."""
    stages = config.get("block_out_channels") or config.get("encoder_block_out_channels")
    return 2 ** (len(stages) - 1)


def load_text_encoder(source: str, dtype=None, component: str = "text_encoder"):
    """A transformers text model of the class its config names: CLIPTextModel (SD 1.5's CLIP ViT-L/14, SD 2's
    OpenCLIP ViT-H, SDXL's first encoder), CLIPTextModelWithProjection (SDXL's second, whose pooled
    projection the UNet is conditioned on) or T5EncoderModel."""
    import transformers

    where = resolve_source(source, component)
    try:
        config, _ = transformers.PretrainedConfig.get_config_dict(where.location, subfolder=where.subfolder or "")
    except (OSError, ValueError) as error:
        raise LaionkitError(f"cannot read the {component} config from {where.location}: {error}") from None
    named = (config.get("architectures") or ["CLIPTextModel"])[0]
    named = TEXT_ENCODER_ALIASES.get(named, named)
    cls = getattr(transformers, named if named in TEXT_ENCODER_CLASSES else "CLIPTextModel")
    model = _from_pretrained(cls, source, component, dtype=dtype)
    return model.eval().requires_grad_(False)


def load_tokenizer(source: str, component: str = "tokenizer"):
    """The tokenizer matching the text encoder: CLIP's BPE (window = model_max_length, 77 for SD),
    T5TokenizerFast where the component's tokenizer_config.json names a T5 tokenizer (SD3, Flux, PixArt),
    Qwen2Tokenizer where it names a Qwen2 one (Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL: byte-level BPE), or
    GemmaTokenizerFast where it names a Gemma one (Sana; its caption window is the family's text_window), or the
    processor where the component is a processor's folder (FLUX.2-dev's PixtralProcessor, whose chat template
    renders the prompt; its ``.tokenizer`` counts tokens)."""
    from transformers import CLIPTokenizer, GemmaTokenizerFast, Qwen2Tokenizer, T5TokenizerFast

    if _is_processor(source, component):
        from transformers import AutoProcessor

        return _from_pretrained(AutoProcessor, source, component)
    named = _tokenizer_class(source, component)
    cls = (T5TokenizerFast if named.startswith("T5") else Qwen2Tokenizer if named.startswith("Qwen2")
           else GemmaTokenizerFast if named.startswith("Gemma") else CLIPTokenizer)
    return _from_pretrained(cls, source, component)


def load_family_tokenizers(family, source_of) -> list:
    """A family's tokenizers (``source_of(component)``: where each loads from), each counting tokens in the
    family's caption window where it has one (``text_window``: the pipeline's, not the tokenizer folder's), as
    encode tokenizes captions and train its --validation-prompts."""
    tokenizers = [load_tokenizer(source_of(tok), tok) for tok, _ in family.text_encoders]
    for tokenizer in tokenizers if family.text_window else ():
        text_tokenizer(tokenizer).model_max_length = family.text_window
    return tokenizers


def text_tokenizer(tokenizer):
    """The tokenizer itself of what load_tokenizer gave (a processor's ``.tokenizer``): what counts tokens."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def _is_processor(source: str, component: str) -> bool:
    """Whether the component loads as a processor: the class the pipeline's model_index.json names for it
    (FLUX.2-dev's "tokenizer": ["transformers", "PixtralProcessor"]; a tokenizer folder may hold a
    processor_config.json beside a pipeline that loads only its tokenizer), else, in a local folder without a
    model_index.json, a processor_config.json in the component's folder."""
    import json

    where = resolve_source(source, component)
    if where.subfolder is None:
        return False
    try:
        if where.local:
            index = Path(where.location, "model_index.json")
            if not index.is_file():
                return Path(where.location, where.subfolder, "processor_config.json").is_file()
        else:
            from huggingface_hub import hf_hub_download

            index = Path(hf_hub_download(where.location, "model_index.json"))
        named = json.loads(index.read_text()).get(component) or [None, None]
    except Exception:  # noqa: BLE001 - no index reachable: a plain tokenizer, as before
        return False
    return isinstance(named, list) and str(named[-1] or "").endswith("Processor")


def _tokenizer_class(source: str, component: str) -> str:
    """The tokenizer_class a component's tokenizer_config.json names ("" when it names none or is unreadable)."""
    where = resolve_source(source, component)
    try:
        if where.local:
            path = Path(where.location, where.subfolder or "", "tokenizer_config.json")
        else:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(where.location, "tokenizer_config.json", subfolder=where.subfolder))
        return str(json.loads(path.read_text()).get("tokenizer_class") or "")
    except Exception:  # noqa: BLE001 - no config reachable: CLIP, as before; from_pretrained says what is wrong
        return ""


def load_unet(source: str, dtype=None):
    """Pretrained UNet2DConditionModel weights (fine-tuning); see load_unet_config for training from scratch."""
    from diffusers import UNet2DConditionModel

    return _from_pretrained(UNet2DConditionModel, source, "unet", torch_dtype=dtype)


def load_unet_config(source: str) -> dict:
    """The UNet2DConditionModel config alone, for ``UNet2DConditionModel.from_config`` (random init)."""
    from diffusers import UNet2DConditionModel

    return _load_config(UNet2DConditionModel, source, "unet")


def load_vae_config(source: str) -> dict:
    """The VAE config alone (any VAE class: load_config reads config.json): what encode must know
    (force_upcast, the class) before choosing the load dtype and class."""
    from diffusers import AutoencoderKL

    return _load_config(AutoencoderKL, source, "vae")


def _load_config(cls, source: str, component: str) -> dict:
    if Path(source).is_file():  # a config.json of its own (--unet-config / --transformer-config FILE)
        location, subfolder = source, None
    else:
        where = resolve_source(source, component)
        location, subfolder = where.location, where.subfolder
    try:
        return dict(cls.load_config(location, subfolder=subfolder))
    except OSError as error:
        raise LaionkitError(f"cannot read the {component} config from {location}: {error}") from error


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_safetensors(path: Path):
    """Yield (name, tensor) of a safetensors file one tensor at a time, each read into memory of its own by a
    plain file read (no memory map): what is resident at once is the tensor the caller holds, whatever the
    file's size (a base quantized as it loads: laionkit/trainer/quantized_base.py)."""
    import torch

    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            handle.seek(8 + size + begin)
            data = bytearray(end - begin)
            handle.readinto(data)
            dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
            yield name, (torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)).reshape(
                entry["shape"])


def load_scheduler(source: str):
    """The training noise scheduler (DDPM with the model's beta schedule and prediction type)."""
    from diffusers import DDPMScheduler

    return _from_pretrained(DDPMScheduler, source, "scheduler")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(source: str, component: str) -> dict:
    """Where a component came from and the sha256 of its files, for manifests (lineage of every output).

    Hub components are hashed from the local hub cache that from_pretrained just filled; when the cache
    cannot be found the hashes are recorded as missing rather than guessed.
    """
    where = resolve_source(source, component)
    record = where.describe()
    folder: Path | None = Path(where.location) if where.local else None
    if folder is None:
        try:
            from huggingface_hub import snapshot_download

            pattern = f"{where.subfolder}/*" if where.subfolder else "*"
            folder = Path(snapshot_download(where.location, allow_patterns=[pattern], local_files_only=True))
        except Exception as error:  # noqa: BLE001 - any cache miss means "no hashes", recorded as such
            record["files"] = None
            record["files_missing_reason"] = f"{type(error).__name__}: {error}"
            return record
    if where.subfolder:
        folder = folder / where.subfolder
    record["files"] = {
        file.name: sha256_file(file)
        for file in sorted(folder.iterdir())
        if file.is_file() and file.name.endswith(WEIGHT_SUFFIXES)
    }
    return record


# --- tiny random-init models in the real formats -------------------------------------------------

TINY_TEXT_HIDDEN = 32
CLIP_VOCAB_SIZE = 49408
CLIP_WINDOW = 77


def clip_bpe() -> tuple[dict[str, int], list[str]]:
    """The OpenAI CLIP BPE that open_clip ships, as (vocab, merges) in Hugging Face's layout.

    Same construction as OpenAI's / open_clip's SimpleTokenizer (256 byte tokens, the same with
    ``</w>``, 48,894 merges, two specials), which is exactly openai/clip-vit-large-patch14's vocabulary.
    """
    import open_clip.tokenizer as oc

    lines = gzip.open(oc.default_bpe()).read().decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    byte_symbols = list(oc.bytes_to_unicode().values())
    tokens = byte_symbols + [symbol + "</w>" for symbol in byte_symbols]
    tokens += ["".join(merge.split()) for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    assert len(tokens) == CLIP_VOCAB_SIZE, len(tokens)
    return {token: i for i, token in enumerate(tokens)}, merges


def clip_tokenizer(folder: Path):
    """A CLIPTokenizer with the real vocabulary, also saved as vocab.json / merges.txt for older readers."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_bpe()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges], model_max_length=CLIP_WINDOW)


def write_tiny_models(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init StableDiffusionPipeline folder: vae/, unet/, text_encoder/, tokenizer/, scheduler/.

    The VAE has SD's 4 latent channels and 8x downsampling (4 blocks, 3 downsamples), the text encoder
    CLIP's 77-token window and real 49,408-token vocabulary (hidden size 32), the UNet cross-attends to
    it, and the scheduler is SD 1.5's. Everything loads with the same from_pretrained calls as SD 1.5.
    """
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    output = Path(output)
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=(8, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=4,
        sample_size=64,
        scaling_factor=0.18215,
    )
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE, hidden_size=TINY_TEXT_HIDDEN, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=CLIP_WINDOW,
        hidden_act="quick_gelu", projection_dim=TINY_TEXT_HIDDEN,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    ))
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=TINY_TEXT_HIDDEN,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    scheduler = DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, steps_offset=1, prediction_type="epsilon",
    )
    tokenizer_dir = output / "tokenizer"
    tokenizer = clip_tokenizer(tokenizer_dir)
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(output, safe_serialization=True)
    return output
