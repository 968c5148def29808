"""Pipeline parallelism (laionkit/trainer/pipeline_parallel.py) for real: torchrun's CPU ranks (gloo) train a tiny
Flux of 2 double- and 4 single-stream blocks cut into 2 and 4 stages, full and LoRA, under each schedule, a tiny
SD3 cut in two, a tiny SDXL UNet cut in 2 and 4, and pipelines replicated 2 x 2 (resumed from 2 x 1); the
losses and the exported weights are the single-process (or DDP) run's. A run killed with -9 resumes exactly; the
exports load in their pipelines in a fresh interpreter; what does not compose is refused in one line."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from fixtures import accelerate_launch, free_port, metrics

from laionkit.trainer.pipeline_parallel import balance

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = ("--max-steps", "4", "--checkpoint-every", "2")
FLAGS = ("--batch-size", "2", "--grad-accum", "2", "--lr", "1e-3", "--log-with", "none", "--quiet", "--workers",
         "0", "--log-every", "1", "--shuffle-buffer", "3", "--caption-dropout", "0.5", *STEPS)
LORA = ("--lora-rank", "4", "--lr", "1e-2")


@pytest.fixture(scope="module")
def deep_flux(flow_latents, tmp_path_factory) -> tuple[Path, Path]:
    """(the flux latents, a pretrained folder whose transformer/ has 6 blocks: 2 double-, 4 single-stream)."""
    from diffusers import FluxTransformer2DModel

    from laionkit.families.flux import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    model = tmp_path_factory.mktemp("deep-flux")
    FluxTransformer2DModel.from_config({**TINY_TRANSFORMER_CONFIG, "num_layers": 2, "num_single_layers": 4}) \
        .save_pretrained(model / "transformer")
    return flow_latents("flux").latents, model


def train_args(deep_flux, run: Path, *more) -> list[str]:
    latents, model = deep_flux
    return ["train", str(latents), "--output", str(run), "--transformer", str(model), *FLAGS, *more]


def torchrun(ranks: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m", "laionkit.cli", *args]


def launched(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=ENV, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]


def assert_trained_alike(reference: Path, run: Path, folder: str = "transformer",
                         name: str = "diffusion_pytorch_model.safetensors", atol: float = 1e-6,
                         steps: int = 4) -> None:
    """Every step's loss and the exported weights are the reference's, within float tolerance (``atol``: of
    weights after Adam's steps, which scale gradients summed in another order up to whole steps)."""
    from safetensors.torch import load_file

    want, got = metrics(reference), metrics(run)
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    before, after = (load_file(path / folder / name) for path in (reference, run))
    assert before.keys() == after.keys()
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=atol, msg=key)


@pytest.fixture(scope="module")
def single(deep_flux, tmp_path_factory) -> dict[str, Path]:
    """The single-process runs the pipelines must reproduce: full and LoRA."""
    runs = {}
    for name, more in (("full", ()), ("lora", LORA)):
        runs[name] = tmp_path_factory.mktemp("single") / name
        run_cli(*train_args(deep_flux, runs[name], *more))
    return runs


@pytest.mark.parametrize(("costs", "parts", "bounds"), [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([3, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # by cost, not by count
    ([4, 1, 1, 1, 1, 4], 3, [(0, 1), (1, 5), (5, 6)]),
    ([2, 2, 1, 1, 1, 1], 4, [(0, 1), (1, 2), (2, 4), (4, 6)]),
    ([1, 2, 3], 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_stages_balance_measured_costs(costs, parts, bounds):
    found = balance(costs, parts)
    assert found == bounds
    assert found[0][0] == 0 and found[-1][1] == len(costs)
    assert all(a < b for a, b in found) and all(b == c for (_, b), (c, _) in zip(found, found[1:]))


@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("size", [8, 7])  # 7: the up blocks take the skip residuals' size (upsample_size)
def test_unet_stages_chained_are_the_unet(family, size):
    """SD's and SDXL's tiny UNets cut into 1 to 5 stages (laionkit/families/unet_stages.py), each stage's output
    tuple fed to the next: the last stage's output is UNet2DConditionModel's, whatever the cut."""
    from diffusers import UNet2DConditionModel

    from laionkit.families import get_family, unet_stages

    spec = get_family(family)
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config({**spec.configs["tiny"], "cross_attention_dim": 32}).eval()
    sample, timestep = torch.randn(2, 4, size, size), torch.tensor([10, 900])
    cond = {"encoder_hidden_states": torch.randn(2, 77, 32)}
    if family == "sdxl":
        width = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        cond["added_cond_kwargs"] = {"text_embeds": torch.randn(2, width), "time_ids": torch.rand(2, 6) * 64}
    with torch.no_grad():
        want = unet(sample, timestep, **cond, return_dict=False)[0]
        units = unet_stages.blocks(unet)
        for count in range(1, len(units) + 1):
            bounds = balance([1.0] * len(units), count)
            first, every = unet_stages.inputs(sample, timestep, cond)
            for n, (a, b) in enumerate(bounds):
                first = unet_stages.stage(unet, units[a:b], n == 0, n == count - 1)(*first, **every)
            torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5, msg=f"{count} stages")


def test_two_stages_killed_and_resumed_and_four_stages_train_as_one_process(deep_flux, single, tmp_path):
    """2 stages (1F1B) killed with -9 as their step-2 checkpoint lands, then resumed, and 4 stages (GPipe):
    each step's loss, gradient norm and the exported transformer are the single process's; the export (the
    stages merged) loads in FluxPipeline in a fresh interpreter."""
    two = tmp_path / "two"
    command = torchrun(2, train_args(deep_flux, two, "--pipeline-stages", "2"))
    process = subprocess.Popen(command, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.time() + 300
    while not (two / "checkpoints" / "step-00000002").is_dir() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(process.pid, 9)
    process.wait()
    assert not (two / "transformer").exists(), "killed too late: the run already finished"
    launched(command + ["--resume", "latest"])
    assert_trained_alike(single["full"], two)
    assert sorted(json.loads(line).get("pipeline_bubble", -1) >= 0
                  for line in (two / "metrics.jsonl").read_text().splitlines()) == [True] * 4

    four = tmp_path / "four"
    launched(torchrun(4, train_args(deep_flux, four, "--pipeline-stages", "4", "--pipeline-schedule", "gpipe")))
    assert_trained_alike(single["full"], four)

    loads = ("import sys, torch; from diffusers import FluxPipeline; pipe = FluxPipeline.from_pretrained(sys.argv[1]); "
             "print(sum(p.numel() for p in pipe.transformer.parameters()))")
    result = subprocess.run([sys.executable, "-c", loads, str(four / "pipeline")], capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) > 0


def test_lora_interleaved_stages_train_as_one_process(deep_flux, single, tmp_path):
    """LoRA on 2 ranks with two stages each (interleaved 1F1B, 4 stages), activation checkpointing inside the
    stages: the losses and the exported adapters are the single process's."""
    run = tmp_path / "lora"
    launched(torchrun(2, train_args(deep_flux, run, *LORA, "--pipeline-stages", "2",
                                    "--pipeline-schedule", "interleaved-1f1b", "--checkpointing", "blocks")))
    assert_trained_alike(single["lora"], run, "lora", "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize(("more", "says"), [
    (("--ema",), "--pipeline-stages 2 with --ema: not built"),
    (("--lora-rank", "4", "--lora-dropout", "0.1"), "with --lora-dropout: not built"),
    (("--pipeline-stages", "0"), "--pipeline-stages 0: must be >= 1"),
    (("--grad-accum", "1"), "--pipeline-schedule 1f1b with --pipeline-stages 2 takes --grad-accum micro-batches >= "),
])
def test_what_does_not_compose_is_refused_in_one_line(deep_flux, tmp_path, more, says):
    result = run_cli(*train_args(deep_flux, tmp_path / "run", "--pipeline-stages", "2", *more), check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert says in result.stderr and "Traceback" not in result.stderr


def test_a_family_without_a_cut_and_too_few_ranks_are_refused(deep_flux, tmp_path):
    """A family whose denoiser has no pipeline cut (PixArt) is refused in one line; a Flux run on fewer ranks
    than stages is refused before it trains."""
    from laionkit.common import LaionkitError
    from laionkit.families import get_family

    with pytest.raises(LaionkitError, match="family pixart's denoiser has no pipeline cut"):
        get_family("pixart").cut()
    flux = run_cli(*train_args(deep_flux, tmp_path / "flux", "--pipeline-stages", "2"), check=False)
    assert flux.returncode == 2 and "not a multiple of 2" in flux.stderr and "Traceback" not in flux.stderr


def test_sharding_inside_a_stage_is_refused_in_one_line(deep_flux, tmp_path):
    """An FSDP launch (train/fsdp.yaml, CPU ranks) with --pipeline-stages: refused before it trains, not run as a
    pipeline without the sharding it was launched for."""
    latents, model = deep_flux
    command = accelerate_launch("fsdp.yaml", "no", latents, tmp_path / "run", "--transformer", model,
                                "--max-steps", "1", "--grad-accum", "2", "--pipeline-stages", "2")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert result.returncode != 0
    assert "--pipeline-stages under a FSDP launch: sharding inside a stage is not built" in result.stderr


def test_sd3_two_stages_train_as_one_process(flow_latents, tmp_path):
    """SD3 (from scratch, its joint blocks cut in two; the last stage's patch tokens against the target laid out
    alike): the losses and the exported transformer are the single process's."""
    sd3 = flow_latents("sd3").latents
    args = ["train", str(sd3), "--transformer-config", "tiny", *FLAGS]
    reference, run = tmp_path / "single", tmp_path / "two"
    run_cli(*args, "--output", reference)
    launched(torchrun(2, [*args, "--output", str(run), "--pipeline-stages", "2"]))
    assert_trained_alike(reference, run)


@pytest.fixture(scope="module")
def sdxl(flow_latents, tmp_path_factory) -> tuple[Path, Path]:
    """(the sdxl latents, its tiny pipeline folder with a UNet of 16 norm groups). With one channel per group (the
    tiny UNet's 32 groups of its 32-channel blocks), the norm after a resnet's conv1 removes that conv's bias and
    the time projection's: their gradients are rounding noise, which Adam scales up to full steps."""
    import shutil

    from diffusers import UNet2DConditionModel

    from laionkit.families.sdxl import TINY_UNET_CONFIG

    made = flow_latents("sdxl")
    model = tmp_path_factory.mktemp("sdxl-16") / "model"
    shutil.copytree(made.model, model, ignore=shutil.ignore_patterns("unet"))
    torch.manual_seed(0)
    UNet2DConditionModel.from_config({**TINY_UNET_CONFIG, "norm_num_groups": 16}).save_pretrained(model / "unet")
    return made.latents, model


def test_sdxl_unet_cut_in_two_and_four_stages_trains_as_one_process(sdxl, tmp_path):
    """SDXL's UNet (DDPM, its skip residuals and added conditioning handed on between stages; its 2 down, mid and
    2 up blocks cut in 2 and, under GPipe, 4 stages; min-SNR weights travel with the targets): the losses and the
    exported UNet are the single process's, and the export loads in StableDiffusionXLPipeline."""
    latents, model = sdxl
    args = ["train", str(latents), "--unet", str(model), *FLAGS, "--snr-gamma", "5"]
    reference, two, four = tmp_path / "single", tmp_path / "two", tmp_path / "four"
    run_cli(*args, "--output", reference)
    launched(torchrun(2, [*args, "--output", str(two), "--pipeline-stages", "2"]))
    assert_trained_alike(reference, two, "unet", atol=1e-5)
    launched(torchrun(4, [*args, "--output", str(four), "--pipeline-stages", "4", "--pipeline-schedule", "gpipe"]))
    assert_trained_alike(reference, four, "unet", atol=1e-5)  # a weight's gradient summed over 4 stages
    loads = ("import sys; from diffusers import StableDiffusionXLPipeline; "
             "print(StableDiffusionXLPipeline.from_pretrained(sys.argv[1]).unet.config.addition_embed_type)")
    result = subprocess.run([sys.executable, "-c", loads, str(four / "pipeline")], capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert result.returncode == 0 and result.stdout.split()[-1] == "text_time", result.stderr[-2000:]


def test_pipelines_replicated_and_resumed_onto_more_train_as_data_parallel_ranks(deep_flux, tmp_path):
    """2 stages x 1 replica stopped after step 1, resumed as 2 stages x 2 replicas (4 ranks) for steps 2 and 3:
    each replica's stages load the first replica's parts, the replicas split the data, draw their noise and
    average their gradients as data-parallel ranks do, so the run is 1 process resumed elastically on 2 DDP
    ranks (same losses, same weights); every sample of each epoch is trained once."""
    flags = [*FLAGS[:FLAGS.index("--max-steps")], "--record-keys"]
    latents, model = deep_flux
    args = ["train", str(latents), "--transformer", str(model), *flags]
    ddp, pipelined = tmp_path / "ddp", tmp_path / "pipelined"
    run_cli(*args, "--output", ddp, "--max-steps", "1")
    launched(torchrun(2, [*args, "--output", str(ddp), "--max-steps", "3", "--resume", "latest"]))
    launched(torchrun(2, [*args, "--output", str(pipelined), "--max-steps", "1", "--pipeline-stages", "2"]))
    launched(torchrun(4, [*args, "--output", str(pipelined), "--max-steps", "3", "--pipeline-stages", "2",
                          "--resume", "latest"]))
    assert_trained_alike(ddp, pipelined, steps=3)
    seen = []  # the first stage's ranks (0, and 2 once resumed): a replica's ranks read the same batches
    for path in sorted((pipelined / "seen").glob("rank-*.jsonl")):
        if int(path.stem.split("-")[1]) % 2 == 0:
            for record in map(json.loads, filter(None, path.read_text().splitlines())):
                seen += zip(record["keys"], record["epochs"])
    assert len(seen) == len(set(seen))  # 4 samples in step 1, then 8 a step (2 replicas): 8 + 8 + 4 of 3 epochs
    assert sorted(collections.Counter(epoch for _, epoch in seen).items()) == [(0, 8), (1, 8), (2, 4)]


def test_lora_on_a_quantized_base_in_two_stages_trains_as_one_process(deep_flux, tmp_path):
    """LoRA on an nf4 base (--base-dtype, laionkit/trainer/quantized_base.py): each stage holds its blocks'
    linears quantized; the losses and the exported adapters are the single nf4 process's."""
    reference, run = tmp_path / "single", tmp_path / "two"
    run_cli(*train_args(deep_flux, reference, *LORA, "--base-dtype", "nf4"))
    launched(torchrun(2, train_args(deep_flux, run, *LORA, "--base-dtype", "nf4", "--pipeline-stages", "2")))
    assert_trained_alike(reference, run, "lora", "pytorch_lora_weights.safetensors")


def test_full_bf16_stages_train_as_one_full_bf16_process(deep_flux, tmp_path):
    """--full-bf16 (weights, gradients and AdamW's state in bf16) in 2 stages: every loss and the exported bf16
    weights are the single --full-bf16 process's; the gradient norm within bf16's rounding (one process takes the
    norm of bf16 gradients in bf16, the stages sum their parts' squares in fp32)."""
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    bf16 = ("--mixed-precision", "bf16", "--full-bf16")
    run_cli(*train_args(deep_flux, one, *bf16))
    launched(torchrun(2, train_args(deep_flux, two, *bf16, "--pipeline-stages", "2")))
    want, got = metrics(one), metrics(two)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-2), step
    before, after = (load_file(path / "transformer" / "diffusion_pytorch_model.safetensors") for path in (one, two))
    assert before.keys() == after.keys() and {t.dtype for t in after.values()} == {torch.bfloat16}
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=key)
