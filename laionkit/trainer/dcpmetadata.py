"""DCP's ``.metadata`` read as data: an unpickler that builds DCP's metadata classes and nothing else, and every
non-tensor entry it points to checked with torch's weights-only loader. Read before DCP (or accelerate's FSDP
loader) touches a checkpoint folder, by checkpoint_async.load and checkpoint.check_pickles."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from laionkit.common import LaionkitError
from laionkit.common.models import weights_error


def _torch_names() -> frozenset:
    """torch's dtypes and layouts, as pickles name them (``torch.float32``): read from the module's own names,
    never looked up by a name the pickle gives."""
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype | torch.layout))


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle of its Metadata dataclasses: build those, torch's sizes, dtypes and layouts
    and paths, refuse anything else (a pickle that would call other code).

    Only exact (module, name) pairs pass: a protocol-4 pickle may name a dotted path inside a module, which
    pickle resolves attribute by attribute (``os.system`` through the metadata module's own ``import os``), so a
    whole allowed module would allow everything it imports. The pairs are what torch 2.9 to 2.14 write (the
    values a ``BytesStorageMetadata`` entry points to are checked by read_metadata)."""

    ALLOWED = frozenset({
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
            "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # the checkpoint's path (Python 3.13 names it so)
    })
    ENUMS = ("_MEM_FORMAT_ENCODING",)  # DCP's enums, whose members a pickle may name through getattr
    TORCH = _torch_names()

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in self.TORCH:
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):  # an enum member by name (torch 2.7's memory formats)
            return self._member
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")

    @classmethod
    def _member(cls, owner, name: str):
        """``getattr`` as the pickle calls it, for the members of DCP's own enums and nothing else."""
        from torch.distributed.checkpoint import metadata

        enums = [getattr(metadata, enum) for enum in cls.ENUMS]
        if any(owner is enum for enum in enums) and isinstance(name, str) and name in owner.__members__:
            return owner[name]
        raise pickle.UnpicklingError(f"getattr({owner!r}, {name!r}) is not part of DCP's metadata")


def read_metadata(path: Path):
    """DCP's ``.metadata`` at ``path`` (this writer's, or FSDP's sharded state in accelerate's layout), read as
    data; every non-tensor entry must load with torch's weights-only loader, since DCP's planner reads those
    with ``weights_only=False``. Anything else is refused in one line, before DCP reads the file."""
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
            _check_values(Path(path).parent, metadata)
        except Exception as error:  # noqa: BLE001 - refused, damaged or not a pickle: one line either way
            raise LaionkitError(f"{path}: not plain checkpoint metadata, refused to load it (checkpoints are data, "
                                f"never code): {one_line(error)}") from None
    return metadata


def _check_values(folder: Path, metadata) -> None:
    """Each non-tensor entry (BytesStorageMetadata: a torch.save pickle inside a ``.distcp`` file, such as an
    optimizer's parameter groups) loads with the weights-only loader."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue
        stored = (metadata.storage_data or {}).get(MetadataIndex(name))
        where = getattr(stored, "relative_path", None)
        if not isinstance(where, str) or Path(where).name != where or getattr(stored, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"{name}: a value stored where laionkit does not read it ({stored!r})")
        with open(folder / where, "rb") as handle:
            handle.seek(stored.offset)
            data = handle.read(stored.length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any refusal or damage: the entry is not plain data
            raise pickle.UnpicklingError(f"{name}: {weights_error(error)}") from None


def one_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"
