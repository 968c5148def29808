"""The order of a run's samples, epoch by epoch, over whatever consumers read them, and what a run has
trained of each epoch (bitmaps): a resume with another layout trains the untrained rest exactly once.

Sample ids. A run's shards, in the order the run first met them (the folder's name order; shards taken
later with --add-shards after them), number their samples 0..N-1: shard i holds ids ``offset[i] ..
offset[i] + count[i] - 1`` in tar order. Shard i takes part from epoch ``from_epoch[i]`` on, which never
decreases with i, so the ids of one epoch are always 0..size(e)-1.

Canonical order. Epoch e's samples: the shards taking part, permuted by a generator seeded with (seed, e),
each in tar order. The order is the sample's, not the rank's (mosaic streaming's idea): one global
order, partitioned over whatever consumers exist.

Partition. Consumer c of N (worker w of rank r is c = r * workers + w) reads, for epoch e, the c-th of N
contiguous chunks of the canonical order minus ``base[e]`` (the samples earlier layouts had trained when
this layout began); chunk sizes differ by at most one, so ranks hold equal work (DDP). The consumer reads
its chunk sequentially, mixes it through its shuffle buffer (draws seeded with (seed, e, c)), and only
then drops the samples in ``trained[e]``. Filtering after the shuffle is what makes a resume with the
same layout continue every consumer's sequence exactly (the untrained samples, bucket leftovers included,
come again in the same relative order); a resume with another layout sets base := trained, so the
untrained rest of every epoch in progress is split over the new consumers, each sample once.

Invariants: base[e] ⊆ trained[e]; every epoch before ``first`` is wholly trained; an epoch at or after
``first`` that has no bitmaps has base = trained = {}.
"""

from __future__ import annotations

import base64
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EpochBits:
    """One epoch's bitmaps over its sample ids (bool arrays of the epoch's size)."""

    base: np.ndarray
    trained: np.ndarray


@dataclass
class DataProgress:
    """What of each epoch the run has trained, over the ids of ``counts`` (samples per shard, id order)."""

    counts: tuple[int, ...]
    from_epoch: tuple[int, ...]
    first: int = 0  # every epoch before it is wholly trained
    epochs: dict[int, EpochBits] = field(default_factory=dict)

    @classmethod
    def fresh(cls, counts: Sequence[int], first: int = 0) -> DataProgress:
        return cls(tuple(int(n) for n in counts), (0,) * len(counts), first)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])

    def shards_in(self, epoch: int) -> int:
        """How many shards (the first ones, in id order) take part in ``epoch``."""
        return sum(1 for start in self.from_epoch if start <= epoch)

    def size(self, epoch: int) -> int:
        return int(self.offsets[self.shards_in(epoch)])

    def bits(self, epoch: int) -> EpochBits:
        if epoch not in self.epochs:
            size = self.size(epoch)
            self.epochs[epoch] = EpochBits(np.zeros(size, bool), np.zeros(size, bool))
        return self.epochs[epoch]

    def mark(self, epochs: Sequence[int], positions: Sequence[int]) -> None:
        """Samples trained: ``positions[i]`` of epoch ``epochs[i]``."""
        epochs, positions = np.asarray(epochs, np.int64), np.asarray(positions, np.int64)
        for epoch in np.unique(epochs):
            self.bits(int(epoch)).trained[positions[epochs == epoch]] = True

    def settle(self) -> None:
        """Move ``first`` past the epochs now wholly trained, forgetting their bitmaps."""
        while self.first in self.epochs and self.epochs[self.first].trained.all():
            del self.epochs[self.first]
            self.first += 1
        for epoch in [e for e in self.epochs if e < self.first]:
            del self.epochs[epoch]

    def started(self) -> int:
        """The first epoch nothing of which is trained yet (``first`` at the least)."""
        begun = [e for e, bits in self.epochs.items() if bits.trained.any()]
        return max(begun, default=self.first - 1) + 1

    def rebase(self) -> None:
        """A new layout begins: what is trained now is left out of its partition (base := trained)."""
        for bits in self.epochs.values():
            bits.base = bits.trained.copy()

    def add_shards(self, counts: Sequence[int]) -> int:
        """Shards appended after the known ones, taking part from the first epoch not yet begun (returned)."""
        joins = self.started()
        for epoch in [e for e in self.epochs if e >= joins]:
            del self.epochs[epoch]  # untouched (all zeros), and of the old size
        self.counts += tuple(int(n) for n in counts)
        self.from_epoch += (joins,) * len(counts)
        return joins

    def merge(self, reduce_max: Callable[[np.ndarray], np.ndarray]) -> None:
        """Union of every rank's ``trained`` (``reduce_max``: element-wise max over the ranks), then settle."""
        last = int(reduce_max(np.array([max(self.epochs, default=self.first - 1)], np.int64))[0])
        epochs = range(self.first, last + 1)
        if not epochs:
            return
        joined = reduce_max(np.concatenate([self.bits(e).trained.view(np.uint8) for e in epochs]))
        at = 0
        for epoch in epochs:
            bits = self.bits(epoch)
            bits.trained = joined[at:at + len(bits.trained)].astype(bool)
            at += len(bits.trained)
        self.settle()

    def record(self) -> dict:
        """JSON-able: counts, from_epoch, first and per epoch the bitmaps (np.packbits, zlib, base64)."""
        return {"counts": list(self.counts), "from_epoch": list(self.from_epoch), "first": self.first,
                "epochs": {str(e): {"base": _pack(b.base), "trained": _pack(b.trained)}
                           for e, b in sorted(self.epochs.items())}}

    @classmethod
    def from_record(cls, record: dict) -> DataProgress:
        progress = cls(tuple(record["counts"]), tuple(record["from_epoch"]), int(record["first"]))
        for epoch, bits in record["epochs"].items():
            size = progress.size(int(epoch))
            progress.epochs[int(epoch)] = EpochBits(_unpack(bits["base"], size), _unpack(bits["trained"], size))
        return progress


def _pack(bits: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes())).decode()


def _unpack(text: str, size: int) -> np.ndarray:
    packed = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8)
    return np.unpackbits(packed, count=size).astype(bool)


def order_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def shuffle_seed(seed: int, epoch: int, consumer: int) -> int:
    """The shuffle buffer's draws of consumer ``consumer`` in ``epoch``."""
    return int(np.random.SeedSequence([seed, epoch, consumer, 1]).generate_state(1)[0])


def shard_order(progress: DataProgress, seed: int, epoch: int) -> list[int]:
    """The shards of ``epoch`` (ids) in its canonical order."""
    order = list(range(progress.shards_in(epoch)))
    random.Random(order_seed(seed, epoch)).shuffle(order)
    return order


def chunk(progress: DataProgress, seed: int, epoch: int, consumer: int, consumers: int,
          ) -> list[tuple[int, np.ndarray]]:
    """Consumer ``consumer`` of ``consumers``'s part of ``epoch``: (shard, its sample indices ascending) in
    reading order, the ``consumer``-th of near-equal contiguous chunks of the canonical order minus base."""
    bits = progress.epochs.get(epoch)
    base = bits.base if bits is not None and bits.base.any() else None
    offsets, order = progress.offsets, shard_order(progress, seed, epoch)
    left = [progress.counts[i] - (int(base[offsets[i]:offsets[i + 1]].sum()) if base is not None else 0)
            for i in order]
    total = sum(left)
    low, high = total * consumer // consumers, total * (consumer + 1) // consumers
    parts, at = [], 0
    for shard, n in zip(order, left):
        start, stop = max(low - at, 0), min(high - at, n)
        if start < stop:
            kept = (np.arange(progress.counts[shard]) if base is None
                    else np.flatnonzero(~base[offsets[shard]:offsets[shard + 1]]))
            parts.append((shard, kept[start:stop]))
        at += n
        if at >= high:
            break
    return parts
