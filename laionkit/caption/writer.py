"""caption's output: one tar per input shard, each sample's members copied as they were and its json
gaining the caption, written through encode's tar writer (TarMembers) under a temporary name and renamed
(uploaded, done record last) when complete."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

from laionkit.common import storage
from laionkit.common.storage import Location
from laionkit.encode.tars import TarMembers


def with_caption(members: dict[str, bytes], name: str, caption: str, model: str) -> dict[str, bytes]:
    """The sample's members with its json (a new one where it had none) gaining ``captions[name]`` and
    ``caption_model[name]``; every other member, and every other json field in its order, as it was."""
    meta = json.loads(members["json"]) if "json" in members else {}
    meta["captions"] = {**meta.get("captions", {}), name: caption}  # objects where present (reader.decode_image)
    meta["caption_model"] = {**meta.get("caption_model", {}), name: model}
    return {**members, "json": json.dumps(meta).encode()}


class CaptionedShard:
    """One output tar: samples in input order (skipped ones left out), members in webdataset's order."""

    def __init__(self, path: Location) -> None:
        self.path = path
        self.stack = ExitStack()
        self.sink = TarMembers(str(self.stack.enter_context(storage.atomic_write(path))))
        self.samples = 0
        self.empty = 0
        self.chars = 0
        self.skips: list[dict] = []
        self.started = time.perf_counter()

    def write(self, key: str, members: dict[str, bytes], name: str, caption: str, model: str) -> None:
        self.sink.add_sample(key, with_caption(members, name, caption, model))
        self.samples += 1
        self.empty += not caption
        self.chars += len(caption)

    def finish(self) -> None:
        self.sink.close()
        self.stack.close()

    def abort(self, error: BaseException) -> None:
        self.sink.close()
        self.stack.__exit__(type(error), error, error.__traceback__)
