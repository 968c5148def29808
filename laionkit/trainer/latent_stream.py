"""Stream latent shards (docs/FORMATS.md §3) into training batches: split, shuffled per epoch, resumable.

Every consumer (one DataLoader worker of one rank) reads its part of each epoch as one infinite stream,
one pass per epoch. Which samples that part holds, in which order, and what a resume leaves out is
laionkit.trainer.latent_order: one canonical order of all samples per epoch, cut into near-equal contiguous
chunks for whatever consumers exist, each chunk mixed through its consumer's shuffle buffer; the samples
the run has already trained (its ``DataProgress`` bitmaps) are dropped after the shuffle. Training
length is counted in steps and chunks are equal to one sample, so every rank runs the same number of
steps and no rank waits for data that isn't there. Every sample carries its epoch and id into its batch,
so the trainer records what it trained, step by step; that record, not a count of batches, is the data
cursor of a checkpoint, which lets a resume change the number of ranks, workers or the batch size.

Batches. A batch holds samples of one latent shape: with aspect-ratio buckets (``encode --buckets``) each
consumer puts its samples, in stream order after the shuffle buffer, into one buffer per shape and emits
a buffer as a batch when it holds ``batch_size`` samples; shapes are never mixed and nothing is padded.
Samples left in a bucket's buffer at the end of an epoch are carried into the next epoch, not dropped,
so every sample is trained on and a bucket smaller than a batch still fills up over epochs. Without
buckets there is one shape and a batch is simply the next ``batch_size`` samples of the endless stream.
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import json
import random
import signal
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from laionkit.common import LaionkitError, storage
from laionkit.common.caption_mix import CaptionMix
from laionkit.common.storage import Location, ReadCache
from laionkit.common.tars import count_samples
from laionkit.trainer.latent_order import DataProgress, chunk, shuffle_seed

# The members a training sample needs; others are skipped unread. Extra text tensors of a model family
# (SDXL's pooled.npy, PixArt's mask.npy) and the json's size fields (SDXL's time_ids) travel in the batch
# when present.
MOMENTS, TEXT = "moments.npy", "text.npy"
IDS_PREFIX = ".ids_"  # encode --text online: <key>.ids_<tokenizer subfolder>.npy, int32 token ids
EXTRA_TENSORS = ("pooled", "mask")
# Decoded keys whose first axis may differ between samples: a family with a text mask stores its states
# and mask trimmed to each caption's length (laionkit.families.FamilySpec.text_mask).
VARIABLE_LENGTH = ("text", "mask")
SIZE_FIELDS = ("original_size", "crop_top_left", "target_size")


@dataclass(frozen=True)
class Unit:
    """Samples ``offset, offset + stride, ...`` (0-based, in tar order) of one shard."""

    shard: str
    offset: int = 0
    stride: int = 1


def shard_paths(latents: Path | Location, complete_only: bool | None = True) -> list[Location]:
    """The folder's complete latent tars (in an object store: those with their done record; with
    ``complete_only=None``, every tar of a folder that holds no done record: Location.list)."""
    shards = Location.parse(latents).list("*.tar", complete_only=complete_only)
    if not shards:
        raise LaionkitError(f"no latent shards (*.tar) in {latents}")
    return shards


def read_unit(unit: Unit, cache: ReadCache | None = None, captions: bool = True) -> Iterator[dict]:
    """Raw (undecoded) samples of one unit, in tar order. A shard in an object store is streamed with
    read-ahead (the next blocks download while this one decodes), or read through ``cache`` (train's
    ``--cache-dir``: later epochs read local copies). ``captions``: False leaves the members of a sample's
    other captions unread (``_first_caption``)."""
    location = Location.parse(unit.shard)
    if location.local and cache is None:
        opened = wds.tariterators.url_opener([{"url": unit.shard}])
    else:
        opened = [{"url": unit.shard, "stream": storage.open_cached(location, cache, prefetch=4)}]
    files = wds.tariterators.tar_file_expander(opened, select_files=_wanted_member if captions else _first_caption)
    samples = wds.tariterators.group_by_keys(files)
    return itertools.islice(_named_errors(samples, unit.shard), unit.offset, None, unit.stride)


# What a damaged shard or member raises while it is read or decoded (tarfile, gzip/zlib, numpy, a file cut
# short or gone): a user's data problem, reported as one line naming the shard and sample, not a traceback.
DATA_ERRORS = (OSError, EOFError, ValueError, tarfile.TarError, zlib.error)


def _reason(error: BaseException) -> str:
    """The error's own words: webdataset appends the stream object (`` @ <_io.BufferedReader ...>``, then
    the stream and URL as more args) to what it reraises, which made the message a tuple with an address."""
    text = str(error.args[0]) if error.args else ""
    text = " ".join(text.split(" @ <")[0].split()) or type(error).__name__
    return text[:300]


def _named_errors(samples: Iterator[dict], shard: str) -> Iterator[dict]:
    """``samples`` of ``shard``; a read failure becomes a LaionkitError naming the shard and the last
    sample read whole (the damage lies after it)."""
    key = None
    try:
        for sample in samples:
            key = sample.get("__key__")
            yield sample
    except DATA_ERRORS as error:
        where = f"after sample {key}" if key is not None else "at its first sample"
        raise LaionkitError(f"{shard}: latent shard damaged {where} ({type(error).__name__}: {_reason(error)}); "
                            "it changed after train opened it: re-copy it or rerun encode for it") from None


def _wanted_member(name: str) -> bool:
    """The tar members train reads: moments, stored text tensors or token ids (online text), the json."""
    return (name.endswith((MOMENTS, TEXT, ".json", *(f".{key}.npy" for key in EXTRA_TENSORS)))
            or (IDS_PREFIX in name and name.endswith(".npy")))


def _first_caption(name: str) -> bool:
    """``_wanted_member`` less the other captions' members of several-caption latents (``<key>.<NAME>.<member>``,
    laionkit.common.caption_mix): without a caption mix a sample trains on its first caption, so the rest stay unread."""
    return _wanted_member(name) and name.rsplit("/", 1)[-1].count(".") < 3


def _require_members(sample: dict) -> None:
    for member in (MOMENTS, TEXT):
        if member == TEXT and any(name.startswith(IDS_PREFIX[1:]) for name in sample):
            continue  # encode --text online: token ids instead of text-encoder outputs
        if member not in sample:
            raise LaionkitError(f"{sample['__url__']}: sample {sample['__key__']} has no .{member} member")


def moments_shape(sample: dict) -> tuple[int, ...]:
    """The shape of a raw sample's moments from its .npy header alone: the bucket key, known without
    decoding, so skipped batches cost no decode."""
    _require_members(sample)
    stream = io.BytesIO(sample[MOMENTS])
    try:
        version = np.lib.format.read_magic(stream)
        if version not in ((1, 0), (2, 0)):
            return tuple(_npy(sample, MOMENTS).shape)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return tuple(reader(stream)[0])
    except ValueError as error:
        raise LaionkitError(f"{sample['__url__']}: sample {sample['__key__']}: .{MOMENTS} is not a numpy "
                            f"array ({error})") from None


def _npy(sample: dict, member: str) -> np.ndarray:
    """A sample's .npy member; one that fails to load is a LaionkitError naming shard, sample and member."""
    try:
        return np.load(io.BytesIO(sample[member]))
    except DATA_ERRORS as error:
        raise LaionkitError(f"{sample.get('__url__')}: sample {sample.get('__key__')}: its .{member} cannot be "
                            f"decoded ({type(error).__name__}: {_reason(error)}); rerun encode for this shard") from None


def with_caption(sample: dict, record: dict | None, mix: CaptionMix, seed: int, names: Sequence[str]) -> tuple[dict, str]:
    """``sample`` with the caption ``mix`` picks for it (from its epoch and id) in the plain text members, and
    that caption's name (laionkit.common.caption_mix): a sample whose json names no captions has only its first."""
    given = (record or {}).get("captions")
    first = (record or {}).get("caption_name") or (names[0] if names else "alt")
    if not isinstance(given, dict) or not given:
        return sample, first
    name = mix.pick(seed, sample["__epoch__"], sample["__id__"], given, names or list(given))
    if name == first:
        return sample, name
    prefix = f"{name}."
    chosen = {member[len(prefix):]: value for member, value in sample.items() if member.startswith(prefix)}
    if not chosen:
        raise LaionkitError(f"{sample.get('__url__')}: sample {sample.get('__key__')} names caption {name} in its "
                            f"json but has no {prefix}* member: rerun encode for this shard")
    kept = {member: value for member, value in sample.items() if not _text_member(member)}
    return {**kept, **chosen}, name


def _text_member(member: str) -> bool:
    """A caption's own member (text states, pooled vector, mask or token ids), plain or a named caption's
    (``vlm.text.npy``)."""
    base = member.split(".", 1)[1] if member.count(".") == 2 else member
    return base in (TEXT, *(f"{key}.npy" for key in EXTRA_TENSORS)) or (base.startswith("ids_") and base.endswith(".npy"))


def decode(sample: dict, mix: CaptionMix | None = None, seed: int = 0, names: Sequence[str] = ()) -> dict:
    """A raw sample as tensors. With a caption ``mix`` (train --caption-mix) its text is the caption the mix
    picks for it (``with_caption``), named under ``caption``; without, its first caption's."""
    _require_members(sample)
    picked = None
    if mix is not None:
        sample, picked = with_caption(sample, _json(sample), mix, seed, names)
    decoded = {
        "key": sample["__key__"],
        "moments": torch.from_numpy(_npy(sample, MOMENTS)),
    }
    if "__id__" in sample:  # from a LatentStream: what the trainer marks as trained
        decoded.update(epoch=sample["__epoch__"], id=sample["__id__"])
    if TEXT in sample:
        decoded["text"] = torch.from_numpy(_npy(sample, TEXT))
    for name in sample:
        if name.startswith(IDS_PREFIX[1:]) and name.endswith(".npy"):  # ids_<tokenizer>.npy -> ids_<tokenizer>
            decoded[name[:-4]] = torch.from_numpy(_npy(sample, name).astype(np.int64))
    for key in EXTRA_TENSORS:
        if f"{key}.npy" in sample:
            decoded[key] = torch.from_numpy(_npy(sample, f"{key}.npy"))
    if "json" in sample:
        try:
            record = json.loads(sample["json"])
            sizes = {name: torch.tensor(record[name], dtype=torch.long) for name in SIZE_FIELDS}
        except (ValueError, KeyError, TypeError):
            sizes = {}  # older or hand-made latents: families that need these fields say so
        decoded.update(sizes)
    if picked is not None:
        decoded["caption"] = picked
    return decoded


def _json(sample: dict) -> dict | None:
    try:
        record = json.loads(sample["json"]) if "json" in sample else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def pad_to(value: torch.Tensor, length: int, dim: int = 0) -> torch.Tensor:
    """``value`` zero-padded along ``dim`` to ``length`` (zeros: masked-out positions, False in a mask)."""
    missing = length - value.shape[dim]
    if missing <= 0:
        return value
    shape = list(value.shape)
    shape[dim] = missing
    return torch.cat([value, value.new_zeros(shape)], dim=dim)


def pad_stack(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack tensors whose first axis may differ (trimmed text), zero-padded to the longest."""
    length = max(value.shape[0] for value in values)
    return torch.stack([pad_to(value, length) for value in values])


def collate(samples: Sequence[dict]) -> dict:
    """A batch of decoded samples: default_collate, except that trimmed text (``VARIABLE_LENGTH``) is
    zero-padded to the longest of the batch, its mask marking the padding as masked out."""
    batch = default_collate([{k: v for k, v in sample.items() if k not in VARIABLE_LENGTH} for sample in samples])
    batch.update({key: pad_stack([sample[key] for sample in samples]) for key in VARIABLE_LENGTH if key in samples[0]})
    return batch


def read_part(shard: str, indices: np.ndarray, offset: int, epoch: int,
              read: Callable[[Unit], Iterable] = read_unit) -> Iterator[dict]:
    """Samples ``indices`` (ascending) of ``shard``, in tar order, each tagged with its epoch and its id
    (``offset`` + index): what the trainer marks as trained (laionkit.trainer.latent_order)."""
    if not len(indices):
        return
    wanted = iter(indices.tolist())
    target = next(wanted)
    for index, sample in enumerate(itertools.islice(read(Unit(shard)), int(indices[-1]) + 1)):
        if index == target:
            sample["__epoch__"], sample["__id__"] = epoch, offset + index
            yield sample
            target = next(wanted, None)


def mixed(samples: Iterable, rng: random.Random, shuffle_buffer: int) -> Iterator:
    """``samples`` through a shuffle buffer. Its draws depend on the number of samples only, never on
    their content or on which of them are later dropped as trained."""
    if shuffle_buffer <= 1:
        return iter(samples)
    return wds.filters.shuffle(bufsize=shuffle_buffer, initial=shuffle_buffer, rng=rng)(samples)


@dataclass(frozen=True)
class StreamLayout:
    """Everything the order of samples depends on, with what the run has trained (``DataProgress``):
    exact resume needs the same layout; another layout continues the epoch with the untrained rest."""

    shards: tuple[str, ...]  # in id order (laionkit.trainer.latent_order)
    rank: int
    world_size: int
    workers: int
    batch_size: int
    seed: int
    shuffle_buffer: int
    # Several latent shapes (encode --buckets): batches are grouped per shape.
    bucketed: bool = False
    samples: tuple[int, ...] = ()  # per shard: counted when not given
    # train --caption-mix: the caption each sample trains on, picked from (seed, epoch, id); the folder's
    # caption names in order (laionkit.common.caption_mix)
    caption_mix: CaptionMix | None = None
    caption_names: tuple[str, ...] = ()

    @property
    def consumers(self) -> int:
        return max(self.workers, 1)


class LatentStream(IterableDataset):
    """One rank's infinite stream of single-shape batches: ``progress`` (what is trained of each epoch)
    continued, after ``batches_done`` batches of this layout (which worker is next, see ``__iter__``)."""

    def __init__(self, layout: StreamLayout, batches_done: int = 0, cache: ReadCache | None = None,
                 progress: DataProgress | None = None) -> None:
        self.layout = layout
        self.batches_done = batches_done
        # where shards are read from does not change the stream: the cache is not in the layout
        self.read = functools.partial(read_unit, cache=cache, captions=layout.caption_mix is not None)
        counts = layout.samples or tuple(count_samples(shard) for shard in layout.shards)
        # a copy: the trainer goes on marking its own as it trains
        self.progress = copy.deepcopy(progress) if progress is not None else DataProgress.fresh(counts)
        if len(self.progress.counts) != len(layout.shards):
            raise ValueError(f"progress over {len(self.progress.counts)} shards, layout of {len(layout.shards)}")

    def __iter__(self) -> Iterator[dict]:
        layout, progress = self.layout, self.progress
        info = get_worker_info()
        # The DataLoader takes batches from its K workers strictly in turn, starting with worker 0, so
        # batch i comes from stream i mod K. A loader restarted after B batches must therefore give its
        # worker w the stream (w + B) mod K.
        worker = ((info.id if info is not None else 0) + self.batches_done) % layout.consumers
        consumer = layout.rank * layout.consumers + worker
        offsets, pending = progress.offsets, {}
        for epoch in itertools.count(progress.first):
            parts = chunk(progress, layout.seed, epoch, consumer, layout.world_size * layout.consumers)
            bits = progress.epochs.get(epoch)
            if not parts:
                if bits is None or not bits.base.any():
                    raise self._starved(worker)
                continue  # the epoch's untrained rest went to other consumers
            trained = bits.trained if bits is not None else None
            if trained is not None and all(trained[offsets[shard] + part].all() for shard, part in parts):
                continue  # all of this consumer's part is trained: not even read
            rng = random.Random(shuffle_seed(layout.seed, epoch, consumer))
            samples = itertools.chain.from_iterable(
                read_part(layout.shards[shard], part, int(offsets[shard]), epoch, self.read) for shard, part in parts)
            for sample in mixed(samples, rng, layout.shuffle_buffer):
                if trained is not None and trained[sample["__id__"]]:
                    continue  # dropped after the shuffle: the others keep their order
                shape = moments_shape(sample)
                if not layout.bucketed and pending and shape not in pending:
                    raise LaionkitError(
                        f"{sample['__url__']}: sample {sample['__key__']} has latent shape {shape}, others "
                        f"{next(iter(pending))}: the folder's manifest names no buckets, so all must match"
                    )
                bucket = pending.setdefault(shape, [])
                bucket.append(sample)
                if len(bucket) == layout.batch_size:
                    pending[shape] = []
                    yield collate([decode(raw, layout.caption_mix, layout.seed, layout.caption_names)
                                   for raw in bucket])

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
    before it could checkpoint. Ignoring is safe: the trainer ends its workers through their index queues
    (``end_workers``), a worker exits by itself once its trainer is gone (torch's manager watchdog), and
    SIGKILL, which a launcher escalates to, still ends it.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_workers(batches) -> None:
    """End a loader iterator's workers now, through their index queues (the DataLoader's own shutdown).

    Train calls it on every way out of its loop, an exception's included. Left to interpreter exit, a
    failed run hung until its launcher killed it (an out-of-memory on an H200, then on CPU): the
    exception's traceback keeps the iterator alive, so multiprocessing's exit hook meets the workers
    first, sends them SIGTERM, which they ignore (``_ignore_interrupt``), and joins them forever."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # absent without workers (num_workers=0)
    if shutdown is not None:
        shutdown()


class LatentLoader(DataLoader):
    """A DataLoader whose iterator passes a worker's LaionkitError on as the worker raised it: one line.

    torch re-raises an error of a worker in the trainer as the same type with the worker's whole
    traceback as its message ("Caught LaionkitError in DataLoader worker process 1. Original Traceback
    ..."), which the CLI printed in full instead of the one line it prints for a user's mistake."""

    def __iter__(self):
        return _OneLineErrors(super().__iter__())


class _OneLineErrors:
    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.batches)
        except LaionkitError as error:
            text = str(error)
            if not text.startswith("Caught LaionkitError"):
                raise
            raise LaionkitError(text.rsplit("LaionkitError: ", 1)[-1].strip()) from None

    def _shutdown_workers(self) -> None:  # end_workers
        end_workers(self.batches)


def latent_loader(layout: StreamLayout, batches_done: int = 0, pin_memory: bool = False,
                  cache: ReadCache | None = None, progress: DataProgress | None = None) -> DataLoader:
    """Batches of ``{"key": [str], "moments": (B, 2C, h, w) fp16, "text": (B, T, D) fp16}``, one (h, w)
    per batch (T: the longest caption of the batch where text is trimmed, ``collate``); the workers form
    the batches (see the module docstring). A damaged shard or member is a one-line LaionkitError naming
    the shard (and sample), with workers or without (LatentLoader)."""
    return LatentLoader(
        LatentStream(layout, batches_done, cache, progress),
        batch_size=None,
        num_workers=layout.workers,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_interrupt if layout.workers else None,
        persistent_workers=False,
        prefetch_factor=4 if layout.workers else None,
    )
