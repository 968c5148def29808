"""Pipeline parallelism (laionkit/trainer/pipeline_parallel.py) for real: torchrun's CPU ranks (gloo) train a tiny
Flux of 2 double- and 4 single-stream blocks cut into 2 and 4 stages, full and LoRA, under each schedule, a tiny
SD3 cut in two, and pipelines replicated 2 x 2; the losses and the exported weights are the single-process (or
DDP) run's. A run killed with -9 resumes exactly; the export loads in FluxPipeline in a fresh interpreter; what
does not compose is refused in one line."""

from __future__ import annotations

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
                         name: str = "diffusion_pytorch_model.safetensors") -> None:
    """Every step's loss and the exported weights are the reference's, within float tolerance."""
    from safetensors.torch import load_file

    want, got = metrics(reference), metrics(run)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    before, after = (load_file(path / folder / name) for path in (reference, run))
    assert before.keys() == after.keys()
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=1e-6, msg=key)


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


def test_pipelines_replicated_train_as_data_parallel_ranks(deep_flux, tmp_path):
    """2 pipelines of 2 stages (4 ranks) train as 2 DDP ranks do: the replicas split the data as DDP's ranks
    do, draw their noise as they do and average their gradients."""
    ddp, replicated = tmp_path / "ddp", tmp_path / "replicated"
    launched(torchrun(2, train_args(deep_flux, ddp)))
    launched(torchrun(4, train_args(deep_flux, replicated, "--pipeline-stages", "2")))
    assert_trained_alike(ddp, replicated)


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


def test_a_family_without_a_cut_and_too_few_ranks_are_refused(latent_shards, deep_flux, tmp_path):
    """SD's UNet (skip connections across its down and up blocks) has no pipeline cut; a Flux run on fewer
    ranks than stages is refused before it trains."""
    sd = run_cli("train", latent_shards, "--output", tmp_path / "sd", "--unet-config", "tiny", *FLAGS,
                 "--pipeline-stages", "2", check=False)
    assert sd.returncode == 2 and "has no pipeline cut" in sd.stderr and "Traceback" not in sd.stderr
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
