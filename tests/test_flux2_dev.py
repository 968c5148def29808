"""FLUX.2 [dev] on CPU through the same encode and train loops as every family: the tiny Flux2Pipeline (a
Mistral3ForConditionalGeneration of 32 layers, a PixtralProcessor around a tokenizer trained on the shipped
captions, the guidance-embedding transformer) -> encode the real photos (Mistral's hidden states 10, 20, 30 of the
caption under FLUX.2's system message, 512 rows) -> the prediction is the transformer as the pipeline calls it,
with the guidance train feeds -> train with validation grids -> RUN/pipeline generates in diffusers' own
Flux2Pipeline with no laionkit; online text gives the stored states. The cross-family tests (exports, LoRA
export, encode_faithful, learning) run it too. One tiny model and encode for the session (flow_latents)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from fixtures import FAMILY_RUN, FlowLatents, family_run, first_rows, stored_states_are_the_pipelines

from laionkit.families import detect_family, get_family


@pytest.fixture(scope="module")
def dev(flow_latents) -> FlowLatents:
    return flow_latents("flux2-dev")


def load_pipeline(dev: FlowLatents):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(dev.model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_stored_states_and_prediction_are_the_pipelines(dev):
    """Each sample stores exactly Flux2Pipeline.encode_prompt's [512, 3 x 16] states, padding rows included (the
    tiny tokenizer's pad id is 6: a padding read as id 0 gives other states there, which the transformer sees),
    and the family's prediction is the transformer called as the pipeline calls it, with the guidance embedding
    fed train's 3.5. The folder is known as flux2-dev by its model_index.json, and without it by its text encoder
    (klein shares the transformer class)."""
    import shutil

    from laionkit.trainer.data import open_latents
    from laionkit.trainer.latent_stream import collate

    manifest = json.loads((dev.latents / "manifest.json").read_text())
    assert manifest["family"] == "flux2-dev" and manifest["text"]["stored"] == {"states": [512, 48]}
    pipe = load_pipeline(dev)
    assert type(pipe.tokenizer).__name__ == "PixtralProcessor" and pipe.tokenizer.tokenizer.pad_token_id != 0
    rows, want, text_ids = stored_states_are_the_pipelines(pipe, dev.latents)

    data = open_latents(dev.latents)
    batch = collate(rows)
    ours = data.normalize(batch["moments"].float().chunk(2, dim=1)[0])
    theirs = pipe._patchify_latents(ours)
    spec = get_family("flux2-dev")
    assert spec.objective.guidance == 3.5 and pipe.transformer.config.guidance_embeds
    sigmas = torch.tensor([.1, .4, .7, 1.])
    with torch.no_grad():
        ids = pipe._prepare_latent_ids(theirs)
        out = pipe.transformer(hidden_states=pipe._pack_latents(theirs), timestep=sigmas,
                               guidance=torch.full((4,), 3.5), encoder_hidden_states=want, txt_ids=text_ids,
                               img_ids=ids, return_dict=False)[0]
        out = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(out, ids))
        mine = spec.predict(pipe.transformer, ours, sigmas, {"states": batch["text"].float(),
                                                              "guidance": torch.full((4,), 3.5)})
    torch.testing.assert_close(mine, out, rtol=1e-2, atol=2e-3)  # fp16 storage of the states
    # the pipeline's output_type="latent" (packed, normalised) is train's latent after the family's unpack
    torch.testing.assert_close(spec.unpack_latents(pipe._pack_latents(theirs), 8, 8), ours)

    assert detect_family(str(dev.model)).name == "flux2-dev"
    bare = shutil.copytree(dev.model, dev.model.parent / "bare", ignore=shutil.ignore_patterns("model_index.json"),
                           dirs_exist_ok=True)
    assert detect_family(str(bare)).name == "flux2-dev"
    assert detect_family(str(bare_klein(dev))).name == "flux2"


def bare_klein(dev: FlowLatents):
    """A tiny klein folder without model_index.json beside dev's: the same transformer class, a Qwen3 encoder."""
    folder = dev.model.parent / "bare-klein"
    if not folder.exists():
        get_family("flux2").write_tiny(folder, 0)
        (folder / "model_index.json").unlink()
    return folder


def test_presets_and_the_real_size_config(dev):
    """--model flux2-dev names black-forest-labs/FLUX.2-dev; --transformer-config flux2-dev is its 32B
    transformer (built on meta tensors), with the guidance embedding and 3 x 5120 text channels."""
    import diffusers

    spec = get_family("flux2-dev")
    assert detect_family("flux2-dev") is spec and spec.presets["flux2-dev"] == "black-forest-labs/FLUX.2-dev"
    with torch.device("meta"):
        model = diffusers.Flux2Transformer2DModel.from_config(spec.configs["flux2-dev"])
    parameters = sum(p.numel() for p in model.parameters())
    assert 31e9 < parameters < 33e9, parameters
    assert model.config.joint_attention_dim == 3 * 5120 and model.config.guidance_embeds


def test_train_validates_and_exports_what_flux2pipeline_loads(dev, tmp_path):
    """A short run from the tiny pipeline (checkpoints, caption dropout, EMA, validation grids and the validation
    loss) exports RUN/pipeline, which diffusers' Flux2Pipeline loads in a fresh interpreter with no laionkit and
    generates a finite image from a prompt."""
    run = family_run(dev, tmp_path / "run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == FAMILY_RUN["max_steps"] and all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    assert list((run / "samples").glob("*.png"))
    index = json.loads((run / "pipeline" / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline" and index["tokenizer"] == ["transformers", "PixtralProcessor"]
    script = textwrap.dedent(f"""
        import sys, numpy as np, torch
        from diffusers import Flux2Pipeline
        pipe = Flux2Pipeline.from_pretrained({str(run / "pipeline")!r})
        pipe.set_progress_bar_config(disable=True)
        image = pipe(prompt="a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images
        print(image.shape, bool(np.isfinite(image).all()), "laionkit" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("(1, 64, 64, 3) True False"), result.stdout


def test_online_text_gives_the_stored_states(dev, image_shards, tmp_path):
    """encode --text online stores the rendered prompt's ids with the mask folded in (-1 - id where masked, so
    the padding id survives); encoding them gives the stored states, padding rows included."""
    from conftest import run_cli

    from laionkit.common.models import load_text_encoder, load_tokenizer
    from laionkit.families.flux2 import unmasked_ids

    run_cli("encode", image_shards / "00000.tar", "--model", dev.model, "--output", tmp_path / "online",
            "--resolution", "64", "--batch-size", "4", "--workers", "0", "--text", "online", "--quiet")
    online = first_rows(tmp_path / "online", 2)
    stored = first_rows(dev.latents, 2)
    spec = get_family("flux2-dev")
    ids = torch.stack([torch.as_tensor(row["ids_tokenizer"]) for row in online]).long()
    tokens, mask = unmasked_ids(ids)
    processor = load_tokenizer(str(dev.model))
    assert int(tokens[~mask].unique().item()) == processor.tokenizer.pad_token_id  # the padding id kept
    encoder = load_text_encoder(str(dev.model))
    with torch.no_grad():
        states = spec.encode_tokens([encoder], [ids])["states"]
    for row, found in zip(stored, states, strict=True):
        np.testing.assert_allclose(row["text"].float(), found.half().float(), atol=1e-3, rtol=1e-3)


def test_encode_without_text_stores_devs_states_and_klein_its_ids(dev, flow_latents, image_shards, tmp_path):
    """The two FLUX.2 families' defaults differ (FamilySpec.default_text, chosen in docs/BENCHMARKS.md): without
    --text, encode stores [dev]'s Mistral states (its 24B encoder beside the 32B transformer would not leave one
    GPU room for the step), the stored states of the session's encode; [klein]'s are Qwen3's token ids."""
    from conftest import run_cli

    for name, model in (("dev", dev.model), ("klein", flow_latents("flux2").model)):
        run_cli("encode", image_shards / "00000.tar", "--model", model, "--output", tmp_path / name,
                "--resolution", "64", "--batch-size", "4", "--workers", "0", "--quiet")
    text = json.loads((tmp_path / "dev" / "manifest.json").read_text())["text"]
    assert "mode" not in text and text["stored"] == {"states": [512, 48]}
    for row, want in zip(first_rows(tmp_path / "dev", 2), first_rows(dev.latents, 2), strict=True):
        torch.testing.assert_close(row["text"], want["text"], rtol=0, atol=0)
    klein = json.loads((tmp_path / "klein" / "manifest.json").read_text())["text"]
    assert klein["mode"] == "online" and klein["ids"] == {"ids_tokenizer.npy": 512}
    assert "ids_tokenizer" in first_rows(tmp_path / "klein", 1)[0]


def test_tiny_mistral_tokenizer_is_reproducible_and_renders_the_pipelines_prompt(tmp_path):
    """write_mistral gives byte-identical files from the same captions; AutoTokenizer loads them; text outside the
    captions round-trips (byte-level BPE); the chat template renders diffusers' format_input messages as
    Mistral-Small-3's does: <s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]C[/INST], <s> once."""
    import hashlib

    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input
    from transformers import AutoTokenizer

    from laionkit.families import tokenizers as tiny_tokenizers

    def digest(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    folder = tiny_tokenizers.write_mistral(tmp_path / "a")
    assert digest(folder) == digest(tiny_tokenizers.write_mistral(tmp_path / "b"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "🐱 Ωmega, a caption: 42"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    rendered = tokenizer.apply_chat_template(format_input(["a red circle"], SYSTEM_MESSAGE)[0], tokenize=False)
    assert rendered == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a red circle[/INST]"
    ids = tokenizer.apply_chat_template(format_input(["a red circle"], SYSTEM_MESSAGE)[0], tokenize=True,
                                        return_dict=True)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_a_tokenizer_folder_loads_as_its_pipeline_names_it(dev, flow_latents, tmp_path):
    """model_index.json decides: FLUX.2-dev's tokenizer/ is a PixtralProcessor, while a pipeline that names a
    tokenizer class gets the tokenizer even where its folder also holds a processor_config.json; without a
    model_index.json, the processor_config.json decides."""
    import shutil

    from laionkit.common.models import load_tokenizer, text_tokenizer

    assert type(load_tokenizer(str(dev.model))).__name__ == "PixtralProcessor"
    klein = shutil.copytree(flow_latents("flux2").model, tmp_path / "klein")
    shutil.copy(dev.model / "tokenizer" / "processor_config.json", klein / "tokenizer")
    tokenizer = load_tokenizer(str(klein))
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and text_tokenizer(tokenizer) is tokenizer
    bare = shutil.copytree(dev.model, tmp_path / "bare", ignore=shutil.ignore_patterns("model_index.json"))
    assert type(load_tokenizer(str(bare))).__name__ == "PixtralProcessor"
