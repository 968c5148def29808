"""Checks train makes before it trusts an input it did not write: one line naming what does not fit.

* online-text latents: the text encoders (and tokenizers) train loads must be the ones encode hashed into
  the manifest's ``models``, else the stored token ids are encoded by another model without a word;
* a pretrained ``--unet`` / ``--transformer`` (or a config file) must be the latents' family's denoiser
  class, checked on its config before diffusers loads weights into the wrong class (a shape error deep
  in from_pretrained otherwise);
* ``--train-guidance`` needs a denoiser with a guidance embedding (it was dropped silently);
* flag combinations of --lora-rank, the validation loss, --eval-every, --fp8, --export, --cpu-offload, --block-swap
  and --gpu-memory-gib, refused by
  TrainConfig.__post_init__ before anything loads.
"""

from __future__ import annotations

from laionkit.common import LaionkitError


def check_text_encoders(family, models: dict, allow: bool, say=print) -> None:
    """Each text encoder and tokenizer of online-text latents is the one encode used: the sha256 of its
    files as now found equals the manifest's (a component encode could not hash is not compared)."""
    from laionkit.common.models import fingerprint

    for pair in family.text_encoders:
        for component in reversed(pair):  # the encoder first: the one that turns ids into states
            recorded = (models.get(component) or {}).get("files")
            if not recorded:
                continue
            source = models[component]["source"]
            found = fingerprint(source, component).get("files") or {}
            changed = sorted(name for name in set(recorded) | set(found) if recorded.get(name) != found.get(name))
            if not changed:
                continue
            message = (f"online-text latents: {component} from {source} is not the one encode used (its "
                       f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} differ from the manifest's "
                       "sha256), so the stored token ids would be encoded by another model")
            if not allow:
                raise LaionkitError(f"{message}: restore it or re-encode, or give --allow-changed-text-encoder "
                                    "to train with it anyway")
            say(f"warning: {message} (--allow-changed-text-encoder)")


def check_denoiser_class(found: str | None, spec, flag: str, source: str) -> None:
    """A model config's ``_class_name`` against the class the latents' family trains."""
    from laionkit.families import families, get_family

    if not found or found == spec.denoiser_class:
        return
    owners = [name for name in families() if get_family(name).denoiser_class == found]
    whose = f" (a {'/'.join(owners)} model)" if owners else ""
    raise LaionkitError(f"{flag} {source}: its config names {found}{whose}; these {spec.name} latents train "
                        f"a {spec.denoiser_class}")


def check_denoiser_folder(source: str, spec, flag: str) -> None:
    """check_denoiser_class on a pretrained model's config (read alone, before any weights)."""
    import diffusers

    from laionkit.common.models import _load_config

    config = _load_config(getattr(diffusers, spec.denoiser_class), spec.presets.get(source, source),
                          spec.denoiser_subfolder)
    check_denoiser_class(config.get("_class_name"), spec, flag, source)


def check_guidance(config, spec, model) -> None:
    """--train-guidance feeds a guidance embedding: refused where the denoiser has none."""
    if config.train_guidance is not None and not getattr(model.config, "guidance_embeds", False):
        raise LaionkitError(f"--train-guidance {config.train_guidance}: this {spec.name} {spec.denoiser_class} has "
                            "no guidance embedding (its config's guidance_embeds is not true); leave the flag out")


# --- Flag checks of TrainConfig.__post_init__, beside the names they check (config sits below the modules
# that act on the flags: lora and pipeline import these, not the other way round) ---

# diffusers' train_text_to_image_lora.py default; the SD3 / Flux transformers' attention uses the same names.
DEFAULT_TARGETS = "to_q,to_k,to_v,to_out.0"
FORMATS = ("pipeline", "single-file")
FILE_MODES = ("copy", "hardlink")
RECIPES = ("tensorwise", "rowwise")


def targets(config) -> list[str]:
    return [name.strip() for name in config.lora_targets.split(",") if name.strip()]


def check_lora(config) -> None:
    """Flag combinations refused before anything loads (called from TrainConfig.__post_init__)."""
    if config.lora_rank is None:
        return
    if config.lora_rank < 1:
        raise LaionkitError(f"--lora-rank {config.lora_rank}: must be >= 1")
    if not 0 <= config.lora_dropout < 1:
        raise LaionkitError(f"--lora-dropout {config.lora_dropout}: must be in [0, 1)")
    if config.lora_alpha is not None and not config.lora_alpha > 0:
        raise LaionkitError(f"--lora-alpha {config.lora_alpha}: must be > 0")
    if not targets(config):
        raise LaionkitError("--lora-targets is empty: give module names, e.g. " + DEFAULT_TARGETS)
    if config.unet_config is not None and not config.lora_random_base:  # the export holds the adapters alone
        raise LaionkitError(f"--lora-rank with --unet-config / --transformer-config {config.unet_config}: adapters "
                            "train on a pretrained base, and a from-scratch base is random and never saved; give "
                            "--unet / --transformer, or drop --lora-rank to train the whole model "
                            "(--lora-random-base allows it, for throughput measurements)")


def check_val_loss(config) -> None:
    """Flag checks run by TrainConfig.__post_init__."""
    if config.val_latents is None:
        if config.val_every or config.val_samples != 64 or config.val_strata != 8:
            raise LaionkitError("--val-every, --val-samples and --val-strata need --val-latents DIR (a latent folder)")
        return
    if config.val_every < 0 or config.val_samples < 1:
        raise LaionkitError(f"--val-every {config.val_every} / --val-samples {config.val_samples}: "
                            "must be >= 0 and >= 1")
    if config.val_strata < 0:
        raise LaionkitError(f"--val-strata {config.val_strata}: must be >= 0 (0: one random level per sample)")


EVAL_DEFAULTS = {"eval_reference": None, "eval_prompts": None, "eval_count": 1000, "eval_steps": 25,
                 "eval_resolution": None, "eval_inception": None, "eval_clip_model": "ViT-L-14",
                 "eval_clip_pretrained": "openai"}


def check_eval(config) -> None:
    """--eval-every and its settings (TrainConfig.__post_init__): the files it names exist, so a run does not
    stop at its first evaluation; the scorers' weights are loaded at setup (laionkit/trainer/evalhook.py)."""
    from pathlib import Path

    if config.eval_every < 0:
        raise LaionkitError(f"--eval-every {config.eval_every}: must be >= 0 (0: never)")
    if not config.eval_every:
        given = [name for name, default in EVAL_DEFAULTS.items() if getattr(config, name) != default]
        if given:
            raise LaionkitError(f"--{given[0].replace('_', '-')} sets up scoring during training: give --eval-every N "
                                "too (or drop it)")
        return
    if config.eval_reference is None:
        raise LaionkitError("--eval-every needs --eval-reference IMAGES (a folder of images or pack's tars) to "
                            "compute FID and KID against")
    reference = Path(config.eval_reference).expanduser()
    if not reference.exists():
        raise LaionkitError(f"--eval-reference {config.eval_reference}: no such folder or tar file")
    if config.eval_prompts is not None and not Path(config.eval_prompts).expanduser().is_file():
        raise LaionkitError(f"--eval-prompts {config.eval_prompts}: no such file")
    for name, low in (("eval_count", 2), ("eval_steps", 1)):
        if getattr(config, name) < low:
            raise LaionkitError(f"--{name.replace('_', '-')} {getattr(config, name)}: must be >= {low}"
                                + (" (FID and KID need 2 images)" if name == "eval_count" else ""))
    if config.eval_resolution is not None and (config.eval_resolution < 8 or config.eval_resolution % 8):
        raise LaionkitError(f"--eval-resolution {config.eval_resolution}: a multiple of 8 (the pipelines' VAEs "
                            "downsample by 8), e.g. 512")
    if "://" not in str(config.output):  # eval.png would become a reference image
        output, source = Path(config.output).expanduser().resolve(), reference.resolve()
        if output == source or source in output.parents:
            raise LaionkitError(f"--output {config.output} {'is' if output == source else 'lies inside'} "
                                f"--eval-reference {config.eval_reference}; outputs never go into inputs")


def check_fp8(config) -> None:
    """Flag combinations refused before anything loads (called from TrainConfig.__post_init__)."""
    if not config.fp8:
        return
    if config.fp8_recipe not in RECIPES:
        raise LaionkitError(f"--fp8-recipe {config.fp8_recipe!r}: one of {', '.join(RECIPES)}")
    try:
        if config.lora_rank is None:  # LoRA's frozen base runs torch._scaled_mm itself (quantized_base.py)
            import torchao.float8  # noqa: F401
    except ImportError:
        raise LaionkitError("--fp8 needs torchao: pip install 'laionkit[fp8]'") from None


def check_plan(config) -> None:
    """--gpu-memory-gib (TrainConfig.__post_init__); against the GPU's memory it is checked where it is applied
    (memory.cap_gpu_memory), and --plan's file where the command reads it (laionkit/plan.py)."""
    import math

    gib = config.gpu_memory_gib
    if gib is not None and not (math.isfinite(gib) and gib > 0):
        raise LaionkitError(f"--gpu-memory-gib {gib}: a number of GiB > 0, e.g. 24")


def check_base_dtype(config) -> None:
    """--base-dtype quantizes the frozen base of a LoRA run; a full-parameter run trains its weights in them."""
    if config.base_dtype != "bf16" and config.lora_rank is None:
        raise LaionkitError(f"--base-dtype {config.base_dtype} quantizes the frozen base of a LoRA run: give "
                            "--lora-rank N too (a full-parameter run trains every weight, which stays bf16/fp32)")


def parse_formats(value: str | None, lora: bool = False) -> tuple[str, ...]:
    """--export: a comma-separated list of FORMATS, none, or auto (the pipeline for a full-parameter run, nothing
    for a LoRA run: see the module docstring)."""
    names = [part.strip() for part in (value or "").split(",") if part.strip()]
    if names == ["none"]:
        return ()
    if names == ["auto"]:
        return () if lora else ("pipeline",)
    bad = [name for name in names if name not in FORMATS]
    if bad or not names:
        raise LaionkitError(f"--export {value!r}: a comma-separated list of {', '.join(FORMATS)}, none or auto")
    if "single-file" in names and "pipeline" not in names:
        raise LaionkitError("--export single-file is converted from the pipeline folder: give --export "
                            "pipeline,single-file")
    return tuple(dict.fromkeys(names))


def check_export(config) -> None:
    """TrainConfig's --export and --export-files, checked before a run starts."""
    if parse_formats(config.export, config.lora_rank is not None) and config.lora_rank is not None \
            and config.unet is None:
        raise LaionkitError(f"--export {config.export} with --lora-rank merges the adapters into the base, and "
                            "--lora-random-base's base is random and never saved: give --export none")
    if config.export_files not in FILE_MODES:
        raise LaionkitError(f"--export-files {config.export_files!r}: choose from {', '.join(FILE_MODES)}")


def check_validation_prompts(config) -> None:
    """--validation-prompts are --validate-every's (its files are read at setup, laionkit/trainer/evaluation.py)."""
    if config.validation_prompts and not config.validate_every:
        raise LaionkitError("--validation-prompts are the prompts of the images --validate-every N samples: give "
                            "--validate-every too")
    if config.validation_prompts and not all(value.strip() for value in config.validation_prompts):
        raise LaionkitError("--validation-prompts: an empty prompt; give the text, or a .txt file of prompts")


def check_block_swap(config) -> None:
    """--block-swap N (laionkit/trainer/blockswap.py); the ranks and the block count are checked at build."""
    if config.block_swap < 0:
        raise LaionkitError(f"--block-swap {config.block_swap}: must be >= 0 (0: off)")
    if config.block_swap and config.compile:
        raise LaionkitError(f"--block-swap {config.block_swap} with --compile: the swap moves weights in hooks "
                            "around each block, which a compiled block does not run; drop one of them")


def check_offload(config) -> None:
    """--cpu-offload's combinations (TrainConfig.__post_init__); that the launch is FSDP is checked when the
    Accelerator is built (laionkit/trainer/offload.py)."""
    if config.cpu_offload and config.ema:
        raise LaionkitError("--cpu-offload with --ema: FSDP2 keeps a shard of each weight per rank and EMA needs "
                            "whole ones on every rank (DDP or DeepSpeed ZeRO-2); drop --ema")


def check_pipeline(config) -> None:
    """--pipeline-stages N (laionkit/trainer/pipeline_parallel.py): what a pipeline-parallel run does not compose
    with yet, refused in one line; the ranks, the family and the buckets are checked at build."""
    if config.pipeline_stages < 1:
        raise LaionkitError(f"--pipeline-stages {config.pipeline_stages}: must be >= 1 (1: off)")
    if config.pipeline_stages == 1:
        return
    given = {"--ema": config.ema, "--compile": config.compile, "--block-swap": config.block_swap,
             "--cpu-offload": config.cpu_offload, "--fp8": config.fp8, "--full-bf16": config.full_bf16,
             "--bf16-weights": config.bf16_weights, "--mixed-precision fp16": config.mixed_precision == "fp16",
             f"--base-dtype {config.base_dtype}": config.base_dtype != "bf16",
             "--lora-dropout": config.lora_dropout, "--val-latents": config.val_latents is not None,
             "--validate-every": config.validate_every, "--eval-every": config.eval_every,
             "--checkpointing auto": config.checkpointing.strip().lower() == "auto", "--stage": config.stage,
             f"--checkpoint-writer {config.checkpoint_writer}": config.checkpoint_writer != "accelerate"}
    refused = [flag for flag, value in given.items() if value]
    if refused:
        raise LaionkitError(f"--pipeline-stages {config.pipeline_stages} with {refused[0]}: not built for a "
                            "pipeline-parallel run (each rank holds only its stages' blocks); drop one of them")
    stages, micro = config.pipeline_stages, config.grad_accum  # torch's schedules' conditions, said in one line
    rounds = max(1, micro // stages)
    if (config.pipeline_schedule == "1f1b" and micro < stages) or \
            (config.pipeline_schedule == "interleaved-1f1b" and micro % rounds):
        raise LaionkitError(f"--pipeline-schedule {config.pipeline_schedule} with --pipeline-stages {stages} takes "
                            f"--grad-accum micro-batches {'>= the stages' if micro < stages else 'a multiple of '}"
                            f"{'' if micro < stages else rounds} (got {micro}); raise --grad-accum or use gpipe")
