"""A checkpoint's data state: what the run has trained of each epoch of its current stage (bitmaps over
sample ids, laionkit.trainer.latent_order), with which stream layout since which step, and the layouts it had.

--resume continues it: with the same layout exactly (every consumer's sequence goes on); with another
number of ranks, --workers, --batch-size or --grad-accum (elastic) the untrained rest of every epoch in
progress is split over the new consumers, each sample trained once in its epoch, and later epochs follow
the new layout; --add-shards takes shards appended to the folder from the first epoch not yet begun. The
LR schedule counts optimizer steps: an elastic resume continues at the checkpoint's step (whatever the
global batch is now), and ``history`` records each layout with the step it began at. Rank 0's record
(``rank-00000.json``, key ``data``) holds it, after the ranks' trained bitmaps are united (all-reduce).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from laionkit.common import LaionkitError
from laionkit.common.storage import Location
from laionkit.trainer.data import layout_key
from laionkit.trainer.latent_order import DataProgress
from laionkit.trainer.latent_stream import StreamLayout, latent_loader
from laionkit.trainer.pipeline_parallel import data_ranks

# What an elastic resume may change; everything else of the layout key (seed, shuffle buffer, shards,
# stages) must stay, shards but for those --add-shards appends.
ELASTIC = ("world_size", "workers", "batch_size", "grad_accum")
VERSION = 1


@dataclass
class DataState:
    stage: int
    shards: list[list]  # [name, samples, bytes] in id order
    layout: dict  # the ELASTIC settings this layout has
    since_step: int  # the step this layout began at
    batches: int  # batches each rank took from this layout's stream (the next DataLoader worker)
    progress: DataProgress
    history: list[dict] = field(default_factory=list)

    def consumed(self, batch: dict) -> None:
        """A batch the trainer trains on (not one a worker prefetched): its samples are trained."""
        self.batches += 1
        self.progress.mark(batch["epoch"].tolist(), batch["id"].tolist())

    def record(self, accelerator) -> dict:
        """Every rank's trained samples united (a collective: every rank calls it), as JSON."""
        self.progress.merge(lambda rows: _gather(accelerator, rows))
        return {"version": VERSION, "stage": self.stage, "shards": self.shards, "layout": self.layout,
                "since_step": self.since_step, "batches": self.batches, "history": self.history,
                "progress": self.progress.record()}

    @classmethod
    def from_record(cls, record: dict) -> DataState:
        return cls(stage=record["stage"], shards=record["shards"], layout=record["layout"],
                   since_step=record["since_step"], batches=record["batches"],
                   progress=DataProgress.from_record(record["progress"]), history=record["history"])


def _gather(accelerator, rows: np.ndarray) -> list[np.ndarray]:
    """Every rank's ``rows`` (an int64 array of shape (n, 2), n differing by rank): an all-gather, padded."""
    if accelerator.num_processes == 1:
        return [rows]
    import torch
    import torch.distributed as dist

    ranks, device = accelerator.num_processes, accelerator.device
    count = torch.tensor([len(rows)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(ranks)]
    dist.all_gather(counts, count)
    longest = max(int(c) for c in counts)
    padded = torch.zeros((longest, 2), dtype=torch.int64, device=device)
    padded[:len(rows)] = torch.from_numpy(np.ascontiguousarray(rows, np.int64))
    found = [torch.empty_like(padded) for _ in range(ranks)]
    dist.all_gather(found, padded)
    return [part[:int(n)].cpu().numpy() for part, n in zip(found, counts)]


def settings(trainer) -> dict:
    return {"world_size": trainer.accelerator.num_processes, "workers": trainer.config.workers,
            "batch_size": trainer.config.batch_size, "grad_accum": trainer.config.grad_accum}


def _layout_entry(trainer, state: DataState, **extra) -> dict:
    now = settings(trainer)
    return {"step": trainer.step, **now, "global_batch": now["world_size"] * now["batch_size"] * now["grad_accum"],
            "epoch": state.progress.first, **extra}


def _stage_shards(trainer, stage: int) -> list[list]:
    return layout_key(trainer.layouts[stage], trainer.schedule.stages[stage][1])["shards"]


def fresh(trainer, stage: int, first_epoch: int = 0) -> DataState:
    """A stage's stream from its start (or from epoch ``first_epoch``)."""
    shards = _stage_shards(trainer, stage)
    state = DataState(stage, shards, settings(trainer), trainer.step, 0,
                      DataProgress.fresh([samples for _, samples, _ in shards], first_epoch))
    state.history.append(_layout_entry(trainer, state))
    return state


def fixed_key(key: dict, add_shards: bool) -> dict:
    """The part of a layout key (data.layout_key) a resume must keep: all but the ELASTIC settings and the
    rank (and the shards, which --add-shards checks itself)."""
    drop = {"rank", "caption_mix", *ELASTIC, *(("shards",) if add_shards else ())}  # caption_mix: check_caption_mix
    kept = {name: value for name, value in key.items() if name not in drop}
    if "stages" in kept:
        kept["stages"] = [[steps, fixed_key(stage, add_shards)] for steps, stage in kept["stages"]]
    return kept


def check_caption_mix(folder: Path, recorded: dict, now: dict, allowed: bool, say) -> None:
    """A resume keeps the run's --caption-mix: it decides which caption every sample trains on, so another one
    would not continue the run it was. ``allowed`` (--allow-caption-mix-change) takes another one from this
    step on (a caption curriculum): the picks are a function of (seed, epoch, sample id), so the data order
    and what is trained stay exact, only the captions of the samples still to come change."""
    before, after = recorded.get("caption_mix"), now.get("caption_mix")
    if before == after:
        return
    if not allowed:
        raise LaionkitError(f"{folder} was written with --caption-mix {before or '(none: first captions)'}, this run "
                            f"has {after or '(none)'}: resume with the same policy, or add "
                            "--allow-caption-mix-change to train on with the new one from here")
    say(f"--allow-caption-mix-change: captions picked by {after or 'first caption'} from here on "
        f"(was {before or 'first caption'})")


def read_records(folder: Path) -> list[dict]:
    """Every rank's record of a checkpoint (rank-N.json, JSON), in rank order."""
    records = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise LaionkitError(f"{path} is not JSON ({error})") from None
    if not records:
        raise LaionkitError(f"{folder} holds no rank-N.json record: not a checkpoint of laionkit train")
    return records


def resume(trainer, records: list[dict]) -> tuple[DataState, bool]:
    """The data state to continue from the checkpoint's ``records`` at ``trainer.step``, and whether the
    layout changed (an elastic resume: the ranks' generators and counts cannot carry over one to one)."""
    t, say = trainer, trainer.accelerator.print
    stage = t.schedule.stage_at(t.step)
    world_changed = len(records) != t.accelerator.num_processes
    recorded = records[0].get("data")
    if recorded is None:  # written before the data state: where in its epoch the old order stood is unknown
        samples = (t.step - t.schedule.start(stage)) * len(records) * records[0]["layout"]["batch_size"] \
            * t.config.grad_accum
        epoch = math.ceil(samples / t.schedule.stages[stage][1].samples)
        if samples:
            say(f"warning: the checkpoint predates laionkit's data-state record: the data stream restarts at "
                f"epoch {epoch} (the rest of epoch {epoch - 1} is not trained again)")
        return fresh(t, stage, epoch), world_changed
    state = DataState.from_record(recorded)
    if state.stage != stage:  # checkpointed at the end of the previous stage
        return fresh(t, stage), world_changed
    now = {name: [name, samples, size] for name, samples, size in _stage_shards(t, stage)}
    for name, samples, size in state.shards:
        if now.get(name) != [name, samples, size]:
            raise LaionkitError(f"--add-shards: shard {name} ({samples} samples, {size} bytes) of the checkpoint "
                                f"is {'gone' if name not in now else 'changed: ' + str(now[name][1:])}; "
                                "added shards may only be appended, the others must stay as they were")
    known = {name for name, _, _ in state.shards}
    added = [entry for name, entry in sorted(now.items()) if name not in known]
    if state.layout == settings(t) and not added:
        return state, world_changed
    state.progress.rebase()
    extra = {}
    if added:
        joins = state.progress.add_shards([samples for _, samples, _ in added])
        state.shards += added
        extra = {"added_shards": [name for name, _, _ in added], "shards_join_epoch": joins}
        say(f"--add-shards: {len(added)} new shard(s) ({sum(n for _, n, _ in added)} samples) take part from "
            f"epoch {joins} on")
    left = {e: bits.trained.size - bits.trained.count() for e, bits in sorted(state.progress.epochs.items())}
    old = state.layout
    state.layout, state.since_step, state.batches = settings(t), t.step, 0
    state.history.append(_layout_entry(t, state, **extra))
    changes = ", ".join(f"{name} {old.get(name)} -> {value}" for name, value in state.layout.items()
                        if old.get(name) != value)
    say(f"elastic resume at step {t.step} (the LR schedule continues at this step): {changes or 'shards added'}; "
        "untrained samples of the epochs in progress, split over the new layout: "
        f"{', '.join(f'epoch {e}: {n}' for e, n in left.items()) or 'none'}")
    return state, True


def stream_layout(trainer, state: DataState) -> StreamLayout:
    """This rank's stream for ``state``: the stage's shards in id order (added shards last)."""
    config, latents = trainer.config, trainer.schedule.stages[state.stage][1]
    paths = {Location.parse(path).name: path for path in latents.shards}
    return StreamLayout(tuple(paths[name] for name, _, _ in state.shards),
                        *data_ranks(config, trainer.accelerator), config.workers, config.batch_size, config.seed,
                        config.shuffle_buffer, bucketed=latents.bucketed, samples=tuple(state.progress.counts),
                        caption_mix=trainer.layouts[state.stage].caption_mix,
                        caption_names=trainer.layouts[state.stage].caption_names)


def loader(trainer, state: DataState, cache=None):
    """The batches of ``state``'s stream, from where it stands."""
    return latent_loader(stream_layout(trainer, state), batches_done=state.batches,
                         pin_memory=trainer.device.type == "cuda", cache=cache, progress=state.progress)
