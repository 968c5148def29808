"""encode's outputs say what went in: missing model components, captions under other names, the model
family of a folder without model_index.json, SD3's patch size, and img2dataset's parquet and files
output formats as inputs (issue "Faithful outputs")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

ENCODE = ("--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet")


def one_line_error(result, *needles: str) -> str:
    """The CLI refused with its one-line error (exit 2, no traceback) containing every needle."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and all(needle in line for needle in needles), result.stderr
    return line


def model_copy(model: Path, folder: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a pipeline folder without the ``drop`` entries (component subfolders, model_index.json)."""
    return Path(shutil.copytree(model, folder, ignore=lambda _, names: [n for n in names if n in drop]
                                if _ == str(model) else []))


# --- 1. a component model_index.json names is missing: one line, in encode and in online-text train --------

@pytest.mark.parametrize("family, missing", [("sd", "tokenizer"), ("flux", "tokenizer_2"),
                                             ("flux", "text_encoder_2"), ("pixart", "tokenizer"),
                                             ("z-image", "text_encoder"), ("qwen-image", "tokenizer"),
                                             ("sana", "tokenizer"), ("flux2", "text_encoder"),
                                             ("flux2-dev", "tokenizer")])
def test_missing_component_subfolder_is_a_one_line_error(tmp_path, image_shards, tiny_models, flow_latents,
                                                         family, missing):
    """Before: SD / PixArt without tokenizer/ failed with OverflowError, Flux without text_encoder_2/ with
    join() ... NoneType, and Flux without tokenizer_2/ encoded every caption with an empty T5 tokenizer."""
    model = tiny_models if family == "sd" else flow_latents(family).model
    broken = model_copy(model, tmp_path / "model", drop=(missing,))
    result = run_cli("encode", image_shards / "00000.tar", "--model", broken, "--output", tmp_path / "out",
                     "--text", "stored", *ENCODE, check=False)
    one_line_error(result, f"{missing}/", str(broken))
    assert not list((tmp_path / "out").glob("*.tar"))


def test_online_text_train_refuses_a_model_folder_missing_a_tokenizer(tmp_path, image_shards, flow_latents):
    """train --text online latents load the text encoders from the manifest's model folder: a tokenizer lost
    since encode is the same one-line error, not a run conditioned on an empty tokenizer's ids."""
    model = model_copy(flow_latents("flux").model, tmp_path / "model")
    latents = tmp_path / "latents"
    run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", latents, "--text", "online", *ENCODE)
    shutil.rmtree(model / "tokenizer_2")
    result = run_cli("train", latents, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "1",
                     "--batch-size", "2", "--workers", "0", "--log-with", "none", "--quiet", check=False)
    one_line_error(result, "tokenizer_2/")
    assert not (tmp_path / "run" / "transformer").exists()


# --- 3. a pipeline folder without model_index.json: the family from its components, or a one-line refusal ---

@pytest.mark.parametrize("family", ["sd3", "flux", "pixart", "sana", "z-image", "qwen-image", "flux2", "flux2-dev"])
def test_transformer_folder_without_model_index_encodes_as_its_family(tmp_path, image_shards, flow_latents, family):
    """Before: encoded as SD (CLIP text only, SD's latent scaling), which no transformer trains on. Now the
    same latents as the folder with its model_index.json, byte for byte."""
    flow = flow_latents(family)
    bare = model_copy(flow.model, tmp_path / "model", drop=("model_index.json",))
    run_cli("encode", image_shards / "00000.tar", "--model", bare, "--output", tmp_path / "out", "--text", "stored",
            *ENCODE)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["family"] == family
    assert (tmp_path / "out" / "00000.tar").read_bytes() == (flow.latents / "00000.tar").read_bytes()


@pytest.mark.parametrize("family", ["sd3", "flux", "pixart", "sana", "sdxl", "qwen-image"])
def test_family_of_a_folder_without_model_index_comes_from_its_components(tmp_path, flow_latents, family):
    """transformer/config.json's class, else the text encoders (SD3's third, Flux's T5 second, PixArt's T5
    alone, Sana's Gemma-2); a UNet with a second text encoder is SDXL."""
    from laionkit.families import detect_family, get_family

    if family == "sdxl":
        model = get_family("sdxl").write_tiny(tmp_path / "sdxl", 0)
    else:
        model = flow_latents(family).model
    bare = model_copy(model, tmp_path / "bare", drop=("model_index.json",))
    assert detect_family(str(bare)).name == family
    if family != "sdxl":
        (bare / "transformer" / "config.json").unlink()  # no readable class: the text encoders decide
        assert detect_family(str(bare)).name == family


def test_unknown_transformer_without_model_index_is_refused(tmp_path, image_shards, flow_latents):
    bare = model_copy(flow_latents("sd3").model, tmp_path / "model", drop=("model_index.json",))
    config = bare / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "HunyuanDiT2DModel"}))
    result = run_cli("encode", image_shards / "00000.tar", "--model", bare, "--output", tmp_path / "out", *ENCODE,
                     check=False)
    one_line_error(result, "HunyuanDiT2DModel", "model_index.json")


# --- 4. SD3's 2x2 patches: odd latent sides are refused at encode, as for Flux and PixArt -----------------

def test_sd3_refuses_sizes_its_patches_cannot_cover(tmp_path, image_shards, flow_latents):
    """Before: encoded, and train failed on the first batch's shape after the whole encode."""
    model = flow_latents("sd3").model
    for resolution, buckets in ((72, ()), (64, ("--buckets",))):
        result = run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", tmp_path / f"o{resolution}",
                         *ENCODE, "--resolution", str(resolution), *buckets, check=False)
        one_line_error(result, "sd3 takes 2x2 latent patches", "multiples of 16 px")
        assert not list((tmp_path / f"o{resolution}").glob("*.tar"))


# --- 2. captions under .caption / json text / TEXT, --caption-key, empty captions counted ------------------

# (key, members besides the image) of one shard: each place a caption may be, and none at all
CAPTION_PLACES = {
    "000000000": {"txt": "a photo from the txt member", "json": {"caption": "the json caption (txt wins)"}},
    "000000001": {"caption": "a photo from a caption member", "json": {}},
    "000000002": {"json": {"text": "a photo from json text"}},
    "000000003": {"json": {"TEXT": "a photo from json TEXT", "caption": None}},
    "000000004": {"txt": "", "json": {"TEXT": "an empty txt falls through to TEXT"}},
    "000000005": {"json": {"url": "https://example.org/no-caption.jpg"}},
}


def caption_shard(realdata: Path, path: Path) -> Path:
    import webdataset as wds

    photos = sorted((realdata / "images").glob("*.jpg"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for (key, members), photo in zip(CAPTION_PLACES.items(), photos):
            sample = {"__key__": key, "jpg": photo.read_bytes(),
                      **{name: value for name, value in members.items() if name != "json"}}
            sink.write({**sample, "json": json.dumps(members["json"])})
    return path


def encoded_captions(folder: Path) -> dict[str, str]:
    import webdataset as wds

    return {sample["__key__"]: json.loads(sample["json"])["caption"]
            for tar in sorted(folder.glob("*.tar")) for sample in wds.WebDataset(str(tar), shardshuffle=False)}


def test_captions_are_found_wherever_tools_put_them_and_empty_ones_are_counted(tmp_path, realdata, tiny_models):
    """Before: .caption members and json text / TEXT became empty captions, and nothing counted them."""
    shard = caption_shard(realdata, tmp_path / "in" / "00000.tar")
    result = run_cli("encode", shard, "--model", tiny_models, "--output", tmp_path / "out",
                     *ENCODE[:-1])  # not --quiet: the summary line
    assert encoded_captions(tmp_path / "out") == {
        "000000000": "a photo from the txt member", "000000001": "a photo from a caption member",
        "000000002": "a photo from json text", "000000003": "a photo from json TEXT",
        "000000004": "an empty txt falls through to TEXT", "000000005": ""}
    record = json.loads((tmp_path / "out" / "00000.stats.json").read_text())
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert record["empty_captions"] == manifest["counts"]["empty_captions"] == 1
    assert "1 with an empty caption" in " ".join(result.stderr.split())

    # --caption-key: one place only, a member or a json key; samples without it get (and count) ""
    run_cli("encode", shard, "--model", tiny_models, "--output", tmp_path / "by-key", "--caption-key", "TEXT", *ENCODE)
    got = encoded_captions(tmp_path / "by-key")
    assert got["000000003"] == "a photo from json TEXT" and got["000000004"] == "an empty txt falls through to TEXT"
    assert got["000000000"] == got["000000001"] == got["000000002"] == got["000000005"] == ""
    manifest = json.loads((tmp_path / "by-key" / "manifest.json").read_text())
    assert manifest["counts"]["empty_captions"] == 4 and manifest["caption_key"] == "TEXT"
    run_cli("encode", shard, "--model", tiny_models, "--output", tmp_path / "member", "--caption-key", "caption",
            *ENCODE)
    assert encoded_captions(tmp_path / "member")["000000001"] == "a photo from a caption member"
    assert encoded_captions(tmp_path / "member")["000000000"] == "the json caption (txt wins)"
    # a rerun into a folder with another caption source is refused, not mixed
    result = run_cli("encode", shard, "--model", tiny_models, "--output", tmp_path / "by-key", *ENCODE, check=False)
    one_line_error(result, "caption_key")


# --- 5. img2dataset's parquet and files output formats as inputs, resumable per unit ----------------------

def img2dataset_output(realdata: Path, folder: Path, output_format: str) -> Path:
    """fixtures.CAPTIONS' photos as img2dataset writes them in ``output_format`` (webdataset, parquet or
    files), through img2dataset's own sample writers: two shards of 4 photos plus one failed download each
    (a row without an image in parquet, nothing in tars and files), a metadata parquet beside tars and
    files folders, and img2dataset's <shard>_stats.json record."""
    import hashlib
    import io

    import pyarrow as pa
    from fixtures import CAPTIONS
    from img2dataset.writer import FilesSampleWriter, ParquetSampleWriter, WebDatasetSampleWriter
    from PIL import Image

    writer_class = {"webdataset": WebDatasetSampleWriter, "parquet": ParquetSampleWriter,
                    "files": FilesSampleWriter}[output_format]
    schema = pa.schema([("url", pa.string()), ("caption", pa.string()), ("key", pa.string()),
                        ("status", pa.string()), ("error_message", pa.string()), ("width", pa.int32()),
                        ("height", pa.int32()), ("original_width", pa.int32()), ("original_height", pa.int32()),
                        ("exif", pa.string()), ("sha256", pa.string())])
    folder.mkdir(parents=True)
    names = sorted(CAPTIONS)
    for shard in range(2):
        writer = writer_class(shard, str(folder), True, 5, schema, "jpg")
        for index, name in enumerate([*names[4 * shard : 4 * shard + 4], "missing.jpg"]):
            key = f"{shard:05d}{index:04d}"
            meta = {"url": f"https://example.org/{name}", "caption": CAPTIONS.get(name), "key": key,
                    "status": "success", "error_message": None, "width": None, "height": None,
                    "original_width": None, "original_height": None, "exif": None, "sha256": None}
            if name == "missing.jpg":
                writer.write(None, key, None, {**meta, "status": "failed_to_download", "error_message": "http 404"})
                continue
            image = Image.open(realdata / "images" / name).convert("RGB")
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=90)  # img2dataset re-encodes to --encode_format
            data = buffer.getvalue()
            meta.update(width=image.width, height=image.height, original_width=image.width,
                        original_height=image.height, sha256=hashlib.sha256(data).hexdigest())
            writer.write(data, key, CAPTIONS[name], meta)
        writer.close()
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": 5, "successes": 4, "failed_to_download": 1, "failed_to_resize": 0}))
    return folder


@pytest.fixture(scope="module")
def img2dataset_formats(tmp_path_factory, realdata) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("img2dataset")
    return {name: img2dataset_output(realdata, root / name, name) for name in ("webdataset", "parquet", "files")}


def test_img2dataset_parquet_and_files_formats_encode_as_its_tars_do(tmp_path, img2dataset_formats, tiny_models):
    """Before: "no tar shards" for both. Now the same latent tars, byte for byte, as from img2dataset's
    webdataset output of the same samples (the failed download is no sample in any format)."""
    assert sorted(p.name for p in img2dataset_formats["files"].iterdir()) == [
        "00000", "00000.parquet", "00000_stats.json", "00001", "00001.parquet", "00001_stats.json"]
    outputs = {}
    for name, folder in img2dataset_formats.items():
        outputs[name] = tmp_path / name
        run_cli("encode", folder, "--model", tiny_models, "--output", outputs[name], *ENCODE)
        manifest = json.loads((outputs[name] / "manifest.json").read_text())
        assert manifest["counts"]["samples_in"] == manifest["counts"]["samples_out"] == 8, name
        assert manifest["complete"] and sorted(manifest["records"]) == ["00000.tar", "00001.tar"]
    tars = {name: {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))} for name, out in outputs.items()}
    assert tars["parquet"] == tars["webdataset"] and tars["files"] == tars["webdataset"]


@pytest.mark.parametrize("output_format", ["parquet", "files"])
def test_parquet_and_files_units_resume_and_wait_for_their_records(tmp_path, img2dataset_formats, tiny_models,
                                                                    output_format):
    """Records, resume and the done-record rule work per parquet file / files folder as per tar."""
    source = Path(shutil.copytree(img2dataset_formats[output_format], tmp_path / "in"))
    out = tmp_path / "out"
    (source / "00001_stats.json").rename(tmp_path / "held.json")  # shard 00001 still being written
    result = run_cli("encode", source, "--model", tiny_models, "--output", out, *ENCODE[:-1])
    assert "left out 1 shard(s) without a done record" in " ".join(result.stderr.split())
    assert sorted(p.name for p in out.glob("*.tar")) == ["00000.tar"]
    first = (out / "00000.stats.json").stat().st_mtime_ns
    (tmp_path / "held.json").rename(source / "00001_stats.json")
    run_cli("encode", source, "--model", tiny_models, "--output", out, *ENCODE)
    assert (out / "00000.stats.json").stat().st_mtime_ns == first  # done once, not redone
    assert json.loads((out / "00001.stats.json").read_text())["samples_out"] == 4
    assert json.loads((out / "manifest.json").read_text())["complete"]
    # a unit that no longer holds what its record says is refused, as a cut tar is
    (out / "00001.tar").unlink()
    if output_format == "files":
        for member in (source / "00001").glob("000010000.*"):  # one sample's image, txt and json
            member.unlink()
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(source / "00001.parquet")
        pq.write_table(table.slice(1), source / "00001.parquet")
    result = run_cli("encode", source, "--model", tiny_models, "--output", out, *ENCODE, check=False)
    one_line_error(result, "holds 3 samples but its done record 00001_stats.json says 4")


def test_metadata_parquet_is_not_taken_for_image_shards(tmp_path, img2dataset_formats, tiny_models):
    """img2dataset's metadata parquet beside tars has no image column: a folder left with only those is a
    one-line error naming the file, not an encode of nothing."""
    source = Path(shutil.copytree(img2dataset_formats["webdataset"], tmp_path / "in"))
    for tar in source.glob("*.tar"):
        tar.unlink()
    result = run_cli("encode", source, "--model", tiny_models, "--output", tmp_path / "out", *ENCODE, check=False)
    one_line_error(result, "00000.parquet has no image column", "metadata parquet")


# --- the caption window (--max-sequence-length): the pipelines' states at that length, recorded, followed -------

def test_a_caption_window_stores_the_pipelines_states_at_that_length(tmp_path, image_shards, flow_latents):
    """FLUX.2 [klein] attends to every padding row, so a caption window is what a step costs: encode
    --max-sequence-length 64 stores Flux2KleinPipeline.encode_prompt(max_sequence_length=64)'s states (and the
    empty caption's), records the window, and train's conditioning follows it. Another window into the same
    folder is refused in one line, not mixed in."""
    from diffusers import Flux2KleinPipeline
    from fixtures import stored_states_are_the_pipelines

    from laionkit.trainer.data import open_latents

    model, latents = flow_latents("flux2").model, tmp_path / "latents"
    run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", latents, "--text", "stored",
            "--max-sequence-length", "64", *ENCODE)
    manifest = json.loads((latents / "manifest.json").read_text())
    assert manifest["text"]["max_sequence_length"] == 64 and manifest["text"]["stored"]["states"][0] == 64
    stored_states_are_the_pipelines(Flux2KleinPipeline.from_pretrained(model), latents, max_sequence_length=64)
    assert open_latents(latents).family.max_sequence_length == 64
    assert "caption window 64 tokens (--max-sequence-length)" in run_cli("stats", latents).stdout
    default = json.loads((flow_latents("flux2").latents / "manifest.json").read_text())["text"]
    assert "max_sequence_length" not in default and default["stored"]["states"][0] == 512

    again = run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", latents, "--text", "stored",
                    "--max-sequence-length", "48", *ENCODE, check=False)
    one_line_error(again, str(latents))


def test_online_text_trains_in_the_recorded_window_and_sd_refuses_one(tmp_path, image_shards, flow_latents,
                                                                       tiny_models):
    """Flux with --text online and --max-sequence-length 32: the ids are 32 wide, train runs T5 on them and
    its caption dropout's "" in the same window (a [32, D] empty text; at T5's own 512 the batch would not
    stack), and says which max_sequence_length the exported pipeline generates with. SD's CLIP window is
    fixed: one line."""
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.objective import OnlineText

    latents = tmp_path / "latents"
    run_cli("encode", image_shards / "00000.tar", "--model", flow_latents("flux").model, "--output", latents,
            "--text", "online", "--max-sequence-length", "32", *ENCODE)
    manifest = json.loads((latents / "manifest.json").read_text())
    assert manifest["text"]["ids"] == {"ids_tokenizer.npy": 77, "ids_tokenizer_2.npy": 32}
    data = open_latents(latents)
    assert OnlineText(data, "cpu", None).empty()["states"].shape[0] == 32
    result = run_cli("train", latents, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", "2",
                     "--batch-size", "2", "--caption-dropout", "0.5", "--workers", "0", "--log-with", "none")
    assert "generate with max_sequence_length=32" in result.stdout + result.stderr
    assert (tmp_path / "run" / "pipeline" / "model_index.json").is_file()

    refused = run_cli("encode", image_shards / "00000.tar", "--model", tiny_models, "--output", tmp_path / "sd",
                      "--max-sequence-length", "32", *ENCODE, check=False)
    one_line_error(refused, "family sd's caption window is fixed")
    assert not (tmp_path / "sd").exists() or not list((tmp_path / "sd").glob("*.tar"))


# --- found when tried as a new user (issue 60): a caption key no sample has, .txt line ends, upscaled photos ---

def test_a_caption_key_no_sample_has_is_a_one_line_error(tmp_path, img2dataset_formats, tiny_models):
    """img2dataset keeps LAION's TEXT as ``caption``: before, --caption-key TEXT encoded 8 of 8 captions empty, exit 0."""
    result = run_cli("encode", img2dataset_formats["parquet"], "--model", tiny_models, "--output", tmp_path / "out",
                     "--caption-key", "TEXT", *ENCODE, check=False)
    one_line_error(result, "--caption-key TEXT", "00000.parquet", "json keys url, caption, key")
    assert not list((tmp_path / "out").glob("*.tar"))


def test_a_txt_captions_line_end_is_not_part_of_the_caption(tmp_path, img2dataset_formats, tiny_models):
    """A files folder whose .txt captions end with a newline (as editors and echo write them) encodes as the one
    without: the line end is no token of the caption."""
    source = Path(shutil.copytree(img2dataset_formats["files"], tmp_path / "in"))
    for txt in source.glob("*/*.txt"):
        txt.write_text(txt.read_text() + "\n")
    run_cli("encode", source, "--model", tiny_models, "--output", tmp_path / "out", *ENCODE)
    run_cli("encode", img2dataset_formats["files"], "--model", tiny_models, "--output", tmp_path / "plain", *ENCODE)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.tar")} == \
        {p.name: p.read_bytes() for p in (tmp_path / "plain").glob("*.tar")}


def test_upscaled_samples_are_counted_and_said(tmp_path, image_shards, tiny_models):
    """At 128 px without --buckets, the 123x456 and 456x123 photos are cropped to 123 px squares and enlarged:
    counted in the records and the manifest, and said in one warning line."""
    result = run_cli("encode", image_shards, "--model", tiny_models, "--output", tmp_path / "out", "--resolution",
                     "128", "--batch-size", "4", "--workers", "0")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["upscaled"] == 2 and manifest["counts"]["samples_out"] == 8
    said = " ".join(result.stderr.split())
    assert said.count("samples upscaled") == 1 and "warning: 2 samples upscaled" in said, result.stderr
    assert "upscaled" in " ".join(run_cli("stats", tmp_path / "out").stdout.split())
