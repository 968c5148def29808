"""What a run writes at its end: the trained denoiser as diffusers loads it (RUN/unet or RUN/transformer, its
EMA, or the LoRA adapters in RUN/lora), from the fp32 master weights where there are some; then the exports
--export asks for (after_training: RUN/pipeline, single files), which `laionkit export RUN` (export_run)
rebuilds from a finished run folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from laionkit.common import (
    LaionkitError,
    atomic_output,
)
from laionkit.trainer.exportrecord import record_export, stale_export
from laionkit.trainer.pipeline_folder import PIPELINE, _base, merge_lora, write_pipeline
from laionkit.trainer.precision import MasterWeights
from laionkit.trainer.singlefile import SINGLE_FILE_FAMILIES, single_file_family, write_single_files
from laionkit.trainer.trainchecks import FILE_MODES, FORMATS, parse_formats
from laionkit.trainer.wrappers import state_dict_of, unwrap


def export(accelerator, unet, ema, master: MasterWeights | None, output: Path, subfolder: str = "unet",
           dtype: torch.dtype = torch.float32) -> None:
    """The final denoiser (and its EMA) as diffusers folders that its class's from_pretrained loads, named
    as the family's pipeline names it (RUN/unet, RUN/transformer; EMA: RUN/unet_ema, RUN/transformer_ema).

    The weights go into a fresh, unwrapped UNet of the same config before saving: under FSDP2 the
    prepared module's parameters are DTensor shards, which diffusers' save_pretrained cannot write
    even when handed the gathered state dict (seen on 2 H200s, 2026-11-30). With MasterWeights or
    DeepSpeed the fp32 master weights are written, not their bf16 rounding. ``dtype`` is the weights'
    own: bfloat16 under --full-bf16, where fp32 would double the size (48 GB for Flux-12B) and add
    nothing; the EMA, kept in fp32, is written in fp32."""
    from accelerate.utils import DistributedType

    state_dict = state_dict_of(accelerator, unet)  # gathers FSDP / ZeRO shards; every rank must call it
    fp32 = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO's module weights are its bf16/fp16 copies; the fp32 master lives in the optimizer's partitions.
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in unwrap(accelerator, unet).named_parameters():  # collective: every rank, in order
            full = safe_get_full_fp32_param(param)
            if full is not None and accelerator.is_main_process:
                fp32[name] = full.detach().cpu()
    elif master is not None:
        fp32 = dict(zip(master.names, master.master))
    if accelerator.is_main_process:
        from accelerate import init_empty_weights

        model = unwrap(accelerator, unet)
        # No random init of a model whose every weight is overwritten next (minutes for Flux-12B on a CPU):
        # parameters are created empty and take the fp32 tensors (master weights where there are) as theirs.
        with init_empty_weights(include_buffers=False):
            plain = type(model).from_config(model.config)
        # copies (a no-op for a GPU's tensors): on the CPU, get_state_dict and the master weights hand out the
        # training tensors themselves, which assign=True would make the parameters that the EMA is copied into
        weights = {name: fp32.get(name, tensor).detach().to("cpu", copy=True) for name, tensor in state_dict.items()}
        plain.load_state_dict({name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()},
                              assign=True)
        with atomic_output(output / subfolder) as tmp:
            plain.save_pretrained(tmp, safe_serialization=True)
            record_export(tmp, output)
        if ema is not None:
            torch.nn.Module.float(plain)
            ema.copy_to(plain.parameters())
            with atomic_output(output / f"{subfolder}_ema") as tmp:
                plain.save_pretrained(tmp, safe_serialization=True)
                record_export(tmp, output)
    accelerator.wait_for_everyone()


# --- the exports besides the denoiser: RUN/pipeline, single files (laionkit/trainer/pipeline_folder.py, singlefile.py) ---

def after_training(accelerator, config, data, noise_scheduler) -> list[str]:
    """train's finish hook (rank 0 writes, every rank waits): RUN/pipeline and the single files asked for;
    returns what rank 0 wrote, relative to the run folder."""
    formats = parse_formats(config.export, config.lora_rank is not None)
    written = []
    if formats and accelerator.is_main_process:
        run, base = Path(config.output), _base(config, data.family)
        merged = merge_lora(run, data.family, base, config.ema) if config.lora_rank is not None else None
        folder = write_pipeline(run, data.family, data.models, base=base, noise_scheduler=noise_scheduler,
                                use_ema=config.ema, files=config.export_files, denoiser=merged)
        accelerator.print(f"pipeline: {folder} (DiffusionPipeline.from_pretrained loads it)")
        written.append(folder.name)
        window = data.family.given_max_sequence_length
        if window is not None:
            accelerator.print(f"pipeline: trained on a caption window of {window} tokens (encode "
                              f"--max-sequence-length): generate with max_sequence_length={window}")
        if "single-file" in formats:
            for path in write_single_files(Path(config.output)):
                accelerator.print(f"single file: {path}")
                written.append(path.relative_to(config.output).as_posix())
    accelerator.wait_for_everyone()
    return written


def written_files(run: Path, names: list[str]) -> tuple[str, ...]:
    """What a finished run wrote, relative to its folder, for the run's last line: a LoRA folder as the weights
    files in it (what load_lora_weights and ComfyUI are given), other folders and files as named."""
    found = []
    for name in names:
        files = sorted(path.name for path in (run / name).glob("*.safetensors")) if name.startswith("lora") else []
        found += [f"{name}/{file}" for file in files] or [name]
    return tuple(found)


# --- `laionkit export RUN`: the same exports of a finished run folder --------------------------------------

def export_run(run: Path, formats: str, files: str = "copy", log=print) -> list[Path]:
    """The exports ``formats`` asks for, of a finished run folder: the pipeline rebuilt from the run's own
    record (its newest checkpoint's trainer.json: latents, base, schedule; a LoRA run's adapters merged into that
    base), single files from RUN/pipeline; ``auto``: export_auto."""
    names = [part.strip() for part in formats.split(",") if part.strip()]
    bad = [name for name in names if name not in FORMATS]
    if names != ["auto"] and (bad or not names):
        raise LaionkitError(f"--format {formats!r}: auto or a comma-separated list of {', '.join(FORMATS)}")
    if files not in FILE_MODES:
        raise LaionkitError(f"--export-files {files!r}: choose from {', '.join(FILE_MODES)}")
    _refuse_stale(run)
    if names == ["auto"]:
        return export_auto(run, files, log)
    written = []
    if "pipeline" in names:
        written.append(_rebuild_pipeline(run, files))
    if "single-file" in names:
        written += write_single_files(run)
    return written


def export_auto(run: Path, files: str, log=print) -> list[Path]:
    """`laionkit export RUN` as given: the single file ComfyUI loads where the family has one (sd, sdxl, sd3,
    flux), else the pipeline folder, which is what loads the others; RUN/pipeline is rebuilt first where the run
    has none (a LoRA run, --export none), since single files are converted from it."""
    pipeline = run / PIPELINE
    written = [] if (pipeline / "model_index.json").is_file() else [_rebuild_pipeline(run, files)]
    if single_file_family(pipeline) is not None:
        return [*written, *write_single_files(run)]
    log(f"{run}: this family has no single-file checkpoint (those exist for {', '.join(SINGLE_FILE_FAMILIES)}); "
        f"its export is the pipeline folder, {pipeline}")
    return written or [pipeline]


def _stopped(run: Path, checkpoint: Path) -> str:
    """Why the newest checkpoint has no export, and the command that writes it (a resume at that step trains no
    further step, and exports)."""
    record = json.loads((checkpoint / "trainer.json").read_text())
    step = record["step"]
    return (f"{run} stopped at step {step} before its end. Export it by resuming at that step (it trains nothing "
            f"more): laionkit train {record['config']['latents']} --output {run} --resume latest --max-steps {step} "
            "<the run's flags>")


def _refuse_stale(run: Path) -> None:
    """An export older than the newest checkpoint (the run was resumed past it, then stopped before its end) is
    not the run's newest model: refused, as a missing one is."""
    from laionkit.trainer.checkpoint import complete_checkpoints

    found = complete_checkpoints(run)
    stale = [folder for folder in sorted(run.iterdir()) if folder.is_dir() and stale_export(folder, found[-1])] \
        if found else []
    if stale:
        raise LaionkitError(f"{stale[0]} is older than {found[-1]}: {_stopped(run, found[-1])}")


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
    # --eval-* name files the export does not need (and that may be gone since)
    kept = {k: v for k, v in recorded.items() if k in known and k not in ("resume", "overwrite", "export")
            and not k.startswith("eval_")}
    config = TrainConfig(**kept)  # its --export was what train wrote then; this is what is asked for now
    data = open_latents(config.latents)
    schedule = None if data.family.objective.kind == "flow" else load_noise_scheduler(config, data.family)
    base = _base(config, data.family)
    trained = run / ("lora" if config.lora_rank is not None else data.family.denoiser_subfolder)
    if not trained.is_dir():
        # stopped before its end (SIGTERM, a preemption): its weights are only in the checkpoint, which train
        # exports when resumed at that step (it trains no further step)
        raise LaionkitError(f"{trained} is missing: {_stopped(run, found[-1])}")
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
