"""laionkit score on the real photos (pack-format tars from ../shared/realdata/images), with a tiny
random-init open_clip model of ViT-L/14's embedding width saved as real weights, the real aesthetic
predictors, and LAION's watermark and NSFW architectures at random init saved in their real layouts."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds
from conftest import run_cli
from fixtures import cut_before_sample, pack_folder, write_image_shards
from PIL import Image
from test_encode_faithful import one_line_error

from laionkit.common.phash import hamming, phash

AESTHETIC_V2 = "aesthetic/sac+logos+ava1-l14-linearMSE.pth"


@pytest.fixture(scope="module")
def shards(tmp_path_factory, realdata) -> Path:
    folder = tmp_path_factory.mktemp("score-shards")
    write_image_shards(realdata / "images", folder)
    return folder


def score_args(shards: Path, output: Path, models: dict, realdata: Path, *extra: str) -> list[str]:
    return ["score", str(shards), "--output", str(output), "--clip-model", str(models["config"]),
            "--clip-pretrained", str(models["weights"]), "--watermark", str(models["watermark"]),
            "--nsfw", str(models["nsfw"]), "--score", f"aes=aesthetic-v2:{realdata / AESTHETIC_V2}",
            "--score", "anime=prompt:an anime drawing|a manga page", "--workers", "0", "--batch-size", "3",
            "--quiet", *extra]


@pytest.fixture(scope="module")
def scored(tmp_path_factory, shards, score_models, realdata) -> Path:
    output = tmp_path_factory.mktemp("scored") / "out"
    args = score_args(shards, output, score_models, realdata)
    run_cli(*args)
    return output


def tar_samples(tar: Path) -> list[dict]:
    return list(wds.WebDataset(str(tar), shardshuffle=False))


def output_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.parent.name in ("scores", "img_emb")}


def test_columns_rows_hashes_and_embeddings_match_the_tars(scored, shards, score_models, realdata):
    from laionkit.common.clip_scores import ScoreSpec, build_scorer, score_embeddings
    from laionkit.evaluate.clipscore import load_clip

    clip, preprocess, _ = load_clip(str(score_models["config"]), str(score_models["weights"]))
    aesthetic = build_scorer(ScoreSpec("aes", "aesthetic-v2", str(realdata / AESTHETIC_V2)))
    for tar in sorted(shards.glob("*.tar")):
        samples = tar_samples(tar)
        table = pq.read_table(scored / "scores" / f"{tar.stem}.parquet")
        embeddings = np.load(scored / "img_emb" / f"img_emb_{tar.stem}.npy")
        assert table.column_names == ["key", "shard", "source", "caption", "width", "height", "sha256", "phash",
                                      "similarity", "pwatermark", "punsafe", "aes", "anime"]
        assert table.num_rows == len(samples) == len(embeddings)
        assert embeddings.dtype == np.float16 and embeddings.shape[1] == 768
        assert table.schema.field("phash").type == "int64"
        rows = table.to_pylist()
        for row, sample in zip(rows, samples):
            data = next(sample[ext] for ext in ("jpg", "png", "webp") if ext in sample)
            assert row["key"] == sample["__key__"] and row["shard"] == tar.stem
            assert row["sha256"] == hashlib.sha256(data).hexdigest()
            image = Image.open(io.BytesIO(data))
            assert (row["width"], row["height"]) == image.size
            assert row["phash"] == phash(image.convert("RGB"))
            assert json.loads(row["source"]) == json.loads(sample["json"])
            assert (row["similarity"] is None) == (not row["caption"].strip())
        pixels = torch.stack([preprocess(Image.open(io.BytesIO(next(s[e] for e in ("jpg", "png", "webp") if e in s))))
                              for s in samples])
        with torch.no_grad():
            expected = torch.nn.functional.normalize(clip.encode_image(pixels).float(), dim=-1).numpy()
        np.testing.assert_allclose(embeddings.astype(np.float32), expected, atol=2e-3)
        np.testing.assert_array_equal(table.column("aes").to_numpy(), score_embeddings(aesthetic, embeddings))
    stats = json.loads((scored / "stats.json").read_text())
    assert stats["complete"] and stats["counts"] == {"samples_in": 8, "samples_out": 8, "skipped": 0}
    summary = " ".join(run_cli("stats", str(scored)).stdout.split())
    assert "2 done, 0 missing" in summary and "8 of 8 (0 skipped)" in summary


def test_watermark_and_nsfw_are_laions_architectures(scored, shards, score_models):
    from torchvision import transforms as T

    from laionkit.score.models import load_nsfw, load_watermark

    samples = tar_samples(shards / "00000.tar")
    table = pq.read_table(scored / "scores" / "00000.parquet")
    embeddings = np.load(scored / "img_emb" / "img_emb_00000.npy")
    laion = T.Compose([T.Resize((256, 256)), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    pixels = torch.stack([laion(Image.open(io.BytesIO(s["jpg"])).convert("RGB")) for s in samples])
    with torch.no_grad():
        watermark = torch.softmax(load_watermark(score_models["watermark"])(pixels), dim=1)[:, 0].numpy()
        nsfw = load_nsfw(score_models["nsfw"])(torch.from_numpy(embeddings).float()).numpy()
    np.testing.assert_allclose(table.column("pwatermark").to_numpy(), watermark, atol=1e-5)
    np.testing.assert_allclose(table.column("punsafe").to_numpy(), nsfw, atol=1e-6)
    assert sorted(load_nsfw(score_models["nsfw"]).state_dict()) == [
        "linear_1.bias", "linear_1.weight", "linear_2.bias", "linear_2.weight", "linear_3.bias", "linear_3.weight",
        "linear_4.bias", "linear_4.weight", "norm.mean", "norm.variance"]


def test_phash_is_near_for_the_same_photo_and_far_for_another(realdata):
    photo = Image.open(realdata / "images" / "524_316.jpg").convert("RGB")
    buffer = io.BytesIO()
    photo.resize((262, 158), Image.Resampling.BICUBIC).save(buffer, format="JPEG", quality=60)
    again = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    assert hamming(phash(photo), phash(again)) <= 4
    others = [hamming(phash(photo), phash(Image.open(p).convert("RGB")))
              for p in sorted((realdata / "images").glob("*.jpg")) if p.name != "524_316.jpg"]
    assert min(others) >= 16, others


def test_without_weights_the_columns_are_left_out_and_said(tmp_path, shards, score_models):
    result = run_cli("score", str(shards / "00000.tar"), "--output", str(tmp_path / "out"), "--clip-model",
                     str(score_models["config"]), "--clip-pretrained", str(score_models["weights"]), "--workers", "0")
    said = " ".join(result.stderr.split())  # the console wraps long lines
    assert "no --watermark weights given: the pwatermark column is not computed" in said
    assert "no --nsfw weights given: the punsafe column is not computed" in said
    assert pq.read_schema(tmp_path / "out" / "scores" / "00000.parquet").names[-1] == "similarity"


def test_a_corrupt_image_is_a_counted_recorded_skip(tmp_path, realdata, score_models):
    shards = tmp_path / "shards"
    write_image_shards(realdata / "images", shards)
    good = tar_samples(shards / "00000.tar")
    with wds.TarWriter(str(shards / "00000.tar")) as sink:
        for index, sample in enumerate(good):
            sample = {k: v for k, v in sample.items() if not k.startswith("__") or k == "__key__"}
            if index == 1:
                sample["jpg"] = sample["jpg"][:200]  # cut inside the JPEG
            sink.write(sample)
    run_cli("score", str(shards / "00000.tar"), "--output", str(tmp_path / "out"), "--clip-model",
            str(score_models["config"]), "--clip-pretrained", str(score_models["weights"]), "--workers", "0")
    record = json.loads((tmp_path / "out" / "records" / "00000.json").read_text())
    assert record["samples_in"] == 4 and record["samples_out"] == 3 and record["skipped"] == {"undecodable": 1}
    assert record["skips"][0]["key"] == good[1]["__key__"]
    table = pq.read_table(tmp_path / "out" / "scores" / "00000.parquet")
    assert good[1]["__key__"] not in table.column("key").to_pylist() and table.num_rows == 3
    assert len(np.load(tmp_path / "out" / "img_emb" / "img_emb_00000.npy")) == 3
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["skips"] == {"undecodable": 1}


def test_a_tar_cut_at_a_member_boundary_is_refused_once_read_and_nothing_of_it_written(tmp_path, realdata,
                                                                                         score_models):
    """A recorded shard is planned from its record; the samples score reads are held to it before it writes."""
    shards = pack_folder(tmp_path / "shards", realdata)
    cut_before_sample(shards / "00001.tar", "000010002")  # 2 whole samples remain
    result = run_cli("score", str(shards), "--output", str(tmp_path / "out"), "--clip-model",
                     str(score_models["config"]), "--clip-pretrained", str(score_models["weights"]), "--workers", "0",
                     "--quiet", check=False)
    one_line_error(result, "00001.tar holds 2 samples but its done record 00001_stats.json says 4")
    assert sorted(path.name for path in (tmp_path / "out").rglob("*") if path.is_file() and "0000" in path.name) == [
        "00000.json", "00000.parquet", "img_emb_00000.npy"]


def test_kill9_mid_run_then_rerun_gives_the_same_files(tmp_path, scored, shards, score_models, realdata):
    args = score_args(shards, tmp_path / "out", score_models, realdata)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-m", "laionkit.cli", *args], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / "out" / "records" / "00000.json"
    deadline = time.monotonic() + 120
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert first.exists() and not (tmp_path / "out" / "records" / "00001.json").exists(), "not killed mid-run"
    run_cli(*args)
    assert output_files(tmp_path / "out") == output_files(scored)


def test_two_ranks_write_disjoint_shards_whose_union_is_one_ranks(tmp_path, scored, shards, score_models, realdata):
    args = score_args(shards, tmp_path / "out", score_models, realdata)
    # rank 1 in its own process (RANK / WORLD_SIZE, as torchrun sets them), rank 0 in this one meanwhile
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "WORLD_SIZE": "2", "RANK": "1"}
    other = subprocess.Popen([sys.executable, "-m", "laionkit.cli", *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_cli(*args, "--rank", "0", "--world-size", "2")
    assert other.wait(timeout=300) == 0, other.stdout.read()
    records = {path.stem: json.loads(path.read_text())["rank"] for path in (tmp_path / "out" / "records").glob("*.json")}
    assert records == {"00000": 0, "00001": 1}
    assert output_files(tmp_path / "out") == output_files(scored)
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["complete"]


def test_a_caption_key_no_sample_has_is_refused_before_any_model_loads(tmp_path, shards):
    """As encode: pack keeps LAION's TEXT as ``caption``, so --caption-key TEXT would score no caption at all."""
    result = run_cli("score", str(shards), "--output", str(tmp_path / "out"), "--caption-key", "TEXT",
                     "--clip-model", "no-such-model", check=False)
    one_line_error(result, "--caption-key TEXT", "00000.tar", "json keys url, caption, key")


def test_rerun_with_other_settings_is_refused(scored, shards, score_models):
    result = run_cli("score", str(shards), "--output", str(scored), "--clip-model", str(score_models["config"]),
                     "--clip-pretrained", str(score_models["weights"]), "--workers", "0", check=False)
    assert result.returncode == 2 and "was scored with other" in " ".join(result.stderr.split())


def pack_metadata(shards: Path, metadata: Path) -> Path:
    """pack's per-shard parquets: img2dataset's columns, key among them."""
    metadata.mkdir()
    for tar in sorted(shards.glob("*.tar")):
        rows = [json.loads(sample["json"]) for sample in tar_samples(tar)]
        pq.write_table(pa_table(rows), metadata / f"{tar.stem}.parquet")
    return metadata


def test_filter_scores_keeps_rows_by_a_column_the_parquet_never_had(tmp_path, scored, shards):
    metadata = pack_metadata(shards, tmp_path / "metadata")
    assert "aes" not in pq.read_schema(metadata / "00000.parquet").names
    scores = pq.read_table(scored / "scores").to_pandas()
    threshold = float(scores["aes"].median())
    run_cli("filter", str(metadata), "--scores", str(scored), "--where", f"aes > {threshold}", "--output",
            str(tmp_path / "kept"), "--quiet")
    kept = pq.read_table(tmp_path / "kept").to_pandas()
    assert sorted(kept["key"]) == sorted(scores.loc[scores["aes"] > threshold, "key"]) and 0 < len(kept) < 8
    assert "pwatermark" in kept.columns and "width" in kept.columns  # the input's width wins, once
    # score's own parquets filter too, and pair with its embeddings by shard name as LAION's release does
    run_cli("filter", str(scored / "scores"), "--embeddings", str(scored / "img_emb"), "--score",
            f"again=aesthetic-v2:{REALDATA_AESTHETIC()}", "--where", "again = aes", "--output",
            str(tmp_path / "rescored"), "--quiet")
    assert pq.read_table(tmp_path / "rescored").num_rows == 8


def test_filter_scores_on_pack_output_of_laion_metadata_reads_the_measured_width(tmp_path, scored, shards):
    """pack of laion2B-en rows carries LAION's claimed WIDTH / HEIGHT beside img2dataset's measured width / height:
    DuckDB cannot tell the two apart by case, so the claimed ones are read as source_WIDTH / source_HEIGHT (pack's
    name for an input column img2dataset owns) and rules on width mean the pixels pack saw."""
    metadata = tmp_path / "metadata"
    metadata.mkdir()
    for tar in sorted(shards.glob("*.tar")):
        rows = [json.loads(sample["json"]) for sample in tar_samples(tar)]
        rows = [{**row, "WIDTH": 1000 + row["width"], "HEIGHT": 1000} for row in rows]  # what LAION claims
        pq.write_table(pa_table(rows), metadata / f"{tar.stem}.parquet")
    result = run_cli("filter", str(metadata), "--scores", str(scored), "--where", "width < 400", "--output",
                     str(tmp_path / "kept"))
    kept = pq.read_table(tmp_path / "kept").to_pandas()
    assert sorted(kept["width"]) == [123, 208, 321, 389, 389] and list(kept["source_WIDTH"]) == list(kept["width"] + 1000)
    assert "source_HEIGHT" in kept.columns and "aes" in kept.columns
    assert "WIDTH read as source_WIDTH" in result.stderr


def test_filter_prompt_scores_take_the_clip_model_config_file_score_takes(tmp_path, scored, score_models):
    """Before: filter's --clip-model refused the .json config score and eval take. Now the same model scores a prompt
    in filter as in score: filter's prompt column equals the score run's, row by row."""
    run_cli("filter", str(scored / "scores"), "--embeddings", str(scored / "img_emb"), "--score",
            "again=prompt:an anime drawing|a manga page", "--clip-model", str(score_models["config"]),
            "--clip-pretrained", str(score_models["weights"]), "--output", str(tmp_path / "out"), "--quiet")
    rows = pq.read_table(tmp_path / "out").to_pandas()
    assert len(rows) == 8
    np.testing.assert_allclose(rows["again"], rows["anime"], atol=1e-5)


def test_filter_top_and_dedup_rank_and_match_joined_score_columns(tmp_path, scored, shards):
    """--top and --dedup read a --scores column through the units' join by key, exactly as rules do."""
    metadata = pack_metadata(shards, tmp_path / "metadata")
    assert {"aes", "shard"}.isdisjoint(pq.read_schema(metadata / "00000.parquet").names)
    scores = pq.read_table(scored / "scores").to_pandas()
    run_cli("filter", str(metadata), "--scores", str(scored), "--top", "0.25:aes", "--output", str(tmp_path / "top"),
            "--quiet")
    kept = pq.read_table(tmp_path / "top").to_pandas()
    assert sorted(kept["key"]) == sorted(scores.nlargest(2, "aes")["key"])  # floor(0.25 x 8) rows, the best
    # shard (score's, not in the input) repeats within a shard: the first row of each, in input order
    run_cli("filter", str(metadata), "--scores", str(scored), "--dedup", "shard", "--output",
            str(tmp_path / "unique"), "--quiet")
    assert list(pq.read_table(tmp_path / "unique").to_pandas()["key"]) == ["000000000", "000010000"]
    result = run_cli("filter", str(metadata), "--scores", str(scored), "--top", "0.5:nope", "--output",
                     str(tmp_path / "bad"), "--quiet", check=False)
    assert result.returncode == 2 and "--top 0.5:nope:" in result.stderr and "aes" in result.stderr


def pa_table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


def REALDATA_AESTHETIC() -> Path:  # noqa: N802
    from conftest import REALDATA

    return REALDATA / AESTHETIC_V2


def test_encode_keep_encodes_only_the_kept_keys(tmp_path, scored, shards, tiny_models):
    kept = tmp_path / "kept"
    run_cli("filter", str(scored / "scores"), "--where", "width < height", "--output", str(kept), "--quiet")
    keys = set(pq.read_table(kept, columns=["key"]).column("key").to_pylist())
    assert 0 < len(keys) < 8
    run_cli("encode", str(shards), "--keep", str(kept), "--model", str(tiny_models), "--output", str(tmp_path / "lat"),
            "--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet")
    encoded = {name.split(".", 1)[0] for tar in (tmp_path / "lat").glob("*.tar")
               for name in __import__("tarfile").open(tar).getnames()}
    assert encoded == keys
    manifest = json.loads((tmp_path / "lat" / "manifest.json").read_text())
    assert manifest["counts"]["samples_out"] == len(keys) and manifest["counts"]["not_kept"] == 8 - len(keys)
    assert manifest["keep"]["keys"] == len(keys)


def test_score_reads_and_writes_a_bucket_like_local_disk(s3, scored, shards, score_models, realdata):
    from laionkit.common.storage import Location

    for tar in sorted(shards.glob("*.tar")):
        location = Location.parse(s3.url("shards", tar.name))
        location.fs.put_file(str(tar), location.path)
    output = s3.url("scored")
    run_cli(*score_args(s3.url("shards"), output, score_models, realdata))
    folder = Location.parse(output)
    remote = {f"{sub}/{p.name}": p.read_bytes() for sub in ("scores", "img_emb") for p in (folder / sub).list()}
    assert remote == output_files(scored) and len(remote) == 4
    assert all((folder / "records" / f"{stem}.json").is_complete() for stem in ("00000", "00001"))
    assert (folder / "stats.json").read_json()["complete"]
    again = run_cli(*score_args(s3.url("shards"), output, score_models, realdata)[:-1])  # resumes: nothing to do
    assert "0 of 2 shards to do" in " ".join(again.stderr.split())


def test_pack_keep_rewrites_only_the_kept_samples_as_a_pack_folder(tmp_path, scored, shards):
    kept = tmp_path / "kept"
    run_cli("filter", str(scored / "scores"), "--where", "width < height", "--output", str(kept), "--quiet")
    keys = set(pq.read_table(kept, columns=["key"]).column("key").to_pylist())
    run_cli("pack", str(shards), "--keep", str(kept), "--output", str(tmp_path / "subset"), "--quiet")
    written = {sample["__key__"]: sample for tar in sorted((tmp_path / "subset").glob("*.tar"))
               for sample in tar_samples(tar)}
    originals = {sample["__key__"]: sample for tar in sorted(shards.glob("*.tar")) for sample in tar_samples(tar)}
    assert set(written) == keys
    for key, sample in written.items():  # members byte for byte
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == \
               {k: v for k, v in originals[key].items() if not k.startswith("__")}
    manifest = json.loads((tmp_path / "subset" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["samples"] == len(keys)
    record = json.loads((tmp_path / "subset" / "00000_stats.json").read_text())
    assert record["not_kept"] + record["successes"] == 4
    # encode reads it as pack's folder: the record's count matches each tar
    from laionkit.encode.reader import find_shards

    assert sum(find_shards([str(tmp_path / "subset")], lambda _: None).values()) == len(keys)


def test_pack_keep_writes_the_same_bytes_every_time(tmp_path, scored, shards):
    """A shard pack --keep redoes (after a kill -9, say) is the shard the first run wrote, byte for byte."""
    import time

    run_cli("filter", str(scored / "scores"), "--where", "width < height", "--output", str(tmp_path / "kept"), "--quiet")
    run_cli("pack", str(shards), "--keep", str(tmp_path / "kept"), "--output", str(tmp_path / "first"), "--quiet")
    time.sleep(1.1)  # tar headers hold whole seconds
    run_cli("pack", str(shards), "--keep", str(tmp_path / "kept"), "--output", str(tmp_path / "second"), "--quiet")
    for tar in sorted((tmp_path / "first").glob("*.tar")):
        assert tar.read_bytes() == (tmp_path / "second" / tar.name).read_bytes(), tar.name


def test_decode_draft_reads_jpegs_smaller_and_keeps_the_stored_size(tmp_path, scored, shards, score_models):
    run_cli("score", str(shards), "--output", str(tmp_path / "out"), "--clip-model", str(score_models["config"]),
            "--clip-pretrained", str(score_models["weights"]), "--workers", "2", "--batch-size", "3",
            "--decode", "draft", "--quiet")  # DataLoader workers decode
    exact, draft = pq.read_table(scored / "scores").to_pandas(), pq.read_table(tmp_path / "out" / "scores").to_pandas()
    assert list(draft["key"]) == list(exact["key"])
    assert list(draft["width"]) == list(exact["width"]) and list(draft["sha256"]) == list(exact["sha256"])
    settings = json.loads((tmp_path / "out" / "records" / "00000.json").read_text())["settings"]
    assert settings["decode"] == "draft"
    cosine = (np.load(tmp_path / "out" / "img_emb" / "img_emb_00000.npy").astype(np.float32)
              * np.load(scored / "img_emb" / "img_emb_00000.npy").astype(np.float32)).sum(1)
    assert cosine.min() > 0.9, cosine


def test_bf16_runs_clip_in_bf16_weights_and_matches_fp32_within_rounding(tmp_path, scored, shards, score_models,
                                                                          realdata):
    """--dtype bf16 (the default on CUDA) runs CLIP in bf16 weights, pixels and token ids cast to match (the
    watermark detector under autocast): the same rows, embeddings and scores as fp32's within bf16's rounding."""
    run_cli(*score_args(shards, tmp_path / "out", score_models, realdata, "--dtype", "bf16"))
    exact, bf16 = pq.read_table(scored / "scores").to_pandas(), pq.read_table(tmp_path / "out" / "scores").to_pandas()
    assert list(bf16["key"]) == list(exact["key"]) and list(bf16["phash"]) == list(exact["phash"])
    for column in ("aes", "anime", "punsafe", "pwatermark", "similarity"):
        assert np.nanmax(np.abs(bf16[column] - exact[column])) < 0.02, column
    for stem in ("00000", "00001"):
        ours, fp32 = (np.load(folder / "img_emb" / f"img_emb_{stem}.npy").astype(np.float32)
                      for folder in (tmp_path / "out", scored))
        assert not np.array_equal(ours, fp32)  # computed in bf16, not fp32
        assert (ours * fp32).sum(1).min() > 0.99
    assert json.loads((tmp_path / "out" / "records" / "00000.json").read_text())["settings"]["compute_dtype"] == \
        "bfloat16"
    from laionkit.score import ScoreConfig, Scorers

    scorers = Scorers(ScoreConfig(shards=(str(shards),), output=str(tmp_path / "x"), clip_model=str(score_models["config"]),
                                  clip_pretrained=str(score_models["weights"]), dtype="bf16", quiet=True),
                      torch.device("cpu"))
    assert {parameter.dtype for parameter in scorers.clip.parameters()} == {torch.bfloat16}  # weights, not autocast


def test_cuda_graphs_flag_gives_the_same_files(tmp_path, scored, shards, score_models, realdata):
    """--cuda-graphs (eager off CUDA; caption chunks rounded to 8 tokens) writes what the default run wrote."""
    from laionkit.score import ScoreConfig, run

    args = score_args(shards, tmp_path / "out", score_models, realdata, "--cuda-graphs")
    run_cli(*args)
    exact, graphed = pq.read_table(scored / "scores").to_pandas(), pq.read_table(tmp_path / "out" / "scores").to_pandas()
    assert list(graphed["key"]) == list(exact["key"])
    for column in ("aes", "anime", "punsafe", "pwatermark", "similarity"):
        np.testing.assert_allclose(graphed[column], exact[column], atol=1e-5, err_msg=column)
    config = ScoreConfig(shards=(str(shards),), output=str(tmp_path / "again"), clip_model=str(score_models["config"]),
                         clip_pretrained=str(score_models["weights"]), workers=0, cuda_graphs=True, quiet=True)
    assert run(config, log=lambda _: None)["cuda_graphs"] == {"image": {"graphs": 0, "replays": 0},
                                                              "text": {"graphs": 0, "replays": 0}}  # off CUDA


def test_compile_compiles_full_batches_once_and_runs_the_others_eager(tmp_path, scored, shards, score_models,
                                                                     monkeypatch):
    """--compile: CLIP's image forward under torch.compile for full batches only (batch 2: each shard of 4 is
    a ramp batch of 1, a full batch of 2 and a last batch of 1), one graph for both shards' full batches and no
    recompile for the others, which run eager; the same files as the default run. Dynamo's guards decide the
    graphs, not the backend, so the test compiles with the eager backend (fast)."""
    from torch._dynamo.utils import counters

    from laionkit.score import ScoreConfig, run

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    config = ScoreConfig(shards=(str(shards),), output=str(tmp_path / "out"), clip_model=str(score_models["config"]),
                         clip_pretrained=str(score_models["weights"]), batch_size=2, workers=0, compile=True,
                         quiet=True)
    assert run(config, log=lambda _: None)["samples_out"] == 8
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])  # the full batches of both shards: one graph
    assert not counters["recompiles"], dict(counters["recompiles"])
    torch._dynamo.reset()
    exact, compiled = pq.read_table(scored / "scores").to_pandas(), pq.read_table(tmp_path / "out" / "scores").to_pandas()
    assert list(compiled["key"]) == list(exact["key"]) and list(compiled["phash"]) == list(exact["phash"])
    np.testing.assert_allclose(compiled["similarity"], exact["similarity"], atol=1e-5)
    for stem in ("00000", "00001"):
        np.testing.assert_allclose(np.load(tmp_path / "out" / "img_emb" / f"img_emb_{stem}.npy").astype(np.float32),
                                   np.load(scored / "img_emb" / f"img_emb_{stem}.npy").astype(np.float32), atol=2e-3)


@pytest.mark.parametrize("mode", ["device", "draft-device"])
def test_decode_device_matches_exact_within_resampling(mode, tmp_path, scored, shards, score_models, realdata):
    """--decode device: workers read and hash; the main process decodes baseline JPEGs (here 2 of 8: the other
    photos are progressive JPEGs, a WebP and a PNG, which workers decode) and makes CLIP / watermark pixels and
    pHash on its device (libjpeg-turbo and torch on this CPU; nvJPEG on CUDA). --decode draft-device: workers
    decode every file (JPEGs at draft's scale), the device makes the pixels and pHash. Rows, keys, sizes and
    hashes equal exact's; embeddings and scores differ by resampling's rounding only, a pHash by a bit or two."""
    run_cli(*score_args(shards, tmp_path / "out", score_models, realdata, "--decode", mode, "--workers", "2"))
    exact, device = pq.read_table(scored / "scores").to_pandas(), pq.read_table(tmp_path / "out" / "scores").to_pandas()
    assert list(device["key"]) == list(exact["key"]) and len(device) == 8
    for column in ("width", "height", "sha256", "caption", "source"):
        assert list(device[column]) == list(exact[column]), column
    assert max(hamming(a, b) for a, b in zip(exact["phash"], device["phash"])) <= 2
    for column in ("aes", "anime", "punsafe", "pwatermark", "similarity"):
        assert np.nanmax(np.abs(device[column] - exact[column])) < 0.01, column
    for stem in ("00000", "00001"):
        cosine = (np.load(tmp_path / "out" / "img_emb" / f"img_emb_{stem}.npy").astype(np.float32)
                  * np.load(scored / "img_emb" / f"img_emb_{stem}.npy").astype(np.float32)).sum(1)
        assert cosine.min() > 0.999, cosine
    assert json.loads((tmp_path / "out" / "records" / "00000.json").read_text())["settings"]["decode"] == mode


def test_decode_device_routes_and_skips_per_file(realdata, monkeypatch):
    """Baseline JPEGs reach the device as bytes; progressive, huge and truncated JPEGs and other formats are decoded
    by the worker (JPEGs at draft's reduced scale) (a truncated one fails there: the exact path's skip). A file nothing decodes is dropped from
    the batch with a skip record naming its key, and the batch's other rows stay aligned."""
    import open_clip

    from laionkit.score.pixels import DevicePixels, device_decodable
    from laionkit.score.reader import ScoreSamples, split_clip_transform

    baseline = (realdata / "images" / "456_123.jpg").read_bytes()
    progressive = (realdata / "images" / "321_421.jpg").read_bytes()
    assert device_decodable(Image.open(io.BytesIO(baseline)), baseline)
    assert not device_decodable(Image.open(io.BytesIO(progressive)), progressive)
    assert not device_decodable(Image.open(io.BytesIO(baseline[:-300])), baseline[:-300])
    monkeypatch.setattr("laionkit.score.pixels.DEVICE_MAX_PIXELS", 123 * 456 - 1)  # 456_123.jpg: 123 x 456 px
    assert not device_decodable(Image.open(io.BytesIO(baseline)), baseline)
    monkeypatch.undo()

    def device_input(data: bytes, draft_side: int | None = None, jpegs: bool = True) -> dict:  # a worker's sample
        samples = ScoreSamples([], None, True, False, 1, draft_side=draft_side, device_decode=True,
                               device_jpegs=jpegs)
        return samples.prepare({"__key__": "k", "jpg": data})

    assert device_input(baseline)["images"] == baseline  # the file's bytes
    assert device_input(baseline, jpegs=False)["images"].shape == (123, 456, 3)  # draft-device: the worker decodes
    assert device_input(progressive)["images"].shape == (421, 321, 3)  # worker-decoded RGB
    drafted = device_input(progressive, 100)  # at --decode draft's reduced DCT scale
    assert drafted["images"].shape[:2] < (421, 321) and min(drafted["images"].shape[:2]) >= 100
    assert (drafted["width"], drafted["height"]) == (321, 421)  # the stored size, as exact records it
    with pytest.raises(OSError):
        device_input(baseline[:-300])

    _, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32")
    transform, _ = split_clip_transform(preprocess)
    other = (realdata / "images" / "123_456.jpg").read_bytes()  # baseline too, another size
    junk = b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9"

    def batch_of(*files: bytes, decoded: tuple[int, ...] = ()) -> dict:
        """A collated batch: each file as its bytes, or (rows in ``decoded``) as the worker's Pillow RGB."""
        keys = ["a", "junk", "b", "c"][: len(files)] if len(files) > 1 else ["b"]
        items = [{"key": key, "source": None, "caption": key, "width": index, "height": index, "sha256": key,
                  "captions": {"alt": key},
                  "images": np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) if index in decoded else data}
                 for index, (key, data) in enumerate(zip(keys, files))]
        return ScoreSamples.collate("00000", items)  # as the DataLoader's workers batch them

    pixels = DevicePixels(transform, True, torch.device("cpu"))
    batch = batch_of(baseline, junk, other, baseline)
    batch["tokens"] = torch.arange(4).repeat_interleave(77).view(4, 77)  # the workers' token ids, a row each
    batch["caption_tokens"] = {"alt": batch["tokens"] + 10}
    out, skips = pixels(batch)
    assert [skip["key"] for skip in skips] == ["junk"] and skips[0]["reason"] == "undecodable"
    assert out["tokens"][:, 0].tolist() == [0, 2, 3] and out["caption_tokens"]["alt"][:, 0].tolist() == [10, 12, 13]
    assert out["key"] == ["a", "b", "c"] and out["width"] == [0, 2, 3] and out["captions"] == {"alt": ["a", "b", "c"]}
    assert out["clip"].shape == (3, 224, 224, 3) and out["watermark"].shape == (3, 256, 256, 3)
    # same-size images are resized together; rows come back in the batch's order
    alone, _ = pixels(batch_of(other))
    for name in ("clip", "watermark", "phash"):
        assert out[name][1].equal(alone[name][0]) and out[name][0].equal(out[name][2]), name
        assert not out[name][0].equal(out[name][1]), name
    for row, data in ((0, baseline), (1, other)):
        assert hamming(int(out["phash"][row]), phash(Image.open(io.BytesIO(data)).convert("RGB"))) <= 2
    # worker-decoded RGB of two sizes travels as one flat tensor; each row gets its own image back, in order
    mixed, _ = pixels(batch_of(baseline, other, progressive, baseline, decoded=(1, 2)))
    shipped = batch_of(baseline, other, progressive, baseline, decoded=(1, 2))
    assert shipped["images"][1:3] == [(456, 123, 3), (421, 321, 3)] and shipped["rgb"].numel() == 3 * (123 * 456 + 421 * 321)
    assert mixed["key"] == ["a", "junk", "b", "c"]  # batch_of's four keys; no file is junk here, none is skipped
    for name in ("clip", "watermark", "phash"):
        assert mixed[name][0].equal(out[name][0]) and mixed[name][3].equal(out[name][0]), name
    assert (mixed["clip"][1].int() - out["clip"][1].int()).abs().max() <= 2  # Pillow's vs the device's IDCT
    assert hamming(int(mixed["phash"][2]), phash(Image.open(io.BytesIO(progressive)).convert("RGB"))) <= 2


def test_a_shards_first_batches_ramp_up_and_workers_give_the_same_files(tmp_path, scored, shards, score_models,
                                                                        realdata):
    """A shard's batches start at batch_size / 8 and double up to batch_size (the device gets work once a worker
    has prepared a few samples, not a whole batch), keep the shard's order, and the ramp is the shard's: two
    workers write the files one process writes."""
    import webdataset as wds

    from laionkit.score.reader import ScoreSamples, batch_sizes

    photos = sorted(p for p in (realdata / "images").iterdir() if p.suffix == ".jpg")
    tar = tmp_path / "00000.tar"
    with wds.TarWriter(str(tar)) as sink:
        for index in range(27):
            sink.write({"__key__": f"{index:09d}", "jpg": photos[index % len(photos)].read_bytes(), "txt": "a photo"})
    samples = ScoreSamples([], lambda image: image.resize((8, 8)), True, False, 16)
    items = list(samples.shard_batches(tar))
    batches, done = items[:-1], items[-1]
    assert [len(batch["key"]) for batch in batches] == [2, 4, 8, 13]  # 16 / 8, doubling, then the shard's rest
    assert [key for batch in batches for key in batch["key"]] == [f"{index:09d}" for index in range(27)]
    assert done.samples_in == 27 and not done.skips
    assert [size for size, _ in zip(batch_sizes(512), range(6))] == [64, 128, 256, 512, 512, 512]
    assert [size for size, _ in zip(batch_sizes(3), range(3))] == [1, 2, 3]

    args = score_args(shards, tmp_path / "out", score_models, realdata)
    run_cli(*args[:-5], "--workers", "2", "--batch-size", "3", "--quiet")  # score_args ends with 0 workers, batch 3
    assert output_files(tmp_path / "out") == output_files(scored)


def test_stacked_resampling_matches_torchvision_per_image_and_pillows_phash(realdata, monkeypatch):
    """--decode device / draft-device on an accelerator: a batch of many sizes is resampled as padded stacks through
    per-image resampling matrices (two batched matrix products, not ~25 kernels per image). Its CLIP and watermark
    pixels are torchvision's antialiased Resize + CenterCrop / squash of each image to within one level, its pHash
    the per-group path's and within 2 bits of Pillow's; how the batch is cut into stacks changes nothing; a
    preprocess it cannot express, or a crop that would pad, goes through torchvision per group."""
    import open_clip
    from torchvision import transforms as T

    import laionkit.score.pixels as pixels_module
    from laionkit.score.pixels import DevicePixels, plan_resample, stacks
    from laionkit.score.reader import split_clip_transform

    photos = [Image.open(path).convert("RGB") for path in sorted((realdata / "images").iterdir())
              if path.suffix in (".jpg", ".png")]
    rng = np.random.default_rng(0)
    images = [torch.from_numpy(np.array(photo)).permute(2, 0, 1) for photo in photos]
    images += [torch.from_numpy(rng.integers(0, 256, (3, *rng.integers(150, 400, 2)), dtype=np.uint8))
               for _ in range(9)]
    images.append(images[0].clone())  # a size twice in the batch
    _, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32")
    transform, _ = split_clip_transform(preprocess)
    stacked = DevicePixels(transform, True, torch.device("cpu"), stacked=True)
    grouped = DevicePixels(transform, True, torch.device("cpu"))  # a CPU's default
    assert stacked.resample is not None and grouped.resample is None
    clip, watermark, hashes = stacked._stacked(images)
    for index, image in enumerate(images):  # torchvision on the image alone, as the grouped path runs it
        alone = transform(image[None])[0]
        assert (clip[index].int() - alone.int()).abs().max() <= 1, index
        squash = T.functional.resize(image[None], [256, 256], antialias=True)[0]
        assert (watermark[index].int() - squash.int()).abs().max() <= 1, index
    assert clip[0].equal(clip[-1]) and watermark[0].equal(watermark[-1]) and hashes[0] == hashes[-1]
    assert hashes.tolist() == grouped._grouped(images)[2].tolist()
    for photo, value in zip(photos, hashes.tolist()):
        assert hamming(phash(photo), value) <= 2

    monkeypatch.setattr(pixels_module, "PAD_PIXELS", 400 * 400)  # a stack per image or two
    assert len(stacks([tuple(image.shape[1:]) for image in images], pixels_module.PAD_PIXELS)) > 8
    for one, many in zip((clip, watermark, hashes), stacked._stacked(images)):
        assert (one.long() - many.long()).abs().max() <= 1
    shapes = [(500, 300), (10, 10), (300, 500), (20, 30), (500, 500)]
    groups = stacks(shapes, 500 * 500)
    assert sorted(index for group in groups for index in group) == list(range(5))
    assert all(len(group) == 1 or len(group) * max(shapes[i][0] for i in group) * max(shapes[i][1] for i in group)
               <= 500 * 500 for group in groups)

    # what the stacks cannot express: per group through torchvision, the same outputs as the grouped path
    assert plan_resample(T.Compose([T.Resize(64), T.RandomCrop(32)])) is None
    assert plan_resample(T.Compose([T.Resize(64, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(64)])) is None
    padding = T.Compose([T.Resize((100, 100)), T.CenterCrop(128)])  # torchvision pads the crop with zeros
    assert DevicePixels(padding, False, torch.device("cpu"), stacked=True)._stacked(images) is None
    batch = {"key": ["a", "b"], "source": [None, None], "caption": ["a", "b"], "width": [1, 2], "height": [1, 2],
             "sha256": ["a", "b"], "jpegs": torch.zeros(0, dtype=torch.uint8),
             "rgb": torch.cat([images[1].permute(1, 2, 0).flatten(), images[2].permute(1, 2, 0).flatten()]),
             "images": [tuple(images[1].permute(1, 2, 0).shape), tuple(images[2].permute(1, 2, 0).shape)]}
    out, _ = DevicePixels(padding, False, torch.device("cpu"), stacked=True)(dict(batch))
    assert out["clip"].shape == (2, 128, 128, 3) and out["clip"][:, :14].max() == 0  # the zeros torchvision pads


def test_luma_is_pillows_grey_from_uint8_and_float32():
    """laionkit.score.pixels.luma (the device pHash's grey image, computed in float32) equals Pillow's RGB -> L
    conversion for every red and green with 16 blues (the extremes among them, where float32's sums are largest),
    from uint8 channels and from the stacks' float32 pixels alike."""
    from laionkit.score.pixels import luma

    blues = np.array([0, 1, 2, 63, 64, 127, 128, 129, 191, 192, 200, 250, 252, 253, 254, 255], dtype=np.uint32)
    red, green, blue = (axis.ravel() for axis in np.meshgrid(np.arange(256), np.arange(256), blues, indexing="ij"))
    rgb = np.stack([red, green, blue], -1).astype(np.uint8).reshape(1024, 1024, 3)
    expected = np.asarray(Image.fromarray(rgb).convert("L"))
    channels = torch.from_numpy(rgb).permute(2, 0, 1)  # a channels-last view, as the stacks are
    for given in (channels, channels.float()):
        grey = luma(given)
        assert grey.dtype == torch.float64 and np.array_equal(grey.numpy(), expected)


def test_resampling_weights_from_each_rows_window_are_the_whole_axis_weights():
    """resample_weights computes each row over its own window of input pixels (bounded by the batch's largest
    reduction, a host number) and scatters it into the zero matrix: the same matrix as computed over the whole
    axis, to float64's last bits, and bit-equal once in float32 (what the CLIP and watermark matmuls take); each
    row sums to 1 and is zero past the image's own size (the stack's padding), when reducing and enlarging."""
    from laionkit.score.pixels import resample_weights

    generator = torch.Generator().manual_seed(0)
    size_in = torch.randint(60, 900, (24,), generator=generator).double()
    for kind, out in (("bicubic", 224), ("bilinear", 256), ("lanczos", 32)):
        resized = torch.clamp(torch.floor(size_in * out / size_in.clamp(max=300)), min=out)  # some enlarged
        offset = torch.round((resized - out) / 2)
        length = int(size_in.max()) + 7  # padded past the largest image
        whole = resample_weights(size_in, resized, offset, out, length, kind)
        scale = float((size_in / resized).max())
        windowed = resample_weights(size_in, resized, offset, out, length, kind, scale)
        assert (windowed - whole).abs().max() < 1e-14, kind
        single = resample_weights(size_in, resized, offset, out, length, kind, scale, torch.float32)
        assert single.dtype == torch.float32 and single.equal(whole.float()), kind
        assert torch.allclose(windowed.sum(-1), torch.ones(()).double())
        past = torch.arange(length)[None, None, :] >= size_in[:, None, None]
        assert not windowed.masked_select(past).any(), kind


def test_draft_device_workers_pad_the_stacks_the_device_takes_as_views(tmp_path, realdata, shards, score_models,
                                                                       monkeypatch):
    """--decode draft-device where the device resamples stacks: the workers pad their decoded images into those
    stacks (zeros past each image), so the device takes a stack as one view instead of copying each image into
    place from Python. The device's outputs are the same as from the images end to end; a device that resamples
    per group (a CPU's default) takes the padded stacks too; a run whose workers pad writes what one whose
    device pads writes, and its loader's batches are the padded ones."""
    import open_clip
    import pandas as pd

    import laionkit.score as score_module
    import laionkit.score.pixels as pixels_module
    from laionkit.score import ScoreConfig, Scorers, run, score_loader
    from laionkit.score.pixels import PAD_PIXELS, DevicePixels
    from laionkit.score.reader import ScoreSamples, split_clip_transform

    rng = np.random.default_rng(0)
    images = [np.asarray(Image.open(path).convert("RGB")) for path in sorted((realdata / "images").iterdir())
              if path.suffix in (".jpg", ".png")]
    images += [rng.integers(0, 256, (*rng.integers(150, 400, 2), 3), dtype=np.uint8) for _ in range(9)]
    items = [{"key": str(index), "source": None, "caption": str(index), "width": 1, "height": 1, "sha256": str(index),
              "images": image} for index, image in enumerate(images)]
    _, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32")
    transform, _ = split_clip_transform(preprocess)
    stacked = DevicePixels(transform, True, torch.device("cpu"), stacked=True)
    grouped = DevicePixels(transform, True, torch.device("cpu"))
    end_to_end = ScoreSamples.collate("00000", items)
    assert "stacks" not in end_to_end
    expected, _ = stacked(dict(end_to_end))
    for budget in (PAD_PIXELS, 400 * 400):  # one stack; a stack per image or two
        monkeypatch.setattr(pixels_module, "PAD_PIXELS", budget)  # the device's own stacks, for end_to_end's batch
        padded = ScoreSamples.collate("00000", items, budget)
        rows = [row for rows, _, _ in padded["stacks"] for row in rows]
        assert sorted(rows) == list(range(len(images))) and (len(padded["stacks"]) > 8) == (budget < PAD_PIXELS)
        start = 0  # each image in place in its stack, zeros past its size
        for stack_rows, height, width in padded["stacks"]:
            stack = padded["rgb"][start:start + len(stack_rows) * height * width * 3].view(len(stack_rows), height, width, 3)
            for slot, row in enumerate(stack_rows):
                h, w = images[row].shape[:2]
                assert stack[slot, :h, :w].numpy().tobytes() == images[row].tobytes()
                assert stack[slot, h:].sum() == 0 and stack[slot, :, w:].sum() == 0
            start += stack.numel()
        assert start == padded["rgb"].numel()
        out, skips = stacked(dict(padded))
        ours, _ = stacked(dict(end_to_end))
        assert not skips and out["key"] == end_to_end["key"]
        for name in ("clip", "watermark", "phash"):
            assert out[name].equal(ours[name]), (budget, name)
            assert (out[name].long() - expected[name].long()).abs().max() <= 1, (budget, name)
        per_group, _ = grouped(dict(padded))  # no stacks on this device: each image a view of its stack
        by_group, _ = grouped(dict(end_to_end))
        for name in ("clip", "watermark", "phash"):
            assert per_group[name].equal(by_group[name]), (budget, name)
    monkeypatch.undo()

    def config(name: str) -> ScoreConfig:
        return ScoreConfig(shards=(str(shards),), output=str(tmp_path / name), clip_model=str(score_models["config"]),
                           clip_pretrained=str(score_models["weights"]), batch_size=3, workers=2,
                           decode="draft-device", quiet=True)

    def frame(name: str) -> pd.DataFrame:
        return pd.concat(pd.read_parquet(path) for path in sorted((tmp_path / name / "scores").glob("*.parquet")))

    run(config("device-pads"), log=lambda _: None)  # the CPU's default: the device resamples per group
    # as on an accelerator: the device resamples stacks, which the workers pad
    monkeypatch.setattr(score_module, "DevicePixels", functools.partial(DevicePixels, stacked=True))
    scorers = Scorers(config("workers-pad"), torch.device("cpu"), lambda _: None)
    batch = next(item for item in score_loader(config("workers-pad"), scorers, sorted(shards.glob("*.tar")))
                 if isinstance(item, dict))
    assert batch["stacks"] and batch["rgb"].numel() >= 3 * sum(h * w for h, w, _ in batch["images"])
    run(config("workers-pad"), log=lambda _: None)
    ours, theirs = frame("workers-pad"), frame("device-pads")
    assert ours["key"].tolist() == theirs["key"].tolist() and len(ours) == 8
    assert [hamming(a, b) for a, b in zip(ours["phash"], theirs["phash"])] == [0] * 8
    assert np.allclose(ours["similarity"], theirs["similarity"], atol=0.02, equal_nan=True)


def test_run_says_where_the_loop_waited(tmp_path, shards, score_models):
    """run()'s summary splits the loop's time: the main thread's waits for data and for the device, and (device
    pixel modes) the pixel thread's waits for the loader and its own time; each within the loop's seconds. The
    time outside the loop too: before the first batch, and writing the last shards after the last batch."""
    from laionkit.score import ScoreConfig, run

    for decode, names in (("draft", {"data", "device"}),
                          ("draft-device", {"data", "device", "pixels_loader_wait", "pixels"})):
        config = ScoreConfig(shards=(str(shards),), output=str(tmp_path / decode), clip_model=str(score_models["config"]),
                             clip_pretrained=str(score_models["weights"]), batch_size=2, workers=1, decode=decode,
                             quiet=True)
        summary = run(config, log=lambda _: None)
        waits = summary["wait_seconds"]
        assert set(waits) == names and summary["samples_out"] == 8, summary
        assert all(0 <= value <= summary["wall_seconds"] for value in waits.values()), summary
        assert waits["data"] + waits["device"] <= summary["seconds"] + 1e-3, summary
        assert summary["startup_seconds"] > 0 and 0 <= summary["drain_seconds"] <= summary["seconds"], summary
        assert summary["startup_seconds"] + summary["seconds"] <= summary["wall_seconds"] + 1e-3, summary
        if decode == "draft-device":
            assert waits["pixels"] > 0, summary  # 8 images resized and hashed in the thread


def test_workers_tokenize_the_captions_the_main_thread_did(shards, score_models):
    """ScoreSamples given CLIP's tokenizer ships each batch's token ids (and a named caption's, shared where it
    is the default caption), equal to what the main thread's tokenizer gives, so the files do not change
    (test_kill9_mid_run_then_rerun_gives_the_same_files and the rank / worker tests compare them)."""
    import open_clip

    from laionkit.score.reader import ScoreSamples

    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    samples = ScoreSamples([], lambda image: image.resize((8, 8)), True, False, 3, captions=("alt",),
                           tokenizer=tokenizer)
    batches = [item for item in samples.shard_batches(shards / "00000.tar") if isinstance(item, dict)]
    assert sum(len(batch["key"]) for batch in batches) == 4
    for batch in batches:
        assert batch["tokens"].equal(tokenizer(batch["caption"])) and len(set(batch["caption"])) == len(batch["key"])
        assert batch["caption_tokens"]["alt"] is batch["tokens"]  # alt is the default caption: the same ids
    plain = ScoreSamples([], lambda image: image.resize((8, 8)), True, False, 3)
    assert not any("tokens" in item for item in plain.shard_batches(shards / "00000.tar") if isinstance(item, dict))


def test_captions_run_over_their_own_tokens_with_the_full_contexts_embeddings(score_models, realdata):
    """TextEncoder sorts a batch's captions by length and runs each chunk only as long as its longest caption
    (the model's own forward, its positional embedding and causal mask cut): on LAION's real alt-texts, the same
    embeddings as encode_text over the whole 77-token context, in the batch's order, from under half the tokens.
    A tower whose output depends on the padding (no causal mask) runs the whole context."""
    import pandas as pd

    from laionkit.score.models import load_score_clip
    from laionkit.score.text import TextEncoder

    clip, _, tokenizer, _ = load_score_clip(str(score_models["config"]), str(score_models["weights"]),
                                            torch.device("cpu"))
    captions = list(pd.read_parquet(realdata / "laion-sample" / "test_1000.parquet")["TEXT"].fillna("")[:512])
    tokens = tokenizer(captions)
    seen = []
    hook = clip.transformer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[:2]))
    with torch.inference_mode():
        full = torch.nn.functional.normalize(clip.encode_text(tokens).float(), dim=-1)
        seen.clear()
        encoder = TextEncoder(clip)
        ours = encoder(tokens, torch.device("cpu"))
        assert len(seen) > 1 and sum(rows * length for rows, length in seen) < 0.5 * tokens.numel(), seen
        assert sum(rows for rows, _ in seen) == len(captions)
        torch.testing.assert_close(ours, full, atol=2e-5, rtol=0)
        seen.clear()  # --cuda-graphs: chunk lengths round up to a multiple of 8 (a graph per shape), same values
        rounded = TextEncoder(clip, cuda_graphs=True)(tokens, torch.device("cpu"))
        assert all(length % 8 == 0 or length == 77 for _, length in seen) and len(seen) > 1, seen
        assert sum(rows * length for rows, length in seen) < 0.5 * tokens.numel(), seen
        torch.testing.assert_close(rounded, full, atol=2e-5, rtol=0)
        hook.remove()
        clip.attn_mask = None  # a bidirectional tower: padding changes its output, so nothing is cut
        assert TextEncoder(clip).trim is None
        torch.testing.assert_close(TextEncoder(clip)(tokens, torch.device("cpu")),
                                   torch.nn.functional.normalize(clip.encode_text(tokens).float(), dim=-1))


def test_a_shard_is_written_after_the_next_batch_is_queued_and_a_failed_write_stops_the_run(tmp_path, shards,
                                                                                            score_models, monkeypatch):
    """A finished shard is written by a thread of its own once its last batch is collected, which is after the next
    shard's first batch is queued on the device (so the device is not drained at every shard's end); a write that
    fails ends the run with its error, and the shard written before it stays done."""
    import laionkit.score as score

    events = []
    launch, finish = score.Scorers.launch, score._finish_shard

    def launched(self, batch):
        events.append(("launch", batch["shard"]))
        return launch(self, batch)

    def finished(output, done, *args):
        events.append(("write", done.shard))
        if done.shard == "00001" and fail:
            raise OSError("No space left on device")
        return finish(output, done, *args)

    monkeypatch.setattr(score.Scorers, "launch", launched)
    monkeypatch.setattr(score, "_finish_shard", finished)
    fail = False
    config = score.ScoreConfig(shards=(str(shards),), output=str(tmp_path / "out"), clip_model=str(score_models["config"]),
                               clip_pretrained=str(score_models["weights"]), batch_size=3, workers=0, quiet=True)
    assert score.run(config, log=lambda _: None)["samples_out"] == 8
    assert events.index(("write", "00000")) > events.index(("launch", "00001"))
    assert [event for event in events if event[0] == "write"] == [("write", "00000"), ("write", "00001")]
    fail = True
    with pytest.raises(OSError, match="No space left"):
        score.run(score.ScoreConfig(**{**config.__dict__, "output": str(tmp_path / "failed")}), log=lambda _: None)
    assert (tmp_path / "failed" / "records" / "00000.json").exists()
    assert not (tmp_path / "failed" / "records" / "00001.json").exists()
