"""One stage never writes into another stage's folder: pack into latents, encode into other image shards,
filter into latents, `models tiny` over anything, locally and in a bucket; a rerun into a stage's own
folder (resume) still passes."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from laionkit.common.storage import Location

SAMPLE = REPO / "laionkit" / "data" / "laion-sample.parquet"


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def remote_digests(url: str) -> dict[str, str]:
    location = Location.parse(url)
    return {name: hashlib.sha256(location.fs.cat_file(name)).hexdigest() for name in sorted(location.fs.find(location.path))}


def refused(result, folder, holds: str) -> None:
    """Exit 2, one line naming the folder and what it holds, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(folder) in lines[0] and holds in lines[0] and "--overwrite" in lines[0], lines[0]


@pytest.fixture
def latents_copy(latent_shards, tmp_path) -> Path:
    return Path(shutil.copytree(latent_shards, tmp_path / "latents"))


def test_pack_into_a_latent_folder_is_refused_and_leaves_it_whole(latents_copy):
    before = digests(latents_copy)
    result = run_cli("pack", SAMPLE, "--output", latents_copy, "--processes", "1", "--quiet", check=False)
    refused(result, latents_copy, "encode's latent shards (00000.stats.json")
    assert digests(latents_copy) == before


def test_encode_into_another_folder_of_image_shards_is_refused(image_shards, tiny_models, tmp_path):
    other = Path(shutil.copytree(image_shards, tmp_path / "other-shards"))
    before = digests(other)
    result = run_cli("encode", image_shards, "--model", tiny_models, "--output", other, "--resolution", "64",
                     "--workers", "0", "--quiet", check=False)
    refused(result, other, "WebDataset tar shards (00000.tar, 00001.tar)")
    assert digests(other) == before
    # --overwrite insists: the latent shards are written beside (same names replaced) the image shards
    run_cli("encode", image_shards, "--model", tiny_models, "--output", other, "--resolution", "64",
            "--workers", "0", "--quiet", "--overwrite")
    assert (other / "manifest.json").is_file()


def test_filter_into_a_latent_folder_is_refused_and_its_own_rerun_resumes(latents_copy, tmp_path):
    before = digests(latents_copy)
    result = run_cli("filter", SAMPLE, "--output", latents_copy, "--where", "punsafe < 0.5", "--quiet", check=False)
    refused(result, latents_copy, "encode's latent shards")
    assert digests(latents_copy) == before
    own = tmp_path / "filtered"
    run_cli("filter", SAMPLE, "--output", own, "--where", "punsafe < 0.5", "--quiet")
    parts = digests(own)
    run_cli("filter", SAMPLE, "--output", own, "--where", "punsafe < 0.5", "--quiet")  # resume: nothing to redo
    assert {k: v for k, v in digests(own).items() if k.startswith("part-")} == \
        {k: v for k, v in parts.items() if k.startswith("part-")}


def test_models_tiny_refuses_any_folder_that_holds_something(latents_copy, tmp_path):
    before = digests(latents_copy)
    result = run_cli("models", "tiny", "--output", latents_copy, check=False)
    refused(result, latents_copy, "encode's latent shards")
    assert digests(latents_copy) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    refused(run_cli("models", "tiny", "--output", notes, check=False), notes, "todo.txt")
    assert (notes / "todo.txt").read_text() == "mine"
    run_cli("models", "tiny", "--output", notes, "--overwrite")  # asked for: replaced whole
    assert (notes / "model_index.json").is_file() and not (notes / "todo.txt").exists()
    (tmp_path / "empty").mkdir()
    run_cli("models", "tiny", "--output", tmp_path / "empty")
    assert (tmp_path / "empty" / "model_index.json").is_file()


def test_in_a_bucket_pack_into_latents_and_encode_into_image_shards_are_refused(
        s3, latent_shards, image_shards, tiny_models):
    latents, shards = s3.url("latents"), s3.url("shards")
    for local, url in ((latent_shards, latents), (image_shards, shards)):
        location = Location.parse(url)
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            location.fs.put_file(str(path), location.join(path.relative_to(local).as_posix()).path)
    before = remote_digests(latents), remote_digests(shards)
    refused(run_cli("pack", SAMPLE, "--output", latents, "--processes", "1", "--quiet", check=False),
            latents, "encode's latent shards")
    refused(run_cli("encode", image_shards, "--model", tiny_models, "--output", shards, "--resolution", "64",
                    "--workers", "0", "--quiet", check=False), shards, "WebDataset tar shards")
    assert (remote_digests(latents), remote_digests(shards)) == before
