"""Running an iterator ahead of its consumer in a thread: the device-side preparation of encode and score
(host-to-device copies, device decode) overlaps the models' work on the previous batch. Also: what a stage's loop
waits for (``timed``), and host lists queued on the device without waiting (``device_tensor``)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import torch


def background(items: Iterator, depth: int, name: str, device: torch.device | None = None) -> Iterator:
    """Run an iterator in a thread, ``depth`` items ahead; its exceptions re-raise in the consumer.

    With a CUDA ``device``, the thread makes it current first (a new thread starts on cuda:0, and this rank's
    device may be another); a ``cuda`` device without an index means the consumer's current one."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    end = object()
    stop = threading.Event()
    index = None
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()

    def produce() -> None:
        try:
            if index is not None:
                torch.cuda.set_device(index)
            for item in items:
                while not stop.is_set():
                    try:
                        box.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            box.put(end)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer thread
            box.put(error)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := box.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``, queued on the current stream without waiting for it.

    ``torch.tensor(values, device="cuda")`` is a blocking copy from pageable memory, which first waits for all the
    work queued on the stream: in a loop that queues batch N + 1 while batch N runs, one such copy per batch makes
    the host wait for batch N and the device idle while the host queues N + 1. From pinned memory the copy is
    queued behind that work instead (the pinned block is kept until the copy has run)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def timed(items, clock: dict[str, float], name: str, first: bool = True) -> Iterator:
    """``items``, adding the seconds each ``next`` waited to ``clock[name]`` (the first item's wait too unless
    ``first`` is False: a loop's start-up, which its caller counts apart)."""
    iterator = iter(items)
    counting = first
    while True:
        started = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        if counting:
            clock[name] += time.perf_counter() - started
        counting = True
        yield item
