"""`laionkit train`: one Accelerate loop that trains a denoiser on streamed latent shards and resumes exactly.

Reads top to bottom: ``setup`` (make_accelerator, the run folder, plan_stages, ``build``: model, optimizer,
EMA, LR schedule) → ``resume`` → per step ``train_step`` (micro_step: loss, backward, apply_gradients),
``MetricsWindow`` (metrics.jsonl), ``checkpoint``, ``validation_loss`` / ``validation_grid`` / evalhook → ``finish``
(export); ``_train`` wires them, and the bench scripts time the same setup and train_step. What it calls
lives in the modules beside it (config, data, model, objective, precision, checkpoint, evaluation,
metrics, export). Runs as one process, or under `accelerate launch` / `torchrun` with the configs in
`train/` (DDP, FSDP, DeepSpeed ZeRO-2). Every rank runs exactly ``max_steps`` optimizer steps: the data
stream (laionkit.trainer.latent_stream) never runs dry, so no rank waits.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from laionkit.common import (
    LaionkitError,
    refuse_other_settings,
    resolve_rank,
    runlock,
    storage,
)
from laionkit.common.caption_mix import parse_mix
from laionkit.common.ranks import check_local_gpus
from laionkit.common.storage import ReadCache
from laionkit.families import Objective
from laionkit.trainer import (
    blockswap,
    checkpoint_async,
    datastate,
    evalhook,
    fp8,
    fsdp,
    lora,
    memory,
    offload,
    pipeline_parallel,
    runfolder,
    trainchecks,
    valloss,
    zero,
)
from laionkit.trainer.checkpoint import (
    check_ranks_agree,
    check_world_size,
    claim_run_folder,
    find_resume,
    last_good,
    load_checkpoint_state,
    save_checkpoint,
    truncate_jsonl,
    weights_fingerprint,
)
from laionkit.trainer.config import TrainConfig, TrainResult
from laionkit.trainer.data import LatentSet, Schedule, layout_key, open_latents, plan_stages
from laionkit.trainer.evaluation import validation_grid, validation_prompts
from laionkit.trainer.export import after_training, export, written_files
from laionkit.trainer.latent_stream import (
    StreamLayout,
    end_workers,
)
from laionkit.trainer.metrics import MetricsWindow, start_trackers
from laionkit.trainer.model import build_unet, flops_per_sample, fsdp_wrap_units
from laionkit.trainer.objective import (
    OnlineText,
    batch_conditioning,
    diffusion_loss,
    flow_loss,
    guidance_input,
    load_noise_scheduler,
    resolve_objective,
    stored_conditioning,
)
from laionkit.trainer.precision import (
    MasterWeights,
    apply_gradients,
    full_bf16_policy,
    make_optimizer,
    rebase_lr,
    scaled_lr,
)
from laionkit.trainer.signals import StopFlag


def run(config: TrainConfig) -> TrainResult:
    # Every URL of the run (latents, --val-latents, --output, in this process and its forked DataLoader
    # workers) is parsed with --storage-options.
    with storage.default_options(storage.parse_storage_options(config.storage_options)):
        if config.cache_dir:  # made and written once now, not first in a DataLoader worker hours in
            ReadCache(config.cache_dir, config.cache_size)
        config, remote = runfolder.stage(config)  # --output URL: train writes a local staging folder
        cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()  # setup may turn it off (the family's)
        try:
            with StopFlag() as stop, runlock.session():  # the run folder's lock / lease, released at the end
                return _train(config, stop, remote)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


@dataclass
class Trainer:
    """What the loop's pieces share: the accelerator, the data plan, the prepared model with its optimizer
    state, and this rank's counters. ``unet`` is the prepared module (what DDP / FSDP wrap, checkpoints
    and exports hold); ``model`` is what the forward pass calls: ``unet`` or its compiled form.
    ``step``, ``bucket_samples`` and ``generator`` are this rank's part of a checkpoint; ``layouts`` (one
    stream per stage), ``data_key`` (what exact resume compares) and ``remote`` are set by setup for a
    run, left empty by build for a bench."""

    config: TrainConfig
    accelerator: Any
    data: LatentSet  # the first stage's latents: what all stages share (family, VAE scaling, empty caption)
    schedule: Schedule
    objective: Objective
    unet: Any
    model: Any
    master: MasterWeights | None
    trained: list
    optimizer: Any
    lr_scheduler: Any
    ema: Any
    noise_scheduler: Any  # DDPM families; None for flow matching
    online: OnlineText | None
    input_dtype: torch.dtype
    empty: dict  # the empty caption's stored tensors on the device, for caption dropout
    model_flops: list[float]  # per sample, per bucket of the schedule
    generator: torch.Generator  # noise, timesteps and dropout: same init on every rank, different draws
    bucket_samples: list[int]  # this rank's samples per bucket since the run began
    # Consecutive steps with a non-finite loss, counted on the device so that no step waits for the host.
    nonfinite: torch.Tensor
    grad_norm: torch.Tensor | None
    step: int = 0
    layouts: list[StreamLayout] = field(default_factory=list)
    data_key: dict = field(default_factory=dict)
    data_state: datastate.DataState | None = None  # what the run trained, marked batch by batch
    remote: runfolder.RunFolder | None = None
    pipeline: pipeline_parallel.Pipeline | None = None  # --pipeline-stages: this rank's stages, their schedule

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def extra_states(self) -> dict:
        """Saved by save_checkpoint as plain tensors, not through accelerate, which unpickles these with
        weights_only=False on load."""
        return {name: obj for name, obj in (("master", self.master), ("ema", self.ema)) if obj is not None}


def make_accelerator(config: TrainConfig):
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    check_local_gpus()  # a launch config's process count written for another machine
    timeout = config.pg_timeout_minutes
    group = {**({"timeout": timedelta(minutes=timeout)} if timeout else {}), **zero.process_group()}
    fsdp.hold_parallelism_on_cpu()  # HSDP on CPU ranks: honor_fsdp_on_cpu sets it (laionkit/trainer/fsdp.py)
    offload.request(config)  # --cpu-offload: FSDP2's CPUOffloadPolicy (laionkit/trainer/offload.py)
    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(**group)] if group else None,
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        log_with=None if config.log_with == "none" else config.log_with,
        project_config=ProjectConfiguration(project_dir=str(config.output),
                                            logging_dir=str(config.output / "logs")),
        step_scheduler_with_optimizer=False,  # the LR schedule counts optimizer steps, once per step
        cpu=zero.cpu_ranks(),  # lets torchrun / accelerate start several CPU ranks (gloo); DeepSpeed's own
    )
    fsdp.honor_fsdp_on_cpu(accelerator)  # accelerate would run an FSDP config on CPU ranks as DDP
    return accelerator


def setup(config: TrainConfig, remote: runfolder.RunFolder | None = None,
          optimizer_factory=make_optimizer) -> Trainer:
    """Everything before the first step: the accelerator and the run folder (claimed, the config logged),
    the latents and their stage schedule, the model as build makes it, and each stage's stream layout.
    The bench scripts call it too (``optimizer_factory``: build's)."""
    from accelerate.utils import DistributedType

    output = config.output
    accelerator = make_accelerator(config)
    memory.cap_gpu_memory(config, accelerator)  # --gpu-memory-gib: before anything is allocated
    launcher = resolve_rank(config.rank, config.world_size)
    if (launcher.rank, launcher.world_size) != (accelerator.process_index, accelerator.num_processes):
        raise LaionkitError(
            f"--rank/--world-size say {launcher.rank}/{launcher.world_size} but the launcher started "
            f"{accelerator.process_index}/{accelerator.num_processes}: train takes ranks from accelerate/torchrun"
        )
    data_rank, world = pipeline_parallel.data_ranks(config, accelerator)  # a pipeline's ranks share its data
    if config.ema and accelerator.distributed_type == DistributedType.FSDP:
        raise LaionkitError("--ema needs whole parameters on every rank: use DDP or DeepSpeed ZeRO-2, not FSDP")
    zero.check(config, accelerator)  # ZeRO-3's refusals (laionkit/trainer/zero.py)
    if output.exists() and not output.is_dir():
        raise LaionkitError(f"--output {output} is a file, not a run folder")
    inputs = [config.latents, *(folder for folder, _ in config.later_stages()),
              *([config.val_latents] if config.val_latents else [])]
    storage.refuse_overlap(inputs, output, "train")
    if remote is not None:  # the bucket's run: fresh-run rules there, a resume's checkpoint downloaded
        config = remote.claim(config, accelerator, inputs)
    claim_run_folder(config, accelerator)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        accelerator.print(f"laionkit train: {json.dumps(asdict(config), default=str)}")
        if config.plan is not None:  # `train --plan`: the plan the run's flags came from, kept beside them
            shutil.copyfile(config.plan, output / "plan.json")
    if config.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data = open_latents(config.latents)
    objective = resolve_objective(config, data.family)
    if not data.family.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if data.empty_shards:
        accelerator.print(f"skipping {len(data.empty_shards)} empty latent shard(s): "
                          f"{', '.join(Path(s).name for s in data.empty_shards)}")
    schedule = plan_stages(config, data, world)
    mix = parse_mix(config.caption_mix)
    if mix is not None:  # every stage's latents must store the captions it names (one line naming the manifest)
        for _, latents, _ in schedule.stages:
            mix.check(latents.captions, latents.scored_captions, latents.manifest)
    trainer = build(config, accelerator, data, schedule, objective, optimizer_factory)
    if config.checkpointing.strip().lower() == "auto":  # measured on the built model, before the first step
        memory.auto_checkpointing(trainer)
    trainer.layouts = [StreamLayout(latents.shards, data_rank, world, config.workers,
                                    config.batch_size, config.seed, config.shuffle_buffer, bucketed=latents.bucketed,
                                    caption_mix=mix, caption_names=latents.captions)
                       for _, latents, _ in schedule.stages]
    trainer.data_key = layout_key(trainer.layouts[0], data)
    if len(schedule.stages) > 1:  # which data each step trains on: every stage's layout and steps
        trainer.data_key["stages"] = [[steps, layout_key(layout, latents)]
                                      for (_, latents, steps), layout in zip(schedule.stages, trainer.layouts)]
    trainer.remote = remote
    return trainer


def build(config: TrainConfig, accelerator, data: LatentSet, schedule: Schedule, objective: Objective,
          optimizer_factory=make_optimizer) -> Trainer:
    """The denoiser as train trains it (LoRA adapters, activation checkpointing, compile, channels_last),
    its precision policy (MasterWeights), optimizer (``optimizer_factory(config, params, lr, device)``),
    EMA and LR schedule, prepared by ``accelerator``; the bench scripts build their step with it too."""
    from accelerate.utils import DistributedType, set_seed
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    device = accelerator.device
    set_seed(config.seed)  # the same initial weights on every rank
    # From scratch on a GPU, the weights are drawn there: seconds for Flux-12B instead of minutes on the CPU
    # (and no 48 GB fp32 copy in host memory). Seeded alike on every rank; DDP broadcasts rank 0's anyway.
    home = offload.build_device(accelerator)  # the host under --cpu-offload, until FSDP2 shards the model
    # (a pipeline's ranks build on the host: each moves only its stages onto its GPU)
    with torch.device(home) if config.unet is None and home.type == "cuda" and config.pipeline_stages == 1 \
            else nullcontext(), lora.drawn_in_low_precision(config, accelerator):
        unet = build_unet(config, data, home)  # --base-dtype: quantized as it loads, there
    trainchecks.check_guidance(config, data.family, unet)
    pipeline = None
    if config.pipeline_stages > 1:  # this rank's stages on the device (laionkit/trainer/pipeline_parallel.py)
        pipeline = pipeline_parallel.place(unet, config, data, schedule, objective, accelerator)
    else:  # --cpu-offload: the host until FSDP2 shards it; else the device (--block-swap: some on the host)
        unet = unet.to(home) if config.cpu_offload else blockswap.place(unet, config, data.family, accelerator)
    if config.lora_rank is not None:  # LoRA hook: freeze the base, add adapters (laionkit/trainer/lora.py)
        lora.attach(unet, config, accelerator, data.family)
    if objective.guidance is not None and not getattr(unet.config, "guidance_embeds", False):
        objective = replace(objective, guidance=None)  # no guidance embedding to feed
    noise_scheduler = load_noise_scheduler(config, data.family) if objective.kind == "ddpm" else None
    shapes = schedule.shapes()
    model_flops = [flops_per_sample(unet, data, home, shapes[key], objective) / config.pipeline_stages
                   for key in schedule.buckets]  # a pipeline's ranks count a share each: the model's in all
    if config.gradient_checkpointing:
        accelerator.print("warning: --gradient-checkpointing is deprecated; it is --checkpointing blocks now")
    interval = config.checkpoint_interval()
    if interval:  # activation checkpointing on the family's blocks (FamilySpec.blocks)
        checked = data.family.checkpoint_blocks(unet, interval)
        accelerator.print(f"activation checkpointing: {len(checked)} of {len(data.family.blocks(unet))} "
                          f"{'/'.join(data.family.block_classes)} blocks")
    if config.fp8 and config.lora_rank is None:  # FP8 hook: the blocks' linear layers train in float8 (fp8.py);
        # a LoRA run's frozen base multiplies in float8 from lora.attach (laionkit/trainer/quantized_base.py)
        fp8.check_device(device)
        converted = fp8.convert(unet, data.family.block_classes, config.fp8_recipe)
        accelerator.print(f"fp8 ({config.fp8_recipe}): {len(converted)} linear layers of the "
                          f"{'/'.join(data.family.block_classes)} blocks")
    if config.compile and data.family.regional_compile:
        # Transformers and SDXL: each block compiled in place, before DDP/FSDP wrap it (FSDP2 renames the
        # classes): compile time independent of depth (SDXL's whole-UNet compile ran past 320 s on an H200).
        # SD 1.x/2.x compile whole below: their glue between blocks (down/up samplers, norms, projections) is
        # a large share of the work at 256-512 px, and whole-model compile is measured there.
        data.family.compile_blocks(unet, dynamic=config.compile_dynamic, mode=config.compile_mode)
    if config.channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    blockswap.attach(unet, config, data.family, accelerator)  # --block-swap N (laionkit/trainer/blockswap.py)
    unet.train()
    full_bf16 = full_bf16_policy(config, accelerator, unet)
    master = MasterWeights(accelerator, unet) if pipeline is None and MasterWeights.wanted(config, accelerator) else None
    held = unet if pipeline is None else pipeline.stages  # a pipeline's rank trains its stages' weights
    trained = master.master if master is not None else [p for p in held.parameters() if p.requires_grad]
    lr = scaled_lr(config, schedule.global_batch)
    optimizer = optimizer_factory(config, trained, lr, device)
    ema = None
    if config.ema:  # in fp32 under --full-bf16 too: a 0.9999 decay's updates vanish in bf16
        shadow = [p.detach().float() for p in trained] if full_bf16 else trained
        ema = EMAModel(shadow, decay=config.ema_decay, foreach=True,
                       model_cls=type(unet), model_config=unet.config)
        ema.to(device)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # we prepare no DataLoader to infer these
        deepspeed = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed["train_micro_batch_size_per_gpu"] = config.batch_size
        deepspeed["gradient_clipping"] = config.max_grad_norm
    if accelerator.distributed_type == DistributedType.FSDP:
        fsdp_wrap_units(accelerator.state.fsdp_plugin, unet, data.family, accelerator.print)
    # --block-swap: placed above; accelerate's .to(device) would bring the host's blocks back
    placement = [False, True] if config.block_swap else None
    if pipeline is None:  # a pipeline's stages average over their replicas themselves (not DDP)
        unet, optimizer = accelerator.prepare(unet, optimizer, device_placement=placement)
    if config.lora_rank is not None and pipeline is None:  # LoRA hook: checkpoints hold the adapters, not the base
        lora.register_checkpoint_hooks(accelerator, unet, config, data.family)
    # DeepSpeed and MasterWeights hold the weights in bf16/fp16 (no autocast): inputs must follow them.
    input_dtype = next(unet.parameters()).dtype
    online = OnlineText(data, device, input_dtype, config.allow_changed_text_encoder) if data.online else None
    lr_scheduler = get_scheduler(
        "constant_with_warmup" if config.lr_schedule == "constant" else "cosine",
        optimizer=optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=schedule.max_steps,
    )
    lr_scheduler = accelerator.prepare(lr_scheduler)
    if config.compile:
        # One graph per bucket shape (dynamic=False, the default): each bucket gets dynamo's default allowance
        # (8 graphs per function, 256 in all), else the shapes past the limit would run uncompiled.
        # --compile-dynamic traces symbolic shapes instead; the allowance is the same.
        # Per block, the blocks of one class share one code object whose graphs differ by the block's shapes
        # (SDXL's ResnetBlock2D has a dozen channel / size pairs): at most one graph per block instance.
        dynamo = torch._dynamo.config
        per_bucket = max(8, len(data.family.blocks(unet))) if data.family.regional_compile else 8
        dynamo.recompile_limit = max(dynamo.recompile_limit, per_bucket * len(schedule.buckets))
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 256 * len(schedule.buckets))
    model = unet
    if config.compile and not data.family.regional_compile:  # UNets: the whole denoiser (see compile_blocks)
        model = torch.compile(unet, dynamic=config.compile_dynamic, mode=config.compile_mode)
    return Trainer(
        config=config, accelerator=accelerator, data=data, schedule=schedule, objective=objective, unet=unet,
        model=model, master=master, trained=trained, optimizer=optimizer, lr_scheduler=lr_scheduler, ema=ema,
        noise_scheduler=noise_scheduler, online=online, input_dtype=input_dtype,
        empty={key: value.to(device, input_dtype) for key, value in (online.empty() if online else data.empty).items()},
        model_flops=model_flops,
        generator=torch.Generator(device).manual_seed(
            config.seed * 1_000_003 + pipeline_parallel.data_ranks(config, accelerator)[0]),
        bucket_samples=[0] * len(schedule.buckets), nonfinite=torch.zeros((), device=device),
        grad_norm=torch.zeros((), device=device), pipeline=pipeline,
    )


def resume(trainer: Trainer) -> Path | None:
    """--resume: the checkpoint find_resume picks, checked against this run's data layout (before the
    model and optimizer load), then loaded: accelerate's state, the master / EMA weights, the data state
    (datastate.resume) and this rank's generator, step and samples per bucket. Another number of ranks,
    --workers, --batch-size or --grad-accum is an elastic resume: each rank's generator is seeded from
    (seed, rank, step) and rank 0 takes over the counts per bucket of all ranks before. None where there
    is none to resume from."""
    t, config, accelerator = trainer, trainer.config, trainer.accelerator
    folder = find_resume(config, accelerator, t.schedule.max_steps)
    if folder is None:
        return None
    records = datastate.read_records(folder)
    check_world_size(folder, accelerator.distributed_type, len(records), accelerator.num_processes)
    if t.pipeline is None:  # a pipeline's stages check their own part as it loads
        lora.check_resume(folder, config, t.data.family)
    datastate.check_caption_mix(folder, records[0].get("layout", {}), t.data_key, config.allow_caption_mix_change,
                                accelerator.print)
    refuse_other_settings(folder, datastate.fixed_key(records[0].get("layout", {}), config.add_shards),
                          datastate.fixed_key(t.data_key, config.add_shards), "written",
                          "resume needs the same latent shards (names, sample counts, sizes; --add-shards "
                          "takes shards appended since), --seed, --shuffle-buffer and --stage schedule")
    if t.pipeline is not None:  # each stage's part (laionkit/trainer/pipeline_parallel.py)
        t.pipeline.load(t, folder, len(records))
    elif checkpoint_async.is_dcp(folder):  # either layout, whichever --checkpoint-writer this run has
        checkpoint_async.load(t, folder)
    else:
        load_checkpoint_state(accelerator, folder, t.extra_states)
    t.step = records[0]["step"]
    t.data_state, elastic = datastate.resume(t, records)
    rank, buckets = accelerator.process_index, t.schedule.buckets
    if elastic:
        t.generator.manual_seed(config.seed * 1_000_003 + rank + 7_919 * t.step)
        counted = {key: sum(int((record.get("bucket_samples") or {}).get(key, 0)) for record in records)
                   for key in buckets} if rank == 0 else {}
    else:
        state = records[rank]
        t.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state["generator"])), dtype=torch.uint8))
        # A checkpoint from before per-bucket counts had one bucket, which took every sample.
        counted = state.get("bucket_samples") or {buckets[0]: t.step * config.batch_size * config.grad_accum}
    t.bucket_samples = [int(counted.get(key, 0)) for key in buckets]
    lr = scaled_lr(config, t.schedule.global_batch)
    old = rebase_lr(t.lr_scheduler, t.optimizer, lr)
    if old is not None:
        accelerator.print(f"--lr {config.lr:g} --scale-lr {config.scale_lr}: the learning rate is {lr:.2e} at global "
                          f"batch {t.schedule.global_batch}, the checkpoint's {old:.2e}; the schedule continues")
    accelerator.print(f"resumed from {folder} at step {t.step}")
    return folder


def micro_step(trainer: Trainer, moments: torch.Tensor, cond: dict, times=None) -> torch.Tensor:
    """One micro-batch inside accelerate's accumulate(): the loss of the family's objective, backward, and
    apply_gradients (clip and optimizer step on the sync micro-batch only). Returns the loss. ``times``
    (a ranktimes.RankTimes) times the forward pass."""
    t = trainer
    with t.accelerator.accumulate(t.unet):
        began = times.begin() if times is not None else None
        if t.noise_scheduler is None:
            loss = flow_loss(t.model, moments, cond, t.empty, t.config, t.data, t.generator, t.objective)
        else:
            loss = diffusion_loss(t.model, moments, cond, t.empty, t.noise_scheduler, t.config, t.data, t.generator)
        if times is not None:
            times.end(began)
        t.accelerator.backward(loss)
        norm = apply_gradients(t.accelerator, t.unet, t.optimizer, t.master, t.config.max_grad_norm)
        if t.accelerator.sync_gradients:
            t.grad_norm = norm  # None under DeepSpeed, which clips inside its step
    return loss


def train_step(trainer: Trainer, batches, stage: int, window: MetricsWindow) -> tuple[list[str], list[int]]:
    """One optimizer step: --grad-accum micro-batches from ``batches`` (batches of stage ``stage``), then
    the LR schedule and EMA step. Counts the step's loss, data wait and model FLOPs into ``window`` and its
    samples per bucket; returns the step's sample keys, their epochs and (--caption-mix) the captions they
    trained on."""
    t, config = trainer, trainer.config
    step_keys, step_epochs, step_captions, step_loss = [], [], [], torch.zeros((), device=t.device)
    micro = []  # --pipeline-stages: the step's micro-batches, which the pipeline runs together
    for _ in range(config.grad_accum):
        waited = time.perf_counter()
        batch = next(batches)
        window.data_wait += time.perf_counter() - waited
        if t.data_state is not None:  # trained now: a resume leaves these samples out
            t.data_state.consumed(batch)
        step_keys += batch["key"]
        step_epochs += batch["epoch"].tolist() if "epoch" in batch else []
        step_captions += batch.get("caption", [])
        bucket = t.schedule.bucket(stage, batch["moments"].shape[1:])
        if t.pipeline is None or t.pipeline.first:  # one rank counts a pipeline's samples
            t.bucket_samples[bucket] += len(batch["key"])
        window.flops += t.model_flops[bucket] * len(batch["key"])
        moments = batch["moments"].to(t.device, non_blocking=True)
        cond = batch_conditioning(batch, t.data, t.device, t.input_dtype, t.online)
        if t.pipeline is not None:
            micro.append((moments, cond))
            continue
        loss = micro_step(t, moments, cond, window.times)
        step_loss += loss.detach().float() / config.grad_accum
    if t.pipeline is not None:
        step_loss = t.pipeline.step(t, micro)
    t.nonfinite = torch.where(torch.isfinite(step_loss), torch.zeros_like(t.nonfinite), t.nonfinite + 1)
    window.add(step_loss, t.nonfinite)
    t.lr_scheduler.step()
    if t.ema is not None:
        t.ema.step(t.trained)
    t.step += 1
    return step_keys, step_epochs, step_captions


def open_records(trainer: Trainer) -> tuple[Path, Path]:
    """metrics.jsonl and this rank's seen-keys file (--record-keys), without the records of steps a
    killed run made past the checkpoint resumed from (they are redone); the trackers started."""
    config, accelerator, step = trainer.config, trainer.accelerator, trainer.step
    main = accelerator.is_main_process
    metrics_path = config.output / "metrics.jsonl"
    keys_path = config.output / "seen" / f"rank-{accelerator.process_index:05d}.jsonl"
    if config.resume is not None:  # also with no checkpoint yet: a killed run's records are redone
        if main:
            truncate_jsonl(metrics_path, step)
            for path in runfolder.dropped_ranks_records(config.output, accelerator.num_processes):  # onto fewer ranks
                truncate_jsonl(path, step)  # (a URL --output uploads them again: RunFolder)
        if config.record_keys:
            truncate_jsonl(keys_path, step)
    if config.record_keys:
        keys_path.parent.mkdir(parents=True, exist_ok=True)
    if main and accelerator.log_with:
        start_trackers(accelerator, config)
    return metrics_path, keys_path


def checkpoint(trainer: Trainer, writer: checkpoint_async.CheckpointWriter | None = None,
               wait: bool = False) -> Path | None:
    """A checkpoint of this step when every rank's weights agree (else an error) and the loss and weights
    are finite on all ranks, uploaded where the run folder is remote; None (a warning) when not finite.
    ``writer`` (--checkpoint-writer async / sync) saves DCP checkpoints, in the background unless ``wait``."""
    t, config, accelerator = trainer, trainer.config, trainer.accelerator
    step, output = t.step, config.output
    # the writer compares the ranks' weights in the background, on its staged copy
    # (a pipeline's ranks hold different stages: nothing to compare)
    fingerprint = weights_fingerprint(accelerator, t.unet, t.master) if writer is None and t.pipeline is None else None
    check_ranks_agree(accelerator, fingerprint, step)
    healthy = t.nonfinite.item() == 0 and (fingerprint is None or fingerprint[1])
    if not accelerator.reduce(torch.tensor(float(healthy), device=t.device), "min").item():
        accelerator.print(f"warning: step {step}: loss or weights not finite, no checkpoint written "
                          f"(the last good one stays: {last_good(output)})")
        return None
    data = t.data_state.record(accelerator) if t.data_state is not None else None  # every rank: a collective
    rank_state = {"step": step, "layout": t.data_key, "fingerprint": fingerprint and fingerprint[0],
                  "bucket_samples": dict(zip(t.schedule.buckets, t.bucket_samples)),
                  "generator": base64.b64encode(t.generator.get_state().numpy().tobytes()).decode()}
    if data is not None and accelerator.is_main_process:
        rank_state["data"] = data  # the ranks' union: rank 0's record holds it (datastate)
    if writer is not None:
        return writer.save(t, rank_state, wait)
    folder = save_checkpoint(accelerator, output, step, rank_state, config.keep_checkpoints,
                             config, {name: obj.state_dict() for name, obj in t.extra_states.items()},
                             t.pipeline and {"pipeline": t.pipeline.state(t)})
    if t.remote is not None:  # uploaded, done record last, older ones pruned in the bucket
        t.remote.checkpoint_saved(accelerator, folder, config.keep_checkpoints)
    return folder


def validation_loss(trainer: Trainer, valset) -> dict:
    """The deterministic validation loss (laionkit/trainer/valloss.py): on every rank (all-reduced), in eval mode,
    through the eager module."""
    t, objective, device, dtype = trainer, trainer.objective, trainer.device, trainer.input_dtype
    t.unet.eval()
    losses = valloss.evaluate(  # val_loss, and val_loss_strata under --val-strata N
        t.accelerator, lambda noisy, timesteps, cond: t.data.family.predict(t.unet, noisy, timesteps, guidance_input(
            objective, stored_conditioning(cond, t.online, device, dtype), len(noisy), device)),
        valset, t.config.batch_size, dtype, t.noise_scheduler,
        flow_shift=None if t.noise_scheduler else objective.sigma_shift,  # per bucket (h, w): a dynamic shift
        timestep_scale=objective.timestep_scale)
    t.unet.train()
    return {**losses, "val_samples": len(valset.keys)}


def finish(trainer: Trainer) -> tuple[str, ...]:
    """After the last step: the samples seen per bucket, the export (the denoiser, or the LoRA adapters)
    and, for a remote run folder, its upload and done record. Returns what rank 0 wrote, relative to the run
    folder (other ranks: nothing), for the run's last line."""
    t, accelerator = trainer, trainer.accelerator
    buckets = t.schedule.buckets
    if len(buckets) > 1:
        seen = accelerator.reduce(torch.tensor(t.bucket_samples, dtype=torch.float64, device=t.device), "sum")
        accelerator.print("samples per bucket (all ranks): " + ", ".join(
            f"{key} {int(n)}" for key, n in zip(buckets, seen.tolist())))
    if t.pipeline is not None:  # rank 0's denoiser takes every stage's weights
        t.pipeline.gather(accelerator, t.unet)
    if t.config.lora_rank is not None:  # LoRA hook: RUN/lora in diffusers' load_lora_weights format
        lora.export(accelerator, t.unet, t.ema, t.master, t.config.output)
        denoiser = "lora"
    else:
        export(accelerator, t.unet, t.ema, t.master, t.config.output, t.data.family.denoiser_subfolder,
               torch.bfloat16 if t.config.full_bf16 else torch.float32)
        denoiser = t.data.family.denoiser_subfolder
    exported = after_training(accelerator, t.config, t.data, t.noise_scheduler)  # RUN/pipeline, single files
    if t.remote is not None:
        t.remote.finished(accelerator)
    if not accelerator.is_main_process:
        return ()
    return written_files(Path(t.config.output), [denoiser, *([f"{denoiser}_ema"] if t.ema is not None else []), *exported])


def _train(config: TrainConfig, stop: StopFlag, remote: runfolder.RunFolder | None = None) -> TrainResult:
    from tqdm.auto import tqdm

    t = setup(config, remote)
    config, accelerator, schedule = t.config, t.accelerator, t.schedule
    device, main, max_steps = t.device, accelerator.is_main_process, schedule.max_steps
    writer = checkpoint_async.writer(t)  # None: accelerate's layout; made on every rank (a gloo group)
    resume(t)
    cache = ReadCache(config.cache_dir, config.cache_size) if config.cache_dir else None
    stage = schedule.stage_at(t.step)
    if t.data_state is None:
        t.data_state = datastate.fresh(t, stage)
    batches = iter(datastate.loader(t, t.data_state, cache))
    try:  # the workers end here on every exit, an exception's included (latents.end_workers says why)
        metrics_path, keys_path = open_records(t)
        validation = validation_prompts(t)
        scoring = evalhook.prepare(t)  # --eval-every: prompts and scorers loaded now, not at the first evaluation
        valset = None  # validation-loss hook (laionkit/trainer/valloss.py)
        if config.val_latents is not None:
            valset = valloss.load(config, t.data)
            accelerator.print(f"validation loss: {len(valset.keys)} samples of {config.val_latents}, "
                              f"every {valloss.every(config)} steps")
        exporter = None
        if main and config.metrics_port:
            from laionkit.common.prometheus import MetricsServer

            exporter = MetricsServer(config.metrics_port, device.index if device.type == "cuda" else None)
        stop.install()
        progress = tqdm(total=max_steps, initial=t.step, disable=config.quiet or not main, desc="train", unit="step")
        window = MetricsWindow(accelerator, schedule.global_batch, config.peak_tflops, metrics_path, exporter)
        last_checkpoint, stopped_by, clock = None, None, checkpoint_async.Clock(config.checkpoint_minutes)
        while t.step < max_steps:
            lora.seed_dropout(config, accelerator.process_index, t.step)  # LoRA hook: dropout masks as exact as the rest
            if t.step == schedule.ends[stage]:  # the next stage's stream starts at its first batch
                stage += 1
                end_workers(batches)  # the previous stage's
                t.data_state = datastate.fresh(t, stage)
                batches = iter(datastate.loader(t, t.data_state, cache))
                accelerator.print(f"step {t.step}: stage {stage + 1} of {len(schedule.stages)}, {schedule.stages[stage][0]}")
            step_keys, step_epochs, step_captions = train_step(t, batches, stage, window)
            if writer is not None:
                writer.check()  # a background save that failed stops the run here, in one line
            progress.update()
            if config.record_keys:
                with open(keys_path, "a") as handle:
                    handle.write(json.dumps({"step": t.step, "keys": step_keys, "epochs": step_epochs,
                                             **({"captions": step_captions} if step_captions else {})}) + "\n")

            val_due = valset is not None and (t.step % valloss.every(config) == 0 or t.step == max_steps)
            eval_due = evalhook.due(config, t.step, max_steps)
            if t.step % config.log_every == 0 or t.step == max_steps or val_due or eval_due:
                record = window.record(t)
                if t.pipeline is not None:  # the bubble share beside samples/s
                    record.update(t.pipeline.record(accelerator))
                if val_due:  # validation-loss hook
                    record.update(validation_loss(t, valset))
                if eval_due:  # --eval-every hook (laionkit/trainer/evalhook.py): every rank exports, rank 0 scores
                    record.update(evalhook.evaluate(t, scoring))
                window.write(record)
                if eval_due and main:
                    evalhook.plot(config)
                if main:
                    progress.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:.1f}")
                window.reset()
                window.check_finite(t.step, config.max_nonfinite, config.output)

            # decided together, so every rank checkpoints and stops (--checkpoint-minutes: rank 0's clock)
            stopped_by = stop.agreed(accelerator, main and clock.due())
            # after the last step: unless --no-checkpoint-at-end (the export is then the run's output)
            due = config.checkpoint_at_end if t.step == max_steps else t.step % config.checkpoint_every == 0
            if due or stopped_by or stop.checkpoint_due:
                # the last one, and one on a stop signal, are written before the run goes on to exit
                last_checkpoint = checkpoint(t, writer, wait=bool(stopped_by) or t.step == max_steps) or last_checkpoint
                clock.saved()
            if validation is not None and (t.step % config.validate_every == 0 or t.step == max_steps):
                validation_grid(t, validation, schedule.stages[stage][1])
            if stopped_by:
                break
        progress.close()
        window.close()
        written = () if stopped_by else finish(t)
        if writer is not None:
            writer.close()
        accelerator.end_training()
    finally:
        end_workers(batches)
        if writer is not None:  # an error's exit: the save in flight, if the ranks can still finish it
            writer.close(timeout=config.pg_timeout_minutes * 60 if config.pg_timeout_minutes else 600, quiet=True)
    return TrainResult(step=t.step, stopped_by=stopped_by, checkpoint=last_checkpoint, written=written)
