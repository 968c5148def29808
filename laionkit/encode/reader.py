"""encode's reader: shard discovery from pack's done records, and the DataLoader side (ShardBatches):
read input units (tars, img2dataset parquet files or files folders), decode + resize + crop on CPU (or pass
JPEG bytes on), tokenize, batch by size, sample json records."""

from __future__ import annotations

import copy
import glob
import io
import json
import math
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.utils.data
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image

from laionkit.common import LaionkitError, split
from laionkit.common.caption_mix import ALT, scored
from laionkit.common.jpeg import joined
from laionkit.common.keys import KeepList
from laionkit.common.storage import Location
from laionkit.common.tars import count_samples, tar_files
from laionkit.encode.caption_scores import read_shard_scores

IMAGE_EXTENSIONS = ("jpg", "jpeg", "webp", "png")


# --- geometry: pure functions ------------------------------------------------------------------

def bucket_sizes(resolution: int, max_ratio: float = 2.0) -> list[tuple[int, int]]:
    """Aspect-ratio buckets of (about) resolution**2 pixels: sides step by resolution/8, rounded to 8 px.

    Each width gets the tallest height that keeps the area within resolution**2, as in NovelAI's
    bucketing; the square bucket is always present. Sorted by aspect ratio (w/h).
    """
    step = max(8, resolution // 8 // 8 * 8)
    area = resolution * resolution
    sizes = {(resolution, resolution)}
    for width in range(step, int(resolution * math.sqrt(max_ratio)) + 1, step):
        height = area // width // step * step
        if height >= step and 1 / max_ratio <= width / height <= max_ratio:
            sizes.add((width, height))
    return sorted(sizes, key=lambda size: (size[0] / size[1], size[0]))


def target_size(width: int, height: int, resolution: int, buckets: Sequence[tuple[int, int]] | None
                ) -> tuple[int, int]:
    """Square resolution, or the bucket nearest in log aspect ratio (ties go to the first)."""
    if not buckets:
        return resolution, resolution
    ratio = math.log(width / height)
    return min(buckets, key=lambda size: abs(math.log(size[0] / size[1]) - ratio))


def center_crop_box(width: int, height: int, out_width: int, out_height: int) -> tuple[int, int, int, int]:
    """The centred (left, top, width, height) region of the original with the output's aspect ratio,
    the largest that fits: resizing it to the output size is "resize the short side, centre-crop"."""
    scale = max(out_width / width, out_height / height)
    crop_width = min(width, round(out_width / scale))
    crop_height = min(height, round(out_height / scale))
    return (width - crop_width) // 2, (height - crop_height) // 2, crop_width, crop_height


# --- input shards ------------------------------------------------------------------------------

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # what webdataset reads (gzip through tarfile's r|*)
PARQUET_SUFFIX = ".parquet"  # img2dataset --output_format parquet: one row per sample, the image in a binary column
PACK_RECORD_SUFFIX = "_stats.json"  # pack's and img2dataset's per-shard done record
# An input unit (shard) is a tar, an img2dataset parquet file, or an img2dataset --output_format files
# folder (NNNNN/ of <key>.jpg, <key>.txt, <key>.json): each is encoded into one output tar named after it.
UNIT_KINDS = ("tar", "parquet", "files")


def shard_stem(path: Path | Location) -> str:
    return next(path.name.removesuffix(suffix) for suffix in SHARD_SUFFIXES + (PARQUET_SUFFIX, "")
                if path.name.endswith(suffix))


def unit_kind(path: Location) -> str:
    """tar, parquet or files: how an input unit is read (by its name; a folder is img2dataset's files format)."""
    if path.name.endswith(SHARD_SUFFIXES):
        return "tar"
    if path.name.endswith(PARQUET_SUFFIX):
        return "parquet"
    return "files" if path.is_dir() else "tar"


def output_name(path: Path | Location) -> str:
    """The output tar of an input shard: its name, as a plain .tar (lineage by name)."""
    return shard_stem(path) + ".tar"


def _pack_count(record: Location) -> int:
    record.refuse_special()
    try:
        return int(record.read_json()["successes"])
    except (OSError, ValueError, KeyError, TypeError, LaionkitError) as error:
        raise LaionkitError(f"{record}: not a pack / img2dataset shard record (no 'successes': {error})") from None


def find_shards(specs: Sequence[str], log: Callable[[str], None] = print,
                storage_options: dict | None = None, stage: str = "encode") -> dict[Location, int | None]:
    """Finished input shards from folders, files, globs and brace patterns, sorted, each with the sample
    count its done record gives (None for a plain webdataset folder, which has no records).

    A shard (input unit) is a tar, an img2dataset parquet file or an img2dataset files folder (``_folder_units``).
    pack renames a shard's tar into place before it writes ``<shard>_stats.json`` (img2dataset writes the
    same record for every output format), so in a folder with records a shard without one is unfinished and
    is left out (said once); a folder with no record at all is plain webdataset, whose shards are taken as
    complete (said once).
    In an object store, only objects with their done record are seen at all (laionkit.common.storage).
    """
    found: list[Location] = []
    for spec in specs:
        path = Location.parse(spec, storage_options)
        if path.is_dir():
            entries = path.list(complete_only=None)
            units = _folder_units(path, entries)
            for record in (p for p in entries if p.name.endswith(PACK_RECORD_SUFFIX)):
                stem = record.name.removesuffix(PACK_RECORD_SUFFIX)
                if not any(shard_stem(unit) == stem for unit in units):
                    raise LaionkitError(f"{record} marks shard {stem} done but its {unit_kind(units[0])} shard is "
                                        f"missing from {path}")
            found += units
            continue
        if path.local:
            matches = [Location("", name) for pattern in braceexpand(spec) for name in sorted(glob.glob(pattern))]
        else:
            matches = [match for pattern in braceexpand(spec)
                       for match in ([Location.parse(pattern, storage_options)] if not glob.has_magic(pattern)
                                     else Location.parse(pattern, storage_options).parent.glob(
                                         Location.parse(pattern).name))
                       if match.exists()]
        if not matches:
            raise LaionkitError(f"input shard {spec} does not exist")
        found += matches
    found = sorted(set(found), key=str)
    for path in found:
        path.refuse_special()
    names = Counter(output_name(path) for path in found)
    clashes = [name for name, count in names.items() if count > 1]
    if clashes:
        raise LaionkitError(f"input shards share the name {clashes[0]} (outputs are named after inputs)")
    shards: dict[Location, int | None] = {}
    unfinished: list[Location] = []
    plain: set[Location] = set()
    with_records = {folder for folder in {path.parent for path in found}
                    if folder.list("*" + PACK_RECORD_SUFFIX, complete_only=None)}
    for path in found:
        record = path.parent / (shard_stem(path) + PACK_RECORD_SUFFIX)
        if record.is_complete() and not record.is_dir():
            shards[path] = _pack_count(record)
        elif path.parent in with_records:
            unfinished.append(path)
        else:
            shards[path] = None
            plain.add(path.parent)
    if unfinished:
        log(f"laionkit {stage}: left out {len(unfinished)} shard(s) without a done record <shard>"
            f"{PACK_RECORD_SUFFIX} (unfinished pack?): {', '.join(str(p) for p in unfinished[:5])}"
            + (" ..." if len(unfinished) > 5 else ""))
    for folder in sorted(plain, key=str):
        log(f"laionkit {stage}: {folder} has no shard records (*{PACK_RECORD_SUFFIX}): taking its shards as "
            "complete (plain webdataset)")
    if not shards:
        raise LaionkitError(f"no finished shards in {', '.join(specs)}: every tar lacks its done record "
                            f"<shard>{PACK_RECORD_SUFFIX}")
    return shards


def _folder_units(path: Location, entries: list[Location]) -> list[Location]:
    """A shard folder's input units, in img2dataset's output formats: webdataset tars, else files folders
    (NNNNN/), else parquet files. img2dataset writes a metadata parquet beside each tar or folder, so
    parquet files are units only where there is neither."""
    tars = [p for p in entries if p.name.endswith(SHARD_SUFFIXES)]
    if tars:
        return tars
    folders = [p for p in entries if not p.name.startswith("_") and "." not in p.name and p.is_dir()]
    if folders:
        return folders
    parquets = [p for p in entries if p.name.endswith(PARQUET_SUFFIX)]
    if parquets:
        return parquets
    if any(p.name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS for p in entries if "." in p.name):
        return [path]  # one files folder given by itself
    raise LaionkitError(f"no input shards in {path}: no tars ({', '.join('*' + s for s in SHARD_SUFFIXES)}), "
                        f"no img2dataset files folders (NNNNN/) and no img2dataset parquet files (*{PARQUET_SUFFIX})")


def _parquet_image_column(shard: Location, schema) -> str:
    """The binary image column of an img2dataset parquet shard (named after --encode_format)."""
    found = next((name for name in IMAGE_EXTENSIONS if name in schema.names), None)
    if found is None:
        raise LaionkitError(f"{shard} has no image column ({', '.join(IMAGE_EXTENSIONS)}; columns: "
                            f"{', '.join(schema.names[:12])}): img2dataset's metadata parquet, not its parquet "
                            "output format; encode the tars or files folders beside it")
    return found


def _files_members(shard: Location) -> dict[str, list[Location]]:
    """A files-format folder's samples: key (the name up to its first dot, as webdataset groups) -> files."""
    samples: dict[str, list[Location]] = {}
    for entry in shard.list(complete_only=None):
        entry.refuse_special()
        if "." in entry.name:
            samples.setdefault(entry.name.split(".", 1)[0], []).append(entry)
    return dict(sorted(samples.items()))


def count_unit(shard: Location) -> int:
    """Samples in an input unit without decoding any: a tar's headers (common.tars), a parquet shard's rows
    that hold an image (img2dataset keeps failed downloads as rows without one; its record counts only the
    successes), a files folder's keys."""
    kind = unit_kind(shard)
    if kind == "tar":
        return count_samples(shard)
    try:
        if kind == "files":
            return len(_files_members(shard))
        import pyarrow.parquet as pq

        with shard.open_read() as handle:
            parquet = pq.ParquetFile(handle)
            column = _parquet_image_column(shard, parquet.schema_arrow)
            index = parquet.schema_arrow.names.index(column)
            groups = [parquet.metadata.row_group(i) for i in range(parquet.metadata.num_row_groups)]
            stats = [group.column(index).statistics for group in groups]
            if all(stat is not None and stat.has_null_count for stat in stats):
                return sum(group.num_rows - stat.null_count for group, stat in zip(groups, stats))
            return len(parquet.read(columns=[column]).column(0).drop_null())
    except (OSError, ValueError) as error:
        raise LaionkitError(f"cannot read shard {shard}: {error}") from None


def unit_samples(shard: Location, stream: ExitStack) -> Iterator[dict]:
    """An input unit's samples as webdataset gives a tar's: ``__key__`` and member name -> bytes (image,
    txt, json, ...). A parquet row's columns other than the image and txt become its json, as img2dataset
    writes them beside a tar's image."""
    kind = unit_kind(shard)
    if kind == "tar":
        if shard.local:  # read from its headers (common.tars), webdataset's members exactly
            files = tar_files(shard.path, str(shard))
        else:  # one sequential pass: a remote tar is streamed with read-ahead, so downloads overlap decoding
            handle = stream.enter_context(shard.open_read(prefetch=4))
            files = wds.tariterators.tar_file_expander([{"url": str(shard), "stream": handle}])
        yield from wds.tariterators.group_by_keys(files)
    elif kind == "files":
        for key, members in _files_members(shard).items():
            yield {"__key__": key, **{member.name.split(".", 1)[1]: member.read_bytes() for member in members}}
    else:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(stream.enter_context(shard.open_read()))
        image = _parquet_image_column(shard, parquet.schema_arrow)
        row = -1
        for batch in parquet.iter_batches(batch_size=256):
            for values in batch.to_pylist():
                row += 1
                data = values.pop(image)
                if data is None:  # a failed download: not a sample (img2dataset's record does not count it)
                    continue
                sample = {"__key__": str(values.get("key") or f"{row:09d}"), image: data}
                caption = values.pop("txt", None)
                if caption is not None:
                    sample["txt"] = str(caption).encode()
                sample["json"] = json.dumps(values, default=str).encode()
                yield sample


def check_count(shard: Location, expected: int | None, found: int) -> None:
    """A tar cut at a member boundary reads as a valid, shorter tar: only the done record tells."""
    if expected is not None and found != expected:
        raise LaionkitError(f"{shard} holds {found} samples but its done record "
                            f"{shard_stem(shard)}{PACK_RECORD_SUFFIX} says {expected}: truncated or changed "
                            "since pack; repack it")


def rank_todo(shards: Sequence[Location], inputs: dict, rank, complete: Callable[[Location, int], bool],
              ) -> tuple[dict[Location, int], list[Location]]:
    """This rank's input units (common.ranks.split) with their sample counts, and those still to do:
    ``complete(shard, samples)`` (the stage's own done record) decides. Encode, score and caption resume per
    shard this way.

    A unit with a done record (pack's, img2dataset's) takes its count from the record, so a stage starts without
    reading every unit's headers first (a serial scan of each tar: seconds on a local folder, minutes through an
    object store); what the stage then reads is held to that count when it has read the unit (``checked_reads``).
    A unit without a record (plain webdataset) is counted from its headers here."""
    counts = {shard: inputs[shard] if inputs[shard] is not None else count_unit(shard) for shard in split(shards, rank)}
    return counts, [shard for shard, samples in counts.items() if not complete(shard, samples)]


def checked_reads(todo: Sequence[Location], inputs: dict, name: Callable[[Location], str] = output_name,
                  ) -> Callable[[ShardDone], ShardDone]:
    """What rank_todo took from the done records, checked once a stage has read a unit: the samples it read
    against the record's count (check_count), before the stage writes anything of the unit. ``name``: what the
    stage's ShardDone calls a unit (encode and caption: its output tar; score: its stem). Returns the ShardDone
    it was given."""
    expected = {name(shard): (shard, inputs[shard]) for shard in todo}

    def check(done: ShardDone) -> ShardDone:
        shard, count = expected[done.shard]
        check_count(shard, count, done.samples_in)
        return done

    return check


def worker_share(shards: Sequence) -> list:
    """The whole shards this DataLoader worker reads: worker w of W takes shards w, w + W, ... (all of them in
    the main process), so a shard's batches come from one worker, in order."""
    worker = torch.utils.data.get_worker_info()
    return list(shards) if worker is None else list(shards[worker.id :: worker.num_workers])


# --- DataLoader side: decode, resize, tokenize, batch --------------------------------------------

@dataclass
class ShardDone:
    """End-of-shard marker: travels behind the shard's last batch through every stage."""

    shard: str
    samples_in: int
    skips: list[dict] = field(default_factory=list)
    not_kept: int = 0  # samples left out by a keep list (encode --keep): counted, not skipped


def original_size(meta: dict | None, width: int, height: int) -> tuple[int, int]:
    """The photo's size before pack resized it (img2dataset's original_width/height), for SDXL-style
    size conditioning; the shard image's own size when the json does not say."""
    try:
        found = int(meta["original_width"]), int(meta["original_height"])
    except (TypeError, KeyError, ValueError):
        return width, height
    return found if min(found) > 0 else (width, height)


def crop_top_left(box: tuple[int, int, int, int], size: tuple[int, int]) -> list[int]:
    """[top, left] of the crop in pixels of the image resized so the crop becomes ``size``: what
    diffusers' SDXL script records as crop_top_left (resize the short side, then centre-crop)."""
    left, top, crop_width, crop_height = box
    return [round(top * size[1] / crop_height), round(left * size[0] / crop_width)]


# Where a sample's caption is looked for, in this order, the first non-empty one winning: pack and
# img2dataset write .txt (and json "caption"); other tools write .caption members or keep LAION's
# parquet column names (json "text" / "TEXT"). `encode --caption-key` names the one place instead.
CAPTION_MEMBERS = ("txt", "caption")
CAPTION_JSON_KEYS = ("caption", "text", "TEXT")


def _as_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _member_text(value) -> str:
    """A caption file's text without its line end: editors and ``echo`` end a .txt with one, which the LLM
    text encoders' tokenizers would encode as a token of the caption."""
    return _as_text(value).rstrip("\r\n")


def caption_of(sample: dict, meta: dict | None, key: str | None = None) -> str:
    """A sample's caption: ``key`` (a member, else a json key) when given, else the first non-empty of
    the .txt and .caption members and json caption / text / TEXT; "" when there is none (counted as an
    empty caption in the shard's record)."""
    meta = meta if isinstance(meta, dict) else {}
    if key is not None:
        return _member_text(sample[key]) if key in sample else _as_text(meta.get(key))
    for text in (*(_member_text(sample.get(member)) for member in CAPTION_MEMBERS),
                 *(_as_text(meta.get(name)) for name in CAPTION_JSON_KEYS)):
        if text.strip():
            return text
    return ""


def check_caption_key(shard: Location, key: str) -> None:
    """``--caption-key`` names a member or json key some sample of ``shard`` has (read until one does): a key
    no sample has (img2dataset stores LAION's TEXT as ``caption``) would encode every caption empty."""
    first = None
    with ExitStack() as stream:
        for sample in unit_samples(shard, stream):
            try:
                meta = json.loads(sample["json"]) if "json" in sample else {}
            except ValueError:
                meta = {}
            meta = meta if isinstance(meta, dict) else {}
            if key in sample or key in meta:
                return
            first = first or (sample, meta)
    if first is not None:
        sample, meta = first
        members = ", ".join(name for name in sample if not name.startswith("__"))
        raise LaionkitError(f"--caption-key {key}: no sample of {shard} has a member or json key {key!r} "
                            f"(sample {sample['__key__']}: members {members}; json keys {', '.join(meta) or 'none'})")


def drafted_box(box: tuple[int, int, int, int], scale: tuple[float, float]) -> tuple[float, float, float, float]:
    """The crop ``box`` (left, top, width, height in original pixels) as a PIL resize box in an image
    decoded at ``scale`` (x, y). JPEG's reduced-size decode rounds the drafted size up (257 px at 1/2 is
    129 px), so the scale must be the DCT factor PIL reports, not drafted size / original size: the
    latter overshoots and puts the box past the decoded image's edge."""
    left, top, crop_width, crop_height = box
    return (left * scale[0], top * scale[1], (left + crop_width) * scale[0], (top + crop_height) * scale[1])


def resize_rgb(data: bytes, size: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray:
    """Decode on CPU (JPEG at a reduced DCT scale when the crop is >= 2x the output) -> (H, W, 3) uint8."""

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        _, _, crop_width, crop_height = box
        drafted = image.draft("RGB", (math.ceil(width * size[0] / crop_width),
                                      math.ceil(height * size[1] / crop_height)))
        # draft returns the original's extent in drafted pixels (e.g. 128.5 for 257 px at 1/2).
        scale = (drafted[1][2] / width, drafted[1][3] / height) if drafted else (1.0, 1.0)
        image = image.convert("RGB")
        if image.size == size and (crop_width, crop_height) == size:
            return np.asarray(image)
        return np.asarray(image.resize(size, Image.Resampling.BICUBIC, box=drafted_box(box, scale)))


class ShardBatches(torch.utils.data.IterableDataset):
    """Iterable over batches of one rank's shards; DataLoader workers each take whole shards.

    Yields dicts (one size, one shard, <= batch_size samples) and a ShardDone after each shard.
    Per-sample problems (no image, undecodable) become recorded skips; a broken tar is an error.
    """

    def __init__(self, shards: Sequence[Location], tokenizer, resolution: int,
                 buckets: Sequence[tuple[int, int]] | None, batch_size: int, gpu_decode: bool,
                 caption_key: str | None = None, keep: KeepList | None = None,
                 captions: Sequence[str] | None = None, caption_scores: Location | None = None) -> None:
        super().__init__()
        self.caption_scores = caption_scores  # --caption-scores: score's scores/ folder, joined per shard and key
        self.caption_key = caption_key
        self.keep = keep
        self.captions = tuple(captions) if captions else None  # --captions: several per sample
        self.shards = list(shards)
        # Its own copy: a fast tokenizer's padding and truncation are state of one Rust object, set on each call.
        # With --workers 0 this reader runs in the prepare thread while the main thread tokenizes the same
        # batch's captions for the text encoder (padding="max_length"); sharing the object let a call here
        # (padding=False) land between the other's settings and its encode: unpadded, ragged ids (seen with
        # Z-Image's Qwen tokenizer, about one encode in ten).
        self.tokenizer = copy.deepcopy(tokenizer)
        self.resolution = resolution
        self.buckets = list(buckets) if buckets else None
        self.batch_size = batch_size
        self.gpu_decode = gpu_decode

    def __iter__(self) -> Iterator[dict | ShardDone]:
        for shard in worker_share(self.shards):
            yield from self.shard_batches(shard)

    def shard_batches(self, shard: Location | Path) -> Iterator[dict | ShardDone]:
        shard = Location.parse(shard)
        pending: dict[tuple[int, int], list[dict]] = {}
        done = ShardDone(output_name(shard), 0)
        stem = shard_stem(shard)
        scores = (read_shard_scores(self.caption_scores, stem, self.captions)
                  if self.caption_scores is not None else None)
        stream = ExitStack()
        try:
            for sample in unit_samples(shard, stream):
                done.samples_in += 1
                if self.keep is not None and not self.keep.kept(stem, sample["__key__"]):
                    done.not_kept += 1
                    continue
                try:
                    item = self.prepare(sample, scores)
                except Exception as error:  # noqa: BLE001 - any decode failure is a recorded skip
                    done.skips.append({"key": sample["__key__"], "reason": getattr(error, "reason", "undecodable"),
                                       "error": f"{type(error).__name__}: {error}"})
                    continue
                group = pending.setdefault(item["size"], [])
                group.append(item)
                if len(group) == self.batch_size:
                    yield self.collate(done.shard, pending.pop(item["size"]))
        except (OSError, ValueError, tarfile.TarError) as error:
            raise LaionkitError(f"cannot read shard {shard}: {error}") from error
        finally:
            stream.close()
        for size in sorted(pending):
            yield self.collate(done.shard, pending[size])
        yield done

    def prepare(self, sample: dict, scores: dict[str, dict[str, float]] | None = None) -> dict:
        """One sample's decode plan and captions; ``scores`` ({key: {name: score}}, encode --caption-scores)
        replace json caption_scores when given."""
        extension = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
        try:
            meta = json.loads(sample["json"]) if "json" in sample else None
        except ValueError as error:
            error.reason = "bad_json"
            raise
        if extension is None:
            error = ValueError(f"no image member ({', '.join(IMAGE_EXTENSIONS)})")
            error.reason = "no_image"
            raise error
        data = sample[extension]
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            on_gpu = self.gpu_decode and image.format == "JPEG" and image.mode in ("RGB", "L")
        size = target_size(width, height, self.resolution, self.buckets)
        box = center_crop_box(width, height, *size)
        item = {
            "key": sample["__key__"], "size": size, "box": box, "image_size": (width, height),
            "original_size": original_size(meta, width, height),
            "caption": caption_of(sample, meta, self.caption_key), "source": meta,
        }
        if self.captions:
            item.update(named_captions(sample, meta, self.captions, self.caption_key))
            if scores is not None:  # the join is the only source (laionkit.encode.caption_scores)
                found = scores.get(sample["__key__"], {})
                item["scores"] = {name: found.get(name) for name in item["texts"]}
            item["caption"] = next(iter(item["texts"].values()))
        if on_gpu:
            item["jpeg"] = data
        else:
            item["pixels"] = resize_rgb(data, size, box)
        return item

    def token_ids(self, captions: list[str]) -> tuple[torch.Tensor, list[int], list[bool]]:
        """The first tokenizer's ids of ``captions`` padded to its window (a longer caption cut to window - 1
        tokens + EOS), each caption's token count and whether it was cut."""
        window = self.tokenizer.model_max_length
        ids = self.tokenizer(captions, truncation=False, padding=False, verbose=False).input_ids
        input_ids = torch.full((len(captions), window), self.tokenizer.pad_token_id, dtype=torch.long)
        counts, cut = [], []
        for row, tokens in enumerate(ids):
            truncated = len(tokens) > window
            if truncated:
                tokens = tokens[: window - 1] + [self.tokenizer.eos_token_id]
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            counts.append(len(tokens))
            cut.append(truncated)
        return input_ids, counts, cut

    def collate(self, shard: str, items: list[dict]) -> dict:
        input_ids, counts, cut = self.token_ids([item["caption"] for item in items])
        named = self.collate_captions(items) if self.captions else None
        records = []
        for row, item in enumerate(items):
            records.append({
                "caption": item["caption"], "num_tokens": counts[row], "truncated": cut[row],
                "original_size": list(item["original_size"]), "image_size": list(item["image_size"]),
                "crop": list(item["box"]), "crop_top_left": crop_top_left(item["box"], item["size"]),
                "size": list(item["size"]), "target_size": list(item["size"]),
                "bucket": list(item["size"]) if self.buckets else None,
                "source": item["source"],
                **(named["records"][row] if named else {}),
            })
        cpu_rows = [row for row, item in enumerate(items) if "pixels" in item]
        gpu_rows = [row for row, item in enumerate(items) if "jpeg" in item]
        return {
            "shard": shard, "size": items[0]["size"], "keys": [item["key"] for item in items],
            "records": records, "input_ids": input_ids,
            **({key: named[key] for key in ("caption_ids", "caption_texts", "present", "caption_skips")}
               if named else {}),
            "cpu_rows": cpu_rows,
            "pixels": torch.from_numpy(np.stack([items[row]["pixels"] for row in cpu_rows])) if cpu_rows else None,
            "gpu_rows": gpu_rows,
            # --decode gpu's files end to end in one tensor, with their lengths (common.jpeg.joined)
            "jpegs": joined([items[row]["jpeg"] for row in gpu_rows]),
            "jpeg_sizes": [len(items[row]["jpeg"]) for row in gpu_rows],
            "boxes": [items[row]["box"] for row in gpu_rows],
        }

    def collate_captions(self, items: list[dict]) -> dict:
        """--captions: per name, every row's ids and text ("" where the sample lacks it: encoded with the
        rest of the batch and dropped, so a caption's states never depend on which others a sample has),
        each row's names (its first caption first) and json ``caption_name`` / ``captions``, and the
        captions skipped."""
        ids, texts, found = {}, {}, {}
        for name in self.captions:
            texts[name] = [item["texts"].get(name, "") for item in items]
            ids[name], counts, cut = self.token_ids(texts[name])
            found[name] = list(zip(counts, cut))
        records, present = [], []
        for row, item in enumerate(items):
            names = [name for name in self.captions if name in item["texts"]]
            present.append(names)
            records.append({"caption_name": names[0], "captions": {name: {
                "text": item["texts"][name], "num_tokens": found[name][row][0], "truncated": found[name][row][1],
                **({"score": item["scores"][name]} if item["scores"].get(name) is not None else {})}
                for name in names}})
        return {"caption_ids": ids, "caption_texts": texts, "present": present, "records": records,
                "caption_skips": [skip for item in items for skip in item["caption_skips"]]}


def caption_texts(sample: dict, meta: dict | None, names: Sequence[str], caption_key: str | None
                  ) -> tuple[dict[str, str], list[dict]]:
    """The one resolution of caption names (laionkit.common.caption_mix), for encode and score: ``texts`` {name: text}
    of those the sample has, in ``names`` order, and a caption skip (key, caption, reason) per name it lacks
    (json captions[NAME] absent, blank or not text). ``alt`` is caption_of's, as encode always took it (an
    empty one counts as present: encoded and counted as an empty caption)."""
    meta = meta if isinstance(meta, dict) else {}
    given = meta.get("captions") if isinstance(meta.get("captions"), dict) else {}
    texts, skips = {}, []
    for name in names:
        if name == ALT:
            texts[name] = caption_of(sample, meta, caption_key)
            continue
        value = given.get(name)
        if isinstance(value, str) and value.strip():
            texts[name] = value
        else:
            skips.append({"key": sample["__key__"], "caption": name,
                          "reason": "missing" if value is None or isinstance(value, str) else "not_text"})
    return texts, skips


def named_captions(sample: dict, meta: dict | None, names: Sequence[str], caption_key: str | None) -> dict:
    """A sample's ``--captions`` (caption_texts): ``texts``, ``scores`` {name: CLIP score or None} (json
    caption_scores), ``caption_skips``. A sample with none of them is skipped."""
    texts, skips = caption_texts(sample, meta, names, caption_key)
    if not texts:
        error = ValueError(f"none of the captions {', '.join(names)} (json captions[NAME]): "
                           + ", ".join(f"{skip['caption']} {skip['reason']}" for skip in skips))
        error.reason = "no_caption"
        raise error
    return {"texts": texts, "scores": {name: scored(meta, name) for name in texts}, "caption_skips": skips}
