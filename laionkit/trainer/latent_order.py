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

Cost at scale. The bitmaps are packed, 8 ids to a byte: an epoch of LAION-2B's 2.3B samples is 288 MB per
bitmap, held by each rank and by each of its DataLoader workers (a bool array would be 2.3 GB). Ranks unite
what they trained by gathering the ids each marked since the last merge (the samples of the steps between two
checkpoints: kilobytes), not by reducing whole bitmaps.
"""

from __future__ import annotations

import base64
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.int64)


class Bits:
    """A bitmap over ids 0..size-1, packed 8 to a byte in np.packbits' order (the bits past ``size`` stay 0)."""

    __slots__ = ("packed", "size")

    def __init__(self, size: int, packed: np.ndarray | None = None) -> None:
        self.size = int(size)
        self.packed = np.zeros((self.size + 7) // 8, np.uint8) if packed is None else packed
        if len(self.packed) != (self.size + 7) // 8:
            raise ValueError(f"{len(self.packed)} bytes for a bitmap of {self.size} bits")

    @classmethod
    def from_bool(cls, values) -> Bits:
        values = np.asarray(values, bool)
        return cls(len(values), np.packbits(values))

    def __getitem__(self, ids):
        """The bit of an id (a bool), or of an array of ids (a bool array)."""
        ids = np.asarray(ids, np.int64)
        return ((self.packed[ids >> 3] >> (7 - (ids & 7)).astype(np.uint8)) & 1).astype(bool)

    def set(self, ids) -> None:
        ids = np.asarray(ids, np.int64)
        np.bitwise_or.at(self.packed, ids >> 3, (1 << (7 - (ids & 7))).astype(np.uint8))

    def range(self, start: int, stop: int) -> np.ndarray:
        """The bits of ids start..stop-1 as a bool array."""
        first = start >> 3
        return np.unpackbits(self.packed[first:(stop + 7) >> 3])[start - 8 * first:stop - 8 * first].astype(bool)

    def count(self) -> int:
        return int(sum(_POPCOUNT[part].sum() for part in np.array_split(self.packed, 1 + len(self.packed) // 2**24)))

    def any(self) -> bool:
        return bool(self.packed.any())

    def all(self) -> bool:
        return self.count() == self.size

    def copy(self) -> Bits:
        return Bits(self.size, self.packed.copy())

    def tolist(self) -> list[bool]:
        return np.unpackbits(self.packed, count=self.size).astype(bool).tolist()


@dataclass
class EpochBits:
    """One epoch's bitmaps over its sample ids."""

    base: Bits
    trained: Bits


@dataclass
class DataProgress:
    """What of each epoch the run has trained, over the ids of ``counts`` (samples per shard, id order)."""

    counts: tuple[int, ...]
    from_epoch: tuple[int, ...]
    first: int = 0  # every epoch before it is wholly trained
    epochs: dict[int, EpochBits] = field(default_factory=dict)
    unmerged: list[np.ndarray] = field(default_factory=list, repr=False)  # (epoch, id) rows marked since merge

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
            self.epochs[epoch] = EpochBits(Bits(size), Bits(size))
        return self.epochs[epoch]

    def mark(self, epochs: Sequence[int], positions: Sequence[int]) -> None:
        """Samples trained: ``positions[i]`` of epoch ``epochs[i]``."""
        epochs, positions = np.asarray(epochs, np.int64), np.asarray(positions, np.int64)
        for epoch in np.unique(epochs):
            self.bits(int(epoch)).trained.set(positions[epochs == epoch])
        self.unmerged.append(np.stack([epochs, positions], axis=1).reshape(-1, 2))

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

    def merge(self, gather: Callable[[np.ndarray], list[np.ndarray]]) -> None:
        """Union of every rank's trained samples, then settle. ``gather`` takes this rank's (epoch, id) rows
        marked since the last merge and returns every rank's (an all-gather); all ranks start from the same
        bitmaps (fresh, or the checkpoint's), so adding everyone's new marks unites them."""
        mine = np.concatenate(self.unmerged) if self.unmerged else np.zeros((0, 2), np.int64)
        self.unmerged = []
        for rows in gather(mine):
            for epoch in np.unique(rows[:, 0]):
                if epoch >= self.first:  # an epoch settled meanwhile is wholly trained already
                    self.bits(int(epoch)).trained.set(rows[rows[:, 0] == epoch, 1])
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
            progress.epochs[int(epoch)] = EpochBits(Bits(size, _unpack(bits["base"])), Bits(size, _unpack(bits["trained"])))
        return progress


def _pack(bits: Bits) -> str:
    return base64.b64encode(zlib.compress(bits.packed.tobytes())).decode()


def _unpack(text: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8).copy()


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
    left = [progress.counts[i] - (int(base.range(offsets[i], offsets[i + 1]).sum()) if base is not None else 0)
            for i in order]
    total = sum(left)
    low, high = total * consumer // consumers, total * (consumer + 1) // consumers
    parts, at = [], 0
    for shard, n in zip(order, left):
        start, stop = max(low - at, 0), min(high - at, n)
        if start < stop:
            kept = (np.arange(progress.counts[shard]) if base is None
                    else np.flatnonzero(~base.range(offsets[shard], offsets[shard + 1])))
            parts.append((shard, kept[start:stop]))
        at += n
        if at >= high:
            break
    return parts
