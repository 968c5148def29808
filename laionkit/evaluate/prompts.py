"""The prompts an evaluation generates for, and the reference images it compares against.

Prompts come from a text file (one per line, blank lines skipped) or from the captions of an encode
output folder (``--val-latents``: shards by name, samples in tar order), the first N; fewer than N are
cycled, each repeat with its own seed, so N images are always generated.

Reference images come from a folder of image files (sorted by name, not recursive) or from pack's
webdataset tars (a folder of ``*.tar`` or tar files); each is centre-cropped to a square and resized to
the generated images' size with PIL's bicubic filter (clean-fid's finding: resize with an antialiasing
filter, the same one for both sets), so FID compares content, not resampling artefacts.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from laionkit.common import LaionkitError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def read_prompts(prompt_file: Path | None, val_latents: Path | None, count: int) -> list[str]:
    """``count`` prompts from exactly one of the two sources, cycled where there are fewer."""
    if (prompt_file is None) == (val_latents is None):
        raise LaionkitError("give one of --prompts FILE or --val-latents DIR")
    if prompt_file is not None:
        if not Path(prompt_file).is_file():
            raise LaionkitError(f"--prompts {prompt_file}: no such file")
        prompts = [line.strip() for line in Path(prompt_file).read_text().splitlines() if line.strip()]
        source = f"--prompts {prompt_file}"
    else:
        prompts = latent_captions(val_latents if "://" in str(val_latents) else Path(val_latents), count)
        source = f"--val-latents {val_latents}"
    if not prompts:
        raise LaionkitError(f"{source}: no prompts in it")
    return [prompts[i % len(prompts)] for i in range(count)]


def latent_captions(folder: Path | str, count: int) -> list[str]:
    """The first ``count`` captions of an encode output folder (a path, or a URL train streams from)."""
    import webdataset as wds

    from laionkit.trainer.latent_stream import shard_paths

    if "://" not in str(folder) and not Path(folder).is_dir():
        raise LaionkitError(f"--val-latents {folder}: no such folder")
    captions = []
    for shard in shard_paths(folder):
        opened = [{"url": str(shard), "stream": shard.open_read()}]
        for sample in wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander(opened)):
            captions.append(json.loads(sample["json"]).get("caption", "") if "json" in sample else "")
            if len(captions) == count:
                return captions
    return captions


def _reference_files(source: Path) -> Iterator[tuple[str, bytes | None]]:
    """(name, encoded bytes) of every image in a folder of images or of webdataset tars; None for a file that
    cannot be read (no permission, or not a regular file: a FIFO would wait for a writer), a counted skip."""
    if source.is_file() and source.suffix == ".tar":
        tars, files = [source], []
    elif source.is_dir():
        tars = sorted(p for p in source.glob("*.tar") if p.is_file())
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    else:
        raise LaionkitError(f"--reference {source}: no such folder or tar file")
    for path in files:
        try:
            yield str(path), path.read_bytes() if path.is_file() else None
        except OSError:
            yield str(path), None
    for tar in tars:
        try:
            with tarfile.open(tar) as archive:
                for member in archive:
                    if member.isfile() and Path(member.name).suffix.lower() in IMAGE_SUFFIXES:
                        yield f"{tar}:{member.name}", archive.extractfile(member).read()
        except (tarfile.TarError, OSError) as error:
            raise LaionkitError(f"--reference {tar}: cannot read the tar ({error})") from None


def square(image, size: int):
    """Centre crop to a square, then bicubic resize to ``size``."""
    from PIL import Image

    image = image.convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)


def reference_images(source: Path, size: int | None, limit: int = 0) -> tuple[np.ndarray | None, int]:
    """(N, size, size, 3) uint8 reference images and the number of files skipped: unreadable, not an image,
    cut short, or a decompression bomb (more pixels than Pillow's limit). ``size`` None: only opened (their
    headers read, so bombs and unreadable files are found), for the check before anything is generated;
    the images are then None."""
    from PIL import Image

    images, skipped = [], 0
    for _name, data in _reference_files(Path(source)):
        try:
            if data is None:
                raise OSError("unreadable")
            with Image.open(io.BytesIO(data)) as image:
                images.append(np.asarray(square(image, size)) if size is not None else None)
        except Exception:  # noqa: BLE001 - any unreadable image (Pillow's bomb error too) is a counted skip
            skipped += 1
            continue
        if limit and len(images) == limit:
            break
    if len(images) < 2:
        raise LaionkitError(f"--reference {source}: {len(images)} readable images ({skipped} skipped); FID and "
                            "KID need at least 2")
    return (np.stack(images) if size is not None else None), skipped
