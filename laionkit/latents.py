"""Stream latent shards (docs/FORMATS.md §3) into training batches: split, shuffled per epoch, resumable.

Every consumer (one DataLoader worker of one rank) owns a fixed set of *units* and reads them as an
infinite stream, one pass per epoch, each epoch in its own seeded order. Training length is counted
in steps, so every rank runs the same number of steps whatever its share of the data: a rank whose
shards are smaller simply starts its next epoch sooner, and no rank ever waits for data that isn't
there. The stream is a pure function of (seed, rank, worker, epoch), so the data cursor is one number
per rank (batches consumed) and resuming means skipping that many samples without decoding them.

Units. With at least as many shards as consumers, shard *i* goes to consumer *i mod n*
(``laionkit.common.split``). With fewer shards than consumers, consumer *c* reads shard *c mod S* and
keeps every *m*-th sample of it, where *m* is the number of consumers sharing that shard, so consumers
still see disjoint samples. The same rule splits a rank's units over its workers. Invariant: for any
number of consumers, the slices of each shard partition its samples exactly.
"""

from __future__ import annotations

import io
import itertools
import json
import random
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from laionkit.common import LaionkitError, Rank, split
from laionkit.common.tars import count_samples

# The members a training sample needs; others are skipped unread. Extra text tensors of a model family
# (SDXL's pooled.npy) and the json's size fields (SDXL's time_ids) travel in the batch when present.
MOMENTS, TEXT = "moments.npy", "text.npy"
EXTRA_TENSORS = ("pooled",)
SIZE_FIELDS = ("original_size", "crop_top_left", "target_size")


@dataclass(frozen=True)
class Unit:
    """Samples ``offset, offset + stride, ...`` (0-based, in tar order) of one shard."""

    shard: str
    offset: int = 0
    stride: int = 1

    def narrow(self, part: int, parts: int) -> Unit:
        """Part ``part`` of ``parts`` disjoint interleaved slices of this unit."""
        return replace(self, offset=self.offset + self.stride * part, stride=self.stride * parts)


def partition(units: Sequence[Unit], consumer: int, consumers: int) -> list[Unit]:
    """The units consumer ``consumer`` of ``consumers`` reads (see the module docstring for the rule).
    Every consumer gets samples as long as every unit holds some: train leaves empty shards out."""
    if len(units) >= consumers:
        return split(units, Rank(consumer, consumers, "partition"))
    if not units:
        return []
    shared = units[consumer % len(units)]
    sharers = len(range(consumer % len(units), consumers, len(units)))
    return [shared.narrow(consumer // len(units), sharers)]


def shard_paths(latents: Path) -> list[Path]:
    shards = sorted(latents.glob("*.tar"))
    if not shards:
        raise LaionkitError(f"no latent shards (*.tar) in {latents}")
    return shards


def unit_length(unit: Unit, shard_sizes: dict[str, int]) -> int:
    return len(range(unit.offset, shard_sizes[unit.shard], unit.stride))


def read_unit(unit: Unit) -> Iterator[dict]:
    """Raw (undecoded) samples of one unit, in tar order."""
    opened = wds.tariterators.url_opener([{"url": unit.shard}])
    files = wds.tariterators.tar_file_expander(
        opened, select_files=lambda name: name.endswith((MOMENTS, TEXT, ".json",
                                                         *(f".{key}.npy" for key in EXTRA_TENSORS)))
    )
    samples = wds.tariterators.group_by_keys(files)
    return itertools.islice(samples, unit.offset, None, unit.stride)


def decode(sample: dict) -> dict:
    for member in (MOMENTS, TEXT):
        if member not in sample:
            raise LaionkitError(f"{sample['__url__']}: sample {sample['__key__']} has no .{member} member")
    decoded = {
        "key": sample["__key__"],
        "moments": torch.from_numpy(np.load(io.BytesIO(sample[MOMENTS]))),
        "text": torch.from_numpy(np.load(io.BytesIO(sample[TEXT]))),
    }
    for key in EXTRA_TENSORS:
        if f"{key}.npy" in sample:
            decoded[key] = torch.from_numpy(np.load(io.BytesIO(sample[f"{key}.npy"])))
    if "json" in sample:
        try:
            record = json.loads(sample["json"])
            sizes = {name: torch.tensor(record[name], dtype=torch.long) for name in SIZE_FIELDS}
        except (ValueError, KeyError, TypeError):
            sizes = {}  # older or hand-made latents: families that need these fields say so
        decoded.update(sizes)
    return decoded


def epoch_seed(seed: int, epoch: int, rank: int, worker: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, rank, worker]).generate_state(1)[0])


def epoch_samples(units: Sequence[Unit], rng: random.Random, shuffle_buffer: int) -> Iterator[dict]:
    """One pass over ``units``: unit order permuted, then samples mixed through a shuffle buffer."""
    order = list(units)
    rng.shuffle(order)
    samples = itertools.chain.from_iterable(read_unit(unit) for unit in order)
    if shuffle_buffer <= 1:
        return samples
    return wds.filters.shuffle(bufsize=shuffle_buffer, initial=shuffle_buffer, rng=rng)(samples)


@dataclass(frozen=True)
class StreamLayout:
    """Everything the order of samples depends on; exact resume needs the same layout."""

    shards: tuple[str, ...]
    rank: int
    world_size: int
    workers: int
    batch_size: int
    seed: int
    shuffle_buffer: int

    @property
    def consumers(self) -> int:
        return max(self.workers, 1)


class LatentStream(IterableDataset):
    """One rank's infinite sample stream, starting after ``batches_done`` batches (the data cursor)."""

    def __init__(self, layout: StreamLayout, batches_done: int = 0) -> None:
        self.layout = layout
        self.batches_done = batches_done
        units = [Unit(shard) for shard in layout.shards]
        self.rank_units = partition(units, layout.rank, layout.world_size)

    def __iter__(self) -> Iterator[dict]:
        layout = self.layout
        info = get_worker_info()
        # The DataLoader takes batches from its K workers strictly in turn, starting with worker 0, so
        # batch i comes from stream i mod K. A loader restarted after B batches must therefore give its
        # worker w the stream (w + B) mod K, which has delivered ceil((B - stream) / K) batches so far.
        worker = ((info.id if info is not None else 0) + self.batches_done) % layout.consumers
        units = partition(self.rank_units, worker, layout.consumers)
        batches = max(0, -(-(self.batches_done - worker) // layout.consumers))
        skip = batches * layout.batch_size
        first_epoch = 0
        if skip:
            sizes = {unit.shard: count_samples(unit.shard) for unit in units}
            length = sum(unit_length(unit, sizes) for unit in units)
            if length == 0:
                raise self._starved(worker)
            first_epoch, skip = divmod(skip, length)
        for epoch in itertools.count(first_epoch):
            rng = random.Random(epoch_seed(layout.seed, epoch, layout.rank, worker))
            produced = 0
            for sample in itertools.islice(epoch_samples(units, rng, layout.shuffle_buffer), skip, None):
                produced += 1
                yield decode(sample)
            if produced == 0 and skip == 0:
                raise self._starved(worker)
            skip = 0

    def _starved(self, worker: int) -> LaionkitError:
        layout = self.layout
        return LaionkitError(
            f"rank {layout.rank} worker {worker} got no samples from {len(layout.shards)} latent shards "
            f"({layout.world_size} ranks x {layout.consumers} workers): are some shards empty?"
        )


# The signals a scheduler or launcher sends to stop a run (docker stop, Kubernetes, Slurm, torchrun
# forwarding them, a closed terminal): the trainer turns each into a checkpoint and an exit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _ignore_interrupt(_worker: int) -> None:
    """Workers leave the stop signals to the trainer, which checkpoints first.

    torchrun, a Ctrl-C and a signal to a container or Slurm step reach the whole process group, workers
    included; a worker that died of it made the trainer fail with "DataLoader worker ... killed by signal"
    before it could checkpoint. Ignoring is safe: the DataLoader ends its workers through their index
    queues at shutdown, a worker exits by itself once its trainer is gone (torch's manager watchdog), and
    SIGKILL, which a launcher escalates to, still ends it.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def latent_loader(layout: StreamLayout, batches_done: int = 0, pin_memory: bool = False) -> DataLoader:
    """Batches of ``{"key": [str], "moments": (B, 2C, h, w) fp16, "text": (B, T, D) fp16}``."""
    return DataLoader(
        LatentStream(layout, batches_done),
        batch_size=layout.batch_size,
        num_workers=layout.workers,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_interrupt if layout.workers else None,
        persistent_workers=False,
        prefetch_factor=4 if layout.workers else None,
    )
