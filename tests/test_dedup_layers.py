"""laionkit dedup: planted exact / pHash / semantic duplicates removed and nothing else, the kept row chosen by
--keep-by, connected groups keep one, --against, 2 ranks = 1 rank, kill -9 then rerun = a clean run, bad
input named in one line; plus real photos through laionkit.common.phash's definition (checked against
imagehash)."""

from __future__ import annotations

import hashlib
import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli
from PIL import Image

from laionkit.common.phash import hamming, phash, phash_bits, phash_of_bytes, sha256_hex

DIM = 32
FAST = ("--clusters", "2", "--bucket-rows", "16", "-q")  # 64 rows -> 4 buckets / partitions


def flip(value: int, bits: list[int]) -> int:
    """``value`` with the given bit positions (0 = most significant) flipped, as a signed int64."""
    unsigned = value & (2**64 - 1)
    for bit in bits:
        unsigned ^= 1 << (63 - bit)
    return unsigned - 2**64 if unsigned >= 2**63 else unsigned


def write_scores(folder: Path, shards: dict[str, list[dict]], embeddings: dict[str, np.ndarray]) -> Path:
    """`laionkit score`'s layout: scores/<stem>.parquet and img_emb/img_emb_<stem>.npy (float16)."""
    (folder / "scores").mkdir(parents=True)
    (folder / "img_emb").mkdir()
    for stem, rows in shards.items():
        table = pa.table({"key": [r["key"] for r in rows], "shard": [stem] * len(rows),
                          "width": [256] * len(rows), "height": [256] * len(rows),
                          "sha256": [r["sha256"] for r in rows], "phash": pa.array([r["phash"] for r in rows], pa.int64()),
                          "similarity": [0.3] * len(rows), "aesthetic": [r.get("aesthetic", 5.0) for r in rows]})
        pq.write_table(table, folder / "scores" / f"{stem}.parquet")
        np.save(folder / "img_emb" / f"img_emb_{stem}.npy", embeddings[stem].astype(np.float16))
    return folder


class Planted:
    """64 distinct rows over 4 shards of 16 (pHashes >= 16 bits apart, embeddings cosine < 0.8), then
    duplicates planted by overwriting chosen rows; ``removed`` maps each planted row's key to (layer, key kept)."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.keys = [f"{i:04d}" for i in range(64)]
        while True:
            self.phash = [int(x) for x in rng.integers(-2**63, 2**63 - 1, 64, dtype=np.int64)]
            if min(hamming(a, b) for i, a in enumerate(self.phash) for b in self.phash[i + 1:]) >= 16:
                break
        self.sha = [hashlib.sha256(f"image {i}".encode()).hexdigest() for i in range(64)]
        self.emb = rng.standard_normal((64, DIM)).astype(np.float32)
        self.emb /= np.linalg.norm(self.emb, axis=1, keepdims=True)
        self.aesthetic = [5.0] * 64
        self.removed: dict[str, tuple[str, str]] = {}

    def copy(self, target: int, source: int) -> None:  # a byte-identical file
        self.sha[target], self.phash[target], self.emb[target] = self.sha[source], self.phash[source], self.emb[source]

    def near(self, target: int, source: int, cosine: float) -> None:
        """``target``'s embedding at ``cosine`` from ``source``'s, turned towards ``target``'s own direction."""
        a, other = self.emb[source], self.emb[target] - self.emb[source] @ self.emb[target] * self.emb[source]
        self.emb[target] = cosine * a + np.sqrt(1 - cosine**2) * other / np.linalg.norm(other)

    def write(self, folder: Path) -> Path:
        shards = {f"{s:05d}": [{"key": self.keys[i], "sha256": self.sha[i], "phash": self.phash[i],
                                "aesthetic": self.aesthetic[i]} for i in range(16 * s, 16 * s + 16)] for s in range(4)}
        return write_scores(folder, shards, {f"{s:05d}": self.emb[16 * s:16 * s + 16] for s in range(4)})


def planted() -> Planted:
    data = Planted()
    data.copy(20, 3)  # exact: 20 is a copy of 3 (other shard)
    data.copy(21, 3)  # and 21: a group of three
    data.removed.update({"0020": ("exact", "0003"), "0021": ("exact", "0003")})
    data.phash[30] = flip(data.phash[5], [0, 17, 40])  # pHash at 3 bits
    data.removed["0030"] = ("phash", "0005")
    data.phash[31] = flip(data.phash[6], [1, 17, 33, 49])  # at 4 bits, one in each 16-bit quarter: banding finds it
    data.removed["0031"] = ("phash", "0006")
    data.phash[32] = flip(data.phash[7], [2, 9, 20, 40, 60])  # at 5 bits: not a duplicate
    data.phash[40] = flip(data.phash[8], [3, 4, 5])  # a chain: 8 ~ 40 (3 bits) ~ 41 (3 more), 8 and 41 6 apart
    data.phash[41] = flip(data.phash[40], [30, 31, 32])
    data.removed.update({"0040": ("phash", "0008"), "0041": ("phash", "0008")})
    data.near(50, 10, 0.99)  # semantic pair
    data.removed["0050"] = ("semantic", "0010")
    data.near(51, 11, 0.97)  # a semantic chain: 11 ~ 51 ~ 52 at 0.97 each, 11 and 52 at ~0.88
    data.emb[52] = 2 * 0.97 * data.emb[51] - data.emb[11]  # the reflection of 11 about 51
    data.removed.update({"0051": ("semantic", "0011"), "0052": ("semantic", "0011")})
    data.near(53, 12, 0.9)  # cosine 0.9 < 1 - 0.05: not a duplicate
    return data


def read(out: Path) -> tuple[list[str], dict[str, tuple[str, str]], dict]:
    import json

    keep = pq.read_table(out / "keep.parquet").column("key").to_pylist()
    removed = pq.read_table(out / "removed.parquet").to_pylist()
    return keep, {r["key"]: (r["layer"], r["duplicate_of"]) for r in removed}, json.loads((out / "stats.json").read_text())


def test_planted_duplicates_are_removed_by_their_layer_and_nothing_else(tmp_path: Path):
    data = planted()
    scores = data.write(tmp_path / "scored")
    run_cli("dedup", scores, "--output", tmp_path / "out", *FAST)
    keep, removed, stats = read(tmp_path / "out")
    assert removed == data.removed
    assert keep == [k for k in data.keys if k not in data.removed]
    assert stats["removed"] == {"exact": 2, "phash": 4, "semantic": 3} and stats["kept"] == 64 - 9
    assert stats["rows_in"] == 64 and stats["buckets"] == 4 and stats["phash_bands"] == 5
    rows = {r["key"]: r for r in pq.read_table(tmp_path / "out" / "removed.parquet").to_pylist()}
    assert rows["0031"]["distance"] == 4 and rows["0041"]["distance"] == 6  # to the kept row, not the neighbour
    assert rows["0050"]["distance"] == pytest.approx(0.01, abs=2e-3) and rows["0020"]["duplicate_of_shard"] == "00000"
    # Four bands of 16 bits miss the pair with one differing bit per band, and --layers picks layers.
    run_cli("dedup", scores, "--output", tmp_path / "bands4", "--phash-bands", "4", "--layers", "phash", *FAST)
    _, removed, stats = read(tmp_path / "bands4")
    assert "0031" not in removed and stats["removed"] == {"phash": 5}  # 20, 21 (equal pHashes), 30, 40, 41


def test_the_kept_row_is_chosen_by_keep_by_then_key(tmp_path: Path):
    data = planted()
    data.aesthetic[21] = 9.0  # the best of the exact group 3, 20, 21
    data.aesthetic[41] = 8.0  # the best of the pHash chain 8, 40, 41
    data.aesthetic[52] = 7.0  # the best of the semantic chain 11, 51, 52
    run_cli("dedup", data.write(tmp_path / "scored"), "--output", tmp_path / "out", "--keep-by", "aesthetic", *FAST)
    keep, removed, _ = read(tmp_path / "out")
    assert {"0021", "0041", "0052"} <= set(keep) and not {"0003", "0020", "0008", "0040", "0011", "0051"} & set(keep)
    assert removed["0003"] == removed["0020"] == ("exact", "0021")
    assert removed["0008"] == removed["0040"] == ("phash", "0041")
    assert removed["0011"] == removed["0051"] == ("semantic", "0052")


def test_against_removes_rows_near_the_reference_set_first(tmp_path: Path):
    data = planted()
    scores = data.write(tmp_path / "scored")
    rng = np.random.default_rng(1)
    reference = np.stack([rng.standard_normal(DIM), data.emb[10] + 0.02 * rng.standard_normal(DIM)])
    rows = [{"key": "ref0", "sha256": data.sha[3], "phash": 0},  # the exact group's image is in the eval set
            {"key": "ref1", "sha256": "f" * 64, "phash": flip(data.phash[13], [7, 8])}]
    refs = write_scores(tmp_path / "coco", {"val": rows}, {"val": reference})
    run_cli("dedup", scores, "--output", tmp_path / "out", "--against", refs, *FAST)
    keep, removed, stats = read(tmp_path / "out")
    against = {k: v for k, v in removed.items() if v[0] == "against"}
    assert against == {"0003": ("against", "ref0"), "0020": ("against", "ref0"), "0021": ("against", "ref0"),
                       "0013": ("against", "ref1"), "0010": ("against", "ref1"), "0050": ("against", "ref1")}
    assert stats["removed"] == {"against": 6, "exact": 0, "phash": 4, "semantic": 2}
    assert len(keep) == 64 - 12


def test_keep_dedups_only_the_listed_rows_so_a_group_keeps_its_best_listed_row(tmp_path: Path):
    """Filter before dedup (`dedup --keep filter's output`): a group whose best row the filter dropped keeps its
    best row among the listed ones, where dedup over every row would keep the dropped one and lose the group."""
    data = planted()
    data.aesthetic[21] = 9.0  # the best of the exact group 3, 20, 21 ...
    data.aesthetic[20] = 6.0  # ... and the best of what the filter keeps
    data.aesthetic[52] = 7.0  # the best of the semantic chain 11, 51, 52
    scores = data.write(tmp_path / "scored")
    listed = [k for k in data.keys if k not in ("0021", "0052", "0060")]
    pq.write_table(pa.table({"key": listed, "similarity": [0.3] * len(listed)}), tmp_path / "kept.parquet")
    rng = np.random.default_rng(2)  # a reference near row 62, behind two unlisted rows of its shard
    refs = write_scores(tmp_path / "coco", {"val": [{"key": "ref0", "sha256": "e" * 64, "phash": 0}]},
                        {"val": (data.emb[62] + 0.01 * rng.standard_normal(DIM))[None]})
    run_cli("dedup", scores, "--output", tmp_path / "out", "--keep", tmp_path / "kept.parquet", "--keep-by",
            "aesthetic", "--against", refs, *FAST)
    keep, removed, stats = read(tmp_path / "out")
    assert removed["0003"] == ("exact", "0020") and "0020" in keep  # not 21, which the filter dropped
    assert removed["0051"] == ("semantic", "0011") and "0011" in keep  # the chain keeps 11 without 52
    assert removed["0062"] == ("against", "ref0")
    assert not {"0021", "0052", "0060"} & (set(keep) | set(removed))  # unlisted rows: neither kept nor removed
    assert set(keep) <= set(listed) and len(keep) + sum(stats["removed"].values()) == stats["rows_in_keep"] == 61
    assert stats["not_in_keep"] == 3 and stats["rows_in"] == 64
    # Another list is another run: refused without --overwrite, not mixed into this one.
    pq.write_table(pa.table({"key": listed[:-1]}), tmp_path / "kept.parquet")
    result = run_cli("dedup", scores, "--output", tmp_path / "out", "--keep", tmp_path / "kept.parquet", "--keep-by",
                     "aesthetic", "--against", refs, *FAST, check=False)
    assert result.returncode == 2 and "stats.json is from another run" in result.stderr
    result = run_cli("dedup", scores, "--output", tmp_path / "out2", "--keep", tmp_path / "nothing.parquet", *FAST,
                     check=False)
    assert result.returncode == 2 and "--keep" in result.stderr and "nothing.parquet: no such file" in result.stderr


def test_clusters_per_row_2_finds_the_pairs_k_means_split_between_clusters(tmp_path: Path):
    """SemDeDup looks for pairs inside one cluster: a pair k-means put in two clusters is missed. With each row in
    its 2 nearest clusters every planted pair is found, and only those."""
    data = Planted()
    planted = {}
    for target in range(32, 64):  # 32 CLIP neighbours at cosine 0.96 (epsilon 0.05), 8 clusters for 64 rows
        data.near(target, target - 32, 0.96)
        planted[data.keys[target]] = ("semantic", data.keys[target - 32])
    scores = data.write(tmp_path / "scored")
    found = {}
    for near in (1, 2):
        run_cli("dedup", scores, "--output", tmp_path / f"near{near}", "--layers", "semantic", "--clusters", "8",
                "--clusters-per-row", str(near), "--bucket-rows", "16", "-q")
        _, found[near], stats = read(tmp_path / f"near{near}")
        assert stats["settings"]["clusters_per_row"] == near
    assert found[2] == planted
    assert found[1].items() < planted.items()  # one nearest cluster (SemDeDup's) misses a split pair here
    distances = pq.read_table(tmp_path / "near2" / "removed.parquet").column("distance").to_numpy()
    assert np.allclose(distances, 0.04, atol=2e-3)  # 1 - cos to the kept row, whichever cluster linked them


def launch(scores: Path, out: Path, rank: int, world: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laionkit.cli", "dedup", str(scores), "--output", str(out), *FAST,
                             "--rank", str(rank), "--world-size", str(world), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def same_outputs(a: Path, b: Path) -> None:
    for name in ("keep.parquet", "removed.parquet", "stats.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not list(b.glob(".work-*")), "the scratch folder is removed at the end"


def test_two_ranks_give_the_same_files_as_one(tmp_path: Path):
    scores = planted().write(tmp_path / "scored")
    run_cli("dedup", scores, "--output", tmp_path / "one", *FAST, "--keep-by", "aesthetic")
    ranks = [launch(scores, tmp_path / "two", rank, 2, "--keep-by", "aesthetic") for rank in (0, 1)]
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    same_outputs(tmp_path / "one", tmp_path / "two")


def test_a_rank_alone_names_the_missing_rank_and_a_rerun_with_other_settings_is_refused(tmp_path: Path):
    scores = planted().write(tmp_path / "scored")
    out = tmp_path / "out"
    result = run_cli("dedup", scores, "--output", out, *FAST, "--rank", "0", "--world-size", "2", "--wait", "0.3",
                     check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "rank 0 waited 0.3 s for 2 units outputs that ranks 1 of 2 write" in result.stderr
    assert "--wait" in result.stderr and len(list(out.glob(".work-*/unit-*"))) == 2  # its own work is kept
    run_cli("dedup", scores, "--output", out, *FAST)  # resumes from it, alone
    result = run_cli("dedup", scores, "--output", out, *FAST, "--epsilon", "0.1", check=False)
    assert result.returncode == 2 and "stats.json is from another run" in result.stderr
    run_cli("dedup", scores, "--output", out, *FAST, "--epsilon", "0.1", "--overwrite")
    assert read(out)[2]["settings"]["epsilon"] == 0.1


def test_a_finished_run_reruns_into_its_own_folder(tmp_path: Path):
    """dedup's folder holds a stats.json, as a score folder does: it must still read as dedup's own."""
    scores = planted().write(tmp_path / "scored")
    out = tmp_path / "out"
    run_cli("dedup", scores, "--output", out, *FAST)
    before = {name: (out / name).read_bytes() for name in ("keep.parquet", "removed.parquet", "stats.json")}
    run_cli("dedup", scores, "--output", out, *FAST)
    assert {name: (out / name).read_bytes() for name in before} == before
    result = run_cli("score", scores / "scores", "--output", out, "--clip-pretrained", "none", check=False)
    assert result.returncode == 2 and "holds dedup's keep / removed lists" in " ".join(result.stderr.split())


def test_the_process_keeps_its_openmp_thread_count(tmp_path: Path):
    """faiss and torch share one OpenMP runtime: a dedup run in a process (laionkit run's in-process steps, the
    Python API) must not leave torch on dedup's --threads afterwards."""
    import torch

    before = torch.get_num_threads()
    run_cli("dedup", planted().write(tmp_path / "scored"), "--output", tmp_path / "out", *FAST,
            "--threads", str(before + 1))
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("marker", ["unit-000002", "pairs-*", "assign-*", "semantic-00001.parquet"])
def test_kill_9_mid_run_then_rerun_gives_the_same_files(tmp_path: Path, marker: str):
    scores = planted().write(tmp_path / "scored")
    run_cli("dedup", scores, "--output", tmp_path / "clean", *FAST)
    out = tmp_path / "out"
    process = launch(scores, out, 0, 1)
    deadline = time.monotonic() + 120
    while not list(out.glob(f".work-*/{marker}")) and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (out / "stats.json").exists()
    run_cli("dedup", scores, "--output", out, *FAST)
    same_outputs(tmp_path / "clean", out)


def test_bad_input_is_one_line_naming_the_file_and_column(tmp_path: Path):
    data = planted()
    scores = data.write(tmp_path / "scored")
    bad = scores / "scores" / "00002.parquet"
    pq.write_table(pq.read_table(bad).drop(["phash"]), bad)
    result = run_cli("dedup", scores, "--output", tmp_path / "out", *FAST, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{bad}: no column 'phash'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = run_cli("dedup", scores, "--output", tmp_path / "out", "--layers", "exact", "--keep-by", "aesthetc",
                     *FAST, check=False)
    assert result.returncode == 2 and "no column 'aesthetc' (--keep-by names it)" in result.stderr
    npy = scores / "img_emb" / "img_emb_00001.npy"
    np.save(npy, data.emb[:15].astype(np.float16))
    result = run_cli("dedup", scores, "--output", tmp_path / "out", "--layers", "exact,semantic", *FAST, check=False)
    assert result.returncode == 2 and f"{npy}: shape (15, {DIM})" in result.stderr and "has 16 rows" in result.stderr
    assert not (tmp_path / "out" / "stats.json").exists()


# ---------------------------------------------------------------------------------------- real photos


def test_phash_is_imagehash_phash_on_real_photos(realdata: Path):
    imagehash = pytest.importorskip("imagehash")
    photos = sorted((REPO / "laionkit" / "data" / "demo").glob("*.jpg")) + sorted((realdata / "images").glob("*.jpg"))
    for path in photos:
        with Image.open(path) as image:
            assert (phash_bits(image) == imagehash.phash(image).hash).all(), path
            assert phash(image) & (2**64 - 1) == int(str(imagehash.phash(image)), 16), path
    assert phash_of_bytes(photos[0].read_bytes()) == phash(Image.open(photos[0]))


def test_real_photos_copies_and_reencodes_are_found(tmp_path: Path):
    photos = sorted((REPO / "laionkit" / "data" / "demo").glob("*.jpg"))
    files = [p.read_bytes() for p in photos]
    names = [p.stem for p in photos]

    def jpeg(data: bytes, quality: int, scale: float = 1.0) -> bytes:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        image = image.resize((int(image.width * scale), int(image.height * scale)), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=quality)
        return buffer.getvalue()

    files += [files[0], jpeg(files[1], 40), jpeg(files[2], 90, 0.5)]  # a copy, a re-encode, a half-size copy
    names += ["copy-of-0", "reencode-of-1", "half-of-2"]
    phashes = [phash_of_bytes(f) for f in files]
    assert hamming(phashes[1], phashes[-2]) <= 4 and hamming(phashes[2], phashes[-1]) <= 4
    rng = np.random.default_rng(0)
    rows = [{"key": n, "sha256": sha256_hex(f), "phash": h} for n, f, h in zip(names, files, phashes)]
    scores = write_scores(tmp_path / "scored", {"photos": rows}, {"photos": rng.standard_normal((len(rows), DIM))})
    run_cli("dedup", scores, "--output", tmp_path / "out", "--layers", "exact,phash", "-q")
    keep, removed, stats = read(tmp_path / "out")
    assert removed == {"copy-of-0": ("exact", names[0]), "reencode-of-1": ("phash", names[1]),
                       "half-of-2": ("phash", names[2])}
    assert keep == names[:len(photos)] and stats["removed"] == {"exact": 1, "phash": 2}


def test_a_nan_or_inf_embedding_is_one_line_naming_the_file_and_row(tmp_path: Path):
    """faiss asserted on them (a traceback), and a cosine with NaN matches nothing: refused, inputs and --against."""
    data = planted()
    data.emb[19, 0] = np.nan  # shard 00001, row 3
    data.emb[40, 5] = np.inf  # shard 00002, row 8
    scores = data.write(tmp_path / "scored")
    for args in ([scores], [planted().write(tmp_path / "clean"), "--against", scores]):
        result = run_cli("dedup", *args, "--output", tmp_path / "out", *FAST, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"{scores / 'img_emb' / 'img_emb_00001.npy'}: row 3 of the embeddings holds NaN or Inf" in result.stderr
    assert not (tmp_path / "out" / "stats.json").exists()


def test_an_unsigned_phash_column_dedups_as_the_same_64_bits(tmp_path: Path):
    """A uint64 pHash >= 2**63 (another tool's scores) failed a checked cast to int64; its bits are the pHash."""
    data = planted()
    signed = data.write(tmp_path / "signed")
    unsigned = data.write(tmp_path / "unsigned")
    for path in sorted((unsigned / "scores").glob("*.parquet")):
        table = pq.read_table(path)
        bits = pa.array([value & (2**64 - 1) for value in table["phash"].to_pylist()], pa.uint64())
        pq.write_table(table.set_column(table.schema.get_field_index("phash"), "phash", bits), path)
    assert max(pq.read_table(unsigned / "scores" / "00001.parquet")["phash"].to_pylist()) >= 2**63
    run_cli("dedup", signed, "--output", tmp_path / "a", *FAST)
    run_cli("dedup", unsigned, "--output", tmp_path / "b", *FAST)
    assert read(tmp_path / "a")[:2] == read(tmp_path / "b")[:2] == (
        [k for k in data.keys if k not in data.removed], data.removed)


def test_keep_by_puts_nan_last_and_refuses_a_column_that_is_no_score(tmp_path: Path):
    """FORMATS §7: nulls last; DuckDB sorts NaN above +inf, so the NaN row was kept over a 9.0."""
    data = planted()
    data.aesthetic[3] = float("nan")  # the exact group 3, 20, 21: 3 was kept by its NaN
    data.aesthetic[21] = 9.0
    scores = data.write(tmp_path / "scored")
    run_cli("dedup", scores, "--output", tmp_path / "out", "--keep-by", "aesthetic", *FAST)
    keep, removed, _ = read(tmp_path / "out")
    assert "0021" in keep and removed["0003"] == removed["0020"] == ("exact", "0021")
    for column in ("key", "sha256", "phash"):  # keys and hashes, numeric or not, are no score
        result = run_cli("dedup", scores, "--output", tmp_path / column, "--keep-by", column, *FAST, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"--keep-by {column}: that column names or hashes a row, it is not a score" in result.stderr


def test_more_clusters_than_rows_is_refused_not_a_silent_empty_layer(tmp_path: Path):
    scores = planted().write(tmp_path / "scored")
    result = run_cli("dedup", scores, "--output", tmp_path / "out", "--clusters", "65", "--bucket-rows", "16", "-q",
                     check=False)
    assert result.returncode == 2 and "--clusters 65: more clusters than the 64 input rows" in result.stderr
    run_cli("dedup", scores, "--output", tmp_path / "exact", "--clusters", "65", "--layers", "exact", "-q")
    # 60 clusters for the 58 rows exact and phash leave: said, even with -q
    result = run_cli("dedup", scores, "--output", tmp_path / "out", "--clusters", "60", "--bucket-rows", "16", "-q")
    assert "--clusters 60 is more than the 58 rows the earlier layers left" in " ".join(result.stderr.split())
