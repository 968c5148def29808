"""laionkit encode on pack-format shards of the real photos, with the tiny models, on CPU."""

from __future__ import annotations

import io
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import run_cli
from fixtures import CAPTIONS, cut_before_sample, pack_folder, write_image_shards
from PIL import Image

import laionkit.encode as encode_stage
from laionkit.common import LaionkitError, write_json
from laionkit.common.models import load_text_encoder, load_tokenizer, load_vae
from laionkit.encode import (
    EncodeConfig,
    ShardBatches,
    _gpu_batch,
    bucket_sizes,
    center_crop_box,
    run,
    target_size,
)


def encode(shards, output, models, **options):
    options = {"resolution": 64, "batch_size": 4, "workers": 0, "quiet": True, **options}
    return run(EncodeConfig(shards=(str(shards),), output=Path(output), model=str(models), **options))


def read_shard(path: Path) -> list[dict]:
    """Plain webdataset, no laionkit: what a user's own training loop would do."""
    samples = []
    for sample in wds.WebDataset(str(path), shardshuffle=False):
        samples.append({
            "key": sample["__key__"],
            "moments": np.load(io.BytesIO(sample["moments.npy"])),
            "text": np.load(io.BytesIO(sample["text.npy"])),
            "json": json.loads(sample["json"]),
        })
    return samples


def tar_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.tar"))}


def input_keys(path: Path) -> list[str]:
    return [sample["__key__"] for sample in wds.WebDataset(str(path), shardshuffle=False)]


# --- geometry ------------------------------------------------------------------------------------

@pytest.mark.parametrize("resolution", [64, 256, 512, 1024])
def test_buckets_have_equal_area_and_latent_friendly_sides(resolution):
    sizes = bucket_sizes(resolution)
    assert (resolution, resolution) in sizes
    for width, height in sizes:
        assert width % 8 == 0 and height % 8 == 0
        assert 0.75 * resolution**2 <= width * height <= resolution**2
        assert 0.5 <= width / height <= 2
    assert len(sizes) == len(set(sizes)) >= 5


@pytest.mark.parametrize("width, height", [(123, 456), (456, 123), (389, 535), (524, 316), (500, 500)])
def test_nearest_bucket_and_center_crop(width, height):
    sizes = bucket_sizes(256)
    chosen = target_size(width, height, 256, sizes)
    distance = lambda size: abs(math.log(size[0] / size[1]) - math.log(width / height))  # noqa: E731
    assert distance(chosen) == min(distance(size) for size in sizes)
    left, top, crop_width, crop_height = center_crop_box(width, height, *chosen)
    assert 0 <= left and 0 <= top and left + crop_width <= width and top + crop_height <= height
    assert crop_width == width or crop_height == height  # the largest centred crop
    assert abs(crop_width / crop_height - chosen[0] / chosen[1]) < 0.02
    assert target_size(width, height, 256, None) == (256, 256)


def random_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """Web photo sizes: sides 257-2000 px, any aspect, plus the sizes whose rounding once broke the crop."""
    rng = np.random.default_rng(seed)
    sizes = [(257, 2000), (2000, 257), (513, 1999), (1031, 777), (259, 1283)]
    return sizes + [tuple(int(side) for side in rng.integers(257, 2001, size=2)) for _ in range(count - len(sizes))]


def test_crop_boxes_fit_every_decode_of_500_web_sizes():
    """Pure geometry of both decode paths. The CPU path resizes from a JPEG decoded at 1/1..1/8 (PIL
    draft: ceil(side / s) pixels); the GPU path slices the crop out of the full-size nvjpeg decode."""
    all_buckets = {resolution: bucket_sizes(resolution) for resolution in (64, 256, 512, 1024)}
    for width, height in random_sizes(500, seed=1):
        full = np.broadcast_to(np.zeros((), np.uint8), (height, width))  # a decoded image's shape, no memory
        for resolution, sizes in all_buckets.items():
            for buckets in (None, sizes):
                size = target_size(width, height, resolution, buckets)
                box = center_crop_box(width, height, *size)
                left, top, crop_width, crop_height = box
                assert 0 <= left and 0 <= top and left + crop_width <= width and top + crop_height <= height
                assert abs(crop_width / crop_height - size[0] / size[1]) < 0.02 or min(crop_width, crop_height) < 64
                assert full[top : top + crop_height, left : left + crop_width].shape == (crop_height, crop_width)
                for factor in (1, 2, 4, 8):
                    scaled = encode_stage.drafted_box(box, (1 / factor, 1 / factor))
                    assert 0 <= scaled[0] < scaled[2] <= math.ceil(width / factor)
                    assert 0 <= scaled[1] < scaled[3] <= math.ceil(height / factor)


def smooth_jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth colour fields): compression artefacts stay small next to the content."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    coarse.resize((width, height), Image.Resampling.BICUBIC).save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def full_decode(data: bytes, size: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray:
    """The reference: plain PIL, full-size decode, crop, bicubic resize."""
    left, top, crop_width, crop_height = box
    image = Image.open(io.BytesIO(data)).convert("RGB").crop((left, top, left + crop_width, top + crop_height))
    return np.asarray(image.resize(size, Image.Resampling.BICUBIC), dtype=np.float32)


@pytest.fixture(scope="module")
def web_jpegs(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    shard = tmp_path_factory.mktemp("web") / "00000.tar"
    images = {f"{index:09d}": smooth_jpeg(width, height, index)
              for index, (width, height) in enumerate(random_sizes(32, seed=2))}
    with wds.TarWriter(str(shard)) as sink:
        for key, data in images.items():
            sink.write({"__key__": key, "jpg": data, "txt": "a photo"})
    return shard, images


@pytest.mark.parametrize("resolution, buckets", [(256, False), (256, True), (512, False)])
def test_shrunk_jpegs_are_never_skipped_and_match_a_full_decode(web_jpegs, tiny_models, resolution, buckets):
    shard, images = web_jpegs
    tokenizer = load_tokenizer(str(tiny_models))
    sizes = bucket_sizes(resolution) if buckets else None
    for gpu_decode in (False, True):  # True: the nvjpeg path's code, with torchvision's CPU decoder
        items = list(ShardBatches([shard], tokenizer, resolution, sizes, 8, gpu_decode).shard_batches(shard))
        done = items.pop()
        assert done.samples_in == len(images) and done.skips == []
        seen = 0
        for batch in items:
            pixels = _gpu_batch(batch, torch.device("cpu"), torch.float32)["pixels"]
            assert batch.get("skips", []) == []
            for key, record, image in zip(batch["keys"], batch["records"], pixels):
                got = ((image.permute(1, 2, 0) + 1) * 127.5).numpy()
                expected = full_decode(images[key], tuple(record["size"]), tuple(record["crop"]))
                assert got.shape == expected.shape
                # Reduced-DCT decodes and antialiased bicubic differ from a full decode by a few levels.
                assert np.abs(got - expected).mean() < 3.0, (key, record["image_size"], record["size"])
                seen += 1
        assert seen == len(images)


# --- outputs -------------------------------------------------------------------------------------

def test_stored_moments_equal_a_plain_diffusers_encode(latent_shards, tiny_models, realdata):
    """Each stored posterior is diffusers' own vae.encode of the photo, preprocessed by hand with PIL + numpy:
    the largest centred square, bicubic to 64 px, [-1, 1]. Like encode, a JPEG whose square is >= 2x the
    output is decoded at PIL's reduced DCT scale (draft) first; the others are decoded at full size."""
    vae = load_vae(str(tiny_models))
    stored = {s["json"]["source"]["url"].rsplit("/", 1)[1]: s for shard in ("00000.tar", "00001.tar")
              for s in read_shard(latent_shards / shard)}
    expected = {}
    for name in ("123_456.jpg", "321_421.jpg", "389_535.jpg", "416_264.jpg", "456_123.jpg", "original.png"):
        image = Image.open(realdata / "images" / name)
        width, height = image.size
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        image.draft("RGB", (math.ceil(width * 64 / side), math.ceil(height * 64 / side)))
        scale = 1 / 2 ** round(math.log2(width / image.width))  # JPEG decodes at 1/1, 1/2, 1/4 or 1/8
        box = (left * scale, top * scale, (left + side) * scale, (top + side) * scale)
        image = image.convert("RGB").resize((64, 64), Image.Resampling.BICUBIC, box=box)
        pixels = torch.from_numpy(np.asarray(image, np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
        with torch.no_grad():
            expected[name] = vae.encode(pixels).latent_dist.parameters[0].numpy()
    for name, moments in expected.items():
        np.testing.assert_allclose(stored[name]["moments"].astype(np.float32), moments, atol=2e-3, rtol=1e-2,
                                   err_msg=name)  # float16 storage


def test_lineage_keys_and_sample_fields(latent_shards, image_shards, tiny_models):
    tokenizer = load_tokenizer(str(tiny_models))
    assert sorted(p.name for p in latent_shards.glob("*.tar")) == ["00000.tar", "00001.tar"]
    captions = set(CAPTIONS.values())
    for shard in ("00000.tar", "00001.tar"):
        samples = read_shard(latent_shards / shard)
        assert [s["key"] for s in samples] == input_keys(image_shards / shard)
        for sample in samples:
            record = sample["json"]
            assert sample["moments"].dtype == np.float16 and sample["moments"].shape == (8, 8, 8)
            assert sample["text"].dtype == np.float16 and sample["text"].shape == (77, 32)
            assert record["caption"] in captions and record["size"] == [64, 64] and record["bucket"] is None
            assert record["source"]["key"] == sample["key"] and "aesthetic" in record["source"]  # scores survive
            width, height = record["image_size"]
            assert record["source"]["width"] == width and record["source"]["height"] == height
            left, top, crop_width, crop_height = record["crop"]
            assert crop_width == crop_height == min(width, height)
            assert record["target_size"] == [64, 64]
            assert record["truncated"] == (record["caption"] == CAPTIONS["416_264.jpg"])
            assert record["num_tokens"] == min(77, len(tokenizer(record["caption"]).input_ids))


def test_manifest_carries_what_training_needs(latent_shards, tiny_models):
    manifest = json.loads((latent_shards / "manifest.json").read_text())
    assert manifest["vae"] == {"scaling_factor": pytest.approx(0.18215), "shift_factor": None,
                               "latent_channels": 4, "downsample_factor": 8}
    assert manifest["text"] == {"hidden_size": 32, "sequence_length": 77, "layer": "last", "pad_token_id": 49407}
    assert manifest["resolution"] == 64 and manifest["buckets"] is None and manifest["stored_dtype"] == "float16"
    assert manifest["counts"] == {"samples_in": 8, "samples_out": 8, "skipped": 0, "truncated_captions": 1,
                                  "empty_captions": 1, "upscaled": 0}  # fixtures.CAPTIONS has one empty caption
    assert manifest["shards"] == {"done": 2, "expected": 2, "missing": []} and manifest["complete"]
    for component in ("vae", "text_encoder", "tokenizer"):
        entry = manifest["models"][component]
        assert entry["source"] == str(tiny_models) and entry["subfolder"] == component
        assert all(len(digest) == 64 for digest in entry["files"].values()) and entry["files"]
    assert manifest["versions"]["torch"]


def test_empty_caption_embedding_matches_an_encoded_empty_caption(latent_shards, tiny_models):
    empty = np.load(latent_shards / "empty_caption.npy")
    assert empty.shape == (77, 32) and empty.dtype == np.float16
    stored = {s["json"]["caption"]: s["text"] for shard in ("00000.tar", "00001.tar")
              for s in read_shard(latent_shards / shard)}
    np.testing.assert_array_equal(stored[""], empty)
    tokenizer, text_encoder = load_tokenizer(str(tiny_models)), load_text_encoder(str(tiny_models))
    ids = tokenizer(["a dog running on the beach, golden hour, 35mm film"], padding="max_length",
                    return_tensors="pt").input_ids
    with torch.no_grad():
        expected = text_encoder(ids).last_hidden_state[0].half().numpy()
    np.testing.assert_allclose(stored["a dog running on the beach, golden hour, 35mm film"], expected, atol=2e-3)


# --- ranks, resume, determinism ------------------------------------------------------------------

def test_two_ranks_equal_one_rank(tmp_path, image_shards, tiny_models, latent_shards):
    for rank in (1, 0):
        summary = encode(image_shards, tmp_path, tiny_models, rank=rank, world_size=2)
        assert summary["shards"] == 1
    assert tar_bytes(tmp_path) == tar_bytes(latent_shards)
    np.testing.assert_array_equal(np.load(tmp_path / "empty_caption.npy"),
                                  np.load(latent_shards / "empty_caption.npy"))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["counts"]["samples_out"] == 8 and manifest["complete"]
    assert encode(image_shards, tmp_path, tiny_models)["shards"] == 0  # rerun: nothing left to do


def test_kill_9_then_rerun_gives_identical_complete_output(tmp_path, realdata, tiny_models):
    inputs = tmp_path / "in"
    write_image_shards(realdata / "images", inputs)
    for index in (2, 3, 4, 5):  # more shards, so the kill lands mid-run
        shutil.copy(inputs / f"{index % 2:05d}.tar", inputs / f"{index:05d}.tar")
    reference = tmp_path / "reference"
    encode(inputs, reference, tiny_models, batch_size=2)

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "laionkit.cli", "encode", str(inputs), "--model", str(tiny_models),
               "--output", str(killed), "--resolution", "64", "--batch-size", "2", "--workers", "0", "--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (killed / "00001.stats.json").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "manifest.json").exists(), "the run finished before the kill; nothing was tested"

    run_cli(*command[3:])
    assert tar_bytes(killed) == tar_bytes(reference)
    assert not list(killed.glob(".*")), "temporaries left behind"
    manifest = json.loads((killed / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["samples_out"] == 24


def test_rerun_with_other_settings_is_refused(tmp_path, image_shards, tiny_models, latent_shards):
    shutil.copytree(latent_shards, tmp_path / "out")
    result = run_cli("encode", image_shards, "--model", tiny_models, "--output", tmp_path / "out",
                     "--resolution", "128", "--workers", "0", check=False)
    assert result.returncode == 2
    assert "with other resolution" in result.stderr and "00000.stats.json" in result.stderr


def test_changed_input_shard_is_redone(tmp_path, image_shards, tiny_models, latent_shards, realdata):
    inputs = tmp_path / "in"
    shutil.copytree(image_shards, inputs)
    shutil.copytree(latent_shards, tmp_path / "out")
    with wds.TarWriter(str(inputs / "00001.tar")) as sink:  # the shard now holds one sample
        sink.write({"__key__": "000010000", "jpg": (realdata / "images" / "123_456.jpg").read_bytes(),
                    "txt": "one photo"})
    summary = encode(inputs, tmp_path / "out", tiny_models)
    assert summary["shards"] == 1 and summary["samples_out"] == 1
    assert [s["json"]["caption"] for s in read_shard(tmp_path / "out" / "00001.tar")] == ["one photo"]


# --- bad input -----------------------------------------------------------------------------------

def test_bad_images_are_counted_recorded_skips(tmp_path, realdata, tiny_models):
    good = (realdata / "images" / "321_421.jpg").read_bytes()
    inputs = tmp_path / "in"
    inputs.mkdir()
    with wds.TarWriter(str(inputs / "00000.tar")) as sink:
        sink.write({"__key__": "000000000", "jpg": good, "txt": "fine"})
        sink.write({"__key__": "000000001", "jpg": b"this is not a jpeg", "txt": "garbage bytes"})
        sink.write({"__key__": "000000002", "jpg": good[: len(good) // 3], "txt": "truncated file"})
        sink.write({"__key__": "000000003", "txt": "no image at all", "json": json.dumps({"caption": "x"})})
        sink.write({"__key__": "000000004", "png": (realdata / "images" / "original.png").read_bytes(), "txt": ""})
        sink.write({"__key__": "000000005", "jpg": good, "txt": "broken metadata", "json": b"{not json"})
    encode(inputs, tmp_path / "out", tiny_models)
    record = json.loads((tmp_path / "out" / "00000.stats.json").read_text())
    assert record["samples_in"] == 6 and record["samples_out"] == 2
    assert record["skipped"] == {"undecodable": 2, "no_image": 1, "bad_json": 1}
    assert [(s["key"], s["reason"]) for s in record["skips"]] == [
        ("000000001", "undecodable"), ("000000002", "undecodable"), ("000000003", "no_image"),
        ("000000005", "bad_json")]
    assert [s["key"] for s in read_shard(tmp_path / "out" / "00000.tar")] == ["000000000", "000000004"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skips"] == {"bad_json": 1, "no_image": 1, "undecodable": 2}
    assert manifest["counts"]["skipped"] == 4


def test_missing_input_is_a_clear_error(tmp_path, tiny_models):
    with pytest.raises(LaionkitError, match="does not exist"):
        encode(tmp_path / "nope.tar", tmp_path / "out", tiny_models)


# --- buckets and the GPU-decode path -------------------------------------------------------------

def test_buckets_record_their_size_and_shape_the_latents(tmp_path, image_shards, tiny_models):
    encode(image_shards, tmp_path, tiny_models, buckets=True)
    sizes = [tuple(size) for size in json.loads((tmp_path / "manifest.json").read_text())["buckets"]]
    seen = set()
    for shard in ("00000.tar", "00001.tar"):
        for sample in read_shard(tmp_path / shard):
            record = sample["json"]
            width, height = record["bucket"]
            assert (width, height) in sizes and record["size"] == [width, height]
            assert record["bucket"] == list(target_size(*record["original_size"], 64, sizes))
            assert sample["moments"].shape == (8, height // 8, width // 8)
            seen.add((width, height))
    assert len(seen) >= 3  # portrait, landscape and near-square photos land in different buckets


def test_bytes_path_decode_matches_cpu_decode(image_shards, tiny_models):
    """The nvjpeg path (run here with torchvision's CPU decoder) gives the pixels the PIL path gives."""
    tokenizer = load_tokenizer(str(tiny_models))
    shard = image_shards / "00000.tar"
    as_pixels = [b for b in ShardBatches([shard], tokenizer, 64, None, 8, gpu_decode=False).shard_batches(shard)]
    as_bytes = [b for b in ShardBatches([shard], tokenizer, 64, None, 8, gpu_decode=True).shard_batches(shard)]
    assert len(as_bytes[0]["gpu_rows"]) == 4 and as_bytes[0]["pixels"] is None
    cpu = _gpu_batch(as_pixels[0], torch.device("cpu"), torch.float32)["pixels"]
    gpu = _gpu_batch(as_bytes[0], torch.device("cpu"), torch.float32)["pixels"]
    assert cpu.shape == gpu.shape == (4, 3, 64, 64)
    # Same crop; PIL decodes at a reduced DCT scale (draft) before its bicubic, so levels differ a little.
    assert (cpu - gpu).abs().mean() < 0.05


def test_help_has_examples():
    result = run_cli("encode", "--help")
    assert "Examples" in result.stdout and "--buckets" in result.stdout


# --- inputs from pack and from peer tools ----------------------------------------------------------

def test_output_that_is_the_input_folder_is_refused(tmp_path, realdata, tiny_models):
    inputs = pack_folder(tmp_path / "good", realdata)
    before = tar_bytes(inputs)
    for output in (inputs, inputs / "latents"):
        with pytest.raises(LaionkitError, match="outputs never overwrite inputs"):
            encode(inputs, output, tiny_models)
    assert tar_bytes(inputs) == before


def test_tar_cut_at_a_member_boundary_is_refused(tmp_path, realdata, tiny_models):
    inputs = pack_folder(tmp_path / "in", realdata)
    cut_before_sample(inputs / "00001.tar", "000010002")  # 2 whole samples remain
    with pytest.raises(LaionkitError, match=r"00001.tar holds 2 samples but its done record 00001_stats.json says 4"):
        encode(inputs, tmp_path / "out", tiny_models)
    # refused once read, before anything of it is written; the whole shard before it is kept
    assert not list((tmp_path / "out").glob("00001*")) and (tmp_path / "out" / "00000.stats.json").exists()


def test_units_with_done_records_are_planned_from_them_without_reading_their_tars(tmp_path, realdata):
    """rank_todo takes a recorded unit's count from its record (no serial header scan of every tar before the
    first batch); a unit without a record is counted from its headers."""
    from laionkit.common.ranks import Rank
    from laionkit.common.storage import Location
    from laionkit.encode.reader import rank_todo

    inputs = pack_folder(tmp_path / "in", realdata)
    recorded, plain = Location.parse(str(tmp_path / "in" / "gone.tar")), Location.parse(str(inputs / "00000.tar"))
    asked = []
    counts, todo = rank_todo([recorded, plain], {recorded: 7, plain: None}, Rank(0, 1),
                             lambda shard, samples: asked.append((shard.name, samples)) or shard is plain)
    assert counts == {recorded: 7, plain: 4} and todo == [recorded]
    assert asked == [("gone.tar", 7), ("00000.tar", 4)]


def test_unfinished_pack_shard_waits_for_its_done_record(tmp_path, realdata, tiny_models):
    inputs = pack_folder(tmp_path / "in", realdata)
    (inputs / "00001_stats.json").unlink()  # pack renamed the tar but has not written its record yet
    lines = []
    summary = run(EncodeConfig(shards=(str(inputs),), output=tmp_path / "out", model=str(tiny_models),
                               resolution=64, batch_size=4, workers=0, quiet=True), log=lines.append)
    assert summary["shards"] == 1 and sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == ["00000.tar"]
    assert [line for line in lines if "without a done record" in line and "00001.tar" in line]
    (inputs / "00001_stats.json").write_text(json.dumps({"count": 4, "successes": 4}))  # pack finishes
    assert encode(inputs, tmp_path / "out", tiny_models)["shards"] == 1
    assert encode_stage.latent_status(tmp_path / "out")["complete"]


def test_plain_webdataset_folder_is_taken_whole_and_said_once(tmp_path, image_shards, tiny_models):
    lines = []
    run(EncodeConfig(shards=(str(image_shards),), output=tmp_path / "out", model=str(tiny_models),
                     resolution=64, batch_size=4, workers=0, quiet=True), log=lines.append)
    assert len([line for line in lines if "plain webdataset" in line]) == 1
    assert encode_stage.latent_status(tmp_path / "out")["counts"]["samples_out"] == 8


def test_true_original_size_and_sdxl_crop_coordinates(tmp_path, realdata, tiny_models):
    """pack resized the photo: the json's original_width/height is the photo, the tar holds a smaller image."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    with wds.TarWriter(str(inputs / "00000.tar")) as sink:
        for index, name in enumerate(("123_456.jpg", "524_316.jpg")):
            data = (realdata / "images" / name).read_bytes()
            width, height = Image.open(io.BytesIO(data)).size
            meta = {"original_width": width * 3, "original_height": height * 3, "width": width, "height": height}
            sink.write({"__key__": f"{index:09d}", "jpg": data, "txt": name, "json": json.dumps(meta)})
    encode(inputs, tmp_path / "out", tiny_models, resolution=64)
    for sample in read_shard(tmp_path / "out" / "00000.tar"):
        record = sample["json"]
        width, height = record["image_size"]
        assert record["original_size"] == [width * 3, height * 3] and record["target_size"] == [64, 64]
        # diffusers' SDXL script: Resize(short side = 64), then a centre crop at round((side - 64) / 2).
        resized = (64, round(height * 64 / width)) if width < height else (round(width * 64 / height), 64)
        top, left = (round((side - 64) / 2) for side in (resized[1], resized[0]))
        assert record["crop_top_left"] == [top, left] and max(top, left) > 0


def _raw_tar(path: Path, members: dict[str, bytes], mode: str = "w") -> None:
    import tarfile

    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_peer_tool_tars_read_as_webdataset_reads_them(tmp_path, realdata, tiny_models):
    inputs = tmp_path / "in"
    inputs.mkdir()
    photos = [(realdata / "images" / name).read_bytes() for name in ("123_456.jpg", "321_421.jpg", "389_535.jpg")]
    members = {f"./{index:09d}.{ext}": data for index, photo in enumerate(photos)
               for ext, data in (("jpg", photo), ("txt", b"a photo"))}
    _raw_tar(inputs / "00000.tar", members)  # GNU tar's `tar -cf x.tar .` names: ./key.ext
    _raw_tar(inputs / "00001.tar.gz", members, "w:gz")
    _raw_tar(inputs / "00002.tgz", {name.replace("./", ""): data for name, data in members.items()}, "w:gz")
    summary = encode(inputs, tmp_path / "out", tiny_models)
    assert summary["shards"] == 3 and summary["samples_out"] == 9
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == ["00000.tar", "00001.tar", "00002.tar"]
    assert len(read_shard(tmp_path / "out" / "00001.tar")) == 3
    assert encode(inputs, tmp_path / "out", tiny_models)["shards"] == 0  # a rerun finds them complete


def test_shards_without_images_are_an_error_that_says_why(tmp_path, tiny_models):
    inputs = tmp_path / "in"
    inputs.mkdir()
    _raw_tar(inputs / "00000.tar", {f"{index:09d}.txt": b"caption only" for index in range(3)})
    with pytest.raises(LaionkitError, match=r"wrote no sample: 3 read .*no_image: 3"):
        encode(inputs, tmp_path / "out", tiny_models)


# --- manifest races and lineage -------------------------------------------------------------------

def test_train_trusts_the_records_not_a_stale_manifest(tmp_path, latent_shards):
    """The end state of the race: all records landed, but the last manifest rename was a stale merge."""
    from laionkit.trainer.data import open_latents

    folder = tmp_path / "latents"
    shutil.copytree(latent_shards, folder)
    (folder / "00001.stats.json").rename(tmp_path / "00001.stats.json")
    stale = encode_stage.merge_records(folder, ["00000.tar", "00001.tar"])  # merged before 00001's record landed
    (folder / "manifest.json").write_text(json.dumps(stale))
    (tmp_path / "00001.stats.json").rename(folder / "00001.stats.json")
    assert not stale["complete"]
    data = open_latents(folder)
    assert data.samples == 8 and len(data.shards) == 2


def _finish_rank(folder: str, name: str, record: str, barrier) -> None:
    barrier.wait()
    write_json(Path(folder, name), json.loads(record))  # the rank's last record lands (atomically, as encode writes it)...
    encode_stage.update_manifest(Path(folder))  # ...and it rewrites the folder manifest


def test_ranks_finishing_together_leave_a_complete_folder(tmp_path, latent_shards):
    """Four real processes finish their shard at the same moment, twelve times over."""
    import multiprocessing

    from laionkit.trainer.data import open_latents

    folder = tmp_path / "latents"
    shutil.copytree(latent_shards, folder)
    template = {name: (folder / f"0000{name[-1]}.tar").read_bytes() for name in ("00000", "00001")}
    records = {}
    for index in range(4):
        source = json.loads((folder / f"0000{index % 2}.stats.json").read_text())
        records[f"{index:05d}.stats.json"] = json.dumps({**source, "shard": f"{index:05d}.tar"})
        (folder / f"{index:05d}.tar").write_bytes(template[f"0000{index % 2}"])
    encode_stage.write_plan(folder, [Path(f"{index:05d}.tar") for index in range(4)])
    context = multiprocessing.get_context("fork")
    for _ in range(12):
        for name in records:
            (folder / name).unlink(missing_ok=True)
        barrier = context.Barrier(4)
        ranks = [context.Process(target=_finish_rank, args=(str(folder), name, record, barrier))
                 for name, record in records.items()]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(60)
            assert process.exitcode == 0
        status = encode_stage.latent_status(folder)
        assert status["complete"] and status["counts"]["samples_out"] == 16
        assert open_latents(folder).samples == 16


def test_same_model_through_a_symlink_or_a_copy_resumes(tmp_path, image_shards, tiny_models, latent_shards):
    shutil.copytree(latent_shards, tmp_path / "out")
    (tmp_path / "link").symlink_to(tiny_models)
    shutil.copytree(tiny_models, tmp_path / "copy")
    for models in (tmp_path / "link", tmp_path / "copy"):
        assert encode(image_shards, tmp_path / "out", models)["shards"] == 0
    config = tmp_path / "copy" / "vae" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()), indent=1))  # same model, other bytes
    with pytest.raises(LaionkitError, match="with other models"):
        encode(image_shards, tmp_path / "out", tmp_path / "copy")


def test_eager_encode_is_contiguous_compiled_is_channels_last(image_shards, tiny_models):
    tokenizer = load_tokenizer(str(tiny_models))
    shard = image_shards / "00000.tar"
    batch = next(ShardBatches([shard], tokenizer, 64, None, 4, gpu_decode=False).shard_batches(shard))
    for compiled in (False, True):
        config = EncodeConfig(shards=(str(shard),), output=Path("unused"), model=str(tiny_models),
                              resolution=64, compile=compiled)
        encoders = encode_stage.Encoders(config, torch.device("cpu"))
        layout = torch.channels_last if compiled else torch.contiguous_format
        weight = encoders.vae.encoder.conv_in.weight
        pixels = _gpu_batch(dict(batch), torch.device("cpu"), torch.float32, compiled)["pixels"]
        assert weight.is_contiguous(memory_format=layout) and pixels.is_contiguous(memory_format=layout)
        assert compiled == (not pixels.is_contiguous())


def test_compiled_encode_compiles_only_in_its_warm_up(image_shards, tiny_models, tmp_path, monkeypatch):
    """The encoders are compiled once, before the loop: batches prepared in the prepare thread must be the
    same kind of tensor as the warm-up's (inference-mode ones), or dynamo recompiles both encoders inside
    the first run's timed loop (the one-time cost that made run 1 of bench_encode 0.71 of the ceiling).
    Dynamo's guards decide this, not the backend, so the test compiles with the eager backend (fast)."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    config = EncodeConfig(shards=(str(image_shards),), output=tmp_path / "out", model=str(tiny_models),
                          resolution=64, batch_size=3, workers=1, compile=True, quiet=True)
    summary = encode_stage.run(config)
    assert summary["samples_out"] == 8  # with padded last batches (8 photos, batches of 3)
    assert counters["frames"]["ok"] == 2, dict(counters["frames"])  # the VAE's and the text encoder's graphs
    torch._dynamo.reset()


def test_tar_members_writes_the_bytes_webdatasets_tar_writer_writes(tmp_path):
    """encode's TarMembers (one write per member, a USTAR header from a template; a sample's members in
    webdataset's order) writes byte for byte the tar webdataset's TarWriter writes for the same samples
    (mtime 0), members of every size including empty and 512-multiples; a name USTAR cannot hold (over
    100 bytes, not ASCII) gets tarfile's PAX header, and tarfile and webdataset read every member back."""
    import tarfile

    from laionkit.encode.tars import TarMembers

    rng = np.random.default_rng(0)
    sizes = [0, 1, 511, 512, 513, 1024, 118_272, 40_000]
    samples = [{"__key__": f"{index:09d}", "moments.npy": rng.bytes(size), "text.npy": rng.bytes(size // 2 + 7),
                "json": json.dumps({"key": index}).encode()} for index, size in enumerate(sizes)]
    theirs = wds.TarWriter(str(tmp_path / "theirs.tar"), encoder=False, mtime=0)
    ours = TarMembers(str(tmp_path / "ours.tar"))
    for sample in samples:
        theirs.write(sample)
        ours.add_sample(sample["__key__"], {k: v for k, v in sample.items() if k != "__key__"})
    theirs.close()
    ours.close()
    assert (tmp_path / "ours.tar").read_bytes() == (tmp_path / "theirs.tar").read_bytes()

    odd = {"k" * 120 + ".json": b"{}", "caf\u00e9-1.json": b"[1]", "plain.txt": b"x" * 700}
    with_pax = TarMembers(str(tmp_path / "pax.tar"))
    for name, data in odd.items():
        with_pax.add(name, data)
    with_pax.close()
    with tarfile.open(tmp_path / "pax.tar") as archive:
        assert {m.name: archive.extractfile(m).read() for m in archive.getmembers()} == odd
    read = list(wds.WebDataset(str(tmp_path / "ours.tar"), shardshuffle=False))
    assert [r["__key__"] for r in read] == [s["__key__"] for s in samples]
    assert all(r["moments.npy"] == s["moments.npy"] for r, s in zip(read, samples))
