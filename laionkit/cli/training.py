"""Training and scoring: `laionkit train` (its options are TrainConfig's fields), `plan`, `export` and `eval`."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from laionkit.cli.app import CONFIG_ONLY, QuietOption, app
from laionkit.common import LaionkitError
from laionkit.common.options import typer_parameters
from laionkit.trainer.config import TrainConfig


@app.command("train", epilog="""More examples:

    accelerate launch --config_file train/ddp.yaml --num_processes 8 -m laionkit.cli train latents/ --output runs/sd15 \\
        --unet-config sd15 --epochs 10 --batch-size 64 --mixed-precision bf16 --compile --channels-last \\
        --snr-gamma 5 --ema --checkpoint-every 2000 --resume latest

    laionkit train latents/ --output runs/ft --unet stable-diffusion-v1-5/stable-diffusion-v1-5 \\
        --max-steps 10000 --lr 1e-5 --validate-every 500

    laionkit train latents-256/ --output runs/multires --unet-config sd15 --max-steps 50000 \\
        --stage latents-512-buckets/:20000 --resume latest

    laionkit train s3://bucket/latents --output runs/tiny --unet-config tiny --cache-dir /scratch/cache --cache-size 200000000000

    laionkit train s3://bucket/latents --output s3://bucket/runs/sd15 --unet-config sd15 --max-steps 50000 \\
        --resume latest   # checkpoints staged in $LAIONKIT_STAGING, uploaded with done records; AWS_* credentials

    laionkit train latents-sd3/ --output runs/sd3 --transformer-config sd3-medium --shift 3 --weighting none \\
        --max-steps 100000 --mixed-precision bf16

    laionkit train latents-flux/ --output runs/flux-full --transformer flux-dev --mixed-precision bf16 \\
        --compile --checkpointing blocks --resume latest

    laionkit train latents-sdxl/ --output runs/sdxl --unet sdxl --checkpointing every-2 --batch-size 16

    laionkit train latents/ --output runs/sd15 --unet-config sd15 --max-steps 100000 --val-latents val-latents/ \\
        --eval-every 10000 --eval-reference coco-val/ --eval-count 1000   # FID, KID, CLIP score in metrics.jsonl

    laionkit train --config runs/sd15.yaml --resume latest   # the file's flags; the command line overrides them

Every rank runs exactly --max-steps optimizer steps (or --epochs converted to steps with the manifest's
sample count; neither given: one epoch). The last line names what the run wrote (RUN/unet or RUN/lora/...,
RUN/pipeline, single files). SIGTERM / SIGINT / SIGHUP save a checkpoint within two steps and exit 128+signal; under
torchrun or accelerate launch set TORCH_ELASTIC_SHUTDOWN_TIMEOUT (docs/CLUSTER.md, "Preemption").
""")
def train_command(ctx: typer.Context, **options) -> None:
    """Train a latent-diffusion UNet on latent shards with Accelerate (one process, DDP, FSDP or DeepSpeed).

    Examples:

    ```
    laionkit train latents/ --output runs/tiny --unet-config tiny --max-steps 200 --batch-size 8

    laionkit train latents/ --output runs/lora --unet stable-diffusion-v1-5/stable-diffusion-v1-5 \\
        --lora-rank 16 --lr 1e-4 --max-steps 2000 --val-latents val-latents/ --val-every 200

    laionkit train latents-flux/ --output runs/flux --transformer flux-dev --lora-rank 16 \\
        --max-steps 2000
    ```
    """
    from laionkit import plan
    from laionkit.trainer import trainfile
    from laionkit.trainer.loop import run

    options = plan.train_options(ctx, trainfile.merge(ctx, options, options.pop("config")))  # --plan over --config
    for name, flag in (("latents", "LATENTS"), ("output", "--output")):
        if options[name] is None:
            raise LaionkitError(f"give {flag} (or {name}: in the --config file)")
    config = TrainConfig(**options)
    if CONFIG_ONLY.get():
        return
    result = run(config)
    if result.stopped_by:
        typer.echo(f"stopped by signal {result.stopped_by} at step {result.step}; checkpoint {result.checkpoint}; "
                   "rerun with --resume latest")
        raise typer.Exit(128 + result.stopped_by)
    if result.written:  # rank 0's: the one line that says where the run's model is
        output = str(options["output"]).rstrip("/")
        typer.echo(f"done at step {result.step}; wrote " + ", ".join(f"{output}/{name}" for name in result.written))


# train's options are TrainConfig's fields (their help, flags and defaults: laionkit/common/options.py), with
# --config after LATENTS and --output.
_train_options = typer_parameters(TrainConfig)
_train_options.insert([option.name for option in _train_options].index("output") + 1, inspect.Parameter(
    "config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[Path], typer.Option(
        "--config", help="A YAML or TOML file of train flags (keys: flag or TrainConfig field names, e.g. max-steps: "
        "1000, latents: data/latents); flags given here override it.", rich_help_panel="Data")]))
train_command.__signature__ = inspect.Signature(
    [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context), *_train_options])


@app.command("plan", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog="""More examples:

    laionkit plan latents/ --output plans/sd15 --batch-sizes 16,32,64 --checkpointing none,every-2,auto -- --unet sd15 --mixed-precision bf16

    laionkit plan latents-flux2/ --output plans/flux2-24 --gpu-memory-gib 24 --base-dtypes bf16,fp8,nf4 \\
        --block-swaps 0,8,16 -- --transformer flux2-dev --lora-rank 64 --mixed-precision bf16

Everything after -- is passed to every candidate's `laionkit train` as given (model, precision, LoRA,
objective...). Each candidate runs in its own process: --steps steps to warm up, --steps measured. The memory
strategies (--base-dtypes, --block-swaps, --cpu-offload) are a ladder: each is tried at a batch only where
those before it did not fit.
""")
def plan_command(
    ctx: typer.Context,
    latents: Annotated[str, typer.Argument(help="An encode output folder, as train takes it.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for plan.json, each candidate's log and its throwaway run.", rich_help_panel="Input and output")],
    batch_sizes: Annotated[str, typer.Option(help="Per-GPU batch sizes to try, comma-separated.", rich_help_panel="Candidates")] = "1,2,4",
    checkpointing: Annotated[str, typer.Option(help="--checkpointing values to try, comma-separated (none, every-N, blocks, auto).", rich_help_panel="Candidates")] = "none,blocks",
    compile: Annotated[str, typer.Option(help="off, on or both: --compile for each candidate.", rich_help_panel="Candidates")] = "both",
    fp8: Annotated[str, typer.Option(help="off, on or both: --fp8 (float8 matmuls) for each candidate.", rich_help_panel="Candidates")] = "off",
    base_dtypes: Annotated[str, typer.Option(help="LoRA runs: --base-dtype values for the frozen base, comma-separated (bf16, fp8, int8, nf4), tried in that order.", rich_help_panel="Candidates")] = "bf16",
    block_swaps: Annotated[str, typer.Option(help="--block-swap values (blocks on the host; 0: none), comma-separated, tried smallest first after the base dtypes.", rich_help_panel="Candidates")] = "0",
    cpu_offload: Annotated[bool, typer.Option("--cpu-offload", help="Last: FSDP2 --cpu-offload (one GPU: accelerate launch --config_file train/fsdp.yaml --num_processes 1), where nothing else fits.", rich_help_panel="Candidates")] = False,
    gpu_memory_gib: Annotated[Optional[float], typer.Option(help="Each candidate's train --gpu-memory-gib: what fits on a GPU of G GiB, measured on a larger one.", rich_help_panel="Candidates")] = None,
    steps: Annotated[int, typer.Option(help="Steps per window: one window warms up, the next is measured.", rich_help_panel="Measurement")] = 5,
    timeout: Annotated[float, typer.Option(help="Seconds a candidate may take (compile included).", rich_help_panel="Measurement")] = 1800.0,
    quiet: QuietOption = False,
) -> None:
    """Measure candidate train configurations (batch, checkpointing, compile, --fp8, memory strategy) and print the fastest that fits.

    Examples:

    ```
    laionkit plan latents-flux/ --output plans/flux -- --transformer flux-dev --lora-rank 64 \\
        --mixed-precision bf16

    laionkit train --plan plans/flux/plan.json --output runs/flux --max-steps 2000   # the fastest that fit
    ```
    """
    from laionkit import plan

    def numbers(flag: str, text: str, low: int) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < low:
            raise LaionkitError(f"{flag} {text!r}: comma-separated integers >= {low}, e.g. {'0,8,16' if low == 0 else '1,2,4'}")
        return values

    modes = {"off": (False,), "on": (True,), "both": (False, True)}
    for flag, value in (("--compile", compile), ("--fp8", fp8)):
        if value not in modes:
            raise LaionkitError(f"{flag} {value!r}: off, on or both")
    dtypes = tuple(v.strip() for v in base_dtypes.split(",") if v.strip())
    if not dtypes or set(dtypes) - set(plan.BASE_DTYPES):
        raise LaionkitError(f"--base-dtypes {base_dtypes!r}: comma-separated {', '.join(plan.BASE_DTYPES)}")
    config = plan.PlanConfig(latents=latents, output=output, batch_sizes=numbers("--batch-sizes", batch_sizes, 1),
                             checkpointing=tuple(v.strip() for v in checkpointing.split(",") if v.strip()),
                             compile=modes[compile], fp8=modes[fp8], base_dtypes=dtypes,
                             block_swaps=numbers("--block-swaps", block_swaps, 0), cpu_offload=cpu_offload,
                             gpu_memory_gib=gpu_memory_gib, steps=steps, timeout=timeout, train_args=tuple(ctx.args),
                             quiet=quiet)
    found = plan.run(config)
    for candidate in found:
        typer.echo(f"{candidate.name:32s} {plan.describe(candidate)}")
    best = plan.fastest(found)
    if best is None:
        raise LaionkitError(f"plan: no candidate fits (see {output / 'plan.json'})")
    typer.echo(f"fastest that fits: {json.loads((output / 'plan.json').read_text())['command']}")
    typer.echo(f"train it: laionkit train --plan {output / 'plan.json'} --output RUN --max-steps N")


@app.command("export", epilog="""More examples:

    laionkit export runs/old --format pipeline,single-file --export-files hardlink

A run trained with --export none (or before pipelines were exported) gets RUN/pipeline rebuilt from its newest
checkpoint's record (latents, base model, noise schedule); a LoRA run's (trained with the default --export auto)
gets RUN/lora merged into a copy of its base at alpha / rank. Single files: SD 1.x/2.x and SDXL as one CompVis/SGM
checkpoint (models/checkpoints/), SD3 and Flux as the denoiser alone (models/diffusion_models/).
""")
def export_command(
    run: Annotated[Path, typer.Argument(help="A finished run folder (RUN/unet or RUN/transformer, checkpoints/).")],
    format: Annotated[str, typer.Option("--format", help="pipeline, single-file, both comma-separated, or auto: the single file where the family has one (sd, sdxl, sd3, flux), else the pipeline folder; RUN/pipeline is rebuilt where missing.")] = "auto",
    export_files: Annotated[str, typer.Option(help="RUN/pipeline's base files: copy or hardlink.")] = "copy",
) -> None:
    """Export a finished run: a diffusers pipeline folder, or single-file checkpoints for ComfyUI / A1111.

    Examples:

    ```
    laionkit export runs/sdxl   # RUN/single_file/sdxl-sdxl.safetensors for ComfyUI / A1111

    laionkit export runs/pixart   # no single-file format: RUN/pipeline (rebuilt if the run has none)
    ```
    """
    from laionkit.trainer.export import export_run

    for path in export_run(run, format, export_files, log=lambda line: typer.echo(line, err=True)):
        typer.echo(str(path))


@app.command("eval", epilog="""More examples:

    laionkit eval runs/a/pipeline --reference coco-val/ --prompts coco-captions.txt --count 5000 \\
        --output evals/a --inception weights-inception-2015-12-05-6726825d.pth --clip-pretrained laion2b_s32b_b82k

Writes OUTPUT/eval.json and OUTPUT/eval-grid.png. Image i uses seed + i, so two pipelines evaluated with the same
prompts, seed and reference are compared on the same noise (compare runs of different settings or data filters).
""")
def eval_command(
    pipeline: Annotated[Path, typer.Argument(help="An exported diffusers pipeline folder (RUN/pipeline; any family).")],
    reference: Annotated[Path, typer.Option(help="Reference images: a folder of image files, or pack's webdataset tars (a folder of *.tar or one tar).", rich_help_panel="Input and output")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for eval.json and eval-grid.png; a run folder (with metrics.jsonl) also gets a metrics record and eval.png.", rich_help_panel="Input and output")],
    prompts: Annotated[Optional[Path], typer.Option(help="A text file of prompts, one per line.", rich_help_panel="Input and output")] = None,
    val_latents: Annotated[Optional[Path], typer.Option(help="Or: an encode output folder whose captions are the prompts (shards by name, tar order).", rich_help_panel="Input and output")] = None,
    count: Annotated[int, typer.Option(help="Images to generate: the first N prompts, cycled if fewer (FID is biased upward at small N; KID is unbiased, so compare runs at one N).", rich_help_panel="Generation")] = 1000,
    seed: Annotated[int, typer.Option(help="Image i is generated from seed + i.", rich_help_panel="Generation")] = 0,
    steps: Annotated[int, typer.Option(help="Sampling steps per image.", rich_help_panel="Generation")] = 25,
    guidance_scale: Annotated[Optional[float], typer.Option(help="Classifier-free guidance scale (default: the pipeline's).", rich_help_panel="Generation")] = None,
    resolution: Annotated[Optional[int], typer.Option(help="Square side of the generated images (default: the pipeline's); references are centre-cropped and resized to it.", rich_help_panel="Generation")] = None,
    batch_size: Annotated[int, typer.Option(help="Images per generation / feature batch.", rich_help_panel="Performance")] = 8,
    reference_count: Annotated[int, typer.Option(help="Use at most this many reference images (0: all).", rich_help_panel="Scores")] = 0,
    inception: Annotated[Optional[str], typer.Option(help="FID Inception-v3 weights (torch-fidelity's / pytorch-fid's state dict): a .pth or .safetensors file, a URL, or a hub id owner/name[/FILE] (default: torch-fidelity's release URL, cached by torch.hub).", rich_help_panel="Scores")] = None,
    clip_model: Annotated[str, typer.Option(help="open_clip model: a name (ViT-L-14), hf-hub:ORG/REPO, or a model config .json file.", rich_help_panel="Scores")] = "ViT-L-14",
    clip_pretrained: Annotated[Optional[str], typer.Option(help="open_clip weights: a tag (openai, laion2b_s32b_b82k) or a .safetensors / state-dict file.", rich_help_panel="Scores")] = "openai",
    kid_subsets: Annotated[int, typer.Option(help="KID: random subsets averaged (torchmetrics: 100).", rich_help_panel="Scores")] = 100,
    kid_subset_size: Annotated[int, typer.Option(help="KID: images per subset (torchmetrics: 1000; cut to the smaller set).", rich_help_panel="Scores")] = 1000,
    device: Annotated[Optional[str], typer.Option(help="torch device (default: cuda if available, else cpu).", rich_help_panel="Performance")] = None,
    dtype: Annotated[str, typer.Option(help="Pipeline dtype: auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16.", rich_help_panel="Performance")] = "auto",
    max_sequence_length: Annotated[Optional[int], typer.Option(help="The pipeline's max_sequence_length: the caption window the model trained with, where encode was given --max-sequence-length (default: the pipeline's).", rich_help_panel="Generation")] = None,
    quiet: QuietOption = False,
) -> None:
    """Score an exported pipeline: FID and KID against reference images, CLIP score against the prompts.

    Examples:

    ```
    laionkit eval runs/sd15/pipeline --reference data/shards --val-latents data/val-latents \\
        --count 1000 --output runs/sd15   # appends fid, kid, clip_score to runs/sd15/metrics.jsonl, plots runs/sd15/eval.png

    laionkit models tiny-eval --output models/eval && laionkit eval runs/tiny/pipeline \\
        --reference photos/ --prompts prompts.txt --count 16 --output evals/tiny \\
        --inception models/eval/inception.pth --clip-model models/eval/tiny-clip.json \\
        --clip-pretrained models/eval/tiny-clip.safetensors
    ```
    """
    from laionkit import evaluate

    config = evaluate.EvalConfig(
        pipeline=pipeline, reference=reference, output=output, prompts=prompts, val_latents=val_latents,
        count=count, seed=seed, steps=steps, guidance_scale=guidance_scale, resolution=resolution,
        batch_size=batch_size, reference_count=reference_count, inception=inception or "", clip_model=clip_model,
        clip_pretrained=clip_pretrained, kid_subsets=kid_subsets, kid_subset_size=kid_subset_size, device=device,
        dtype=dtype, quiet=quiet, max_sequence_length=max_sequence_length)
    evaluate.run(config, log=typer.echo)
