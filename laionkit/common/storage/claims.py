"""Which folders a stage may write to: never an input, never another stage's outputs, and an output
replaced whole only when empty."""

from __future__ import annotations

import os

from laionkit.common.errors import LaionkitError
from laionkit.common.outputs import describe_holdings, folder_holds, refuse_other_stage
from laionkit.common.outputs import refuse_overlap as refuse_local_overlap
from laionkit.common.storage.location import Location


def refuse_overlap(inputs, output: Location | str, stage: str) -> None:
    """``laionkit.common.refuse_overlap`` for URLs too: an output that is, contains or lies inside an
    input (same store, same bucket, key prefix on ``/`` boundaries) is refused. Stores differ → no overlap."""
    output = Location.parse(output)
    inputs = [Location.parse(given) for given in inputs]
    if output.local:
        refuse_local_overlap([i.path for i in inputs if i.local], output.path, stage)
        return
    out = output.path.rstrip("/") + "/"
    for given in inputs:
        if given.protocol != output.protocol:
            continue
        source = given.path.rstrip("/") + "/"
        if out.startswith(source) or source.startswith(out):
            relation = "is" if out == source else ("lies inside" if out.startswith(source) else "contains")
            raise LaionkitError(f"{stage}: --output {output} {relation} the input {given}; "
                                "outputs never overwrite inputs, choose another folder")


def claim_output(output: Location | str, stage: str, overwrite: bool = False) -> None:
    """Refuse an ``output`` folder that holds another stage's outputs (``outputs.refuse_other_stage``),
    unless ``overwrite``. A rerun of the same stage into its own folder (resume) passes."""
    output = Location.parse(output)
    if overwrite or not output.is_dir():
        return
    names = [entry.name for entry in output.list(complete_only=False)]
    refuse_other_stage(names, str(output), stage)


def refuse_nonempty(output: Location | str, stage: str) -> None:
    """For outputs replaced whole (a model folder): refuse any folder that holds anything."""
    output = Location.parse(output)
    if not output.is_dir():
        return
    names = sorted(os.listdir(output.path)) if output.local else [e.name for e in output.list(complete_only=False)]
    if names:
        held = describe_holdings(folder_holds(names)) or ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        raise LaionkitError(f"{stage}: --output {output} is not empty (it holds {held}); "
                            "choose a new folder, or --overwrite to replace it")
