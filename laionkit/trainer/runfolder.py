"""`laionkit train --output URL`: the run folder in an object store (s3://, gs://, ...), staged on local disk.

Train and accelerate write to local paths, so a URL's run folder lives in a local staging folder
(``$LAIONKIT_STAGING`` or the system temp folder, one per URL, shared by the ranks of a node) and train
writes there as for a local ``--output``. The bucket is the truth, the staging folder a working copy:

* each complete checkpoint is uploaded object by object, ``trainer.json`` (which lists every file's size
  and sha256) last of its objects, then its done record (``checkpoints/.step-N.done``); older ones are
  then pruned in the bucket as on disk (``--keep-checkpoints``), with every leftover of a killed upload.
  ``metrics.jsonl`` and each rank's ``seen/rank-N.jsonl`` follow each checkpoint;
* at the end the export (``unet/``, ``transformer/``, ``lora/`` and their ``_ema``) is uploaded with a done
  record each, with ``metrics.jsonl``, ``samples/`` and ``logs/``;
* a run starts from an empty staging folder: a fresh run refuses a bucket folder that holds a run (or
  deletes it with ``--overwrite``), and ``--resume latest`` downloads the newest checkpoint whose done record
  exists (one killed mid-upload has none and is passed over), with the metrics and seen-key records.

Ranks on one node share the staging folder; on several nodes each has its own, and the files of a
checkpoint (accelerate's per-rank RNG states, ``rank-N.json``) are uploaded by the lowest rank that sees
them, so every rank's files reach the bucket without a shared file system.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

from laionkit.common import LaionkitError, runlock, storage
from laionkit.common.outputs import partial_path
from laionkit.common.storage import Location

RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "unet", "unet_ema", "transformer", "transformer_ema", "lora", "lora_ema",
               "pipeline", "single_file", "samples", "seen", "logs", "eval.png")


EXPORTS = ("unet", "unet_ema", "transformer", "transformer_ema", "lora", "lora_ema", "pipeline", "single_file")
SHARED = ("metrics.jsonl", "samples", "logs", "eval.png")  # uploaded by rank 0 at the end (metrics.jsonl also per checkpoint)


def stage(config):
    """The config train runs with (``output`` a local Path) and the RunFolder of a URL output, else None."""
    given = config.output
    location = Location.parse(str(given), storage.parse_storage_options(getattr(config, "storage_options", None)))
    if location.local:
        return replace(config, output=Path(given)), None
    location.check_writable()
    digest = hashlib.sha256(str(location).encode()).hexdigest()[:16]
    local = Path(storage.staging_dir(), f"laionkit-run-{location.name}-{digest}")
    return replace(config, output=local), RunFolder(location, local)


def last_logged_step(metrics: Path | str) -> int | None:
    """The step of the last record of a metrics.jsonl (a path, or its text), None when there is none;
    a record that cannot be read counts as a run past any checkpoint (refused, never silently replaced)."""
    if isinstance(metrics, Path):
        if not metrics.is_file():
            return None
        metrics = metrics.read_text(errors="replace")
    lines = [line for line in metrics.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return int(json.loads(lines[-1])["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62


def start_over(config, where, found: list[str], checkpoint: bool, logged: int | None) -> bool:
    """Whether the run outputs ``found`` in ``where`` are deleted before this run starts (True), kept
    (False), or the run is refused (an error): a fresh run refuses a folder that holds a run unless
    --overwrite; --resume latest with no complete checkpoint starts over only where nothing of value would
    be replaced: an empty folder (a new preemptible job always passes --resume latest) or a run killed
    before its first checkpoint (no export, no step logged at or past --checkpoint-every, so at most the
    records of steps it redoes), else it is refused unless --overwrite."""
    if not found:
        return False
    if config.resume is None:
        if not config.overwrite:
            raise LaionkitError(f"--output {where} already holds a run ({', '.join(found)}): give --resume latest "
                                "to continue it, or --overwrite to delete it and start over")
        return True
    if config.resume != "latest" or checkpoint:
        return False
    if config.overwrite:
        return True
    exports = [name for name in found if name in EXPORTS]
    if not exports and (logged is None or logged < config.checkpoint_every):
        return False  # killed before its first checkpoint: it starts over, its records are redone
    why = f"its export {', '.join(exports)}" if exports else f"metrics.jsonl up to step {logged}"
    raise LaionkitError(f"--resume latest: --output {where} holds a run ({why}) but no complete checkpoint to "
                        "resume from; give --overwrite with it to delete the run and start over, or --resume a "
                        "checkpoint folder")


def dropped_ranks_records(output: Path, world: int) -> list[Path]:
    """The seen-keys files (RUN/seen/rank-N.jsonl) of ranks N >= ``world``: after an elastic resume onto
    fewer ranks no rank truncates them, so rank 0 does (their steps past the checkpoint are redone)."""
    found = sorted((output / "seen").glob("rank-*.jsonl"))
    return [path for path in found if path.stem[5:].isdigit() and int(path.stem[5:]) >= world]


def _gather(accelerator, item) -> list:
    from accelerate.utils import gather_object

    return gather_object([item]) if accelerator.num_processes > 1 else [item]


def _broadcast(accelerator, answer: list) -> list:
    from accelerate.utils import broadcast_object_list

    if accelerator.num_processes > 1:
        broadcast_object_list(answer)
    return answer


class RunFolder:
    """The bucket side of a staged run folder: ``remote`` (the URL) and ``local`` (its staging folder)."""

    def __init__(self, remote: Location, local: Path):
        self.remote, self.local = remote, local

    def __str__(self) -> str:
        return str(self.remote)

    # ---- start: claim the bucket folder, fill the staging folder ------------------------------------
    def claim(self, config, accelerator, inputs: list):
        """Refuse or delete another run in the bucket folder (as claim_run_folder does on disk), empty the
        staging folder, and for a resume download what it reads. Returns the config to run with."""

        storage.refuse_overlap(inputs, self.remote, "train")
        answer = [None, None]  # error, checkpoint name to resume from
        if accelerator.is_main_process:
            try:
                runlock.hold(runlock.BucketLease(self.remote))  # one train per folder, before anything is read
                answer = [None, self._decide(config, RUN_OUTPUTS)]
            except LaionkitError as error:
                answer = [str(error), None]
        error, name = _broadcast(accelerator, answer)
        if error is not None:
            raise LaionkitError(error)
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            shutil.rmtree(self.local, ignore_errors=True)
            self.local.mkdir(parents=True)
            if name is not None:
                self._download(self.remote.join("checkpoints", name), self.local / "checkpoints" / name)
            if config.resume is not None:  # the records truncate_jsonl cuts back to the checkpoint's step
                for part in ("metrics.jsonl", "seen", "wandb.json"):  # and the W&B run a resume continues
                    self._download(self.remote / part, self.local / part)
        accelerator.wait_for_everyone()
        if name is not None and config.resume != "latest":
            return replace(config, resume=str(self.local / "checkpoints" / name))
        return config

    def _decide(self, config, run_outputs) -> str | None:
        """Rank 0: the checkpoint to download (None: none), after the fresh-run rules."""
        storage.claim_output(self.remote, "train", config.overwrite)
        found = [entry for entry in self.remote.list(complete_only=False) if entry.name in run_outputs]
        complete = self.remote.join("checkpoints").list("step-*") if config.resume == "latest" else []
        metrics = self.remote / "metrics.jsonl"
        logged = last_logged_step(metrics.read_bytes().decode(errors="replace")) if metrics.exists() else None
        if start_over(config, self.remote, [e.name for e in found], bool(complete), logged):
            for entry in found:
                entry.remove()
            return None
        if config.resume is None:
            return None
        if config.resume != "latest":
            given = Location.parse(config.resume, self.remote.options)
            if given.local:
                return None  # a local checkpoint folder: train reads it where it is
            if given.parent != self.remote / "checkpoints":
                raise LaionkitError(f"--resume {given}: a checkpoint of --output {self.remote} "
                                    f"({self.remote}/checkpoints/step-N) or a local folder")
            if not given.is_complete():
                raise LaionkitError(f"--resume {given}: not a complete checkpoint (no done record: its upload "
                                    "was cut short)")
            return given.name
        return complete[-1].name if complete else None

    def _download(self, source: Location, target: Path) -> None:
        fs = source.fs
        if fs.isfile(source.path):
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(source.path, str(target))
            return
        prefix = source.path.rstrip("/") + "/"
        for key in sorted(fs.find(source.path)):
            if key.startswith(prefix):
                (target / key[len(prefix):]).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(key, str(target / key[len(prefix):]))

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_saved(self, accelerator, final: Path, keep: int) -> None:
        """Upload the checkpoint train just completed in staging; every rank calls it."""
        folder = final if final.is_dir() else partial_path(final)  # a node without rank 0: its part only
        mine = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) \
            if folder.is_dir() else []
        owner = {}
        for rank, names in sorted(_gather(accelerator, (accelerator.process_index, mine))):
            for name in names:
                owner.setdefault(name, rank)
        target = self.remote.join("checkpoints", final.name)
        if accelerator.is_main_process:  # a killed run's objects of this step go first, its record before them
            target.remove()
        accelerator.wait_for_everyone()
        sizes = {}
        with storage.one_line_errors("cannot write", target):
            for name, rank in owner.items():
                if rank == accelerator.process_index and name != "trainer.json":
                    target.fs.put_file(str(folder / name), target.join(name).path)
                    sizes[name] = (folder / name).stat().st_size
        sizes = {k: v for part in _gather(accelerator, sizes) for k, v in part.items()}
        self._upload_own_records(accelerator)
        if accelerator.is_main_process:
            with storage.one_line_errors("cannot write", target):
                target.fs.put_file(str(folder / "trainer.json"), target.join("trainer.json").path)
            sizes["trainer.json"] = (folder / "trainer.json").stat().st_size
            storage.mark_done(target, {"sizes": sizes})
            self._prune(keep)
            self._put(self.local / "metrics.jsonl")
            self._put(self.local / "wandb.json")  # absent without --log-with wandb: _put skips it
        accelerator.wait_for_everyone()
        if not final.is_dir() and folder.is_dir() and accelerator.is_local_main_process:
            shutil.rmtree(folder, ignore_errors=True)  # staged on a node rank 0 does not tidy

    def _prune(self, keep: int) -> None:
        folder = self.remote / "checkpoints"
        kept = {entry.name for entry in folder.list("step-*")[-keep:]}
        for entry in folder.list("step-*", complete_only=False):
            if entry.name not in kept:
                entry.remove()

    def _upload_own_records(self, accelerator) -> None:
        own = self.local / "seen" / f"rank-{accelerator.process_index:05d}.jsonl"
        if own.is_file():
            self._put(own)
        if accelerator.is_main_process:  # as rank 0 truncated them (loop.open_records)
            for path in dropped_ranks_records(self.local, accelerator.num_processes):
                self._put(path)

    def _put(self, path: Path) -> None:
        """One file or folder as plain objects (no done record): a single PUT is whole or absent."""
        if path.exists():
            storage.upload(path, self.remote / path.relative_to(self.local).as_posix())

    # ---- the end --------------------------------------------------------------------------------------
    def finished(self, accelerator) -> None:
        """Upload the export (each folder with its done record, after its objects) and the records."""
        self._upload_own_records(accelerator)
        if accelerator.is_main_process:
            for name in EXPORTS:
                if (self.local / name).is_dir():
                    put_folder(self.local / name, self.remote / name)
            for name in SHARED:
                self._put(self.local / name)
        accelerator.wait_for_everyone()


def put_folder(local: Path, target: Location) -> None:
    """A local folder as objects under ``target``, its done record removed first and written last."""
    target.remove()
    storage.mark_done(target, {"sizes": storage.upload(local, target)})
