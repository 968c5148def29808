"""RUN/pipeline for every family: a few train steps on the session's tiny models and latents, then diffusers
alone, in a fresh interpreter with no laionkit and no base model id, loads RUN/pipeline and generates."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from laionkit.families import get_family

FAST = dict(max_steps=2, batch_size=2, lr=1e-3, log_with="none", quiet=True, workers=0, shuffle_buffer=3,
            checkpoint_every=2, log_every=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, latent_shards, tiny_models, image_shards, flow_latents) -> dict[str, dict]:
    """One short run per family, fine-tuned from a base or from scratch (then the pipeline's parts come from
    the latent manifest), with and without EMA."""
    from laionkit.encode import EncodeConfig
    from laionkit.encode import run as encode
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    root = tmp_path_factory.mktemp("exports")
    sdxl = get_family("sdxl").write_tiny(root / "sdxl-model", 0)
    encode(EncodeConfig(shards=(str(image_shards),), output=root / "sdxl-latents", model=str(sdxl), resolution=64,
                        batch_size=4, workers=0, quiet=True))
    plans = {  # family: (latents, TrainConfig options, the denoiser folder the pipeline must hold)
        "sd": (latent_shards, dict(unet_config="tiny", ema=True, ema_decay=0.5), "unet_ema"),
        "sdxl": (root / "sdxl-latents", dict(unet=str(sdxl), prediction_type="v_prediction"), "unet"),
        "sd3": (flow_latents("sd3").latents, dict(unet=str(flow_latents("sd3").model)), "transformer"),
        "flux": (flow_latents("flux").latents, dict(unet_config="tiny"), "transformer"),
        "pixart": (flow_latents("pixart").latents, dict(unet=str(flow_latents("pixart").model), ema=True),
                   "transformer_ema"),
        "z-image": (flow_latents("z-image").latents, dict(unet_config="tiny"), "transformer"),
        "qwen-image": (flow_latents("qwen-image").latents, dict(unet_config="tiny"), "transformer"),
        "sana": (flow_latents("sana").latents, dict(unet_config="tiny"), "transformer"),
        "flux2": (flow_latents("flux2").latents, dict(unet_config="tiny"), "transformer"),
        "flux2-dev": (flow_latents("flux2-dev").latents, dict(unet_config="tiny"), "transformer"),
    }
    found = {}
    for name, (latents, options, denoiser) in plans.items():
        output = root / name
        run(TrainConfig(latents=latents, output=output, **FAST, **options))
        found[name] = {"run": str(output), "denoiser": denoiser, "subfolder": get_family(name).denoiser_subfolder,
                       "pipeline": get_family(name).pipeline_class}
    return found


GENERATE = """
import json, sys
import numpy as np
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

report = {}
for name, run in json.loads(sys.argv[1]).items():
    pipe = DiffusionPipeline.from_pretrained(run["run"] + "/pipeline")
    extra = {"use_resolution_binning": False} if name in ("pixart", "sana") else {}  # bins start at 256 px
    image = pipe(prompt="a dog running on the beach", height=64, width=64, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0), **extra).images[0]
    want = load_file(run["run"] + "/" + run["denoiser"] + "/diffusion_pytorch_model.safetensors")
    have = getattr(pipe, run["subfolder"]).state_dict()
    report[name] = {"class": type(pipe).__name__, "shape": list(image.shape), "finite": bool(np.isfinite(image).all()),
                    "same_keys": sorted(want) == sorted(have),
                    "equal": all(torch.equal(have[key], want[key]) for key in want),
                    "prediction_type": pipe.scheduler.config.get("prediction_type")}
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
print(json.dumps(report))
"""


def test_every_family_exports_a_pipeline_diffusers_loads_and_generates_from(runs, tmp_path):
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE), json.dumps(runs)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    report = json.loads(free.stdout.strip().splitlines()[-1])
    for name, run in runs.items():
        got = report[name]
        assert got["class"] == run["pipeline"], name
        assert got["shape"] == [64, 64, 3] and got["finite"], name
        assert got["same_keys"] and got["equal"], f"{name}: the pipeline's denoiser is not {run['denoiser']}/"
        index = json.loads((Path(run["run"]) / "pipeline" / "model_index.json").read_text())
        assert index["_class_name"] == run["pipeline"]
    assert report["sdxl"]["prediction_type"] == "v_prediction"  # the schedule it was trained with


def test_pipeline_files_are_copies_by_default_and_the_denoiser_is_the_runs_own(runs):
    """The base's VAE is a copy (a write into the pipeline cannot reach the base); the denoiser shares its
    inode with RUN/unet (or the EMA folder): one copy of the weights on disk."""
    sd3 = Path(runs["sd3"]["run"])
    vae = sd3 / "pipeline" / "vae" / "diffusion_pytorch_model.safetensors"
    assert vae.stat().st_nlink == 1 and not vae.is_symlink()
    denoiser = sd3 / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors"
    assert denoiser.samefile(sd3 / "transformer" / "diffusion_pytorch_model.safetensors")


def _assert_holds(model, folder: Path, what: str) -> None:
    """Every tensor of ``folder``'s safetensors equals the model's, key for key."""
    import torch
    from safetensors.torch import load_file

    want = {}
    for path in folder.glob("*.safetensors"):
        want.update(load_file(str(path)))
    have = model.state_dict()
    assert set(want) <= set(have), f"{what}: missing {sorted(set(want) - set(have))[:5]}"
    unequal = [key for key in want if not torch.equal(have[key].to(want[key].dtype), want[key])]
    assert not unequal, f"{what}: {len(unequal)} tensors differ, e.g. {unequal[:3]}"


def test_single_files_load_back_through_diffusers_from_single_file(runs, monkeypatch):
    """`laionkit export RUN --format single-file` writes the original layouts; diffusers' own single-file
    loaders (offline, configs from the run's pipeline folder) read back exactly the pipeline's weights."""
    import diffusers
    import torch
    from conftest import run_cli
    from diffusers.loaders import single_file_utils
    from safetensors import safe_open

    files = {}
    for name in ("sd", "sdxl", "sd3", "flux"):
        run = Path(runs[name]["run"])
        files[name] = Path(run_cli("export", run, "--format", "single-file").stdout.split()[-1])
        assert files[name].parent == run / "single_file"
    with safe_open(str(files["sd"]), "pt") as sd, safe_open(str(files["sdxl"]), "pt") as xl:
        assert "model.diffusion_model.input_blocks.0.0.weight" in sd.keys()  # what ComfyUI / A1111 detect
        assert "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight" in sd.keys()
        assert "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" in xl.keys()
        # the SDXL run trained v-prediction: the key ComfyUI's SDXL loader reads it by (tests/test_comfyui.py)
        assert "v_pred" in xl.keys() and "v_pred" not in sd.keys()
    with safe_open(str(files["flux"]), "pt") as flux:
        assert "double_blocks.0.img_attn.qkv.weight" in flux.keys() and "single_blocks.0.linear1.weight" in flux.keys()

    for name, cls, parts in (("sd", "StableDiffusionPipeline", ("unet", "vae", "text_encoder")),
                             ("sdxl", "StableDiffusionXLPipeline", ("unet", "vae", "text_encoder", "text_encoder_2"))):
        pipeline = Path(runs[name]["run"]) / "pipeline"
        pipe = getattr(diffusers, cls).from_single_file(str(files[name]), config=str(pipeline), local_files_only=True)
        for part in parts:
            _assert_holds(getattr(pipe, part), pipeline / part, f"{name} {part}")
    sd3 = Path(runs["sd3"]["run"]) / "pipeline"
    model = diffusers.SD3Transformer2DModel.from_single_file(str(files["sd3"]), config=str(sd3), subfolder="transformer",
                                                             local_files_only=True)
    _assert_holds(model, sd3 / "transformer", "sd3 transformer")

    # diffusers' Flux reader splits linear1 at FLUX.1's widths (3072 and 4 x 3072); the tiny model's are its own.
    flux = Path(runs["flux"]["run"]) / "pipeline"
    config = json.loads((flux / "transformer" / "config.json").read_text())
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    split = torch.split

    def tiny_split(tensor, sizes, dim=0):
        return split(tensor, [inner, inner, inner, tensor.shape[0] - 3 * inner] if sizes == (3072,) * 3 + (12288,)
                     else sizes, dim)

    monkeypatch.setattr(single_file_utils, "torch", type("T", (), {"split": staticmethod(tiny_split),
                                                                   "__getattr__": lambda self, n: getattr(torch, n)})())
    model = diffusers.FluxTransformer2DModel.from_single_file(str(files["flux"]), config=str(flux),
                                                              subfolder="transformer", local_files_only=True)
    _assert_holds(model, flux / "transformer", "flux transformer")


def _files(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3", "flux", "pixart", "sana", "z-image", "qwen-image", "flux2",
                                    "flux2-dev"])
def test_export_rebuilds_the_pipeline_of_a_run_trained_with_export_none(runs, tmp_path, family):
    """`laionkit export RUN --format pipeline` on a run trained with --export none rebuilds, from its newest
    checkpoint's record (latents, base, --prediction-type), the pipeline train writes: file for file."""
    from conftest import run_cli

    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    written = Path(runs[family]["run"])
    recorded = json.loads(sorted((written / "checkpoints").glob("step-*"))[-1].joinpath("trainer.json").read_text())
    options = {key: recorded["config"][key]
               for key in ("latents", "unet", "unet_config", "prediction_type", "ema", "ema_decay")}
    output = tmp_path / f"{family}-none"
    run(TrainConfig(output=output, export="none", **FAST, **options))
    assert not (output / "pipeline").exists()
    sub = runs[family]["subfolder"]
    assert _files(output / sub) == _files(written / sub)  # the same training: the test's premise

    printed = run_cli("export", output, "--format", "pipeline").stdout.split()
    assert printed == [str(output / "pipeline")]
    rebuilt, want = _files(output / "pipeline"), _files(written / "pipeline")
    assert sorted(rebuilt) == sorted(want)
    assert [name for name in want if rebuilt[name] != want[name]] == []


SINGLE_FILES = {"sd", "sdxl", "sd3", "flux"}  # the families whose single-file layout ComfyUI loads


def test_export_without_a_format_writes_what_loads_each_family(runs, tmp_path):
    """`laionkit export RUN` as a new user types it, on every family's run without RUN/pipeline (--export none,
    a LoRA run): the pipeline rebuilt, then the single file where the family has one; the others say in one
    line that their pipeline folder is the export. Run again with the pipeline there: only the single file."""
    import shutil

    from conftest import run_cli

    for family, found in runs.items():
        run = tmp_path / family
        shutil.copytree(found["run"], run, ignore=shutil.ignore_patterns("pipeline", "single_file"))
        result = run_cli("export", run, check=False)
        assert result.returncode == 0, (family, result.stderr[-2000:])
        single = [str(run / "single_file" / f"{family}-{family}.safetensors")] if family in SINGLE_FILES else []
        assert result.stdout.split() == [str(run / "pipeline"), *single], family
        assert (run / "pipeline" / "model_index.json").is_file()
        assert ("has no single-file checkpoint" in result.stderr) == (family not in SINGLE_FILES), result.stderr
        assert run_cli("export", run).stdout.split() == (single or [str(run / "pipeline")]), family


# --- LoRA runs: --export pipeline merges the adapters at the trained strength --------------------------------

RANK, ALPHA = 4, 16.0  # alpha != rank: a merge at scale 1 instead of alpha / rank = 4 is far off
LORA = dict(lora_rank=RANK, lora_alpha=ALPHA, max_steps=2, batch_size=4, lr=1e-2, log_with="none", quiet=True,
            workers=0, shuffle_buffer=3, checkpoint_every=2)

# The denoiser's output on fixed inputs, by a plain diffusers call per family: run as is in the test and in the
# fresh interpreter that loads the pipeline (no laionkit there).
PREDICT = """
import torch

def predict(name, model):
    config = model.config
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, config.in_channels, 8, 8, generator=generator)
    with torch.no_grad():
        if name == "sd":
            states = torch.randn(2, 7, config.cross_attention_dim, generator=generator)
            return model(noisy, torch.tensor([10, 500]), encoder_hidden_states=states).sample
        if name == "sd3":
            states = torch.randn(2, 7, config.joint_attention_dim, generator=generator)
            pooled = torch.randn(2, config.pooled_projection_dim, generator=generator)
            return model(hidden_states=noisy, encoder_hidden_states=states, pooled_projections=pooled,
                         timestep=torch.tensor([200.0, 700.0])).sample
        states = torch.randn(2, 7, config.caption_channels, generator=generator)
        if name == "sana":
            return model(noisy, encoder_hidden_states=states, encoder_attention_mask=torch.ones(2, 7),
                         timestep=torch.tensor([200.0, 700.0])).sample
        return model(noisy, encoder_hidden_states=states, encoder_attention_mask=torch.ones(2, 7),
                     timestep=torch.tensor([10, 500]), added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
"""


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, latent_shards, tiny_models, flow_latents) -> dict[str, dict]:
    """LoRA runs (rank 4, alpha 16) with --export pipeline, for SD, SD3, PixArt (PEFT's folder) and Sana, and an SD
    one with the default --export auto."""
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    root = tmp_path_factory.mktemp("lora-exports")
    plans = {"sd": (latent_shards, tiny_models), "sd3": (flow_latents("sd3").latents, flow_latents("sd3").model),
             "pixart": (flow_latents("pixart").latents, flow_latents("pixart").model),
             "sana": (flow_latents("sana").latents, flow_latents("sana").model)}
    found = {}
    for name, (latents, model) in plans.items():
        run(TrainConfig(latents=latents, output=root / name, unet=str(model), export="pipeline", **LORA))
        found[name] = {"run": str(root / name), "model": str(model), "subfolder": get_family(name).denoiser_subfolder,
                       "pipeline": get_family(name).pipeline_class}
    run(TrainConfig(latents=latent_shards, output=root / "sd-auto", unet=str(tiny_models), **LORA))
    found["sd-auto"] = dict(found["sd"], run=str(root / "sd-auto"))
    return found


def _trained_lora_model(name: str, run: dict):
    """The trained model as plain weights: the base, each adapter of the last checkpoint merged at alpha / rank."""
    import diffusers
    import torch
    from safetensors.torch import load_file

    spec = get_family(name)
    model = getattr(diffusers, spec.denoiser_class).from_pretrained(run["model"], subfolder=spec.denoiser_subfolder)
    adapters = load_file(Path(run["run"]) / "checkpoints" / "step-00000002" / "adapter.safetensors")
    modules = dict(model.named_modules())
    names = {key.split(".lora_A.")[0] for key in adapters if ".lora_A." in key}
    assert names
    with torch.no_grad():
        for module in names:
            down, up = (adapters[f"{module}.lora_{part}.default.weight"] for part in "AB")
            modules[module].weight += ALPHA / RANK * up @ down
    return model.eval()


LORA_GENERATE = PREDICT + """
import json, sys
import numpy as np
from diffusers import DiffusionPipeline

report = {}
for name, run in json.loads(sys.argv[1]).items():
    pipe = DiffusionPipeline.from_pretrained(run["run"] + "/pipeline")
    extra = {"use_resolution_binning": False} if name in ("pixart", "sana") else {}
    image = pipe(prompt="a dog running on the beach", height=64, width=64, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0), **extra).images[0]
    denoiser = getattr(pipe, run["subfolder"])
    report[name] = {"class": type(pipe).__name__, "finite": bool(np.isfinite(image).all()),
                    "denoiser": type(denoiser).__name__, "plain": not any("lora" in key for key in denoiser.state_dict()),
                    "output": predict(name, denoiser.eval()).tolist()}
assert not any(name.startswith("laionkit") for name in sys.modules), "laionkit was imported"
print(json.dumps(report))
"""


def test_lora_run_exports_a_pipeline_that_generates_as_the_trained_model(lora_runs, tmp_path):
    """--export pipeline on a LoRA run: diffusers alone, in a fresh interpreter with no laionkit, loads RUN/pipeline,
    generates, and its denoiser (a plain model, no LoRA layers) gives the trained model's output: the base with
    the adapters merged at alpha / rank."""
    import diffusers
    import torch

    scope: dict = {}
    exec(PREDICT, scope)  # noqa: S102 - the same call the fresh interpreter makes
    chosen = {name: lora_runs[name] for name in ("sd", "sd3", "pixart", "sana")}
    free = subprocess.run([sys.executable, "-c", textwrap.dedent(LORA_GENERATE), json.dumps(chosen)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": "1"})
    assert free.returncode == 0, free.stderr[-3000:]
    report = json.loads(free.stdout.strip().splitlines()[-1])
    for name, run in chosen.items():
        spec, got = get_family(name), report[name]
        assert got["class"] == run["pipeline"] and got["finite"] and got["plain"], name
        assert got["denoiser"] == spec.denoiser_class, name
        want = scope["predict"](name, _trained_lora_model(name, run))
        base = getattr(diffusers, spec.denoiser_class).from_pretrained(run["model"], subfolder=run["subfolder"])
        assert (want - scope["predict"](name, base.eval())).abs().max() > 1e-3, f"{name}: the adapters did not train"
        torch.testing.assert_close(torch.tensor(got["output"]), want, rtol=1e-4, atol=1e-5, msg=name)


def test_lora_run_exports_no_pipeline_by_default_and_laionkit_export_merges_one(lora_runs):
    """--export auto (the default) on a LoRA run writes RUN/lora alone; `laionkit export RUN --format pipeline`
    on the finished run writes the pipeline --export pipeline would have, file for file."""
    import torch
    from conftest import run_cli
    from safetensors.torch import load_file

    from laionkit.trainer.lora import EXPORT_FILE

    auto, written = Path(lora_runs["sd-auto"]["run"]), Path(lora_runs["sd"]["run"])
    assert (auto / "lora").is_dir() and not (auto / "pipeline").exists()
    same = [torch.equal(a, b) for a, b in zip(*(load_file(run / "lora" / EXPORT_FILE).values() for run in (auto, written)))]
    assert same and all(same)  # the same training: the test's premise
    assert run_cli("export", auto, "--format", "pipeline").stdout.split() == [str(auto / "pipeline")]
    rebuilt, want = _files(auto / "pipeline"), _files(written / "pipeline")
    assert sorted(rebuilt) == sorted(want)
    assert [name for name in want if rebuilt[name] != want[name]] == []


def test_lora_pipeline_is_refused_onto_another_base_and_without_a_saved_one(lora_runs, tiny_models, latent_shards,
                                                                           tmp_path):
    """Adapters merged into another base than the one they trained on give another model: `laionkit export` of a
    LoRA run whose recorded --unet now holds other weights is refused in one line, as --export pipeline is with
    --lora-random-base (a random base, never saved)."""
    import shutil

    from conftest import run_cli
    from safetensors.torch import load_file, save_file

    from laionkit.common import LaionkitError
    from laionkit.trainer.config import TrainConfig

    base = tmp_path / "base"
    shutil.copytree(tiny_models, base)
    weights = base / "unet" / "diffusion_pytorch_model.safetensors"
    save_file({key: value + 1 for key, value in load_file(weights).items()}, str(weights))
    run = tmp_path / "run"
    shutil.copytree(lora_runs["sd-auto"]["run"], run, ignore=shutil.ignore_patterns("pipeline"))
    record = run / "checkpoints" / "step-00000002" / "trainer.json"
    found = json.loads(record.read_text())
    found["config"]["unet"] = str(base)
    record.write_text(json.dumps(found))
    refused = run_cli("export", run, "--format", "pipeline", check=False)
    assert refused.returncode == 2 and "trained on another" in refused.stderr and "Traceback" not in refused.stderr
    assert not (run / "pipeline").exists()

    with pytest.raises(LaionkitError, match="--lora-random-base"):
        TrainConfig(latents=latent_shards, output=tmp_path / "random", unet_config="tiny", lora_random_base=True,
                    export="pipeline", **LORA)
    TrainConfig(latents=latent_shards, output=tmp_path / "random", unet_config="tiny", lora_random_base=True, **LORA)


def test_bucket_run_uploads_its_pipeline_and_single_file_whole_before_their_done_records(s3, latent_shards, tmp_path,
                                                                                          monkeypatch):
    """--output s3://...: RUN/pipeline and RUN/single_file reach the bucket as the staging folder holds them, file
    for file, each folder's done record written only once all its objects are there; the downloaded pipeline
    loads with diffusers."""
    import diffusers

    from laionkit.common import storage
    from laionkit.common.storage import Location
    from laionkit.trainer.config import TrainConfig
    from laionkit.trainer.loop import run

    monkeypatch.setenv("LAIONKIT_STAGING", str(tmp_path / "staging"))
    present = {}  # folder -> its objects in the bucket when its done record was written
    mark_done = storage.mark_done

    def recording(location, record=None):
        if location.name in ("pipeline", "single_file"):
            prefix = location.path.rstrip("/") + "/"
            present[location.name] = sorted(key[len(prefix):] for key in location.fs.find(location.path))
        mark_done(location, record)

    monkeypatch.setattr(storage, "mark_done", recording)
    remote = Location.parse(s3.url("runs", "sd"))
    run(TrainConfig(latents=latent_shards, output=str(remote), unet_config="tiny", export="pipeline,single-file",
                    **FAST))
    staging = next((tmp_path / "staging").iterdir())
    for name in ("pipeline", "single_file"):
        folder = remote / name
        assert folder.is_complete(), name
        downloaded = tmp_path / "downloaded" / name
        folder.fs.get(folder.path + "/", str(downloaded), recursive=True)
        want = _files(staging / name)
        assert want and _files(downloaded) == want, name
        assert present[name] == sorted(want), f"{name}: its done record came before all its objects"
        assert json.loads(folder.done_record.read_bytes())["sizes"] == {k: len(v) for k, v in want.items()}
    pipe = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "downloaded" / "pipeline")
    assert type(pipe).__name__ == "StableDiffusionPipeline"


def test_export_refuses_an_export_older_than_the_newest_checkpoint(latent_shards, tmp_path, monkeypatch):
    """A run trained to step 4 (RUN/unet and its pipeline written then), resumed with a later --max-steps and
    stopped by SIGTERM at step 6: its RUN/unet is step 4's model. `laionkit export` refuses it in one line, as it
    refuses a run with no RUN/unet, and says how to export step 6's; the resume at that step exports it."""
    import os
    import signal

    import torch
    from conftest import run_cli
    from safetensors.torch import load_file

    from laionkit.trainer import loop
    from laionkit.trainer.config import TrainConfig

    run = tmp_path / "run"
    options = dict(latents=latent_shards, output=run, unet_config="tiny",
                   **{key: value for key, value in FAST.items() if key != "max_steps"})
    loop.run(TrainConfig(max_steps=4, export="pipeline", **options))
    weights = run / "unet" / "diffusion_pytorch_model.safetensors"
    at_four = load_file(weights)
    step = loop.train_step

    def sigterm_after_six(trainer, *args):
        done = step(trainer, *args)
        if trainer.step == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return done

    monkeypatch.setattr(loop, "train_step", sigterm_after_six)
    stopped = loop.run(TrainConfig(max_steps=20, resume="latest", **options))
    monkeypatch.undo()
    assert stopped.stopped_by == signal.SIGTERM and stopped.step == 6
    assert (run / "checkpoints" / "step-00000006").is_dir()
    for format in ("pipeline", "single-file"):
        refused = run_cli("export", run, "--format", format, check=False)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert f"{run / 'unet'} is older than {run / 'checkpoints' / 'step-00000006'}" in refused.stderr
        assert "--resume latest --max-steps 6" in refused.stderr
    assert all(torch.equal(value, at_four[key]) for key, value in load_file(weights).items())  # untouched

    loop.run(TrainConfig(max_steps=6, resume="latest", **options))
    assert run_cli("export", run, "--format", "pipeline").stdout.split() == [str(run / "pipeline")]
    exported = load_file(run / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == at_four.keys() and not all(torch.equal(exported[k], at_four[k]) for k in at_four)
