"""Session fixtures shared across stages: tiny models, pack-format image shards, encode-format latent shards.

Imported by conftest.py. Image shards follow docs/FORMATS.md section 2 (what `laionkit pack` writes) and
are built from the real photos in ../shared/realdata/images; latent shards are `laionkit encode`'s output
on them with the tiny models, so downstream tests consume what the upstream stage really produces.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
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


def _pack_sample(key: str, name: str, data: bytes, extension: str, index: int, caption: str) -> dict:
    from PIL import Image

    width, height = Image.open(io.BytesIO(data)).size
    meta = {
        "url": f"https://example.org/realdata/{name}", "caption": caption, "key": key, "status": "success",
        "error_message": None, "width": width, "height": height, "original_width": width,
        "original_height": height, "exif": None, "sha256": hashlib.sha256(data).hexdigest(),
        # score columns carried through from filter; encode must keep them in `source`
        "aesthetic": 4.5 + 0.25 * index, "punsafe": 0.01 * index, "pwatermark": 0.05,
    }
    return {"__key__": key, extension: data, "txt": caption, "json": json.dumps(meta)}


def write_image_shards(images: Path, output: Path, captions: dict[str, str] | None = None) -> list[Path]:
    """WebDataset tars in pack's layout: <key>.jpg|png|webp, <key>.txt, <key>.json; keys like img2dataset's.
    ``captions``: {file name: caption} in place of CAPTIONS."""
    import webdataset as wds
    from PIL import Image

    output.mkdir(parents=True, exist_ok=True)
    captions = captions or CAPTIONS
    names = sorted(captions)
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
                sink.write(_pack_sample(key, name, data, extension, index, captions[name]))
        shards.append(path)
    return shards


def pack_folder(folder: Path, realdata: Path, records: bool = True) -> Path:
    """pack's layout: the fixture tars plus each shard's done record <shard>_stats.json (successes = samples)."""
    write_image_shards(realdata / "images", folder)
    if records:
        for tar in sorted(folder.glob("*.tar")):
            (folder / f"{tar.stem}_stats.json").write_text(json.dumps({"count": SHARD_SIZE, "successes": SHARD_SIZE}))
    return folder


def cut_before_sample(tar: Path, key: str) -> None:
    """Truncate ``tar`` where sample ``key``'s first header starts: the samples before it stay whole, a valid but
    shorter tar that only its done record tells from the packed one."""
    import tarfile

    with tarfile.open(tar) as opened:
        offset = next(member.offset for member in opened if member.name.startswith(key))
    with open(tar, "r+b") as handle:
        handle.truncate(offset)


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


@pytest.fixture(scope="session")
def bucket_latents(tmp_path_factory, image_shards, tiny_models) -> Path:
    """`laionkit encode --buckets` of the real photos with the tiny models at 64 px: three latent shapes,
    unevenly filled (tests/test_buckets.py, tests/test_valloss.py)."""
    from conftest import run_cli

    output = tmp_path_factory.mktemp("bucketed")
    run_cli("encode", image_shards, "--output", output, "--model", tiny_models, "--resolution", "64", "--buckets",
            "--batch-size", "4", "--workers", "0", "--quiet")
    return output


@dataclass(frozen=True)
class FlowLatents:
    name: str  # a transformer family: sd3, flux or qwen-image (flow matching), pixart (DDPM, masked text), sana (flow, masked text)
    model: Path  # its tiny pipeline folder (`FamilySpec.write_tiny`)
    latents: Path  # `laionkit encode` of image_shards with it at 64 px


@pytest.fixture(scope="session")
def flow_latents(tmp_path_factory, image_shards):
    """``flow_latents("sd3" | "flux" | "pixart" | "sana" | "z-image" | "qwen-image" | "flux2")``: the family's tiny pipeline and its encode of image_shards at
    64 px, built on first use and shared by every test of the session (tests/test_sd3_flux.py,
    tests/test_scale.py, tests/test_pixart.py)."""
    from laionkit.encode import EncodeConfig, run
    from laionkit.families import get_family

    built: dict[str, FlowLatents] = {}

    def get(name: str) -> FlowLatents:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            model = get_family(name).write_tiny(root / "model", 0)
            run(EncodeConfig(shards=(str(image_shards),), output=root / "latents", model=str(model), resolution=64,
                             batch_size=4, workers=0, quiet=True, text="stored"))  # online is some families' default
            built[name] = FlowLatents(name, model, root / "latents")
        return built[name]

    return get


# A transformer family's short run from a pretrained (tiny) pipeline folder, as each family's test file trains it
# (test_pixart, test_sana, test_zimage, test_qwenimage): checkpoints at step 2, caption dropout, EMA, validation
# images and the validation loss, as TrainConfig keyword arguments besides latents, val_latents, output, unet.
FAMILY_RUN = dict(max_steps=4, batch_size=4, lr=1e-3, log_with="none", quiet=True, log_every=1, workers=0,
                  shuffle_buffer=3, caption_dropout=0.5, checkpoint_every=2, validate_every=4, validation_count=2,
                  validation_steps=2, val_samples=3, val_every=2, ema=True, ema_decay=0.9)


def family_run(flow: FlowLatents, output: Path) -> Path:
    """FAMILY_RUN on ``flow``'s latents (also its validation latents), from its tiny pipeline, into ``output``."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    run(TrainConfig(latents=flow.latents, val_latents=flow.latents, output=output, unet=str(flow.model), **FAMILY_RUN))
    return output


def stored_states_are_the_pipelines(pipe, latents: Path, count: int = 4, **window) -> tuple[list[dict], object, object]:
    """The first ``count`` samples' stored text states (and the folder's empty caption) equal the pipeline's
    ``encode_prompt`` of their captions (fp16 storage: atol 3e-3, rtol 1e-2); returns (rows, states, text ids).
    ``window``: encode_prompt's max_sequence_length, where encode was given one."""
    import numpy as np
    import torch
    import webdataset as wds

    shard = sorted(latents.glob("*.tar"))[0]
    captions = [json.loads(sample["json"])["caption"]
                for sample, _ in zip(wds.WebDataset(str(shard), shardshuffle=False), range(count))]
    rows = first_rows(latents, count)
    with torch.no_grad():
        want, text_ids = pipe.encode_prompt(captions, device="cpu", **window)
        empty, _ = pipe.encode_prompt("", device="cpu", **window)
    for row, states in zip(rows, want, strict=True):
        np.testing.assert_allclose(row["text"].float(), states, atol=3e-3, rtol=1e-2)
    np.testing.assert_allclose(np.load(latents / "empty_caption.npy"), empty[0], atol=3e-3, rtol=1e-2)
    return rows, want, text_ids


def first_rows(latents: Path, count: int) -> list[dict]:
    """The first ``count`` decoded samples of a latent folder's first shard."""
    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import Unit, decode, read_unit

    data = open_latents(latents)
    return [decode(sample) for sample, _ in zip(read_unit(Unit(data.shards[0])), range(count))]


# The Flux run of flux_run, as keyword arguments of laionkit.trainer.TrainConfig (besides latents, val_latents
# and output): from scratch (--transformer-config tiny, the dynamic shift), checkpoints every 3 steps, EMA,
# validation images and the validation loss.
FLUX_RUN = dict(unet_config="tiny", max_steps=6, batch_size=2, lr=1e-3, log_with="none", quiet=True, log_every=1,
                workers=0, shuffle_buffer=3, caption_dropout=0.5, checkpoint_every=3, validate_every=6,
                validation_count=2, validation_steps=2, val_samples=3, val_every=3, ema=True, ema_decay=0.9)


@pytest.fixture(scope="session")
def flux_run(tmp_path_factory, flow_latents):
    """The TrainConfig of a Flux run (FLUX_RUN on flow_latents("flux")) trained once, in this process, for
    the session: the uninterrupted reference that kill -9 + resume, per-block compile and checkpointing
    must reproduce, and an export (transformer/, transformer_ema/) for diffusers' FluxPipeline."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    flux = flow_latents("flux")
    config = TrainConfig(latents=flux.latents, val_latents=flux.latents,
                         output=tmp_path_factory.mktemp("flux-run") / "reference", **FLUX_RUN)
    run(config)
    return config


@dataclass(frozen=True)
class SharpModels:
    name: str  # the family
    model: Path  # `laionkit models tiny --family NAME` with its VAE sharpened (tests/learning.py: sharpen_vae)
    photos: Path  # the 8 distinct real photos it encoded (a folder of image files)
    latents: Path  # `laionkit encode` of 8 distinct real photos (CAPTIONS) with it at 64 px, text stored
    # (with --max-sequence-length where given)
    # (SDXL: the photos cut to 64 x 64 px first, so that its size time ids do not tell them apart)
    vae_stats: dict  # the photos' scaled latents: std and mean pairwise MSE between photos


@pytest.fixture(scope="session")
def sharp_models(tmp_path_factory, realdata):
    """``sharp_models(family)``: a tiny pipeline folder whose VAE has what a trained one has, a sharp posterior
    (log-variance -30, so each draw is the mean) and latents of unit spread after its scaling factor that
    differ between photos, and its encode of the real photos (one mirrored: two of them are one photo);
    built on first use per family. A random-init VAE's latents are noise around nearly equal means, which
    no denoiser can learn to tell apart (see sharpen_vae): the proof-of-learning tests need these.
    ``sharp_models(family, window)``: encoded with ``--max-sequence-length window``."""
    from conftest import run_cli

    from laionkit.common.learnable_models import distinct_photos, sharpen_dc_vae, sharpen_vae

    built: dict[str, SharpModels] = {}

    def get(name: str, window: int | None = None) -> SharpModels:
        if (name, window) not in built:
            root = tmp_path_factory.mktemp(f"sharp-{name}")
            photos = distinct_photos(realdata / "images", root / "photos", square=64 if name == "sdxl" else None)
            write_image_shards(photos, root / "packed")
            run_cli("models", "tiny", "--family", name, "--output", root / "model")
            sharpen = sharpen_dc_vae if name == "sana" else sharpen_vae  # Sana's DC-AE: deterministic
            stats = sharpen(root / "model" / "vae", photos)
            run_cli("encode", root / "packed", "--model", root / "model", "--output", root / "latents",
                    "--resolution", "64", "--batch-size", "8", "--workers", "0", "--text", "stored", "--quiet",
                    *(("--max-sequence-length", window) if window else ()))
            built[name, window] = SharpModels(name, root / "model", photos, root / "latents", stats)
        return built[name, window]

    return get

def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, parents first, found through /proc (Linux)."""
    children = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[parent].append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children[found[-1]]
    return found


def signal_all(pids: list[int], signum: int) -> None:
    """``signum`` to each of ``pids`` that is still alive."""
    for each in pids:
        try:
            os.kill(each, signum)
        except ProcessLookupError:
            pass


def kill_tree(pid: int) -> None:
    """kill -9 of ``pid`` and its descendants, as a scheduler ends a job: torchrun (also inside `accelerate
    launch`) starts each rank in a session of its own, so killing the launcher's process group alone would
    leave the ranks training on."""
    signal_all(process_tree(pid), signal.SIGKILL)


def with_hook(env: dict[str, str], tmp_path: Path, hook: str) -> dict[str, str]:
    """``env`` plus a sitecustomize running ``hook`` in every Python process started with it."""
    import textwrap

    folder = tmp_path / f"hook-{len(list(tmp_path.glob('hook-*')))}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(hook))
    return {**env, "OMP_NUM_THREADS": "1", "LAIONKIT_STAGING": str(tmp_path / "staging"),
            "PYTHONPATH": os.pathsep.join([str(folder), str(_REPO), os.environ.get("PYTHONPATH", "")])}


def killed(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """A stage in a process group of its own (pack's workers too), expected to die by SIGKILL."""
    result = subprocess.run([sys.executable, "-m", "laionkit.cli", *map(str, argv)], env=env, capture_output=True,
                            text=True, timeout=300, start_new_session=True)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    return result


def metrics(run: Path) -> dict[int, dict]:
    """A run's metrics.jsonl records by step."""
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def assert_lora_resumed_like(whole: Path, resumed: Path, steps: list[int]) -> dict:
    """A LoRA run resumed (into its own folder) from a checkpoint of ``whole`` logged whole's losses at
    ``steps``, all it logged, and exported the same adapters to the bit; returns whole's export."""
    import torch
    from safetensors.torch import load_file

    expected, got = metrics(whole), metrics(resumed)
    assert sorted(got) == steps
    for step in steps:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7), step
    exported = load_file(whole / "lora" / "pytorch_lora_weights.safetensors")
    again = load_file(resumed / "lora" / "pytorch_lora_weights.safetensors")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)
    return exported


def assert_resumed_like(reference: Path, resumed: Path, steps: int, val_steps: tuple[int, int]) -> None:
    """A resumed run logged every step's loss as the uninterrupted one did, and the same fixed-sigma
    validation loss at both validation steps (which differ: the weights moved between them)."""
    expected, got = metrics(reference), metrics(resumed)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7), step
    for step in val_steps:  # the same weights give the same number
        assert got[step]["val_loss"] == pytest.approx(expected[step]["val_loss"], rel=1e-6), step
    assert expected[val_steps[1]]["val_loss"] != expected[val_steps[0]]["val_loss"]


def train_flags(**options) -> list[str]:
    """TrainConfig keyword arguments as `laionkit train` flags."""
    flags = []
    for key, value in options.items():
        flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags


def assert_same_exports(reference: Path, resumed: Path, folders=("transformer", "transformer_ema")) -> None:
    """The resumed run exported what the whole run did: every tensor of each folder's weights."""
    import torch
    from safetensors.torch import load_file

    for folder in folders:
        want, have = (load_file(run / folder / "diffusion_pytorch_model.safetensors") for run in (reference, resumed))
        assert want.keys() == have.keys(), folder
        for key in want:
            torch.testing.assert_close(have[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{folder} {key}")


def assert_kill9_resumes_like(reference: Path, args: list[str], run: Path, kill_at: int, steps: int) -> None:
    """`laionkit ARGS` (a train of ``steps`` steps into ``run``, validating at ``kill_at`` and at the end)
    killed with SIGKILL the moment its step-``kill_at`` checkpoint lands, while it still runs (nothing
    exported yet), then rerun with --resume latest: every step's loss, the validation losses, the last
    validation grid and the exported transformer/ and transformer_ema/ are the uninterrupted reference's."""
    import subprocess
    import sys
    import time

    from conftest import run_cli

    process = subprocess.Popen([sys.executable, "-m", "laionkit.cli", *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / f"step-{kill_at:08d}").is_dir() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    process.kill()
    assert process.wait() == -9, "the run ended before the kill"
    assert not (run / "transformer").exists(), "killed too late: the run already finished"
    run_cli(*args, "--resume", "latest")
    assert_resumed_like(reference, run, steps=steps, val_steps=(kill_at, steps))
    for output in (reference, run):
        assert (output / "samples" / f"step-{steps:06d}.png").stat().st_size > 0
        assert (output / "transformer" / "config.json").is_file() and not (output / "unet").exists()
    assert_same_exports(reference, run)


_REPO = Path(__file__).resolve().parents[1]
_LAUNCH_FAST = ("--batch-size", "2", "--log-with", "none", "--quiet", "--workers", "0", "--log-every", "1")


def accelerate_launch(config: str, precision: str, latents: Path, run: Path, *args) -> list[str]:
    """The command line of `laionkit train` under `accelerate launch` with a train/ config, on 2 ranks (a free
    rendezvous port: fixed ones clash with ports other tests were handed meanwhile)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(_REPO / "train" / config),
            "--num_processes", "2", "--mixed_precision", precision, "--main_process_port", str(free_port()),
            "-m", "laionkit.cli", "train", str(latents), "--output", str(run), *_LAUNCH_FAST, *map(str, args)]


def finish(command: list[str]) -> subprocess.CompletedProcess:
    """Run a launch to its end (5 min at most); its stderr tail is the failure message."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=_REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def compile_on_cpu(monkeypatch, backend: str) -> list[tuple[object, dict]]:
    """Route ``torch.compile`` through ``backend`` for a CPU test: ``eager`` (dynamo's tracing and guards
    alone) or ``aot_eager`` (also AOT autograd's forward and backward graphs, without inductor's codegen,
    which takes minutes per graph on a shared CPU). Returns the calls train makes, (target, options) each."""
    import torch

    calls = []
    original = torch.compile

    def compile_(target, **options):
        calls.append((target, options))
        return original(target, **{**options, "mode": None, "backend": backend})

    monkeypatch.setattr(torch, "compile", compile_)
    return calls


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free local TCP port for a launcher's rendezvous, drawn below Linux's ephemeral range (32768-60999), from
    a range of this xdist worker's own. A port the kernel picked (bind to 0) could be given to another process's
    outgoing connection (gloo's, another test's) between this probe and the launcher's bind: EADDRINUSE, seen in CI.
    Ports outside the ephemeral range are never handed out so, and the workers' ranges do not overlap."""
    import random
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 20000 + 2000 * (worker % 6)
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(low, low + 2000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{low + 2000}")


def steps_done(run: Path) -> int:
    """Steps rank 0 has finished (--record-keys writes one line per step, whatever --log-every is)."""
    keys = run / "seen" / "rank-00000.jsonl"
    return keys.read_text().count("\n") if keys.is_file() else 0


@pytest.fixture(scope="module")
def score_models(tmp_path_factory) -> dict[str, Path]:
    from laionkit.score.models import write_random_nsfw, write_random_watermark, write_tiny_score_clip

    folder = tmp_path_factory.mktemp("score-models")
    config, weights = write_tiny_score_clip(folder)
    return {"config": config, "weights": weights, "nsfw": write_random_nsfw(folder / "nsfw.safetensors"),
            "watermark": write_random_watermark(folder / "watermark.safetensors")}


def vlm_caption(alt: str) -> str:
    """What a VLM might say instead: the alt-text's words reversed, after a preamble (never equal to it)."""
    return "a photo showing " + " ".join(reversed(alt.split()))


def add_captions(image_shards: Path, output: Path, lacking: set[str] = frozenset(),
                 vlm: dict[str, str] | None = None) -> Path:
    """image_shards with json captions["vlm"] and caption_scores added as `laionkit caption` writes them
    (txt and json caption keep the alt-text), except for the keys in ``lacking``; ``vlm`` {key: text} in place
    of vlm_caption's."""
    import webdataset as wds

    output.mkdir(parents=True, exist_ok=True)
    for tar in sorted(image_shards.glob("*.tar")):
        with wds.TarWriter(str(output / tar.name)) as sink:
            for index, sample in enumerate(wds.WebDataset(str(tar), shardshuffle=False)):
                meta = json.loads(sample["json"])
                if sample["__key__"] not in lacking:
                    meta["captions"] = {"vlm": (vlm or {}).get(sample["__key__"]) or vlm_caption(meta["caption"])}
                    meta["caption_scores"] = {"alt": 0.2 + 0.05 * index, "vlm": 0.3}
                sink.write({**{k: v for k, v in sample.items() if not k.startswith("__")},
                            "__key__": sample["__key__"], "json": json.dumps(meta)})
    return output
