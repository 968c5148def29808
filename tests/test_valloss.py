"""The deterministic validation loss: one number for fixed weights, whatever the ranks, batch or workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, run_script_in_process

# The validation loss of one fixed tiny UNet, under 1 process or torchrun: DDPM, then flow matching, then
# DDPM again after one weight changed.
EVALUATE = """
import json, sys, torch
from pathlib import Path
from accelerate import Accelerator
from laionkit.trainer import valloss
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.data import open_latents
from laionkit.trainer.model import build_unet
from laionkit.trainer.objective import load_noise_scheduler

latents, batch = Path(sys.argv[1]), int(sys.argv[2])
config = TrainConfig(latents=latents, output=Path("unused"), unet_config="tiny", max_steps=1,
                     val_latents=latents, val_samples=7, seed=3)
accelerator = Accelerator(cpu=True)
data = open_latents(latents)
torch.manual_seed(0)
unet = build_unet(config, data).eval()
val = valloss.load(config, data)
forward = lambda noisy, t, cond: unet(noisy, t, cond["text"], return_dict=False)[0]
found = [valloss.evaluate(accelerator, forward, val, batch, torch.float32, load_noise_scheduler(config)),
         valloss.evaluate(accelerator, forward, val, batch, torch.float32, None, flow_shift=3.0)]
with torch.no_grad():
    unet.conv_in.weight.mul_(1.1)
found.append(valloss.evaluate(accelerator, forward, val, batch, torch.float32, load_noise_scheduler(config)))
if accelerator.is_main_process:
    print(json.dumps({"keys": list(val.keys), "losses": found}))
accelerator.end_training()  # destroys the process group: exiting with gloo's threads alive can abort a rank
"""


def _evaluate(script: Path, latents: Path, ranks: int, batch: int) -> dict:
    if ranks == 1:  # one process: this one
        result = run_script_in_process(script, latents, batch)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                    "29571"]
        result = subprocess.run([*launcher, str(script), str(latents), str(batch)], capture_output=True, text=True,
                                timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_one_and_two_ranks_give_the_same_validation_loss_which_follows_the_weights(latent_shards, tmp_path):
    script = tmp_path / "evaluate.py"
    script.write_text(EVALUATE)
    one = _evaluate(script, latent_shards, 1, 4)
    two = _evaluate(script, latent_shards, 2, 2)  # 7 samples: 4 + 3, the short rank pads a masked slot
    assert len(one["keys"]) == 7 and one["keys"] == sorted(one["keys"])  # the first 7, in shard order
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-6)
    ddpm, flow, changed = one["losses"]
    assert ddpm != pytest.approx(changed, rel=1e-4)  # the weights changed, so did the loss
    assert flow != pytest.approx(ddpm, rel=1e-4)


def test_val_loss_goes_to_metrics_and_a_resume_reproduces_it(latent_shards, tmp_path):
    args = ("--unet-config", "tiny", "--batch-size", "4", "--lr", "1e-3", "--log-with", "none", "--quiet",
            "--max-steps", "4", "--log-every", "3", "--checkpoint-every", "2", "--val-latents", latent_shards,
            "--val-every", "2")
    whole = tmp_path / "whole"
    run_cli("train", latent_shards, "--output", whole, *args, "--workers", "2")
    records = {r["step"]: r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [2, 3, 4]  # val steps are logged even off --log-every
    assert "val_loss" not in records[3]
    assert records[2]["val_samples"] == records[4]["val_samples"] == 8  # what the folder holds (< 64)
    assert records[2]["val_loss"] != pytest.approx(records[4]["val_loss"], rel=1e-4)

    # resumed: the same weights at step 4 give the same number
    resumed = tmp_path / "resumed"
    run_cli("train", latent_shards, "--output", resumed, *args, "--workers", "2", "--resume",
            whole / "checkpoints" / "step-00000002")
    got = {r["step"]: r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())}
    assert got[4]["val_loss"] == pytest.approx(records[4]["val_loss"], rel=1e-6)

    from laionkit.demo import plot_metrics

    plot_metrics(whole / "metrics.jsonl", tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 0

    bad = run_cli("train", latent_shards, "--output", tmp_path / "bad", "--unet-config", "tiny", "--max-steps", "1",
                  "--val-every", "2", check=False)
    assert bad.returncode == 2 and "--val-every and --val-samples need --val-latents" in bad.stderr


def test_bucketed_val_latents_batch_within_a_shape_and_give_one_value_for_any_ranks(bucket_latents, tmp_path):
    """--val-latents on bucketed latents stopped the run (torch.stack of unequal shapes); a batch now holds
    one shape, and 1 or 2 ranks, batch 4 or 2 or 1, give the same loss."""
    from laionkit.trainer import valloss
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.data import open_latents

    config = TrainConfig(latents=bucket_latents, output=tmp_path / "unused", unet_config="tiny", max_steps=1,
                         val_latents=bucket_latents, val_samples=7, seed=3)
    val = valloss.load(config, open_latents(bucket_latents))
    assert len(valloss.shape_groups(val)) >= 2, [tuple(x.shape) for x in val.latents]

    script = tmp_path / "evaluate.py"
    script.write_text(EVALUATE)
    one = _evaluate(script, bucket_latents, 1, 4)
    assert one["losses"] == pytest.approx(_evaluate(script, bucket_latents, 1, 1)["losses"], rel=1e-5)
    assert _evaluate(script, bucket_latents, 2, 2)["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert one["keys"] == list(val.keys)

    run = tmp_path / "run"
    run_cli("train", bucket_latents, "--output", run, "--unet-config", "tiny", "--batch-size", "2", "--log-with", "none",
            "--quiet", "--max-steps", "2", "--workers", "0", "--val-latents", bucket_latents, "--val-every", "2")
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["val_samples"] == 8 and record["val_loss"] > 0
