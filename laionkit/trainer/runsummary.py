"""`laionkit stats RUN` for a train run folder: how far it got, its loss, its checkpoints and what it exported.

Read from what the run writes anyway (metrics.jsonl, each checkpoint's trainer.json, the export folders), so a
run still going, killed, or in a bucket is summarised alike, and nothing is written.
"""

from __future__ import annotations

import json

from laionkit.common import LaionkitError
from laionkit.common.storage import Location
from laionkit.trainer.runfolder import EXPORTS

# The scores a step's metrics.jsonl record may carry beside the loss: --validation-latents, --eval-every.
EVALUATIONS = ("val_loss", "fid", "kid", "clip_score")


def logged_steps(folder: Location) -> list[dict]:
    """metrics.jsonl's records; a line cut by a kill (the last one) is left out, not an error."""
    metrics = folder / "metrics.jsonl"
    if not metrics.exists():
        return []
    records = []
    for line in metrics.read_bytes().decode(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [record for record in records if isinstance(record, dict) and "step" in record]


def checkpoints(folder: Location) -> list[Location]:
    """Complete checkpoints, oldest first: trainer.json is written last into each."""
    found = (folder / "checkpoints").list("step-*", complete_only=None) if (folder / "checkpoints").is_dir() else []
    return sorted((c for c in found if (c / "trainer.json").exists()), key=lambda c: c.name)


def summarize(folder: Location):
    from rich.table import Table

    records, saved = logged_steps(folder), checkpoints(folder)
    if not records and not saved:
        raise LaionkitError(f"{folder}: no logged step (metrics.jsonl) and no checkpoint: a run that has not "
                            "trained a step yet")
    config = (saved[-1] / "trainer.json").read_json()["config"] if saved else {}
    table = Table(title=f"laionkit train: {folder}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    last = records[-1] if records else {}
    target = (f" of {config['max_steps']:,}" if config.get("max_steps")
              else f" ({config['epochs']} epochs)" if config.get("epochs") else "")
    table.add_row("steps", f"{last.get('step', 0):,}{target}")
    losses = [(record["step"], record["loss"]) for record in records if isinstance(record.get("loss"), (int, float))]
    if losses:
        best = min(losses, key=lambda item: item[1])
        table.add_row("loss", f"{losses[-1][1]:.4f} at step {losses[-1][0]:,} (first {losses[0][1]:.4f}, "
                              f"lowest {best[1]:.4f} at step {best[0]:,})")
    for name in EVALUATIONS:
        scored = [record for record in records if isinstance(record.get(name), (int, float))]
        if scored:
            table.add_row(name, f"{scored[-1][name]:.4f} at step {scored[-1]['step']:,}")
    if "samples_per_s" in last:
        table.add_row("samples/s", f"{last['samples_per_s']:,.2f} (last logged)")
    table.add_row("checkpoints", ", ".join(c.name for c in saved) or "none")
    exported = [name for name in EXPORTS if (folder / name).exists()]
    table.add_row("exported", ", ".join(f"{name}/" for name in exported) or "nothing yet (the run has not finished)")
    return table
