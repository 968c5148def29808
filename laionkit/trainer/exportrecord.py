"""The record an export folder keeps (RUN/unet, RUN/lora, ...): the run's newest checkpoint when it was written,
so `laionkit export` can tell an export that a resumed run went past. Its own module: LoRA's export and the
denoiser's both write it, and export.py imports the LoRA module."""

from __future__ import annotations

import json
from pathlib import Path

EXPORT_RECORD = "laionkit-export.record"  # JSON; not a suffix RUN/pipeline copies from the folder (pipeline.KEEP_SUFFIXES)


def record_export(folder: Path, run: Path) -> None:
    """Name, in the exported ``folder``, the newest checkpoint of ``run`` at the time of the export: a resumed run
    that checkpoints past it and stops before its end leaves this export behind, and `laionkit export` must see
    that (``stale_export``). The newest is the last step's, or an older one under --no-checkpoint-at-end."""
    from laionkit.trainer.checkpoint import complete_checkpoints

    found = complete_checkpoints(run)
    (folder / EXPORT_RECORD).write_text(json.dumps({"checkpoint": found[-1].name if found else None}) + "\n")


def stale_export(trained: Path, newest: Path) -> bool:
    """``trained`` (RUN/unet, RUN/lora, ...) was written before the checkpoint ``newest``: the run went on past
    it. An export without the record (written by an older laionkit) cannot tell, and is taken as current."""
    record = trained / EXPORT_RECORD
    return record.is_file() and json.loads(record.read_text())["checkpoint"] != newest.name
