"""caption's output: one tar per input shard, each sample's members copied as they were and its json
gaining the caption, written through encode's tar writer (TarMembers) under a temporary name and renamed
(uploaded, done record last) when complete."""

from __future__ import annotations

import contextlib
import glob
import json
import socket
import time
from contextlib import ExitStack
from pathlib import Path

from laionkit.common import storage
from laionkit.common.outputs import PARTIAL_SUFFIX
from laionkit.common.runlock import pid_alive
from laionkit.common.storage import Location
from laionkit.encode.tars import TarMembers


def with_caption(members: dict[str, bytes], name: str, caption: str, model: str) -> dict[str, bytes]:
    """The sample's members with its json (a new one where it had none) gaining ``captions[name]`` and
    ``caption_model[name]``; every other member, and every other json field in its order, as it was."""
    meta = json.loads(members["json"]) if "json" in members else {}
    meta["captions"] = {**meta.get("captions", {}), name: caption}  # objects where present (reader.decode_image)
    meta["caption_model"] = {**meta.get("caption_model", {}), name: model}
    return {**members, "json": json.dumps(meta).encode()}


def clear_dead_temporaries(path: Location) -> None:
    """Remove the temporaries of ``path`` that this host's killed caption processes left (their pid is gone):
    each process writes under a name of its own, which no later run reuses, so nothing else would."""
    if not path.local:
        return
    final = Path(path.path)
    prefix = f".{final.name}.{socket.gethostname()}-"
    for tmp in final.parent.glob(glob.escape(prefix) + "*" + PARTIAL_SUFFIX):
        pid = tmp.name[len(prefix):-len(PARTIAL_SUFFIX)]
        if pid.isdigit() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


class CaptionedShard:
    """One output tar: samples in input order (skipped ones left out), members in webdataset's order."""

    def __init__(self, path: Location) -> None:
        self.path = path
        self.stack = ExitStack()
        clear_dead_temporaries(path)
        # a temporary of this process's own (shared): another process's can never be renamed into place as ours
        self.sink = TarMembers(str(self.stack.enter_context(storage.atomic_write(path, shared=True))))
        self.samples = 0
        self.empty = 0
        self.chars = 0
        self.skips: list[dict] = []
        self.started = time.perf_counter()

    def write(self, key: str, members: dict[str, bytes], name: str, caption: str, model: str) -> None:
        with storage.one_line_errors("cannot write", self.path):  # a full disk, named by the tar
            self.sink.add_sample(key, with_caption(members, name, caption, model))
        self.samples += 1
        self.empty += not caption
        self.chars += len(caption)

    def finish(self) -> None:
        with storage.one_line_errors("cannot write", self.path):
            self.sink.close()
        self.stack.close()

    def abort(self, error: BaseException) -> None:
        with contextlib.suppress(OSError):  # the temporary is removed anyway; a full disk fails its end blocks too
            self.sink.close()
        self.stack.__exit__(type(error), error, error.__traceback__)
