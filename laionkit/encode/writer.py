"""encode's writer: the writer thread, one output tar per input shard (written by ``tars.ShardOutput``)."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

from laionkit.common import Rank, storage
from laionkit.common import caption_mix as captions
from laionkit.common.storage import Location
from laionkit.encode.config import QUEUE_DEPTH
from laionkit.encode.device import Encoders
from laionkit.encode.reader import ShardDone
from laionkit.encode.records import record_path, shard_record
from laionkit.encode.tars import ShardOutput, npy_bytes


def write_empty_captions(output: Location, encoders: Encoders) -> None:
    """The folder's empty-caption tensors (caption dropout), once: every rank writes the same bytes."""
    for key, empty in encoders.empty_caption().items():
        empty_path = output / encoders.family.empty_file(key)
        if not empty_path.is_complete():
            with storage.atomic_write(empty_path, shared=True) as tmp:
                tmp.write_bytes(npy_bytes(empty))


class _Writer:
    """The writer thread: host copies land, samples go into their shard's tar, finished shards are renamed."""

    def __init__(self, output: Location, settings: dict, models: dict, rank: Rank, progress) -> None:
        self.output = output
        self.settings = settings
        self.models = models
        self.rank = rank
        self.progress = progress
        self.open: dict[str, ShardOutput] = {}
        self.samples_out = 0
        self.skipped = 0
        self.empty_captions = 0
        self.upscaled = 0
        self.decoded: Counter = Counter()
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="laionkit-writer", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        while self.thread.is_alive():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise self.error or RuntimeError("encode writer thread stopped")

    def close(self) -> None:
        self.put(None)
        self.thread.join()
        if self.error:
            raise self.error

    def abort(self, error: BaseException) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        for shard in self.open.values():
            shard.abort(error)
        self.open.clear()

    def _loop(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if isinstance(item, ShardDone):
                    self._finish(item)
                else:
                    self._write(item)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            self.error = error

    def _shard(self, name: str) -> ShardOutput:
        if name not in self.open:
            self.open[name] = ShardOutput(self.output / name)
        return self.open[name]

    def _write(self, item: dict) -> None:
        shard = self._shard(item["shard"])
        shard.skips += item["skips"]
        self.decoded.update(item["decoded"])
        if item["done"] is not None:
            item["done"].synchronize()
        if "captions" in item:  # --captions: recorded even where no sample of the batch is left
            kept = set(item["keys"])
            shard.caption_skips += [skip for skip in item["caption_skips"] if skip["key"] in kept]
        if item["moments"] is not None:
            if item.get("captions") is not None:
                stored = _caption_rows(item)
            else:
                stored = _host(item["stored"], item["trim"])
            shard.write(item["keys"], item["records"], item["moments"].numpy(), stored)
        self.progress.update(len(item["keys"]) + len(item["skips"]))

    def _finish(self, done: ShardDone) -> None:
        shard = self._shard(done.shard)
        skips = sorted(shard.skips + done.skips, key=lambda skip: skip["key"])
        if shard.samples + len(skips) + done.not_kept != done.samples_in:
            raise RuntimeError(f"{done.shard}: {shard.samples} written + {len(skips)} skipped + {done.not_kept} "
                               f"not kept != {done.samples_in} read")
        seconds = time.perf_counter() - shard.started
        shard.finish()
        del self.open[done.shard]
        self.progress.update(len(done.skips) + done.not_kept)
        record = shard_record(done, shard, skips, seconds, self.rank.rank, self.settings, self.models)
        storage.write_json(record_path(self.output, done.shard), record)
        self.samples_out += shard.samples
        self.skipped += len(skips)
        self.empty_captions += shard.empty_captions
        self.upscaled += shard.upscaled


def _host(stored: dict, trim: tuple | None) -> dict:
    """A batch's text members on the host: batch arrays, or one array per sample for the members ``trim``
    cuts to each caption's length (a family with a text mask)."""
    found = {member: value.numpy() for member, value in stored.items()}
    if trim is not None:
        lengths, members = trim
        found.update({member: [row[:n] for row, n in zip(found[member], lengths.tolist())] for member in members})
    return found


def _caption_rows(item: dict) -> list[dict]:
    """--captions: each sample's text members, its first caption's under the plain names (text.npy, ...),
    every other one it has under NAME.<member> (laionkit.common.caption_mix)."""
    by_name = {name: _host(stored, trim) for name, (stored, trim) in item["captions"].items()}
    return [{captions.member(name, plain, index == 0): values[row]
             for index, name in enumerate(names) for plain, values in by_name[name].items()}
            for row, names in enumerate(item["present"])]
