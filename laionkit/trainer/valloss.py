"""A deterministic validation loss: `laionkit train --val-latents DIR` writes ``val_loss`` and
``val_loss_strata`` to metrics.jsonl.

The training loss is noisy (fresh noise, timesteps and latent draws every step), so two checkpoints or
two runs cannot be compared on it. Here every sample of a fixed set (the first ``--val-samples`` of DIR:
shards in name order, samples in tar order) gets fixed draws from generators seeded by the sample key
and --seed, never by the rank: the posterior sample of its latent, and its noise.

Noise levels are stratified (``--val-strata N``, default 8), as the SD3 paper, MLPerf's Flux benchmark
and torchtitan's Flux validation score a run: every sample is evaluated at every stratum k = 0..N-1, at
``u_k = (k + 0.5) / N``, with its own noise per (sample, stratum) (a generator seeded by --seed, the key
and k). ``u`` becomes the timestep the way training maps it: DDPM ``floor(u * T)``, flow matching sigma
``u`` through the run's shift (static, or Flux's per-resolution one), so stratum 0 is the least noisy.
Each stratum's loss is the mean over the samples and ``val_loss`` the mean over the strata: the loss
varies far more between noise levels than between samples, so fixed levels, not one random level per
sample, make two numbers comparable, and the per-stratum values show which levels a change moved.
(torchtitan evaluates every sample at all 8 midpoints, as here; MLPerf gives sample i the level
``(i mod 8) / 8`` instead, one forward per sample.) N strata cost N forwards per sample. N = 1 is the
midpoint alone. ``--val-strata 0`` keeps the older unstratified loss: one forward per sample at a fixed
uniform ``u`` drawn from the sample's own generator after its latent and noise; ``val_loss_strata`` is
then left out.

The loss is the plain MSE to the objective's target (no min-SNR or flow weighting, so runs with other
weightings compare), summed with its count per stratum on every rank over every world-th (sample,
stratum) pair and all-reduced. The values are therefore the same for any number of ranks or --workers
(up to float summation order), and change only when the weights do. Ranks run the same number of
forward passes (short ranks pad with masked pairs), which FSDP needs. Latents of several shapes
(``encode --buckets``) are batched within their shape: the pairs of each shape, samples in key order,
are split over the ranks as above, so a sample's loss and its rank do not depend on the other shapes.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laionkit.common import LaionkitError
from laionkit.trainer.objective import draw_latents


@dataclass(frozen=True)
class ValSet:
    keys: tuple[str, ...]
    latents: tuple[torch.Tensor, ...]  # N of (C, h, w) fp32, scaled as the denoiser sees them; (h, w) per bucket
    noise: tuple[torch.Tensor, ...]  # N of (C, h, w) fp32
    u: torch.Tensor  # (N,) fp64 in [0, 1)
    cond: dict[str, torch.Tensor]  # every stored conditioning member (decode's keys but key and moments)
    strata: int = 0  # --val-strata; 0: noise and u above (one level per sample), else stratum_noise at strata_u
    seed: int = 0  # --seed, for stratum_noise



def every(config) -> int:
    """--val-every, else --validate-every, else --checkpoint-every."""
    return config.val_every or config.validate_every or config.checkpoint_every


def sample_generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"laionkit-val/{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def stratum_noise(seed: int, key: str, stratum: int, shape) -> torch.Tensor:
    """The fixed noise of one (sample, stratum): the same for any N, rank or batch."""
    return torch.randn(tuple(shape), generator=sample_generator(seed, f"{key}/stratum-{stratum}"))


def strata_u(strata: int) -> torch.Tensor:
    """The strata's midpoints (k + 0.5) / N in [0, 1), fp64, increasing noise."""
    return (torch.arange(strata, dtype=torch.float64) + 0.5) / strata


def load(config, data) -> ValSet:
    """The fixed samples and their fixed draws, on the CPU; DIR must come from the training data's VAE
    and text encoder (same latent and text shapes, scaling and shift)."""
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import Unit, decode, pad_stack, read_unit

    val = open_latents(config.val_latents)
    ours = (data.moments_shape, data.text_shape, data.scaling_factor, data.shift_factor)
    theirs = (val.moments_shape, val.text_shape, val.scaling_factor, val.shift_factor)
    if (val.latents_mean, val.latents_std) != (data.latents_mean, data.latents_std):
        raise LaionkitError(f"--val-latents {config.val_latents}: its VAE's latents_mean / latents_std differ from the "
                            "training latents': encode it with the same VAE")
    if val.online != data.online:
        raise LaionkitError(f"--val-latents {config.val_latents}: its text is {'online' if val.online else 'stored'}, "
                            f"the training latents' {'online' if data.online else 'stored'}: encode both with the "
                            "same --text")
    if ours != theirs:
        raise LaionkitError(f"--val-latents {config.val_latents}: latents {theirs[0]}, text {theirs[1]}, scaling "
                            f"{theirs[2]}, shift {theirs[3]} differ from the training latents' {ours}: encode "
                            "it with the same models and resolution")
    keys, latents, noise, u, cond = [], [], [], [], {}
    samples = itertools.chain.from_iterable(read_unit(Unit(shard)) for shard in val.shards)
    for raw in itertools.islice(samples, config.val_samples):
        sample = decode(raw)
        generator = sample_generator(config.seed, sample["key"])
        latent = draw_latents(sample["moments"][None], data.deterministic, generator)[0]  # no draw: deterministic VAE
        keys.append(sample["key"])
        latents.append(data.normalize(latent))
        noise.append(torch.randn(latent.shape, generator=generator))
        u.append(torch.rand((), generator=generator, dtype=torch.float64))
        for name, value in sample.items():
            if name not in ("key", "moments"):
                cond.setdefault(name, []).append(value)
    if not keys:
        raise LaionkitError(f"--val-latents {config.val_latents}: no samples")
    return ValSet(tuple(keys), tuple(latents), tuple(noise), torch.stack(u),
                  {name: pad_stack(values) for name, values in cond.items()},  # trimmed text padded
                  config.val_strata, config.seed)


@torch.no_grad()
def evaluate(accelerator, forward, val: ValSet, batch_size: int, input_dtype: torch.dtype,
             noise_scheduler=None, flow_shift: float | Callable[[int, int], float] | None = None,
             timestep_scale: float = 1000.0) -> dict:
    """The loss over ``val`` across all ranks, as metrics.jsonl records it: ``val_loss`` (the mean over
    the strata of each stratum's mean over the samples) and ``val_loss_strata`` (the N means, increasing
    noise; absent for ``val.strata == 0``). ``forward(noisy, timesteps, cond)`` is the denoiser's
    prediction, ``cond`` the batch's stored conditioning by member name (floats in ``input_dtype``);
    DDPM uses ``noise_scheduler``, flow matching (``noise_scheduler=None``) ``flow_shift`` and passes
    sigma x ``timestep_scale`` as the timestep (SD3: 1000, Flux: 1, as their pipelines do). ``flow_shift``
    is a number or, where it depends on the resolution (Flux's dynamic shift), a function of (h, w)."""
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    total = torch.zeros(max(val.strata, 1), 2, device=device, dtype=torch.float64)  # per stratum: loss sum, count
    for group in shape_groups(val):
        pairs = [(i, k) for i in group for k in range(max(val.strata, 1))]  # (sample, stratum)
        mine = pairs[rank::world]
        slots = math.ceil(len(pairs) / world)
        index = mine + [pairs[0]] * (slots - len(mine))  # padding: the shape's first pair, masked out
        mask = torch.tensor([1.0] * len(mine) + [0.0] * (slots - len(mine)))
        for start in range(0, slots, batch_size):
            total += _batch_loss(forward, val, index[start:start + batch_size], mask[start:start + batch_size],
                                 device, input_dtype, noise_scheduler, flow_shift, timestep_scale)
    total = accelerator.reduce(total, "sum")  # float64: 1 and N ranks differ only in summation order
    means = (total[:, 0] / total[:, 1]).tolist()
    if not val.strata:
        return {"val_loss": means[0]}
    return {"val_loss": math.fsum(means) / len(means), "val_loss_strata": means}


def shape_groups(val: ValSet) -> list[list[int]]:
    """The samples' indices by latent shape, shapes in the order they first occur, indices in key order."""
    groups: dict[tuple, list[int]] = {}
    for index, latent in enumerate(val.latents):
        groups.setdefault(tuple(latent.shape), []).append(index)
    return list(groups.values())


def _batch_loss(forward, val: ValSet, chosen: list[tuple[int, int]], mask: torch.Tensor, device, input_dtype,
                noise_scheduler, flow_shift, timestep_scale) -> torch.Tensor:
    """(loss sum, count) per stratum of one single-shape batch of (sample, stratum) pairs, its masked
    (padding) pairs counting zero."""
    from laionkit.families import flow

    samples = [i for i, _ in chosen]
    strata = torch.tensor([k for _, k in chosen])
    x0 = torch.stack([val.latents[i] for i in samples]).to(device)
    if val.strata:
        noise = torch.stack([stratum_noise(val.seed, val.keys[i], k, val.latents[i].shape) for i, k in chosen])
        u = strata_u(val.strata)[strata]
    else:
        noise, u = torch.stack([val.noise[i] for i in samples]), val.u[torch.tensor(samples)]
    noise, u = noise.to(device), u.to(device)
    samples = torch.tensor(samples)
    cond = {name: v[samples].to(device, input_dtype if v.is_floating_point() else v.dtype)
            for name, v in val.cond.items()}
    if noise_scheduler is not None:
        steps = noise_scheduler.config.num_train_timesteps
        timesteps = (u * steps).long().clamp(max=steps - 1)
        noisy = noise_scheduler.add_noise(x0, noise, timesteps)
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        else:
            target = noise_scheduler.get_velocity(x0, noise, timesteps)
    else:
        if callable(flow_shift):
            flow_shift = flow_shift(*x0.shape[2:])
        sigmas = flow.shift_sigmas(u, flow_shift) if flow_shift else u
        noisy, target = flow.interpolate(x0, noise, sigmas.float()), flow.velocity_target(x0, noise)
        timesteps = sigmas.float() * timestep_scale
    prediction = forward(noisy.to(input_dtype), timesteps, cond)
    losses = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    weights = mask.to(device, torch.float64)
    per_pair = torch.stack([losses.double() * weights, weights], dim=1)
    return torch.zeros(max(val.strata, 1), 2, device=device, dtype=torch.float64).index_add_(
        0, strata.to(device), per_pair)

