"""The global sample order, its partition over consumers, and the trained-sample bitmaps (laionkit.trainer.latent_order);
the stream continuing them under another layout (laionkit.trainer.latent_stream)."""

from __future__ import annotations

import collections
import itertools
import tarfile
from pathlib import Path

import numpy as np
import pytest

from laionkit.trainer.latent_order import Bits, DataProgress, chunk, shard_order
from laionkit.trainer.latent_stream import StreamLayout, end_workers, latent_loader


def _canonical(progress: DataProgress, seed: int, epoch: int, base: np.ndarray | None) -> list[int]:
    offsets = progress.offsets
    ids = [i for shard in shard_order(progress, seed, epoch) for i in range(offsets[shard], offsets[shard + 1])]
    return [i for i in ids if base is None or not base[i]]


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("excluded", [0.0, 0.3, 0.9])
def test_chunks_cut_the_canonical_order_minus_base_into_near_equal_parts(shards, ranks, workers, excluded):
    progress = DataProgress.fresh([5 + 3 * i for i in range(shards)])
    base = None
    if excluded:
        base = np.random.default_rng(shards * ranks).random(progress.size(0)) < excluded
        progress.bits(0).base, progress.bits(0).trained = Bits.from_bool(base), Bits.from_bool(base)
    offsets, parts = progress.offsets, []
    for consumer in range(ranks * workers):
        parts.append([int(offsets[shard] + i) for shard, indices in chunk(progress, 3, 0, consumer, ranks * workers)
                      for i in indices])
    assert list(itertools.chain(*parts)) == _canonical(progress, 3, 0, base)  # in order, each once
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_each_epoch_has_its_own_shard_order():
    progress = DataProgress.fresh([4] * 8)
    orders = {tuple(shard_order(progress, 0, epoch)) for epoch in range(6)}
    assert len(orders) > 1 and all(sorted(order) == list(range(8)) for order in orders)


def test_progress_record_round_trips_settles_rebases_and_adds_shards():
    progress = DataProgress.fresh([3, 5])
    progress.mark([0] * 8, range(8))
    progress.mark([1, 1, 2], [0, 7, 4])
    progress.settle()
    assert progress.first == 1 and sorted(progress.epochs) == [1, 2]
    again = DataProgress.from_record(progress.record())
    assert again.record() == progress.record() and again.epochs[1].trained.tolist() == [
        True, False, False, False, False, False, False, True]
    again.rebase()
    assert again.epochs[2].base.tolist() == again.epochs[2].trained.tolist()
    assert again.add_shards([4]) == 3  # epochs 1 and 2 have begun: the new shard takes part from 3 on
    assert again.size(2) == 8 and again.size(3) == 12 and again.from_epoch == (0, 0, 3)


def test_merge_is_the_union_of_every_rank():
    ranks = [DataProgress.fresh([4]) for _ in range(3)]
    ranks[0].mark([0, 0], [0, 1])
    ranks[1].mark([0, 0, 1], [2, 3, 0])
    sent = [np.concatenate(progress.unmerged) if progress.unmerged else np.zeros((0, 2), np.int64)
            for progress in ranks]  # what each rank contributes to the all-gather

    for progress in ranks:
        progress.merge(lambda rows: sent)
        assert progress.first == 1 and progress.epochs[1].trained.tolist() == [True, False, False, False]
        assert progress.record() == ranks[0].record() and progress.unmerged == []
    ranks[2].mark([1], [3])  # the next merge adds only what was marked since
    for progress in ranks:
        progress.merge(lambda rows: [np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64), np.array([[1, 3]])])
        assert progress.epochs[1].trained.tolist() == [True, False, False, True]


@pytest.mark.parametrize("size", [1, 7, 8, 9, 64, 1001])
def test_packed_bits_read_set_count_and_slice_as_a_bool_array_would(size):
    values = np.random.default_rng(size).random(size) < 0.4
    bits = Bits.from_bool(values)
    ids = np.arange(size)
    assert bits[ids].tolist() == values.tolist() and bool(bits[size - 1]) == bool(values[-1])
    assert bits.count() == values.sum() and bits.any() == values.any() and bits.all() == values.all()
    for start, stop in [(0, size), (size // 3, size), (1, max(1, size - 2)), (size // 2, size // 2)]:
        assert bits.range(start, stop).tolist() == values[start:stop].tolist()
    bits.set(ids[::3])
    values[::3] = True
    assert bits.tolist() == values.tolist() and bits.count() == values.sum()
    bits.set(ids)
    assert bits.all() and bits.packed[-1] == np.packbits(np.ones(size, bool))[-1]  # the padding stays 0


def _counts(shards) -> list[int]:
    return [sum(1 for name in tarfile.open(shard).getnames() if name.endswith(".json")) for shard in shards]


def _take(layout: StreamLayout, progress: DataProgress, done: int, batches: int) -> list[dict]:
    stream = iter(latent_loader(layout, done, progress=progress))
    try:
        taken = [next(stream) for _ in range(batches)]
    finally:
        end_workers(stream)
    return taken


@pytest.mark.parametrize("folder", ["latent_shards", "bucket_latents"])
def test_another_layout_trains_the_rest_of_the_epoch_once(folder, request):
    """2 ranks x 2 workers, batch 1, take 1 batch per rank (leftover samples wait in bucket buffers); then
    3 ranks x 1 worker, batch 2, on the rest: every sample of epoch 0 is trained exactly once."""
    latents: Path = request.getfixturevalue(folder)
    shards = tuple(map(str, sorted(latents.glob("*.tar"))))
    progress, bucketed, trained = DataProgress.fresh(_counts(shards)), folder == "bucket_latents", []
    for rank in range(2):
        for batch in _take(StreamLayout(shards, rank, 2, 2, 1, 5, 3, bucketed, tuple(progress.counts)), progress, 0, 1):
            trained += list(zip(batch["epoch"].tolist(), batch["key"]))
        progress.mark(batch["epoch"], batch["id"])
    progress.settle()
    progress.rebase()
    for rank in range(3):
        layout = StreamLayout(shards, rank, 3, 0, 2, 5, 3, bucketed, tuple(progress.counts))
        for batch in _take(layout, progress, 0, 4):
            trained += list(zip(batch["epoch"].tolist(), batch["key"]))
    first = collections.Counter(key for epoch, key in trained if epoch == 0)
    assert len(first) == 8 and set(first.values()) == {1}, first
    assert all(n == 1 for n in collections.Counter(key for epoch, key in trained if epoch == 1).values())
