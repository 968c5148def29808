"""caption's reader, the DataLoader side: input units read as encode reads them (laionkit/encode/reader.py),
images decoded, batched per shard and preprocessed for the model in the workers.

A batch is up to --batch-size consecutive decodable samples of one shard, so which samples share a batch
depends only on the shard and the batch size, never on ranks or workers: outputs are identical for any split.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack

import torch.utils.data
from PIL import Image

from laionkit.common import LaionkitError
from laionkit.common.storage import Location
from laionkit.encode.reader import IMAGE_EXTENSIONS, ShardDone, output_name, unit_samples, worker_share


class SampleSkip(ValueError):
    """A sample that cannot be captioned: recorded in its shard's record with ``reason``, not written."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def members_of(sample: dict) -> dict[str, bytes]:
    """A sample's members as stored (webdataset's ``__key__`` / ``__url__`` fields left out), as bytes."""
    return {name: value if isinstance(value, bytes) else str(value).encode()
            for name, value in sample.items() if not name.startswith("__")}


def decode_image(members: dict[str, bytes]) -> Image.Image:
    """The sample's image as RGB, fully decoded (a truncated file fails here, not in the model's processor);
    its json must be an object when there is one, with ``captions`` and ``caption_model`` objects where it has
    them (the caption is added there)."""
    extension = next((ext for ext in IMAGE_EXTENSIONS if ext in members), None)
    if extension is None:
        raise SampleSkip("no_image", f"no image member ({', '.join(IMAGE_EXTENSIONS)})")
    if "json" in members:
        try:
            meta = json.loads(members["json"])
        except ValueError as error:
            raise SampleSkip("bad_json", f"json member: {error}") from None
        if not isinstance(meta, dict):
            raise SampleSkip("bad_json", f"json member is a {type(meta).__name__}, not an object")
        for field in ("captions", "caption_model"):  # where the caption goes: an object of name -> text
            if not isinstance(meta.get(field, {}), dict):
                raise SampleSkip("bad_json", f"json field {field!r} is a {type(meta[field]).__name__}, not an object")
    try:
        with Image.open(io.BytesIO(members[extension])) as image:
            return image.convert("RGB")
    except Exception as error:  # noqa: BLE001 - any decode failure is a recorded skip
        raise SampleSkip("undecodable", f"{type(error).__name__}: {error}") from None


def skip_record(key: str, error: SampleSkip | Exception) -> dict:
    return {"key": key, "reason": getattr(error, "reason", "unprocessable"), "error": f"{error}"[:500]}


class CaptionBatches(torch.utils.data.IterableDataset):
    """Batches of one rank's shards; DataLoader workers each take whole shards.

    Yields dicts {shard, keys, members (each sample's as stored), inputs (``prepare`` of the images)} and a
    ShardDone after each shard's last batch. ``prepare`` is the model's CPU side (the processor), run here
    in the workers; an image it refuses is a recorded skip (reason ``unprocessable``) and the rest of its
    batch is prepared again without it.
    """

    def __init__(self, shards: Sequence[Location], batch_size: int, prepare: Callable[[list[Image.Image]], object]):
        super().__init__()
        self.shards = list(shards)
        self.batch_size = batch_size
        self.prepare = prepare

    def __iter__(self) -> Iterator[dict | ShardDone]:
        for shard in worker_share(self.shards):
            yield from self.shard_batches(shard)

    def shard_batches(self, shard: Location) -> Iterator[dict | ShardDone]:
        shard = Location.parse(shard)
        done = ShardDone(output_name(shard), 0)
        pending: list[tuple[str, dict[str, bytes], Image.Image]] = []
        stream = ExitStack()
        try:
            for sample in unit_samples(shard, stream):
                done.samples_in += 1
                members = members_of(sample)
                try:
                    pending.append((sample["__key__"], members, decode_image(members)))
                except SampleSkip as error:
                    done.skips.append(skip_record(sample["__key__"], error))
                    continue
                if len(pending) == self.batch_size:
                    yield from self.batch(done, pending)
                    pending = []
        except (OSError, ValueError, tarfile.TarError) as error:
            raise LaionkitError(f"cannot read shard {shard}: {error}") from error
        finally:
            stream.close()
        if pending:
            yield from self.batch(done, pending)
        yield done

    def batch(self, done: ShardDone, items: list[tuple[str, dict[str, bytes], Image.Image]]) -> Iterator[dict]:
        try:
            inputs = self.prepare([image for _, _, image in items])
        except Exception:  # noqa: BLE001 - find the image the processor refuses; the rest are captioned
            kept = []
            for item in items:
                try:
                    self.prepare([item[2]])
                    kept.append(item)
                except Exception as error:  # noqa: BLE001 - recorded with its reason
                    done.skips.append(skip_record(item[0], error))
            if not kept:
                return
            items, inputs = kept, self.prepare([image for _, _, image in kept])
        yield {"shard": done.shard, "keys": [key for key, _, _ in items],
               "members": [members for _, members, _ in items], "inputs": inputs}
