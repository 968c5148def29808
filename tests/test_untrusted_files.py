"""A run folder, a model folder or a weights file a user hands over is data, never code: every place laionkit
deserializes such a file is tried with a hostile one whose payload would create a marker file. Each is refused
in one line naming the file (exit 2 through the CLI), and the marker never appears."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path, PosixPath

import pytest
import torch
from conftest import run_cli

from laionkit.common import LaionkitError

TINY = ("--unet-config", "tiny", "--batch-size", "2", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "0", "--log-every", "1")


def _text(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def calls(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle calling ``module.name(argument)``: STACK_GLOBAL, which resolves a dotted ``name``
    attribute by attribute inside ``module``, then REDUCE."""
    return b"\x80\x04" + _text(module) + _text(name) + b"\x93" + _text(argument) + b"\x85R."


class _Bound:
    """``getattr(PosixPath(marker), "touch")``: getattr on something other than an enum."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __call__(self):
        raise AssertionError("only pickled")

    def __reduce__(self):
        return getattr, (PosixPath(self.marker), "touch")


class _Touches:
    """Calls what _Bound's getattr returns: the marker's Path.touch()."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return _Bound(self.marker), ()


class _System:
    """What ``pickle.dumps`` writes for an os.system call (the global ``posix.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def hostile_pickles(marker: Path) -> dict[str, bytes]:
    """Pickles that would create ``marker``, each in another shape."""
    command = f"touch {marker}"
    return {
        "dotted name through DCP's module": calls("torch.distributed.checkpoint.metadata", "os.system", command),
        "dotted name through torch": calls("torch", "os.system", command),
        "os.system": pickle.dumps(_System(marker), protocol=2),
        "builtins.eval": calls("builtins", "eval", f"__import__('os').system('{command}')"),
        "getattr on a path": pickle.dumps(_Touches(marker), protocol=4),
    }


def test_the_hostile_pickles_run_their_payload_when_unpickled_plainly(tmp_path):
    """The control: each pickle the tests below hand over does create its marker under plain pickle.loads."""
    for shape, data in hostile_pickles(tmp_path / "marker").items():
        pickle.loads(data)
        assert (tmp_path / "marker").exists(), shape
        (tmp_path / "marker").unlink()


# ---- DCP's .metadata (checkpoint_async) -----------------------------------------------------------------
def dcp_state(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.randn(3, 4)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.mark.parametrize("shape", list(hostile_pickles(Path("m"))))
def test_a_hostile_dcp_metadata_is_refused_in_one_line_and_its_payload_never_runs(shape, tmp_path):
    """Each shape of hostile .metadata (a dotted name through a module DCP's classes live in, a plain
    os.system, builtins.eval, getattr on a path) is refused before anything is called."""
    from laionkit.trainer.checkpoint_async import _reader

    state, marker = dcp_state(tmp_path / "state"), tmp_path / "marker"
    (state / ".metadata").write_bytes(hostile_pickles(marker)[shape])
    with pytest.raises(LaionkitError, match=r"\.metadata: not plain checkpoint metadata, refused to load it") as error:
        _reader(state).read_metadata()
    assert "\n" not in str(error.value)
    assert not marker.exists()


def test_a_dcp_value_that_is_not_a_tensor_must_load_as_data_before_dcp_unpickles_it(tmp_path):
    """DCP stores a non-tensor value (an optimizer's parameter groups, say) as a torch.save pickle inside a
    .distcp file and reads it back with weights_only=False: the metadata reader first loads each such value with
    the weights-only loader. Plain values pass; one that would run code is refused, and never runs."""
    import torch.distributed.checkpoint as dcp

    from laionkit.trainer.checkpoint_async import _reader

    plain = {"model": {"w": torch.randn(3, 4)}, "groups": {"lr": 0.1, "name": "adamw"}}
    dcp.save(plain, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    loaded = {"model": {"w": torch.empty(3, 4)}, "groups": {"lr": None, "name": None}}
    dcp.load(loaded, storage_reader=_reader(tmp_path / "plain"), no_dist=True)
    assert loaded["groups"] == plain["groups"] and torch.equal(loaded["model"]["w"], plain["model"]["w"])

    marker = tmp_path / "marker"
    dcp.save({"model": {"w": _System(marker)}}, checkpoint_id=str(tmp_path / "state"), no_dist=True)
    with pytest.raises(LaionkitError, match=r"refused to load it .*model\.w: a pickle that is not plain tensor data"
                                            r".*GLOBAL posix\.system") as error:
        _reader(tmp_path / "state").read_metadata()
    assert "\n" not in str(error.value)
    assert not marker.exists()


def forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace ``name`` in ``checkpoint`` and its size and sha256 in trainer.json, as anyone who can write the
    run folder can."""
    (checkpoint / name).write_bytes(data)
    record = json.loads((checkpoint / "trainer.json").read_text())
    record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "trainer.json").write_text(json.dumps(record))


def assert_refused(result, marker: Path, *words: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    [line] = [line for line in lines if line.startswith("error:")]
    assert lines[-1] == line, result.stderr[-3000:]  # one line, the last: nothing of it wrapped onto the next
    assert all(word in line for word in words), line
    assert not marker.exists()


def test_train_resume_latest_refuses_a_forged_dcp_metadata_in_one_line(latent_shards, tmp_path):
    """End to end: a run with DCP checkpoints whose step-2 .metadata is replaced by a hostile pickle (its hash
    in trainer.json updated to match): ``train --resume latest`` exits 2 with one line, the command never ran."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    args = (*TINY, "--checkpoint-every", "2", "--checkpoint-writer", "async")
    run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "2")
    checkpoint = run / "checkpoints" / "step-00000002"
    forge(checkpoint, "state/.metadata", hostile_pickles(marker)["dotted name through DCP's module"])
    result = run_cli("train", latent_shards, "--output", run, *args, "--max-steps", "4", "--resume", "latest",
                     check=False)
    assert_refused(result, marker, "state/.metadata", "refused to load it", "os.system")


# ---- CLIP weights: filter / score / eval's --clip-pretrained ----------------------------------------------
@pytest.fixture(scope="module")
def eval_models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("eval-models")
    run_cli("models", "tiny-eval", "--output", folder)
    return folder


def test_unsafe_clip_and_inception_weights_are_one_line_naming_the_file_in_filter_score_and_eval(
        eval_models, image_shards, latent_shards, tiny_models, realdata, tmp_path):
    """A .pt state dict holding a pickle that would run code, as --clip-pretrained: torch's weights-only loader
    refuses it inside open_clip; each stage says so in one line naming the file (it was a traceback). So does
    eval's --inception."""
    import numpy as np

    marker, weights = tmp_path / "marker", tmp_path / "clip.pt"
    torch.save({"visual.proj": _System(marker)}, weights)
    clip = ("--clip-model", eval_models / "tiny-clip.json", "--clip-pretrained", weights)
    embeddings = tmp_path / "img_emb_0000.npy"
    np.save(embeddings, np.zeros((1000, 32), np.float16))
    commands = {
        "filter": ("filter", realdata / "laion-sample" / "test_1000.parquet", "--embeddings", embeddings,
                   "--score", "anime=prompt:an anime drawing", "--clip-model", "ViT-S-32", "--clip-pretrained",
                   weights, "--output", tmp_path / "filtered", "-q"),  # prompt scores take a model name
        "score": ("score", image_shards, "--output", tmp_path / "scored", *clip, "--workers", "0", "--quiet"),
        "eval": ("eval", tiny_models, "--reference", realdata / "images", "--val-latents", latent_shards,
                 "--count", "2", "--steps", "1", "--output", tmp_path / "evaluated", "--inception",
                 eval_models / "inception.pth", *clip, "--quiet"),
    }
    for args in commands.values():
        result = run_cli(*args, check=False)
        assert_refused(result, marker, str(weights), "not plain tensor data", "GLOBAL posix.system")
    inception = list(commands["eval"])  # eval's --inception weights too
    inception[inception.index("--inception") + 1] = weights
    inception[inception.index("--clip-pretrained") + 1] = eval_models / "tiny-clip.safetensors"
    assert_refused(run_cli(*inception, check=False), marker, str(weights), "not plain tensor data",
                   "GLOBAL posix.system")


# ---- model folders: a .bin weights file instead of safetensors ----------------------------------------------
def with_pickled_weights(folder: Path, component: str, into: Path, marker: Path) -> Path:
    """A copy of the model folder ``folder`` whose ``component`` holds its weights as a hostile pickle (the
    file name diffusers / transformers read when no safetensors file is there)."""
    import shutil

    shutil.copytree(folder, into)
    target = into / component if component else into
    weights = sorted(target.glob("*.safetensors"))
    assert weights, target
    for path in weights:
        path.unlink()
    name = "pytorch_model.bin" if (target / "config.json").is_file() and "_class_name" not in json.loads(
        (target / "config.json").read_text()) else "diffusion_pytorch_model.bin"
    torch.save({"weight": _System(marker)}, target / name)
    return into


@pytest.mark.parametrize("component", ["vae", "text_encoder"])
def test_encode_refuses_a_model_folder_whose_pickled_weights_would_run_code(component, image_shards, tiny_models,
                                                                          tmp_path):
    marker = tmp_path / "marker"
    model = with_pickled_weights(tiny_models, component, tmp_path / "model", marker)
    result = run_cli("encode", image_shards, "--model", model, "--output", tmp_path / "out", "--resolution", "64",
                     "--workers", "0", "--quiet", check=False)
    assert_refused(result, marker, f"cannot load {component} from {model}", "not plain tensor data",
                   "GLOBAL posix.system")


def test_train_and_eval_refuse_a_model_folder_whose_pickled_weights_would_run_code(latent_shards, tiny_models,
                                                                                 eval_models, realdata, tmp_path):
    """train's --unet and eval's pipeline folder (DiffusionPipeline.from_pretrained, which wraps the refusal for
    diffusers' models and passes transformers' through)."""
    marker = tmp_path / "marker"
    unet = with_pickled_weights(tiny_models, "unet", tmp_path / "unet-model", marker)
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--unet", unet, "--max-steps", "1",
                     "--batch-size", "2", "--workers", "0", "--log-with", "none", "--quiet", check=False)
    assert_refused(result, marker, "cannot load unet", "not plain tensor data", "GLOBAL posix.system")
    for component in ("unet", "text_encoder"):
        pipeline = with_pickled_weights(tiny_models, component, tmp_path / f"pipeline-{component}", marker)
        result = run_cli("eval", pipeline, "--reference", realdata / "images", "--val-latents", latent_shards,
                         "--count", "2", "--steps", "1", "--output", tmp_path / "evaluated", "--inception",
                         eval_models / "inception.pth", "--clip-model", eval_models / "tiny-clip.json",
                         "--clip-pretrained", eval_models / "tiny-clip.safetensors", "--quiet", check=False)
        assert_refused(result, marker, f"PIPELINE {pipeline}", "not plain tensor data", "GLOBAL posix.system")


def test_caption_refuses_a_model_whose_pickled_weights_would_run_code(image_shards, tmp_path):
    marker, model = tmp_path / "marker", tmp_path / "tiny-vlm"
    run_cli("models", "tiny-vlm", "--output", model)
    with_pickled_weights(model, "", tmp_path / "hostile-vlm", marker)
    result = run_cli("caption", image_shards, "--model", tmp_path / "hostile-vlm", "--output", tmp_path / "out",
                     "--max-new-tokens", "4", "--quiet", check=False)
    assert_refused(result, marker, "--model", "not plain tensor data", "GLOBAL posix.system")


# ---- accelerate's checkpoint layout (and DeepSpeed's files in it) ----------------------------------------------
def dcp_metadata(marker: Path) -> bytes:
    return hostile_pickles(marker)["dotted name through DCP's module"]


# Files of accelerate's layout a resume reads, each replaced (or added, as FSDP's sharded state and a custom
# object would be) by a hostile pickle.
ACCELERATE_FILES = {
    "optimizer.bin": lambda marker: pickle.dumps(_System(marker)),
    "scheduler.bin": lambda marker: _torch_saved(marker),
    "random_states_0.pkl": lambda marker: _torch_saved(marker),  # accelerate skips a file it cannot read
    "custom_checkpoint_0.pkl": lambda marker: _torch_saved(marker),  # accelerate: weights_only=False
    "pytorch_model_fsdp_0/.metadata": dcp_metadata,  # FSDP's sharded state: DCP's plain pickle.load
}


def _torch_saved(marker: Path) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"state": _System(marker)}, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory, latent_shards) -> Path:
    run = tmp_path_factory.mktemp("accelerate-layout") / "run"
    run_cli("train", latent_shards, "--output", run, *TINY, "--checkpoint-every", "2", "--checkpoint-writer",
            "accelerate", "--max-steps", "2")
    return run


@pytest.mark.parametrize("name", list(ACCELERATE_FILES))
def test_train_resume_refuses_a_forged_file_of_accelerates_layout_in_one_line(name, accelerate_run, latent_shards,
                                                                              tmp_path):
    """Each pickle accelerate's load_state (or DCP under it) would read, forged with its hash in trainer.json:
    refused before accelerate reads anything, one line naming the file."""
    import shutil

    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(accelerate_run, run)
    checkpoint = run / "checkpoints" / "step-00000002"
    (checkpoint / name).parent.mkdir(exist_ok=True)
    forge(checkpoint, name, ACCELERATE_FILES[name](marker))
    result = run_cli("train", latent_shards, "--output", run, *TINY, "--checkpoint-every", "2", "--checkpoint-writer",
                     "accelerate", "--max-steps", "4", "--resume", "latest", check=False)
    assert_refused(result, marker, str(checkpoint / name), "refused to load it")


def test_deepspeed_files_load_as_data_and_a_hostile_one_is_refused(tmp_path):
    """DeepSpeed's engine unpickles its checkpoint files with weights_only=False; check_pickles reads each first
    with the weights-only loader, allowing the data classes DeepSpeed stores (its loss scaler, ZeRO stage and
    fragment addresses, as in the files DeepSpeed 0.19 writes for ZeRO 1-3), and nothing else."""
    from collections import OrderedDict

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from laionkit.trainer.checkpoint import check_pickles

    folder = tmp_path / "step-00000002" / "pytorch_model"
    folder.mkdir(parents=True)
    torch.save({"module": OrderedDict(w=torch.randn(2, 2, dtype=torch.bfloat16)), "buffer_names": [],
                "param_shapes": [OrderedDict(w=torch.Size([2, 2]))], "ds_version": "0.19.8"},
               folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
                                         "param_slice_mappings": [OrderedDict(w=fragment_address(4, 0))],
                                         "single_partition_of_fp32_groups": [torch.zeros(4)]}},
               folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    check_pickles(folder.parent, deepspeed=True)

    marker = tmp_path / "marker"
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(_torch_saved(marker))
    with pytest.raises(LaionkitError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: a pickle that is not plain "
                                            r"tensor data, refused to load it .*posix\.system") as error:
        check_pickles(folder.parent, deepspeed=True)
    assert "\n" not in str(error.value) and not marker.exists()


# ---- NumPy, YAML and TOML files ------------------------------------------------------------------------------
def hostile_npy(path: Path, marker: Path) -> None:
    import numpy as np

    np.save(path, np.array([_System(marker)] * 4, dtype=object), allow_pickle=True)


def test_npy_files_holding_pickles_are_refused_in_one_line(latent_shards, realdata, tmp_path):
    """np.load never unpickles (allow_pickle=False): an object array as train's empty caption, as a sample's
    latent member, or as filter's --embeddings is refused in one line naming the file, and never runs."""
    import io
    import shutil
    import tarfile

    marker = tmp_path / "marker"
    latents = tmp_path / "latents"
    shutil.copytree(latent_shards, latents)
    hostile_npy(latents / "empty_caption.npy", marker)
    result = run_cli("train", latents, "--output", tmp_path / "run", *TINY, "--max-steps", "1", check=False)
    assert_refused(result, marker, "empty_caption.npy")

    shutil.copy(latent_shards / "empty_caption.npy", latents / "empty_caption.npy")
    buffer = io.BytesIO()
    hostile_npy(buffer, marker)
    for shard in ("00000.tar", "00001.tar"):
        with tarfile.open(latent_shards / shard) as source, tarfile.open(latents / shard, "w") as target:
            for member in source:
                data = source.extractfile(member).read()
                if member.name.endswith(".text.npy"):
                    data = buffer.getvalue()
                    member.size = len(data)
                target.addfile(member, io.BytesIO(data))
    result = run_cli("train", latents, "--output", tmp_path / "run2", *TINY, "--max-steps", "1", check=False)
    assert_refused(result, marker, ".text", "cannot be decoded")

    embeddings = tmp_path / "img_emb_0000.npy"
    hostile_npy(embeddings, marker)
    result = run_cli("filter", realdata / "laion-sample" / "test_1000.parquet", "--embeddings", embeddings,
                     "--score", "anime=prompt:anime", "--clip-model", "ViT-S-32", "--clip-pretrained", "none",
                     "--output", tmp_path / "filtered", check=False)
    assert_refused(result, marker, str(embeddings))


def test_yaml_tags_in_recipes_and_train_configs_are_refused_in_one_line(latent_shards, tmp_path):
    """Recipes and train --config files are read with yaml.safe_load: a python/object tag is no constructor
    there. TOML has no tags, so a train --config .toml holds plain values only."""
    marker = tmp_path / "marker"
    tag = f'!!python/object/apply:os.system ["touch {marker}"]'
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"workdir: {tmp_path / 'work'}\nstages:\n  filter: {tag}\n")
    assert_refused(run_cli("run", recipe, check=False), marker, str(recipe), "not valid YAML", "python/object")
    config = tmp_path / "train.yaml"
    config.write_text(f"lr: {tag}\n")
    result = run_cli("train", latent_shards, "--output", tmp_path / "run", "--config", config, check=False)
    assert_refused(result, marker, str(config), "not valid YAML", "python/object")


def test_unsafe_score_heads_are_one_line_naming_the_file(eval_models, image_shards, realdata, tmp_path):
    """The other weights filter and score read with torch.load(weights_only=True): a --score head
    (aesthetic-v2:FILE), score's --watermark and --nsfw. Refused in one line naming the file (torch's
    message, paragraphs long, was printed whole)."""
    import numpy as np

    marker, weights = tmp_path / "marker", tmp_path / "head.pth"
    torch.save({"layers.0.weight": _System(marker)}, weights)
    embeddings = tmp_path / "img_emb_0000.npy"
    np.save(embeddings, np.zeros((1000, 768), np.float16))
    result = run_cli("filter", realdata / "laion-sample" / "test_1000.parquet", "--embeddings", embeddings,
                     "--score", f"aes=aesthetic-v2:{weights}", "--output", tmp_path / "filtered", check=False)
    assert_refused(result, marker, str(weights), "not plain tensor data", "GLOBAL posix.system")
    clip = ("--clip-model", eval_models / "tiny-clip.json", "--clip-pretrained", eval_models / "tiny-clip.safetensors")
    for flag in ("--watermark", "--nsfw"):
        result = run_cli("score", image_shards, "--output", tmp_path / f"scored{flag}", *clip, flag, weights,
                         "--workers", "0", "--quiet", check=False)
        assert_refused(result, marker, str(weights), "not plain tensor data", "GLOBAL posix.system")
