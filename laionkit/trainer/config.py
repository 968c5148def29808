"""`laionkit train`'s options: TrainConfig (one frozen dataclass, checked once in __post_init__) and TrainResult.

Each field is the single definition of its flag: help, flags and choices (``Literal``) live here, and the
command (laionkit/cli/training.py), `train --config` files and recipes are built from them (laionkit/common/options.py);
a new train flag is a new field here, nothing more. Fields are in the order `laionkit train --help` lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from laionkit.common import (
    LaionkitError,
)
from laionkit.common.caption_mix import parse_mix
from laionkit.common.options import (
    QUIET_HELP,
    RANK_HELP,
    STORAGE_HELP,
    WORLD_SIZE_HELP,
    check_choices,
    option,
)
from laionkit.trainer import trainchecks


@dataclass(frozen=True)
class TrainConfig:
    latents: Path | str = option(
        help="An encode output folder (latent shards + manifest.json); a path or URL (streamed).",
        type=str, argument=True)
    # a folder or a URL (s3://...), staged locally (laionkit/trainer/runfolder.py)
    output: Path | str = option(
        help="Run folder (a path or URL): checkpoints, metrics, samples, unet/.",
        flags=("--output", "-o"), type=str, group="Data")
    unet: str | None = option(
        None, "Fine-tune: a hub id, preset (sd15, sd2, sdxl, sd3-medium, flux-dev, pixart-sigma-xl, qwen-image) or "
        "folder with the family's unet/ or transformer/ weights.", flags=("--unet", "--transformer"), group="Model")
    unet_config: str | None = option(
        None, "From scratch: an architecture of the latents' family (sd: sd15, sd2-base, tiny; sdxl: sdxl, "
        "tiny; sd3: sd3-medium, tiny; flux: flux-dev, tiny; pixart: pixart-sigma-xl, tiny; qwen-image: qwen-image, "
        "tiny) or a config "
        "folder/file.", flags=("--unet-config", "--transformer-config"), group="Model")
    noise_scheduler: str | None = option(
        None, "DDPM schedule source (default: --unet's, else SD's scaled_linear).", group="Model")
    prediction_type: Literal["epsilon", "v_prediction"] | None = option(
        None, "epsilon or v_prediction (default: the scheduler's).", group="Model")
    timestep_sampling: Literal["uniform", "logit-normal"] = option(
        "uniform", "DDPM timesteps: uniform or logit-normal.", group="Optimization")
    logit_mean: float = option(0.0, "Mean of the logit-normal timestep density.", group="Optimization")
    logit_std: float = option(1.0, "Std of the logit-normal timestep density.", group="Optimization")
    # --- flow matching (SD3, Flux): None takes the family's default (laionkit/families, Objective) ---
    sigma_sampling: Literal["logit_normal", "logit-normal", "uniform", "mode"] | None = option(
        None, "Flow matching (sd3, flux): logit_normal, uniform or mode (default: the family's, "
        "logit_normal).", group="Optimization")
    mode_scale: float = option(1.29, "Flow matching: scale of the mode sigma density.", group="Optimization")
    # a number (static shift), "dynamic" (Flux's per-resolution rule) or "none"
    shift: str | None = option(
        None, "Flow matching: sigma shift s (a number), dynamic (Flux's rule per resolution) or none "
        "(default: sd3 3, flux dynamic).", group="Optimization")
    weighting: Literal["none", "sigma_sqrt", "cosmap"] | None = option(
        None, "Flow matching loss weighting: none, sigma_sqrt or cosmap (default: none).", group="Optimization")
    train_guidance: float | None = option(
        None, "Flow matching: the guidance embedding's input while training a transformer with "
        "guidance_embeds (default: flux 3.5).", group="Optimization")
    snr_gamma: float | None = option(None, "Min-SNR loss weighting gamma (5 is common).", group="Optimization")
    noise_offset: float = option(0.0, "Offset noise strength (0.05-0.1 typical).", group="Optimization")
    input_perturbation: float = option(0.0, "Input perturbation strength (0.1 typical).", group="Optimization")
    caption_dropout: float = option(0.0, "Probability of the stored empty-caption embedding.", group="Data")
    # which of a sample's stored captions it trains on (laionkit/common/caption_mix.py; encode --captions stores several)
    caption_mix: str | None = option(
        None, "Latents with several captions per sample (encode --captions): the caption each sample trains on, "
        "picked per sample and epoch from (seed, epoch, sample id) with these weights, e.g. alt:0.2,vlm:0.8 "
        "(renormalised over the captions a sample has), or clip / clip:TEMPERATURE: softmax of each caption's "
        "CLIP score / TEMPERATURE (default 1), as Sana samples captions. Default: each sample's first caption. "
        "--caption-dropout applies after the pick; validation uses the first caption.", group="Data")
    allow_caption_mix_change: bool = option(
        False, "With --resume: continue a run under another --caption-mix (a curriculum: the data order stays "
        "exact, samples from here on get the new policy's captions). Without it, a changed policy is refused.", group="Data")
    batch_size: int = option(32, "Samples per GPU per micro-step.", group="Optimization")
    grad_accum: int = option(1, "Micro-steps per optimizer step (no gradient sync between).", group="Optimization")
    max_steps: int | None = option(None, "Optimizer steps to train.", group="Optimization")
    epochs: float | None = option(
        None, "Or: passes over the manifest's samples, as steps (default: 1 when --max-steps is not given).",
        group="Optimization")
    lr: float = option(1e-4, "Learning rate (per sample under --scale-lr linear/sqrt).", group="Optimization")
    scale_lr: Literal["none", "linear", "sqrt"] = option(
        "none", "none, linear or sqrt: lr x global batch (or its sqrt).", group="Optimization")
    lr_schedule: Literal["constant", "cosine"] = option(
        "constant", "constant or cosine, after --warmup-steps.", group="Optimization")
    warmup_steps: int = option(0, "Linear warmup steps.", group="Optimization")
    weight_decay: float = option(1e-2, "AdamW weight decay.", group="Optimization")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0: no clipping).", group="Optimization")
    optimizer: Literal["adamw", "adamw8bit"] = option(
        "adamw", "adamw (fused on GPU) or adamw8bit (bitsandbytes).", group="Optimization")
    mixed_precision: Literal["no", "fp16", "bf16"] | None = option(
        None, "no, fp16 or bf16 (default: the accelerate config's, else no).", group="Precision and memory")
    # None: on in eager mode, off with --compile (measured, see MasterWeights)
    bf16_weights: bool | None = option(
        None, "With bf16 on one GPU or DDP: bf16 weights in forward/backward, fp32 master weights in the "
        "optimizer, EMA and checkpoints (faster eager: docs/BENCHMARKS.md). --no-bf16-weights: autocast over fp32 "
        "weights, as diffusers' scripts do. Default: on, off with --compile (autocast measured faster "
        "compiled).", flags=("--bf16-weights/--no-bf16-weights",), group="Precision and memory")
    # weights, gradients and optimizer state all in bf16, no fp32 master (full_bf16_policy)
    full_bf16: bool = option(
        False, "With bf16 on one GPU or DDP: weights, gradients and AdamW state all in bf16, no fp32 master "
        "weights (kohya's --full_bf16): 8 bytes per trained parameter instead of 20 (full-parameter Flux-12B "
        "on one H200) and the fastest step; updates under ~0.2 % of a weight are lost, so keep it for memory "
        "or large learning rates.", group="Precision and memory")
    ema: bool = option(False, "Keep an EMA of the weights, exported to unet_ema/.", group="Optimization")
    ema_decay: float = option(0.9999, "EMA decay.", group="Optimization")
    checkpointing: str = option(
        "none", "Activation checkpointing per block of the family's denoiser (UNet: ResnetBlock2D, "
        "BasicTransformerBlock; SD3: JointTransformerBlock; Flux: double- and single-stream blocks; PixArt: "
        "BasicTransformerBlock): blocks (every block), every-N (every N-th block: less recompute, more "
        "memory), auto (the fewest blocks that let the batch fit, chosen from measured steps before training "
        "on one GPU or DDP; RUN/checkpointing.json records it) or none. Same losses and gradients, less activation memory, ~1/3 more compute per "
        "checkpointed block.", group="Precision and memory")
    gradient_checkpointing: bool = option(False, "Deprecated: the same as --checkpointing blocks.", group="Precision and memory")
    compile: bool = option(
        False, "torch.compile (dynamic=False: one graph per latent shape, i.e. per bucket; see "
        "--compile-dynamic). SD3 / Flux / PixArt / SDXL: each block on its own (regional: compile time "
        "independent of depth); SD 1.x/2.x: the whole UNet. Combines with --checkpointing.", group="Precision and memory")
    compile_mode: str = option("default", "torch.compile mode: default, reduce-overhead, max-autotune.", group="Precision and memory")
    # dynamic=True: one graph with symbolic shapes for every bucket (measured: BENCHMARKS)
    compile_dynamic: bool = option(
        False, "With --compile: trace symbolic shapes (dynamic=True), one graph for every bucket shape, "
        "instead of one static graph per bucket. docs/BENCHMARKS.md measures both on aspect-ratio buckets.", group="Precision and memory")
    channels_last: bool = option(False, "channels_last memory format for the UNet.", group="Precision and memory")
    # --- block swap on one GPU (laionkit/trainer/blockswap.py) ---
    block_swap: int = option(
        0, "One GPU: the last N of the family's blocks keep their weights in (pinned) host memory, each copied in "
        "on a side stream one block ahead of use, in forward and backward. LoRA: the frozen base's weights swap "
        "(the adapters stay on the GPU), so a base larger than the GPU trains; full fine-tune: weights leave the "
        "GPU only during forward and backward (gradients and optimizer state stay), less activation-time memory. "
        "0: off. Not with --compile, FSDP, DeepSpeed or several ranks.", group="Precision and memory")
    # --- `laionkit plan`'s answers: a share of the GPU, and the plan a run comes from (laionkit/plan.py) ---
    gpu_memory_gib: float | None = option(
        None, "Cap this process's share of its GPU at G GiB (torch.cuda.set_per_process_memory_fraction), as a "
        "smaller card would hold it: what trains on 24 / 48 GB, measured on a larger GPU (`laionkit plan "
        "--gpu-memory-gib`). Memory outside PyTorch's allocator (the CUDA context) is not counted. Ignored, "
        "with a line, without a CUDA device.", group="Precision and memory")
    plan: Path | None = option(
        None, "A plan.json `laionkit plan` wrote: train its fastest candidate (the plan's LATENTS, train flags "
        "and the candidate's batch / checkpointing / compile / memory flags; flags given here override them, "
        "and they override a --config file's). RUN/plan.json keeps a copy.", group="Precision and memory")
    tf32: bool = option(True, "TF32 matmuls and convolutions in float32.", group="Precision and memory")
    seed: int = option(0, "Seed: model init (same on every rank), data order and noise.", group="Optimization")
    workers: int = option(2, "DataLoader workers per rank.", group="Data")
    shuffle_buffer: int = option(1000, "Samples in each worker's shuffle buffer.", group="Data")
    checkpoint_every: int = option(1000, "Checkpoint every N steps.", group="Checkpointing and resume")
    checkpoint_minutes: float | None = option(
        None, "Also checkpoint when M minutes have passed since the last checkpoint (rank 0's clock; every rank "
        "saves at the same step).", group="Checkpointing and resume")
    checkpoint_writer: Literal["accelerate", "async", "sync", "auto"] = option(
        "accelerate", "accelerate: accelerate's save_state layout, rank 0 writes while every rank waits (DeepSpeed "
        "needs it); async: sharded DCP checkpoints, the GPUs wait only for a copy into host memory and a thread "
        "writes (and uploads) them; sync: the same DCP checkpoints written before training goes on; auto: async, "
        "accelerate under DeepSpeed (what the cluster recipes use). --resume reads either layout (docs/FORMATS.md).", group="Checkpointing and resume")
    keep_checkpoints: int = option(3, "Keep the last K checkpoints.", group="Checkpointing and resume")
    checkpoint_at_end: bool = option(
        True, "Checkpoint after the last step (resumable: weights, optimizer, data position). --no-checkpoint-at-end "
        "keeps only the export, for a run that will not be continued (a full checkpoint of a multi-billion-parameter "
        "model with fp32 master weights and AdamW is 16 bytes a parameter); a stop signal still checkpoints. A later "
        "`laionkit export RUN` reads the newest periodic checkpoint's record, so export what you need now (--export).", group="Checkpointing and resume")
    resume: str | None = option(
        None, "latest (newest complete checkpoint that verifies, if any) or a checkpoint folder (with a URL "
        "--output: one of its checkpoints/step-N URLs).", group="Checkpointing and resume")
    add_shards: bool = option(
        False, "With --resume: take latent shards appended to the folder since the checkpoint, from the first "
        "epoch no rank has begun (the epochs in progress finish on the shards they began with). Without it, "
        "a changed shard set is refused.", group="Checkpointing and resume")
    overwrite: bool = option(
        False, "Delete the run already in --output (metrics, checkpoints, unet/...) and start over.", group="Checkpointing and resume")
    allow_changed_text_encoder: bool = option(
        False, "Online-text latents: train although a text encoder or tokenizer's files differ from the "
        "sha256 encode recorded in the manifest (refused by default: the stored token ids would be encoded "
        "by another model).", group="Data")
    max_nonfinite: int = option(
        3, "Stop with an error after this many consecutive steps with a non-finite loss.", group="Optimization")
    log_every: int = option(10, "Log (and check for SIGTERM) every N steps.", group="Logging")
    log_with: Literal["tensorboard", "wandb", "none"] = option(
        "tensorboard", "tensorboard, wandb or none (metrics.jsonl is always written).", group="Logging")
    # --log-with wandb: wandb.init's project, entity, name and tags; the run id is kept in RUN/wandb.json
    wandb_project: str | None = option(None, "--log-with wandb: the W&B project (default: laionkit).", group="Logging")
    wandb_entity: str | None = option(None, "--log-with wandb: the W&B entity (team or user; default: yours).", group="Logging")
    wandb_run_name: str | None = option(
        None, "--log-with wandb: the W&B run's name (default: W&B's); a resume keeps the run's id.", group="Logging")
    wandb_tags: str | None = option(None, "--log-with wandb: comma-separated W&B tags.", group="Logging")
    validate_every: int = option(0, "Sample images every N steps (0: never).", group="Validation and evaluation")
    validation_count: int = option(4, "Fixed prompts: the first N captions of the first shard.", group="Validation and evaluation")
    validation_steps: int = option(25, "DDIM steps per validation image.", group="Validation and evaluation")
    # --- validation prompts of the user's (laionkit/trainer/evaluation.py: prompt_texts) ---
    validation_prompts: tuple[str, ...] | None = option(
        None, "--validate-every's prompts instead of the first --validation-count captions: a prompt, or a "
        ".txt file of prompts one per line; repeatable, in order. Encoded once at the start by the latents' "
        "own text encoders (the manifest's models), as encode encoded the captions.", group="Validation and evaluation")
    guidance_scale: float = option(5.0, "Classifier-free guidance scale for validation.", group="Validation and evaluation")
    peak_tflops: float = option(989.0, "Peak TFLOP/s per GPU for MFU (989: H100/H200 SXM dense bf16).", group="Logging")
    metrics_port: int | None = option(None, "Serve Prometheus metrics on this port (rank 0).", group="Logging")
    record_keys: bool = option(False, "Write the sample keys of every step, with their epochs, to "
                                      "RUN/seen/rank-N.jsonl.", group="Logging")
    # --- LoRA and the validation loss (laionkit/trainer/lora.py, laionkit/trainer/valloss.py) ---
    lora_rank: int | None = option(
        None, "Train LoRA adapters of this rank on a frozen pretrained --unet / --transformer (PEFT); "
        "checkpoints hold the adapters, RUN/lora/ is what diffusers' pipe.load_lora_weights loads "
        "(lora_kohya.safetensors beside it, with .alpha, is what ComfyUI loads).", group="Model")
    lora_alpha: float | None = option(None, "LoRA alpha (scale alpha/rank; default: the rank).", group="Model")
    lora_dropout: float = option(0.0, "Dropout on the LoRA branch while training.", group="Model")
    # trainchecks.DEFAULT_TARGETS
    lora_targets: str = option("to_q,to_k,to_v,to_out.0", "Comma-separated module names that get adapters.", group="Model")
    # --lora-rank on --unet-config (a random base, never saved): benchmarks only
    lora_random_base: bool = option(
        False, "Allow --lora-rank with --unet-config / --transformer-config: adapters on a random base that "
        "is never saved, useless outside the run; for throughput measurements.", group="Model")
    # the frozen base's block linear layers stored quantized (laionkit/trainer/quantized_base.py)
    base_dtype: Literal["bf16", "fp8", "int8", "nf4"] = option(
        "bf16", "With --lora-rank: how the frozen base's block linear layers are held: bf16, fp8 (e4m3, a scale per "
        "output channel), int8 (a scale per output channel) or nf4 (QLoRA's 4-bit levels, a scale per 64 weights), "
        "quantized block by block as the base loads; embedders, norms and adapters stay bf16/fp32, checkpoints hold "
        "the adapters, the export merges into the bf16 base. A resume needs the same --base-dtype.", group="Precision and memory")
    val_latents: Path | None = option(
        None, "A latent folder (encode output) for a deterministic validation loss, written to metrics.jsonl "
        "as val_loss.", group="Validation and evaluation")
    val_every: int = option(
        0, "Validation loss every N steps and at the end (default: --validate-every, else "
        "--checkpoint-every).", group="Validation and evaluation")
    val_samples: int = option(
        64, "The first N samples of --val-latents (shards by name, tar order), each with fixed noise and "
        "timesteps (--val-strata of them: N x strata forwards per validation).", group="Validation and evaluation")
    val_strata: int = option(  # laionkit/trainer/valloss.py
        8, "Validation noise levels: every --val-samples sample at each of N fixed timesteps / sigmas u = "
        "(k + 0.5) / N (N forwards per sample), written as val_loss (their mean) and val_loss_strata; 1: the "
        "midpoint; 0: one fixed random level per sample, no strata. E.g. --val-strata 4.", group="Validation and evaluation")
    # --- scoring during training (laionkit/trainer/evalhook.py; the scores of `laionkit eval`) ---
    eval_every: int = option(
        0, "Score the run's weights every N steps and at the end (0: never): N images generated by the pipeline "
        "the run would export then, FID and KID against --eval-reference and CLIP score against their prompts, "
        "as `laionkit eval` scores RUN/pipeline; written to metrics.jsonl (fid, kid, kid_std, clip_score) and "
        "plotted in RUN/eval.png. E.g. --eval-every 5000 --eval-reference coco-val/ --eval-count 1000.", group="Validation and evaluation")
    eval_reference: Path | None = option(
        None, "--eval-every: reference images, a folder of image files or pack's webdataset tars (a folder of "
        "*.tar, or one tar).", group="Validation and evaluation")
    eval_prompts: Path | None = option(
        None, "--eval-every: a text file of prompts, one per line (default: the captions of --val-latents, else "
        "of LATENTS; shards by name, tar order).", group="Validation and evaluation")
    eval_count: int = option(
        1000, "--eval-every: images per evaluation, the first N prompts (cycled if fewer), image i from seed i "
        "(FID is biased upward at small N: compare runs at one N).", group="Validation and evaluation")
    eval_steps: int = option(25, "--eval-every: sampling steps per image.", group="Validation and evaluation")
    eval_resolution: int | None = option(
        None, "--eval-every: square side of the generated images (default: the exported pipeline's, which from "
        "scratch is the latents' size).", group="Validation and evaluation")
    eval_inception: str | None = option(
        None, "--eval-every: FID Inception-v3 weights (torch-fidelity's state dict): a .pth or .safetensors file, "
        "a URL or a hub id owner/name[/FILE] (default: torch-fidelity's release URL, cached by torch.hub).", group="Validation and evaluation")
    eval_clip_model: str = option(
        "ViT-L-14", "--eval-every: open_clip model for the CLIP score: a name, hf-hub:ORG/REPO or a model config "
        ".json file.", group="Validation and evaluation")
    eval_clip_pretrained: str | None = option(
        "openai", "--eval-every: open_clip weights: a tag (openai, laion2b_s32b_b82k) or a .safetensors / "
        "state-dict file.", group="Validation and evaluation")
    stage: tuple[str, ...] | None = option(
        None, "DIR:STEPS: after LATENTS' steps, train STEPS more on the encode folder DIR (repeatable, in "
        "order: a multi-resolution schedule; resumes across the switch).", group="Data")
    # local copies of latent shards read from a URL, at most cache_size bytes
    cache_dir: Path | None = option(
        None, "Latents at a URL: keep local copies of their shards here (shared by workers and ranks); made "
        "and checked writable at the start.", group="Data")
    cache_size: int = option(
        100 * 2**30, "--cache-dir: at most this many bytes, least recently used evicted.", group="Data")
    # the blocks' linear layers in float8 (laionkit/trainer/fp8.py)
    fp8: bool = option(
        False, "Train the denoiser blocks' linear layers in float8 (torchao; GPUs of compute capability "
        "8.9+; fastest with --compile), bf16 elsewhere; with --lora-rank, the frozen base's block matmuls run in "
        "float8 (the input's gradient only; --base-dtype fp8 uses the stored float8 weights). Opt-in: docs/BENCHMARKS.md measures its speed and "
        "loss against bf16.", group="Precision and memory")
    fp8_recipe: str = option(
        "tensorwise", "--fp8 scaling: tensorwise (one scale per tensor, fastest) or rowwise (closer to bf16).", group="Precision and memory")
    # what finish writes besides RUN/unet: auto, pipeline, single-file (laionkit/trainer/pipeline_folder.py)
    export: str = option(
        "auto", "What the run exports besides unet/ (transformer/): pipeline (RUN/pipeline, a whole "
        "diffusers pipeline folder), pipeline,single-file (also RUN/single_file/, the ComfyUI / A1111 "
        "checkpoint), none, or auto (default: pipeline, except for LoRA runs, which export RUN/lora only); "
        "e.g. --export pipeline,single-file. --export pipeline on a LoRA run merges the adapters into a copy "
        "of the base (its whole size again).", group="Export")
    export_files: str = option(
        "copy", "RUN/pipeline's VAE, text encoders and tokenizers: copy (default) or hardlink (no extra "
        "space where the base lies on the same filesystem; an in-place write into the pipeline then changes "
        "the base too).", group="Export")
    # --storage-options JSON for the latents, --val-latents and --output URLs
    storage_options: str | None = option(None, STORAGE_HELP, group="Data")
    rank: int | None = option(None, RANK_HELP, group="Distribution")
    world_size: int | None = option(None, WORLD_SIZE_HELP, group="Distribution")
    # the process group's collective timeout (accelerate's InitProcessGroupKwargs; docs/CLUSTER.md)
    pg_timeout_minutes: float | None = option(
        None, "Minutes a collective (all-reduce, barrier) may wait for the other ranks before the run fails "
        "with a timeout instead of hanging (default: torch's, 10 for NCCL, 30 for gloo). Raise it when one "
        "rank may pause long (a slow checkpoint upload on rank 0), lower it to fail fast on a dead node; "
        "e.g. --pg-timeout-minutes 60.", group="Distribution")
    # --- offload (laionkit/trainer/offload.py; DeepSpeed's is train/deepspeed-zero3-offload.yaml) ---
    cpu_offload: bool = option(
        False, "FSDP2 CPU offload (CPUOffloadPolicy): each rank's shard of the parameters, gradients and AdamW "
        "state in host memory, the optimizer step on the CPU; for full fine-tunes larger than the GPUs (Flux-12B "
        "on one 80 GB GPU). Under an FSDP launch only, one GPU included: accelerate launch --config_file "
        "train/fsdp.yaml --num_processes 1 -m laionkit.cli train ... --cpu-offload. Not with --ema.", group="Precision and memory")
    # --- pipeline parallelism (laionkit/trainer/pipeline_parallel.py) ---
    pipeline_stages: int = option(
        1, "Pipeline parallelism: the denoiser's blocks cut into N stages, one per rank (torchrun / accelerate "
        "--num_processes a multiple of N: the ranks past N run replicas of the pipeline, gradients averaged "
        "among them), balanced by each block's measured forward + backward time; --grad-accum micro-batches of "
        "--batch-size samples flow through them. For cards joined by a slow link (docs/CLUSTER.md). 1: off.",
        group="Distribution")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = option(
        "1f1b", "--pipeline-stages: torch.distributed.pipelining's schedule: gpipe, 1f1b or interleaved-1f1b "
        "(two stages per rank).", group="Distribution")
    quiet: bool = option(False, QUIET_HELP, flags=("--quiet", "-q"), group="Logging")

    def __post_init__(self) -> None:
        check_choices(self)
        if (self.unet is None) == (self.unet_config is None):
            raise LaionkitError("give exactly one of --unet / --transformer (fine-tune) or --unet-config / "
                                "--transformer-config (from scratch)")
        if self.max_steps is not None and self.epochs is not None:
            raise LaionkitError("give one of --max-steps or --epochs, not both")
        at_least = {"batch_size": 1, "grad_accum": 1, "log_every": 1, "checkpoint_every": 1, "keep_checkpoints": 1,
                    "max_steps": 1, "max_nonfinite": 1, "workers": 0, "shuffle_buffer": 0, "warmup_steps": 0,
                    "validate_every": 0, "validation_count": 1, "validation_steps": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise LaionkitError(f"--{name.replace('_', '-')} {value}: must be >= {low}")
        if not 0 <= self.seed < 2**32:  # accelerate's set_seed seeds numpy, whose seeds are 32-bit
            raise LaionkitError(f"--seed {self.seed}: must be an integer in [0, 2**32)")
        for name in ("lr", "epochs", "pg_timeout_minutes", "checkpoint_minutes"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise LaionkitError(f"--{name.replace('_', '-')} {value}: must be a finite number > 0")
        given = [name for name in ("wandb_project", "wandb_entity", "wandb_run_name", "wandb_tags")
                 if getattr(self, name) is not None]
        if given and self.log_with != "wandb":
            raise LaionkitError(f"--{given[0].replace('_', '-')} goes with --log-with wandb (not {self.log_with})")
        if self.add_shards and self.resume is None:
            raise LaionkitError("--add-shards goes with --resume: it takes new shards into a run that continues")
        if self.resume not in (None, "latest") and self.overwrite:
            raise LaionkitError("--overwrite goes with --resume latest only (resume if a checkpoint exists, else "
                                "delete the run and start over); --resume FOLDER continues that checkpoint")
        parse_mix(self.caption_mix)  # its syntax now; the names against the latents' manifest at setup
        if not 0 <= self.caption_dropout <= 1:
            raise LaionkitError("--caption-dropout is a probability in [0, 1]")
        if self.shift not in (None, "dynamic", "none"):
            try:
                value = float(self.shift)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise LaionkitError(f"--shift {self.shift!r}: a number > 0 (static shift), dynamic or none")
        if self.full_bf16 and (self.mixed_precision not in (None, "bf16") or self.bf16_weights is False):
            raise LaionkitError("--full-bf16 trains bf16 weights without fp32 master copies: it needs "
                                "--mixed-precision bf16 and cannot be combined with --no-bf16-weights")
        if self.compile_dynamic and not self.compile:
            raise LaionkitError("--compile-dynamic chooses how --compile treats shapes: give it with --compile")
        self.later_stages()
        self.checkpoint_interval()
        trainchecks.check_plan(self)
        trainchecks.check_lora(self)
        trainchecks.check_val_loss(self)
        trainchecks.check_eval(self)
        trainchecks.check_fp8(self)
        trainchecks.check_base_dtype(self)
        trainchecks.check_export(self)
        trainchecks.check_block_swap(self)
        trainchecks.check_offload(self)
        trainchecks.check_validation_prompts(self)
        trainchecks.check_pipeline(self)

    def checkpoint_interval(self) -> int:
        """--checkpointing as a block interval: 0 none, 1 every block (``blocks``), N every N-th block
        (``every-N``). The deprecated --gradient-checkpointing means ``blocks``."""
        value = self.checkpointing.strip().lower()
        if self.gradient_checkpointing:
            if value not in ("none", "blocks"):
                raise LaionkitError(f"--gradient-checkpointing (deprecated) is --checkpointing blocks; it "
                                    f"contradicts --checkpointing {self.checkpointing}: give only --checkpointing")
            return 1
        if value in ("none", "auto"):  # auto: none until memory.auto_checkpointing measures (after build)
            return 0
        if value == "blocks":
            return 1
        prefix, _, count = value.partition("every-")
        if prefix or not count.isdigit() or int(count) < 1:
            raise LaionkitError(f"--checkpointing {self.checkpointing!r}: blocks (every block), every-N (every "
                                "N-th block, N >= 1), auto (the fewest that fit, measured) or none")
        return int(count)

    def later_stages(self) -> list[tuple[Path, int]]:
        """The --stage folders and their steps, trained after the LATENTS stage."""
        found = []
        for spec in self.stage or ():
            folder, colon, steps = spec.rpartition(":")
            if not colon or not folder or not steps.isdigit() or int(steps) < 1:
                raise LaionkitError(f"--stage {spec!r}: give DIR:STEPS, STEPS a whole number of steps >= 1")
            found.append((Path(folder), int(steps)))
        return found


@dataclass(frozen=True)
class TrainResult:
    step: int
    stopped_by: int | None  # the signal number that ended the run early, else None
    checkpoint: Path | None
    written: tuple[str, ...] = ()  # rank 0's exports, relative to the run folder (laionkit/trainer/export.py)
