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

LoRA runs (``--lora-rank``) write no pipeline by default (``--export auto``): the base is unchanged, RUN/lora
loads onto it (laionkit/trainer/lora.py), and a merged copy of the base costs its whole size again (a Flux transformer:
48 GB in fp32). ``--export pipeline`` (or ``laionkit export RUN --format pipeline``) writes one with the adapters
merged into the denoiser at the trained strength (alpha / rank): the base's denoiser in fp32, RUN/lora (RUN/lora_ema
under --ema) loaded as users load it (diffusers' ``load_lora_adapter``, what ``pipe.load_lora_weights`` calls, with
the file's alpha metadata; PixArt: PEFT's ``PeftModel.from_pretrained``), fused (``fuse_lora`` / ``merge_and_unload``)
and saved as a plain model, so the pipeline generates as the trained model with no LoRA loader at hand.

Single-file checkpoints: laionkit/trainer/singlefile.py. ``after_training`` and ``laionkit export RUN``:
laionkit/trainer/export.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from laionkit.common import LaionkitError, atomic_output

PIPELINE = "pipeline"
SINGLE_FILE = "single_file"  # RUN/single_file/<name>.safetensors
# Files a component folder needs: configs, tokenizer files, safetensors weights (no pickles, no other
# frameworks' weights, no precision variants when the plain file is there).
KEEP_SUFFIXES = (".json", ".txt", ".model", ".safetensors", ".jinja")  # .jinja: a chat template (Qwen, Z-Image)
VARIANT = re.compile(r"\.(fp16|bf16|fp32|non_ema|ema)\.(safetensors|json)$|\.index\.(fp16|bf16)\.json$")
# The sampler a family's pipeline gets when no base model brings one (DDPM families; flow families use
# FamilySpec.sampler).
DEFAULT_SAMPLERS = {"sd": "EulerDiscreteScheduler", "sdxl": "EulerDiscreteScheduler",
                    "pixart": "DPMSolverMultistepScheduler"}
# The trained noise schedule, carried into the pipeline's scheduler.
SCHEDULE_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas", "prediction_type",
                 "steps_offset")


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
                index[name] = _write_scheduler(tmp / name, spec, base, base_index, noise_scheduler)
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


def _write_scheduler(target: Path, spec, base: str | None, base_index: dict, noise_scheduler) -> list:
    """The base's scheduler (``base_index``: its model_index.json) or the family's sampler, with the trained
    noise schedule."""
    import diffusers

    config, name = {}, None
    if base and (base_index.get("scheduler") or [None])[0] is not None:
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
