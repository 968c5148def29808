"""Issue 30's end-to-end proof: curation from pixels on the real rows and photos of ../shared/realdata, as a
user runs it on the command line, each stage killed with -9 once mid-run and rerun to the outputs of an
uninterrupted run of that stage.

pack (real LAION rows' alt-texts, the photos on a loopback image server, plus a copy and a re-encode planted)
→ score (tiny random-init open_clip of ViT-L/14's width in open_clip's layout, the real aesthetic v2 weights,
LAION's watermark and NSFW heads at random init in their layouts) → dedup (exact, pHash, semantic: the planted
duplicates and a pair the photos hold go) → filter dedup's keep list by `similarity`, a column the rows never
had (`filter --scores`)
→ pack --keep (the kept samples, nothing downloaded again) → caption (the tiny VLM) → encode --captions alt,vlm
→ train --caption-mix alt:0.5,vlm:0.5.

The kill is deterministic: a sitecustomize hook in the killed process SIGKILLs its process group right after
the stage renames a chosen output into place (every stage commits local files with os.replace), so each
stage dies having written some output and before it finished. The uninterrupted reference of each stage runs
in this process (run_cli), its input the chain's previous (resumed) output.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli
from fixtures import killed, metrics, with_hook
from PIL import Image
from test_caption import digests, tar_members, tiny_vlm  # noqa: F401 (tiny_vlm: a fixture)
from test_caption_mix import FAST as TRAIN_FAST
from test_caption_mix import seen
from test_dedup_layers import same_outputs
from test_score import output_files, score_args

from laionkit.common.imageserver import Response, folder_routes, serve

PHOTOS = 8
# Planted duplicates: 456_123.jpg's bytes under another URL (the exact layer removes one of the two) and
# 416_264.jpg re-encoded at JPEG quality 40 (other bytes, the same pHash within 4 bits: the pHash layer).
# The photos themselves hold a pair too: original.png is 389_535.jpg losslessly, so pack's 64 px JPEGs of
# the two are the same bytes (exact).
COPY, REENCODED = "copy-of-456_123.jpg", "reencoded-416_264.jpg"
PACK = ("--image-size", "64", "--processes", "1", "--threads", "2", "--timeout", "5", "--shard-size", "3",
        "--allow-private-hosts", "-q")
CAPTION = ("--max-new-tokens", "6", "--batch-size", "2", "--workers", "0", "-q")
ENCODE = ("--resolution", "64", "--batch-size", "4", "--workers", "0", "--captions", "alt,vlm", "-q")
TRAIN = (*TRAIN_FAST, "--max-steps", "4", "--checkpoint-every", "2", "--caption-mix", "alt:0.5,vlm:0.5",
         "--resume", "latest")

# Runs in the killed process: SIGKILL its whole group (pack's workers too) right after a file or folder whose
# path matches LAIONKIT_KILL_AFTER is renamed into place.
KILL_HOOK = """
    import fnmatch, os, signal
    pattern = os.environ.get("LAIONKIT_KILL_AFTER")
    if pattern:
        replace = os.replace
        def replace_then_die(src, dst, *args, **kwargs):
            replace(src, dst, *args, **kwargs)
            if fnmatch.fnmatch(os.fspath(dst), pattern):
                os.killpg(0, signal.SIGKILL)
        os.replace = replace_then_die
"""


def tars(folder: Path) -> dict[str, dict[str, bytes]]:
    """Each tar of ``folder``: its members by name, byte for byte."""
    return {path.name: tar_members(path) for path in sorted(folder.glob("*.tar"))}


def assert_equal(reference, resumed) -> None:
    assert resumed == reference


def statuses(folder: Path) -> dict[str, list[dict]]:
    """Pack's per-sample status parquets, rows by key: img2dataset writes them (and the tars) in the order
    downloads finish, so only their content is the same from run to run."""
    return {p.name: sorted(pq.read_table(p).to_pylist(), key=lambda row: row["key"])
            for p in sorted(folder.glob("*.parquet"))}


def same_training(reference: Path, resumed: Path) -> None:
    """Every step trained the same samples with the same picked captions, to the same loss and gradient norm
    (on CPU with one thread, to the bit)."""
    assert seen(resumed) == seen(reference)
    assert [(r["loss"], r["grad_norm"]) for r in metrics(resumed).values()] == \
        [(r["loss"], r["grad_norm"]) for r in metrics(reference).values()]
    assert {name for record in seen(reference).values() for name in record["captions"]} == {"alt", "vlm"}


def url_of(source: str) -> str:
    return json.loads(source)["url"].rsplit("/", 1)[1]


def files(folder: Path, pattern: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(pattern))}


def killed_then_rerun(kill_env: dict, after: str, finished: str, args: list, output: Path) -> None:
    """`laionkit ARGS` killed with -9 once a path matching ``output/AFTER`` lands: it wrote some outputs and
    not ``output/FINISHED`` (a glob: what a finished run writes last); then the same command again (in this
    process), to its end."""
    result = killed(args, {**kill_env, "LAIONKIT_KILL_AFTER": str(output / after)})
    assert list(output.glob(after)) and not list(output.glob(finished)), result.stderr
    run_cli(*args)
    assert list(output.glob(finished))


@pytest.fixture(scope="module")
def photos(realdata):
    routes = folder_routes(realdata / "images")
    routes[COPY] = Response(routes["456_123.jpg"].body)
    buffer = io.BytesIO()
    Image.open(io.BytesIO(routes["416_264.jpg"].body)).save(buffer, format="JPEG", quality=40)
    routes[REENCODED] = Response(buffer.getvalue())
    with serve(routes) as server:
        yield server


def test_curation_from_pixels_survives_kill_9_at_every_stage(tmp_path, realdata, photos, score_models,  # noqa: F811
                                                             tiny_models, tiny_vlm):  # noqa: F811
    started = time.monotonic()
    kill_env = with_hook(dict(os.environ), tmp_path, KILL_HOOK)

    # real LAION rows: their alt-texts, with URLs of the photos on the loopback server (and the planted two)
    texts = pq.read_table(realdata / "laion-sample" / "test_1000.parquet", columns=["TEXT"]).column("TEXT")
    names = [*sorted(folder_routes(realdata / "images")), COPY, REENCODED]
    assert len(names) == PHOTOS + 2
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"URL": [photos.url(n) for n in names], "TEXT": texts.to_pylist()[: len(names)]}), rows)
    timings = {}

    def stage(args: list, after: str, finished: str, same) -> Path:
        """One stage as the chain runs it: an uninterrupted reference into ref-OUTPUT (in this process), then a
        run into OUTPUT killed with -9 after AFTER and rerun; ``same(reference, output)`` compares them."""
        clock = time.monotonic()
        output = Path(args[args.index("--output") + 1])
        reference = output.with_name(f"ref-{output.name}")
        run_cli(*[reference if str(arg) == str(output) else arg for arg in args])
        killed_then_rerun(kill_env, after, finished, args, output)
        same(reference, output)
        timings[" ".join(map(str, args[:1] + [a for a in args if a == "--keep"]))] = round(time.monotonic() - clock, 1)
        return output

    # -- pack: 10 rows in 4 shards of 3; killed once shard 0 is recorded. img2dataset writes samples in the order
    # their downloads finish: the same members and status rows, not the same bytes
    shards = stage(["pack", rows, "--output", tmp_path / "shards", *PACK], "00000_stats.json", "manifest.json",
                   lambda a, b: (assert_equal(tars(a), tars(b)), assert_equal(statuses(a), statuses(b))))
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["complete"] and manifest["samples"] == PHOTOS + 2
    downloads = dict(photos.hits)

    # -- score: killed once shard 0's record is written; scores and embeddings the same bytes
    scored = stage(score_args(shards, tmp_path / "scored", score_models, realdata), "records/00000.json", "stats.json",
                   lambda a, b: assert_equal(output_files(a), output_files(b)))

    # -- dedup over score's output, killed after its first unit of work. A random-init CLIP maps every photo
    # near every other: a tight --epsilon keeps the semantic layer to pairs it cannot tell apart
    dedup = stage(["dedup", scored, "--output", tmp_path / "dedup", "--keep-by", "aes", "--epsilon", "0.001", "-q"],
                  ".work-*/unit-000000", "stats.json", same_outputs)
    url = {key: url_of(source) for key, source in
           zip(*pq.read_table(scored / "scores", columns=["key", "source"]).to_pydict().values())}
    removed = sorted((row["layer"], *sorted((url[row["key"]], url[row["duplicate_of"]])))
                     for row in pq.read_table(dedup / "removed.parquet").to_pylist())
    assert removed == [("exact", "389_535.jpg", "original.png"), ("exact", "456_123.jpg", COPY),
                       ("phash", "416_264.jpg", REENCODED)]
    assert json.loads((dedup / "stats.json").read_text())["removed"] == {"exact": 2, "phash": 1, "semantic": 0}

    # -- filter dedup's survivors by CLIP similarity, a score the rows never had (joined from score's output):
    # killed after its part, before its stats
    scores = pq.read_table(scored / "scores").to_pandas()
    survivors = scores[scores.key.isin(pq.read_table(dedup / "keep.parquet").column("key").to_pylist())]
    threshold = float(survivors.similarity.median())
    kept = stage(["filter", dedup / "keep.parquet", "--scores", scored, "--where", f"similarity > {threshold}",
                  "--output", tmp_path / "kept", "-q"], "part-*.parquet", "_laionkit/filter-stats-*",
                 lambda a, b: assert_equal(files(a, "part-*"), files(b, "part-*")))
    keys = sorted(pq.read_table(kept, columns=["key"]).column("key").to_pylist())
    assert keys == sorted(survivors.key[survivors.similarity > threshold]) and 0 < len(keys) < PHOTOS

    # -- pack --keep: each shard rewritten with the kept samples only (byte for byte, in order), no download
    subset = stage(["pack", shards, "--keep", kept, "--output", tmp_path / "subset", "-q"], "00000_stats.json",
                   "manifest.json", lambda a, b: assert_equal(digests(a), digests(b)))
    assert sorted(key for members in tars(subset).values() for key in {n.split(".")[0] for n in members}) == keys

    # -- caption the kept samples with the tiny VLM (greedy): killed after the first captioned tar, before its
    # record (caption writes no manifest: the last shard's record is its last file)
    captioned = stage(["caption", subset, "--model", tiny_vlm, "--output", tmp_path / "captioned", *CAPTION], "00000.tar",
                      "00003_stats.json", lambda a, b: assert_equal(digests(a), digests(b)))

    # -- encode the alt-text and the VLM caption: killed after the first latent shard
    latents = stage(["encode", captioned, "--model", tiny_models, "--output", tmp_path / "latents", *ENCODE],
                    "00000.tar", "manifest.json", lambda a, b: assert_equal(digests(a), digests(b)))
    assert sorted({n.split(".")[0] for members in tars(latents).values() for n in members}) == keys

    # -- train on both captions, half and half: killed once checkpoint 2 lands, resumed
    stage(["train", latents, "--output", tmp_path / "run", *TRAIN], "checkpoints/step-00000002", "unet",
          same_training)
    assert photos.hits == downloads  # nothing after pack downloaded anything
    print(timings, round(time.monotonic() - started, 1))
