"""Elastic resume under FSDP2: a checkpoint of 2 sharded ranks resumes on 3 ranks (the model and AdamW
state resharded by torch.distributed.checkpoint), with the checkpoint writers users get (accelerate's
sharded state dict, the default) and laionkit's DCP writer; with the DCP writer the run goes on through the
interrupted epoch, whose keys are trained once, none twice (the epoch's rest comes from the rank records, which
both writers write alike; tests/test_elastic.py shows the same under DDP, with signals and buckets)."""

from __future__ import annotations

import collections

import pytest
from fixtures import accelerate_launch, finish
from safetensors.torch import load_file
from test_elastic import TINY, keys_of, trained, widen


def launch(ranks: int, latents, run, *args) -> list[str]:
    command = accelerate_launch("fsdp.yaml", "no", latents, run, *TINY, *args)
    command[command.index("--num_processes") + 1] = str(ranks)
    return command


@pytest.mark.parametrize("writer", ["accelerate", "sync"])
def test_fsdp_checkpoint_of_two_ranks_resumes_on_three_with_its_weights_and_the_epochs_rest(writer, latent_shards,
                                                                                           tmp_path):
    latents = widen(latent_shards, range(2), tmp_path / "latents")  # 16 samples
    run = tmp_path / "run"
    args = ("--checkpoint-writer", writer, "--checkpoint-every", 2)
    finish(launch(2, latents, run, "--batch-size", 2, "--max-steps", 2, *args))  # 8 of 16 samples trained
    exported = load_file(run / "unet" / "diffusion_pytorch_model.safetensors")
    # 3 ranks, batch 1, --max-steps at the checkpoint's step: loads and exports without training
    (run / "unet").rename(tmp_path / "unet-2-ranks")
    result = finish(launch(3, latents, run, "--batch-size", 1, "--max-steps", 2, "--resume", "latest", *args))
    assert "elastic resume at step 2" in result.stdout and "world_size 2 -> 3" in result.stdout, result.stdout[-3000:]
    resharded = load_file(run / "unet" / "diffusion_pytorch_model.safetensors")
    assert resharded.keys() == exported.keys()
    assert all(resharded[name].equal(exported[name]) for name in exported)
    if writer == "accelerate":  # the epoch's rest comes from the rank records, which both writers write alike
        return
    # on to the end of epoch 0 and into epoch 1 on 3 ranks: every sample of epoch 0 trained once
    finish(launch(3, latents, run, "--batch-size", 1, "--max-steps", 6, "--resume", "latest", *args))
    epochs = collections.defaultdict(collections.Counter)
    for key, epoch in trained(run):
        epochs[epoch][key] += 1
    assert set(epochs[0]) == keys_of(latents) and set(epochs[0].values()) == {1}


@pytest.mark.parametrize(("kind", "written_by", "ranks", "refused"), [
    ("DEEPSPEED", 2, 3, True), ("DistributedType.DEEPSPEED", 8, 4, True), ("DEEPSPEED", 2, 2, False),
    ("FSDP", 2, 3, False), ("MULTI_GPU", 4, 1, False), ("MULTI_CPU", 2, 3, False)])
def test_a_deepspeed_checkpoint_is_refused_on_another_world_size_before_it_loads(kind, written_by, ranks, refused,
                                                                                  tmp_path):
    from laionkit.common import LaionkitError
    from laionkit.trainer.checkpoint import check_world_size

    if not refused:
        check_world_size(tmp_path, kind, written_by, ranks)
        return
    with pytest.raises(LaionkitError, match=rf"written by {written_by} DeepSpeed rank\(s\), resumed on {ranks}"):
        check_world_size(tmp_path, kind, written_by, ranks)
