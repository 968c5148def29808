"""The shared home of every stage: rank sharding, crash-safe outputs and manifests, model loading."""

from laionkit.common.errors import LaionkitError
from laionkit.common.outputs import (
    atomic_output,
    read_json,
    refuse_other_settings,
    refuse_overlap,
    save_image_grid,
    strict_json,
    versions,
    write_json,
)
from laionkit.common.ranks import Rank, available_cpus, resolve_rank, split, stage_device

__all__ = [
    "LaionkitError", "Rank", "atomic_output", "available_cpus", "read_json", "refuse_other_settings", "refuse_overlap",
    "resolve_rank", "save_image_grid", "split", "stage_device", "strict_json",
    "versions", "write_json",
]
