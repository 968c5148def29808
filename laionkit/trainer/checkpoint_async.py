"""Sharded checkpoints (torch.distributed.checkpoint, DCP) written in the background: the GPUs wait only for the
copy of the training state into (pinned) host memory; a thread per rank writes it, uploads it where the run
folder is a URL, and rank 0 writes the done record last.

A checkpoint folder ``step-N`` of this format (``--checkpoint-writer async`` or ``sync``; docs/FORMATS.md):

* ``state/``: DCP's files, ``.metadata`` and ``__R_K.distcp``; each rank writes its shards (FSDP2) and a share
  of the tensors every rank holds alike (DDP: DCP writes each once). The tensors: ``model`` (the fp32 master
  weights under MasterWeights, the adapters of a LoRA run, else the model's state dict), ``optimizer`` (its
  per-parameter state by parameter name) and ``ema`` (the shadow weights). Tensors only, read back with
  ``weights_only=True``; ``.metadata`` (DCP's index, a pickle) is read by an unpickler that builds DCP's
  metadata classes and nothing else;
* ``rank-R.json`` (the rank record: save_checkpoint's ``rank_state``, read by datastate.read_records) and
  ``random-R.json`` (the rank's Python, NumPy and torch generator states), written by rank R;
* ``adapter.safetensors`` of a LoRA run (the adapters whole, with their settings and base: lora.check_resume);
* ``trainer.json``, written last by rank 0 once every rank's files are written: step, config, versions,
  ``"format": "dcp"``, the host state (LR schedule, optimizer parameter groups, EMA counters) and the size
  and sha256 of every file. Its folder gets its name only then (a temporary ``.step-N.partial`` before), so
  ``complete_checkpoints`` and ``--resume latest`` never see a checkpoint whose write was cut short.

Invariants: at most one save in flight (the next one, and the end of the run, wait for it); the staging
buffers are reused only once the previous write has read them; every rank's thread ends with the same
outcome (rank 0 broadcasts it), and a failed write is raised, one line, at the next step or at exit.
The background collectives run on a gloo group of their own, never on the group training all-reduces on.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from laionkit.common import LaionkitError, read_json, versions
from laionkit.common.models import sha256_file
from laionkit.common.outputs import partial_path
from laionkit.trainer import lora
from laionkit.trainer.checkpoint import checkpoint_dir, complete_checkpoints, last_good, ranks_differ
from laionkit.trainer.dcpmetadata import one_line, read_metadata
from laionkit.trainer.wrappers import unwrap

FORMAT = "dcp"
STATE = "state"


def is_dcp(folder: Path) -> bool:
    return (folder / STATE / ".metadata").is_file()


# ---- what a checkpoint holds ----------------------------------------------------------------------------
def _named_module(names: list[str], params: list) -> torch.nn.Module:
    """A module whose parameters are ``params`` under ``names`` (dotted paths): what torch's optimizer state
    helpers need to name the optimizer's state by parameter, for master weights that live in no model."""
    root = torch.nn.Module()
    for name, param in zip(names, params):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            module = module._modules.setdefault(part, torch.nn.Module())
        module.register_parameter(leaf, param)
    return root


def _optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's


@dataclass
class Parts:
    """The training state as DCP tensors (``tensors``) and JSON (``host``), and what owns each."""

    tensors: dict
    host: dict
    owner: torch.nn.Module  # the module the optimizer's parameters are named by
    trained: list[str] = field(default_factory=list)  # names of the weights that train (the fingerprint's)


def parts(trainer) -> Parts:
    """The state of ``trainer`` (loop.Trainer) by reference: the model's weights, the optimizer's state (made
    now where it has none yet, so that a load has tensors to load into), the EMA; the LR schedule, optimizer
    groups and EMA counters as JSON."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    t = trainer
    unwrapped = unwrap(t.accelerator, t.unet)
    if t.master is not None:  # the fp32 master weights are the model; the bf16 ones are their rounding
        owner = _named_module(t.master.names, t.master.master)
        model = dict(zip(t.master.names, (p.detach() for p in t.master.master)))
        trained = list(t.master.names)
    elif t.config.lora_rank is not None:  # the adapters; the frozen base is not part of a checkpoint
        owner = t.unet
        model = {name: p.detach() for name, p in lora.trainable(unwrapped)}
        trained = list(model)
    else:
        owner = t.unet
        model = get_model_state_dict(t.unet)
        trained = [name for name, p in unwrapped.named_parameters() if p.requires_grad]
    optimizer = get_optimizer_state_dict(owner, _optimizer(t.optimizer))
    tensors = {"model": model, "optimizer": optimizer["state"]}
    host = {"scheduler": t.lr_scheduler.state_dict(), "param_groups": optimizer["param_groups"]}
    if t.ema is not None:
        tensors["ema"] = dict(zip(trained, t.ema.shadow_params))
        host["ema"] = {k: v for k, v in t.ema.state_dict().items() if k != "shadow_params"}
    return Parts(tensors, json.loads(json.dumps(host)), owner, trained)


def random_states() -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_random_states(state: dict) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# ---- loading: data only (the metadata through laionkit/trainer/dcpmetadata.py) ----------------------------
def _reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            named = getattr(self, "_get_metadata_path", None)  # torch 2.8 added rank-local metadata files
            path = named(kwargs.get("rank")) if named else self.fs.concat_path(self.path, ".metadata")
            metadata = read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataReader(str(folder))


def load(trainer, folder: Path) -> None:
    """Every rank: the tensors into the training state in place (DCP reads each rank's shards), then the
    optimizer groups, LR schedule, EMA counters and this rank's generators; the master weights are
    published into the bf16 weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    t = trainer
    state = parts(t)
    host = read_json(folder / "trainer.json").get("host", {})
    reader = _reader(folder / STATE)
    reader.read_metadata()  # a refusal is one line here; inside dcp.load it is wrapped into its rank report
    with torch.no_grad():
        try:
            dcp.load(state.tensors, storage_reader=reader, no_dist=t.accelerator.num_processes == 1)
        except LaionkitError:
            raise
        except Exception as error:  # DCP's CheckpointException wraps every rank's error; the first line says it
            raise LaionkitError(f"--resume {folder}: its state does not load into this model ("
                                f"{str(error).strip().splitlines()[-1][:300]})") from None
    set_optimizer_state_dict(state.owner, _optimizer(t.optimizer),
                             {"state": state.tensors["optimizer"], "param_groups": host["param_groups"]})
    t.lr_scheduler.load_state_dict(host["scheduler"])
    if t.master is not None:
        t.master.publish()
    if t.ema is not None:
        t.ema.load_state_dict({**host["ema"], "shadow_params": list(state.tensors["ema"].values())})
    randoms = folder / f"random-{t.accelerator.process_index:05d}.json"
    if randoms.is_file():  # absent for a rank that an elastic resume added (datastate reseeds it)
        set_random_states(json.loads(randoms.read_text()))


# ---- saving ----------------------------------------------------------------------------------------------
def _fingerprint(trained: list[str], model: dict) -> tuple[str, bool]:
    """weights_fingerprint's digest, of the staged copy: the ranks' weights must agree (DDP)."""
    digest, finite = hashlib.sha256(), True
    for name in trained:
        values = model[name].float()
        finite = finite and bool(torch.isfinite(values).all())
        digest.update(name.encode())
        digest.update(values.contiguous().numpy())  # the same bytes as tobytes(), without a copy of them
    return digest.hexdigest(), finite


@dataclass
class Job:
    """One save: what the main thread staged, and what the writing thread does with it."""

    step: int
    final: Path
    staged: dict
    host: dict
    trained: list[str]
    rank_state: dict
    randoms: dict
    healthy: bool
    adapters: dict | None
    records: dict = field(default_factory=dict)  # remote run folder: record files' bytes at the checkpoint


class CheckpointWriter:
    """Saves checkpoints in DCP format, in the background (``background=True``) or before returning.

    Every rank calls ``save`` at the same step, ``check`` once per step and ``close`` at the end."""

    def __init__(self, accelerator, config, remote=None, background: bool = True) -> None:
        import torch.distributed as dist

        self.accelerator, self.config, self.remote, self.background = accelerator, config, remote, background
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.group = None
        if self.world > 1:  # the writing thread's collectives never meet training's on one group
            from datetime import timedelta

            self.group = dist.new_group(backend="gloo", timeout=timedelta(hours=2))
        self._buffers: dict | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.written: list[tuple[int, float]] = []  # (step, seconds from save to its done record), rank 0
        self.last: Path | None = None
        self.lora_base: dict | None = None  # a LoRA run's lora.base_identity, recorded in adapter.safetensors

    # -- the main thread --
    def save(self, trainer, rank_state: dict, wait: bool = False) -> Path | None:
        """Stage the state into host memory and write it with this rank's ``rank_state`` (the record
        datastate.read_records reads back; its ``fingerprint`` is set here) in the background unless ``wait`` or
        the writer is synchronous. Returns the folder the checkpoint will have; None where a sync save
        skipped it."""
        self.wait()
        t = trainer
        began = time.monotonic()
        state = parts(t)
        adapters = None
        if t.config.lora_rank is not None:  # gathered on every rank (FSDP shards); written by rank 0
            adapters = {n: p.contiguous().cpu() for n, p in lora.adapters(unwrap(self.accelerator, t.unet)).items()}
        staged = self._stage(state.tensors)
        job = Job(t.step, checkpoint_dir(t.config.output, t.step), staged, state.host, state.trained, rank_state,
                  random_states(), bool(t.nonfinite.item() == 0), adapters, self._records())
        if _is_fsdp(self.accelerator):
            job.trained = []  # FSDP ranks hold different shards: no fingerprint to compare
        if self.background and not wait:
            self._thread = threading.Thread(target=self._run, args=(job, began), daemon=True,
                                            name=f"laionkit-checkpoint-{t.step}")
            self._thread.start()
            return job.final
        self._run(job, began)
        self.check()
        return self.last if self.last == job.final else None

    def _stage(self, tensors: dict) -> dict:
        """A copy of ``tensors`` in host memory (pinned on a GPU machine), made once and refilled at every
        save: the only part of a save the training step waits for, with the sync below."""
        from torch.distributed._state_dict_utils import (
            _check_state_dict_similarity,
            _copy_state_dict,
            _create_cpu_state_dict,
        )

        cuda = torch.cuda.is_available()
        if self._buffers is None or not _check_state_dict_similarity(tensors, self._buffers):
            self._buffers = _create_cpu_state_dict(tensors, pin_memory=cuda)
        staged = _copy_state_dict(tensors, self._buffers, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return staged

    def _records(self) -> dict:
        """The records a remote run folder uploads with each checkpoint, as they are at this step (they
        grow while the upload runs)."""
        if self.remote is None:
            return {}
        output = self.config.output
        names = [f"seen/rank-{self.rank:05d}.jsonl", *(["metrics.jsonl"] if self.rank == 0 else [])]
        return {name: (output / name).read_bytes() for name in names if (output / name).is_file()}

    @property
    def busy(self) -> bool:
        """Whether a save is being written in the background now."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a save that failed (every rank raises the same line)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise LaionkitError(error)

    def wait(self) -> None:
        """Until the save in flight, if any, is written; its error raised."""
        if self._thread is not None:
            self._thread.join()
        self.check()

    def close(self, timeout: float | None = None, quiet: bool = False) -> None:
        """The end of the run: wait for the save in flight, then raise its error. On an error's exit
        (``quiet``): at most ``timeout`` s (a rank that is gone never finishes its part), and its error only
        said, not raised over the one the run stops with."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        if quiet and self._error is not None:
            self.accelerator.print(f"error: {self._error}")
            self._error = None
        self.check()

    # -- the writing thread: every rank runs it for the same step; rank 0 finishes --
    def _run(self, job: Job, began: float) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            outcome = self._write(job)
        except (Exception, CheckpointException) as error:  # a collective broke: a rank is gone; this rank says so
            outcome = f"step {job.step}: checkpoint not written: {one_line(error)}"
        if outcome is None:
            self.last = job.final
            if self.rank == 0:
                self.written.append((job.step, time.monotonic() - began))
        elif outcome.startswith("warning:"):
            self.accelerator.print(outcome)
        else:
            self._error = outcome

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.barrier(group=self.group)

    def _all(self, item) -> list:
        import torch.distributed as dist

        if self.group is None:
            return [item]
        found = [None] * self.world
        dist.all_gather_object(found, item, group=self.group)
        return found

    def _from_main(self, item):
        import torch.distributed as dist

        if self.group is None:
            return item
        answer = [item]
        dist.broadcast_object_list(answer, src=0, group=self.group)
        return answer[0]

    def _write(self, job: Job) -> str | None:
        """Returns None (written), a warning (skipped) or the error; the same on every rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        folder = partial_path(job.final)
        local_main = self.accelerator.is_local_main_process
        target = self.remote.remote.join("checkpoints", job.final.name) if self.remote is not None else None
        fingerprint = _fingerprint(job.trained, job.staged["model"]) if job.trained else None
        found = self._all((fingerprint, job.healthy))
        differ = ranks_differ([f[0] for f, _ in found], job.step) if fingerprint else None
        if differ:
            return differ
        if not all(healthy and (f is None or f[1]) for f, healthy in found):
            return (f"warning: step {job.step}: loss or weights not finite, no checkpoint written (the last good "
                    f"one stays: {last_good(self.config.output)})")
        if local_main:  # a killed run's leftovers of this step, here and in the bucket
            shutil.rmtree(folder, ignore_errors=True)
            if self.rank == 0 and target is not None:
                target.remove()
        self._barrier()
        mine, error = {}, None
        try:
            writer = FileSystemWriter(str(folder / STATE), thread_count=min(4, os.cpu_count() or 1))
            dcp.save(job.staged, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
            written = [folder / f"rank-{self.rank:05d}.json", folder / f"random-{self.rank:05d}.json"]
            written[0].write_text(json.dumps({**job.rank_state, "fingerprint": fingerprint and fingerprint[0]}))
            written[1].write_text(json.dumps(job.randoms))
            written += sorted((folder / STATE).glob(f"__{self.rank}_*.distcp"))
            if self.rank == 0:
                written.append(folder / STATE / ".metadata")
                if job.adapters is not None:
                    written.append(self._save_adapters(folder, job.adapters))
            mine = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in written}
            if target is not None:
                for name in mine:
                    target.fs.put_file(str(folder / name), target.join(name).path)
                self._put_records(job.records)
        except (Exception, CheckpointException) as caught:  # DCP's is a BaseException; said by every rank below
            error = f"rank {self.rank}: {one_line(caught)}"
        found = self._all((error, mine))
        outcome = None
        errors = [e for e, _ in found if e]
        if errors:
            outcome = (f"step {job.step}: checkpoint {job.final.name} was not written ({'; '.join(errors)}); the "
                       f"last good one stays: {last_good(self.config.output)}")
        elif self.rank == 0:
            try:
                self._finish(job, folder, {k: v for _, part in found for k, v in part.items()}, target)
            except Exception as caught:  # noqa: BLE001
                outcome = f"step {job.step}: checkpoint {job.final.name} was not written: {one_line(caught)}"
        outcome = self._from_main(outcome)
        if local_main and self.rank != 0 and folder.is_dir() and not job.final.is_dir():
            shutil.rmtree(folder, ignore_errors=True)  # another node's part, uploaded (rank 0 renamed its own)
        return outcome

    def _save_adapters(self, folder: Path, adapters: dict) -> Path:
        from safetensors.torch import save_file

        config = self.config
        recorded = {"laionkit_lora": json.dumps(lora.settings(config)),
                    lora.BASE_KEY: json.dumps(self.lora_base)}
        path = folder / lora.ADAPTER_FILE
        save_file(adapters, str(path), metadata=recorded)
        return path

    def _put_records(self, records: dict) -> None:
        for name, data in records.items():
            with self.remote.remote.join(*name.split("/")).fs.open(self.remote.remote.join(*name.split("/")).path,
                                                                   "wb") as handle:
                handle.write(data)

    def _finish(self, job: Job, folder: Path, files: dict, target) -> None:
        """Rank 0, once every rank's files are written: trainer.json (the record every resume checks), the
        folder's name, the upload's done record, older checkpoints pruned."""
        from laionkit.common import storage

        record = {"step": job.step, "world_size": self.world, "format": FORMAT, "config": asdict(self.config),
                  "versions": versions(), "host": job.host, "files": dict(sorted(files.items()))}
        (folder / "trainer.json").write_text(json.dumps(record, indent=2, default=str))
        if job.final.is_dir():
            shutil.rmtree(job.final)
        os.replace(folder, job.final)
        keep = self.config.keep_checkpoints
        for old in complete_checkpoints(self.config.output)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        if target is not None:
            target.fs.put_file(str(job.final / "trainer.json"), target.join("trainer.json").path)
            sizes = {name: value["bytes"] for name, value in files.items()}
            sizes["trainer.json"] = (job.final / "trainer.json").stat().st_size
            storage.mark_done(target, {"sizes": sizes})
            self.remote._prune(keep)


def writer_kind(choice: str, deepspeed: bool) -> str:
    """What --checkpoint-writer ``choice`` writes with: ``auto`` is async, and accelerate's layout under DeepSpeed
    (which saves its own partitioned state: async and sync are refused there, one line)."""
    if choice == "auto":
        return "accelerate" if deepspeed else "async"
    if deepspeed and choice != "accelerate":
        raise LaionkitError(f"--checkpoint-writer {choice}: DeepSpeed saves its own partitioned state; use "
                            "--checkpoint-writer accelerate (or auto) with a DeepSpeed config")
    return choice


def writer(trainer) -> CheckpointWriter | None:
    """The writer --checkpoint-writer asks for (None: accelerate's save_state layout, save_checkpoint)."""
    from accelerate.utils import DistributedType

    config = trainer.config
    kind = writer_kind(config.checkpoint_writer, trainer.accelerator.distributed_type == DistributedType.DEEPSPEED)
    if kind == "accelerate":
        return None
    made = CheckpointWriter(trainer.accelerator, config, trainer.remote, background=kind == "async")
    if config.lora_rank is not None:
        made.lora_base = lora.base_identity(config, trainer.data.family)
    return made


class Clock:
    """--checkpoint-minutes on rank 0: due once M minutes have passed since the last checkpoint, then not again
    until M more have (the loop's agreement lands a step later; the clock must not ask twice meanwhile)."""

    def __init__(self, minutes: float | None) -> None:
        self.seconds = None if minutes is None else minutes * 60
        self.since = time.monotonic()

    def due(self) -> bool:
        if self.seconds is None or time.monotonic() - self.since < self.seconds:
            return False
        self.since = time.monotonic()
        return True

    def saved(self) -> None:
        self.since = time.monotonic()


def _is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP
