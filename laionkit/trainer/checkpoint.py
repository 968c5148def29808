"""Checkpoints: a folder ``step-N`` saved whole or not at all, verified against its recorded sha256, chosen
and loaded on --resume; the per-rank records and weight fingerprints every rank must agree on; the run
folder's claim (RUN_OUTPUTS, --overwrite).

Invariant of a checkpoint folder ``step-N``: it holds the state *after* N optimizer steps, and rank 0's record
marks exactly the samples those steps trained (datastate); its name exists only once all ranks wrote it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

from laionkit.common import (
    LaionkitError,
    atomic_output,
    read_json,
    runlock,
    versions,
)
from laionkit.common.models import sha256_file, weights_error
from laionkit.common.outputs import partial_path
from laionkit.common.storage import claim_output
from laionkit.trainer import runfolder
from laionkit.trainer.config import TrainConfig
from laionkit.trainer.precision import MasterWeights
from laionkit.trainer.runfolder import RUN_OUTPUTS
from laionkit.trainer.wrappers import unwrap

CHECKPOINT_PREFIX = "step-"


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def complete_checkpoints(output: Path) -> list[Path]:
    """Finished checkpoints, oldest first. Unfinished ones live under hidden .partial names, never listed."""
    folder = output / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def verify_checkpoint(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from (a file missing, of another size or content than recorded
    when it was saved), or None when it is whole."""
    try:
        files = read_json(folder / "trainer.json")["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"its trainer.json is unreadable or lists no files ({error})"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if sha256_file(path) != want["sha256"]:
            return f"{name} does not hold what was written (sha256 differs)"
    return None


def choose_resume(config: TrainConfig, say) -> Path | None:
    """--resume latest: the newest checkpoint that verifies, saying which ones were passed over;
    an explicit folder must verify."""
    if config.resume is None:
        return None
    if config.resume == "latest":
        found = complete_checkpoints(config.output)
        for folder in reversed(found):
            problem = verify_checkpoint(folder)
            if problem is None:
                return folder
            say(f"warning: checkpoint {folder} is damaged ({problem}); trying an older one")
        if found:  # starting over would replace the run these checkpoints belong to
            raise LaionkitError(f"--resume latest: every checkpoint in {config.output / 'checkpoints'} is damaged "
                                "(above); restore one, or remove checkpoints/ and give --overwrite to start over")
        return None
    path = Path(config.resume)
    if not (path / "trainer.json").is_file():
        raise LaionkitError(f"--resume {path}: not a complete checkpoint folder (no trainer.json)")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise LaionkitError(f"--resume {path}: damaged checkpoint: {problem}")
    return path


def find_resume(config: TrainConfig, accelerator, max_steps: int | None = None) -> Path | None:
    """Rank 0 reads and verifies the checkpoint files (once, not once per rank) and tells the others. A
    checkpoint past ``max_steps`` is refused: the run would export its later weights as if it had stopped
    at ``max_steps``."""
    from accelerate.utils import broadcast_object_list

    answer = [None, None]
    if accelerator.is_main_process:
        try:
            found = choose_resume(config, accelerator.print)
            step = found and read_json(found / "trainer.json").get("step")
            if max_steps is not None and isinstance(step, int) and step > max_steps:
                raise LaionkitError(f"--resume {config.resume}: {found} is at step {step}, past this run's "
                                    f"{max_steps} steps (--max-steps / --epochs / --stage): give at least {step}")
            answer = [None if found is None else str(found), None]
        except LaionkitError as error:
            answer = [None, str(error)]
    if accelerator.num_processes > 1:
        broadcast_object_list(answer)
    if answer[1] is not None:
        raise LaionkitError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def weights_fingerprint(accelerator, unet, master: MasterWeights | None) -> tuple[str, bool] | None:
    """sha256 of the fp32 (master) weights in parameter-name order, and whether all are finite. Ranks
    of DDP / ZeRO-2 hold the same whole weights after every step, so their fingerprints must agree;
    FSDP and ZeRO-3 ranks hold different shards, so they have no fingerprint to compare (None)."""
    from accelerate.utils import DistributedType

    from laionkit.trainer import zero

    if accelerator.distributed_type == DistributedType.FSDP or zero.stage(accelerator) == 3:
        return None
    if master is not None:
        named = zip(master.names, master.master)
    else:  # what trains: all weights, or the adapters of a LoRA run (the frozen base cannot drift)
        named = ((n, p) for n, p in unwrap(accelerator, unet).named_parameters() if p.requires_grad)
    digest, finite = hashlib.sha256(), True
    with torch.no_grad():
        for name, weight in named:
            values = weight.detach().float()
            finite = finite and bool(torch.isfinite(values).all())
            digest.update(name.encode())
            digest.update(values.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest(), finite


def check_ranks_agree(accelerator, fingerprint: tuple[str, bool] | None, step: int) -> None:
    """Every rank compares all ranks' fingerprints, so all stop together with the same message."""
    from accelerate.utils import gather_object

    if fingerprint is None:
        return
    found = gather_object([fingerprint[0]]) if accelerator.num_processes > 1 else [fingerprint[0]]
    differ = ranks_differ(found, step)
    if differ:
        raise LaionkitError(differ)


def ranks_differ(found: list[str], step: int) -> str | None:
    """The error when the ranks' weight fingerprints ``found`` (by rank) are not all rank 0's, else None."""
    differ = [rank for rank, digest in enumerate(found) if digest != found[0]]
    if not differ:
        return None
    return (f"step {step}: the weights of rank(s) {', '.join(map(str, differ))} differ from rank 0's "
            f"(sha256 {', '.join(f'rank {r}: {d[:12]}' for r, d in enumerate(found))}); the ranks no "
            "longer train one model, so no checkpoint was written. Please report this with the command line")


def save_checkpoint(accelerator, output: Path, step: int, rank_state: dict, keep: int,
                    config: TrainConfig, extra_states: dict, rank_tensors: dict | None = None) -> Path:
    """All ranks write into a hidden temporary folder; rank 0 renames it once every rank is done.

    Everything a resume reads is data, never code: accelerate's weights (safetensors) and optimizer /
    scheduler files (loaded with weights_only=True), the rank records as JSON, and the master / EMA
    weights (``extra_states``, written by rank 0: equal on every rank) as plain tensors. trainer.json,
    written last, records the size and sha256 of every file, so a damaged checkpoint is found before
    anything is loaded from it. ``rank_tensors`` (a pipeline stage's weights and optimizer state, differing by
    rank) are written by every rank as NAME-rank-RRRRR.pt."""
    final = checkpoint_dir(output, step)
    main = accelerator.is_main_process
    space = disk_full_is_one_line(partial_path(final), step, output)
    with (atomic_output(final) if main else nullcontext(None)) as tmp, space:
        accelerator.wait_for_everyone()  # rank 0 has cleared any stale temporary
        folder = tmp if main else partial_path(final)
        accelerator.save_state(str(folder))
        (folder / f"rank-{accelerator.process_index:05d}.json").write_text(json.dumps(rank_state))
        for name, state in (rank_tensors or {}).items():
            torch.save(state, folder / f"{name}-rank-{accelerator.process_index:05d}.pt")
        if main:
            for name, state in extra_states.items():
                torch.save(state, folder / f"{name}.pt")
        accelerator.wait_for_everyone()
        if main:
            files = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
                     for path in sorted(folder.rglob("*")) if path.is_file()}
            (folder / "trainer.json").write_text(json.dumps(
                {"step": step, "world_size": accelerator.num_processes, "config": asdict(config),
                 "versions": versions(), "files": files}, indent=2, default=str))
    if main:
        for old in complete_checkpoints(output)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


# How a full disk shows while a checkpoint is written: errno, or only in words (safetensors' Rust I/O error;
# torch.save's zip writer says "unexpected pos", nothing more, which the free space then tells apart).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_WORDS = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded", "os error 122")


@contextmanager
def disk_full_is_one_line(folder: Path, step: int, output: Path) -> Iterator[None]:
    """A full disk while the checkpoint is written into ``folder`` (the temporary that atomic_output then
    removes, so no part of it stays as if complete) becomes one line naming the run folder and what to
    do; any other failure passes as it is. The free space is read before the temporary is removed."""
    try:
        yield
    except Exception as error:
        try:
            usage = shutil.disk_usage(folder if folder.exists() else output)
        except OSError:
            usage = None
        said = getattr(error, "errno", None) in DISK_FULL or any(word in str(error) for word in DISK_FULL_WORDS)
        write_error = isinstance(error, OSError | RuntimeError) or "Safetensor" in type(error).__name__
        if not (said or (write_error and usage is not None and usage.free < 64 * 2**20)):
            raise
        size = f" ({usage.total / 2**20:.0f} MiB in all)" if usage else ""
        raise LaionkitError(
            f"step {step}: the disk of {output}{size} is full: no space for checkpoint step-{step:08d}, "
            "none of it was kept. Free space there (a URL --output stages in LAIONKIT_STAGING, else the temp "
            f"folder), lower --keep-checkpoints or give --output on a larger disk, then --resume latest (last "
            f"good checkpoint: {last_good(output)})") from None


def load_tensors(path: Path):
    """torch.load restricted to tensors and plain containers: a pickle that would run code is refused."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise LaionkitError(f"{path}: {weights_error(error)}") from None


# The pickles of accelerate's layout: its optimizer / scheduler / sampler / scaler files, its generators
# (random_states_R.pkl), DeepSpeed's model and ZeRO partition files, the master / EMA weights.
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl")


def check_pickles(folder: Path, deepspeed: bool) -> None:
    """Every pickle of a checkpoint in accelerate's layout loads with torch's weights-only loader before
    anything is loaded from it: DeepSpeed unpickles its files with ``weights_only=False``, accelerate its custom
    objects too and FSDP's sharded ``.metadata`` without restriction, and it skips a generator file it cannot
    read without a word. Allowed besides tensors: the NumPy generator state accelerate stores, and the plain
    data classes DeepSpeed stores (loss scaler, ZeRO stage, fragment addresses). One line naming the file
    otherwise."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    from laionkit.trainer.dcpmetadata import read_metadata

    for path in sorted(folder.rglob(".metadata")):
        read_metadata(path)
    allowed = [*TORCH_SAFE_GLOBALS, *(_deepspeed_data() if deepspeed else ())]
    for path in sorted({p for pattern in PICKLES for p in folder.rglob(pattern)}):
        if path.name.startswith("custom_checkpoint_"):  # laionkit registers none; accelerate would unpickle it
            raise LaionkitError(f"{path}: laionkit saves no custom state, and accelerate unpickles this file "
                                "unrestricted: refused to load it (checkpoints are data, never code)")
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        except Exception as error:  # noqa: BLE001 - refused or damaged: not loaded either way
            raise LaionkitError(f"{path}: {weights_error(error)}") from None


def _deepspeed_data() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_world_size(folder: Path, distributed_type: str, written_by: int, ranks: int) -> None:
    """Refuse, before anything loads, a resume that DeepSpeed cannot do: ZeRO partitions the optimizer state
    into one file per data-parallel rank, and its loader reads them only at the world size that wrote them
    (DeepSpeed's universal checkpoints convert them: ``ds_to_universal.py``). DDP checkpoints hold whole
    tensors and FSDP2's are torch.distributed.checkpoint shards, which load on any number of ranks, so those
    resume elastically (datastate.resume)."""
    if str(distributed_type).upper().endswith("DEEPSPEED") and written_by != ranks:
        raise LaionkitError(f"--resume {folder}: written by {written_by} DeepSpeed rank(s), resumed on {ranks}: "
                            f"ZeRO's optimizer partitions load only on {written_by} ranks; resume on {written_by} "
                            "(an elastic resume works under DDP and FSDP2)")


def load_checkpoint_state(accelerator, folder: Path, extra_states: dict) -> None:
    """accelerate's state (each pickle first checked as data: check_pickles), then the master / EMA weights."""
    from accelerate.utils import DistributedType

    check_pickles(folder, accelerator.distributed_type == DistributedType.DEEPSPEED)
    accelerator.load_state(str(folder), load_kwargs={"weights_only": True})
    for name, target in extra_states.items():
        target.load_state_dict(load_tensors(folder / f"{name}.pt"))


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop records of steps a killed run made past the checkpoint we resume from (they are redone)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= after_step]
    with atomic_output(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def claim_run_folder(config: TrainConfig, accelerator) -> None:
    """A fresh run never mixes into another's outputs: the main rank takes the folder's lock first (one
    train per folder, laionkit/common/runlock.py), then a folder that holds a run is refused unless --resume
    continues it or --overwrite deletes it first (runfolder.start_over: also a --resume latest that has
    no checkpoint to continue from). A folder that holds another stage's outputs is refused as every
    stage refuses it (storage.claim_output), unless --overwrite."""
    answer = [None, False]  # error, start over
    if accelerator.is_main_process:
        try:
            config.output.mkdir(parents=True, exist_ok=True)
            runlock.hold(runlock.LocalLock(config.output))
            claim_output(config.output, "train", config.overwrite)
            found = [name for name in RUN_OUTPUTS if (config.output / name).exists()]
            answer = [None, runfolder.start_over(config, config.output, found, bool(complete_checkpoints(
                config.output)), runfolder.last_logged_step(config.output / "metrics.jsonl"))]
        except (LaionkitError, OSError) as error:
            answer = [str(error), False]
    error, delete = runfolder._broadcast(accelerator, answer)
    if error is not None:
        raise LaionkitError(error)
    if delete:
        accelerator.wait_for_everyone()  # every rank has looked before rank 0 deletes
        if accelerator.is_main_process:
            for name in RUN_OUTPUTS:
                path = config.output / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    accelerator.wait_for_everyone()


def last_good(output: Path) -> str:
    found = complete_checkpoints(output)
    return str(found[-1]) if found else "none"
