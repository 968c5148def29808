"""Session fixtures shared across stages: tiny models, pack-format image shards, encode-format latent shards.

Imported by conftest.py. Image shards follow docs/FORMATS.md section 2 (what `laionkit pack` writes) and
are built from the real photos in ../shared/realdata/images; latent shards are `laionkit encode`'s output
on them with the tiny models, so downstream tests consume what the upstream stage really produces.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

# Captions chosen to exercise the text path: an empty one and one longer than CLIP's 77-token window.
CAPTIONS = {
    "123_456.jpg": "a narrow portrait photo of a street at dusk",
    "208_495.jpg": "",
    "321_421.jpg": "close-up of autumn leaves on wet stones",
    "389_535.jpg": "a dog running on the beach, golden hour, 35mm film",
    "416_264.jpg": " ".join(["an extremely detailed and very long caption describing a mountain lake"] * 12),
    "456_123.jpg": "panorama of a city skyline",
    "524_316.jpg": "Café table with croissant & coffee — morning light",
    "original.png": "a blurry photo of a flower in a garden",
}
SHARD_SIZE = 4  # 8 photos -> shards 00000.tar and 00001.tar


def _pack_sample(key: str, name: str, data: bytes, extension: str, index: int) -> dict:
    from PIL import Image

    width, height = Image.open(io.BytesIO(data)).size
    caption = CAPTIONS[name]
    meta = {
        "url": f"https://example.org/realdata/{name}", "caption": caption, "key": key, "status": "success",
        "error_message": None, "width": width, "height": height, "original_width": width,
        "original_height": height, "exif": None, "sha256": hashlib.sha256(data).hexdigest(),
        # score columns carried through from filter; encode must keep them in `source`
        "aesthetic": 4.5 + 0.25 * index, "punsafe": 0.01 * index, "pwatermark": 0.05,
    }
    return {"__key__": key, extension: data, "txt": caption, "json": json.dumps(meta)}


def write_image_shards(images: Path, output: Path) -> list[Path]:
    """WebDataset tars in pack's layout: <key>.jpg|png|webp, <key>.txt, <key>.json; keys like img2dataset's."""
    import webdataset as wds
    from PIL import Image

    output.mkdir(parents=True, exist_ok=True)
    names = sorted(CAPTIONS)
    shards = []
    for shard in range(0, len(names), SHARD_SIZE):
        path = output / f"{shard // SHARD_SIZE:05d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for index, name in enumerate(names[shard : shard + SHARD_SIZE], start=shard):
                data = (images / name).read_bytes()
                extension = name.rsplit(".", 1)[1]
                if name == "524_316.jpg":  # one WebP, as pack writes with --encode-format webp
                    buffer = io.BytesIO()
                    Image.open(io.BytesIO(data)).save(buffer, format="WEBP", quality=90)
                    data, extension = buffer.getvalue(), "webp"
                key = f"{shard // SHARD_SIZE:05d}{index % SHARD_SIZE:04d}"
                sink.write(_pack_sample(key, name, data, extension, index))
        shards.append(path)
    return shards


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A diffusers pipeline folder of tiny random-init models (`laionkit models tiny`)."""
    from laionkit.common.models import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def image_shards(tmp_path_factory, realdata) -> Path:
    """A pack-format folder with 00000.tar and 00001.tar holding the 8 real photos (one PNG, one WebP)."""
    folder = tmp_path_factory.mktemp("packed")
    write_image_shards(realdata / "images", folder)
    return folder


@pytest.fixture(scope="session")
def latent_shards(tmp_path_factory, image_shards, tiny_models) -> Path:
    """`laionkit encode` of image_shards with the tiny models at 64 px: 00000.tar, 00001.tar, manifest.json."""
    from laionkit.encode import EncodeConfig, run

    output = tmp_path_factory.mktemp("latents")
    run(EncodeConfig(shards=(str(image_shards),), output=output, model=str(tiny_models), resolution=64,
                     batch_size=4, workers=0, quiet=True))
    return output
