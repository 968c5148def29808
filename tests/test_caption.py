"""`laionkit caption` on the real photos with the tiny random-init Qwen2-VL of `laionkit models tiny-vlm`,
loaded as users load theirs (AutoProcessor + AutoModelForImageTextToText): new shards with every member
copied and json["captions"]["vlm"] added, a corrupt image recorded as a skip, greedy captions identical
across reruns, 1 vs 2 rank processes and a kill -9 + rerun."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from fixtures import CAPTIONS, cut_before_sample, kill_tree, pack_folder, write_image_shards
from test_encode_faithful import one_line_error

# Small enough for seconds on one CPU core; the batch size is the same in every run (it decides which images
# share a padded batch, so the greedy captions are compared like for like).
CAPTION_ARGS = ("--max-new-tokens", "6", "--batch-size", "3", "--quiet")


def tar_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar if member.isreg()}


def digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("*.tar"))}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vlm") / "tiny-vlm"
    run_cli("models", "tiny-vlm", "--output", folder)
    return folder


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory, realdata) -> Path:
    """The 8 real photos in pack's layout (00000.tar, 00001.tar), plus 00002.tar: one photo and one JPEG cut
    in half (a corrupt image)."""
    import webdataset as wds

    folder = tmp_path_factory.mktemp("photos")
    write_image_shards(realdata / "images", folder)
    photo = (realdata / "images" / "123_456.jpg").read_bytes()
    with wds.TarWriter(str(folder / "00002.tar")) as sink:
        for index, data in enumerate((photo, photo[: len(photo) // 2])):
            meta = {"key": f"00002{index:04d}", "caption": CAPTIONS["123_456.jpg"], "status": "success"}
            sink.write({"__key__": f"00002{index:04d}", "jpg": data, "txt": CAPTIONS["123_456.jpg"],
                        "json": json.dumps(meta)})
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory, photo_shards, tiny_vlm) -> Path:
    """One uninterrupted run, one process, two DataLoader workers."""
    output = tmp_path_factory.mktemp("captioned") / "reference"
    run_cli("caption", photo_shards, "--model", tiny_vlm, "--output", output, "--workers", "2", *CAPTION_ARGS)
    return output


def test_tiny_vlm_loads_as_users_load_theirs(tiny_vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    names = {path.name for path in tiny_vlm.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "processor_config.json",
            "chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= names
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    assert type(processor).__name__ == "Qwen2VLProcessor" and type(model).__name__ == "Qwen2VLForConditionalGeneration"
    tokenizer = processor.tokenizer
    assert json.loads((tiny_vlm / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        assert token in tokenizer.all_special_tokens or tokenizer.convert_tokens_to_ids(token) is not None
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.text_config.vocab_size == len(tokenizer)
    # trained on the shipped LAION captions: common caption words are single tokens
    assert len(tokenizer.tokenize(" photo")) == 1 and len(tokenizer("a photo of the sea").input_ids) <= 6
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
        add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_workers_cast_pixels_to_the_models_dtype_as_the_device_would(tiny_vlm, realdata):
    """A bf16 captioner's workers hand over bf16 pixel values, equal to the processor's float32 ones cast (what
    generate did on the device before), and the token ids untouched."""
    import torch
    from PIL import Image

    from laionkit.caption.backends import TransformersCaptioner
    from laionkit.caption.config import CaptionConfig

    captioner = TransformersCaptioner(CaptionConfig(shards=("-",), output="-", model=str(tiny_vlm), dtype="bf16", max_new_tokens=4),
                                      torch.device("cpu"))
    images = [Image.open(path).convert("RGB") for path in sorted((realdata / "images").glob("*.jpg"))[:2]]
    prepared = captioner.prepare(images)
    plain = captioner.processor(text=[captioner.text] * 2, images=images, return_tensors="pt", padding=True)
    assert prepared["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(prepared["pixel_values"], plain["pixel_values"].to(torch.bfloat16))
    assert torch.equal(prepared["input_ids"], plain["input_ids"])
    assert len(captioner.generate(prepared)) == 2


def test_caption_copies_every_member_and_adds_the_caption(reference, photo_shards, tiny_vlm, realdata, tmp_path):
    from laionkit.common import LaionkitError, storage
    from laionkit.encode.reader import find_shards

    inputs_before = digests(photo_shards)
    assert sorted(path.name for path in reference.iterdir() if path.name != ".laionkit-caption-rank-0.lock") == [
        "00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json", "00002.tar", "00002_stats.json",
        "caption.json"]
    seen = 0
    captions = []
    for shard in ("00000.tar", "00001.tar", "00002.tar"):
        before, after = tar_members(photo_shards / shard), tar_members(reference / shard)
        if shard == "00002.tar":  # the corrupt image is left out, and recorded
            assert set(before) - set(after) == {"000020001.jpg", "000020001.json", "000020001.txt"}
        else:
            assert set(after) == set(before)
        for name, data in after.items():
            if not name.endswith(".json"):
                assert data == before[name], name  # images, alt-text: the same bytes
                continue
            source, meta = json.loads(before[name]), json.loads(data)
            assert list(meta)[: len(source)] == list(source) and {k: meta[k] for k in source} == source
            assert set(meta) - set(source) == {"captions", "caption_model"}
            assert meta["caption_model"] == {"vlm": str(tiny_vlm)}
            assert isinstance(meta["captions"]["vlm"], str) and meta["captions"]["vlm"].strip()
            captions.append(meta["captions"]["vlm"])
            seen += 1
    assert seen == 9
    assert len(set(captions)) >= 5  # the captions depend on the image (two of the photos are one photo)
    record = json.loads((reference / "00002_stats.json").read_text())
    assert (record["count"], record["successes"], record["skipped"]) == (2, 1, {"undecodable": 1})
    assert record["skips"][0]["key"] == "000020001"
    assert record["settings"]["name"] == "vlm" and record["settings"]["decoding"] == "greedy"
    # the folder reads as pack's: encode finds each shard with the sample count its record gives
    assert {path.name: count for path, count in find_shards([str(reference)]).items()} == {
        "00000.tar": 4, "00001.tar": 4, "00002.tar": 1}
    stats = run_cli("stats", reference)
    assert "9 of 10 samples" in stats.stdout and "undecodable" in stats.stdout

    # A rerun into the same folder does nothing; the inputs were never written to.
    again = run_cli("caption", photo_shards, "--model", tiny_vlm, "--output", reference, *CAPTION_ARGS[:-1])
    assert "0 of 3 shards to do" in again.stderr
    assert digests(photo_shards) == inputs_before
    # Other settings into the same folder are refused, naming what differs.
    other = run_cli("caption", photo_shards, "--model", tiny_vlm, "--output", reference, "--prompt", "Say hi.",
                    *CAPTION_ARGS, check=False)
    assert other.returncode == 2 and "prompt" in other.stderr
    # Never into the input folder, nor into another stage's.
    into_input = run_cli("caption", photo_shards, "--model", tiny_vlm, "--output", photo_shards / "sub",
                         *CAPTION_ARGS, check=False)
    assert into_input.returncode == 2 and "never overwrite inputs" in into_input.stderr
    with pytest.raises(LaionkitError, match="caption's captioned image shards"):
        storage.claim_output(str(reference), "encode")
    with pytest.raises(LaionkitError, match="pack's image shards"):
        storage.claim_output(str(pack_folder(tmp_path / "packed", realdata)), "caption")
    # A caption folder is captioned again under another name: both captions, the alt-text still there.
    run_cli("caption", reference / "00000.tar", "--model", tiny_vlm, "--output", tmp_path / "second", "--name",
            "second", *CAPTION_ARGS)
    meta = json.loads(tar_members(tmp_path / "second" / "00000.tar")["000000000.json"])
    assert set(meta["captions"]) == {"vlm", "second"} and meta["caption"] == CAPTIONS["123_456.jpg"]


def _caption_process(photo_shards, tiny_vlm, output, *extra, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laionkit.cli", "caption", str(photo_shards), "--model",
                             str(tiny_vlm), "--output", str(output), *CAPTION_ARGS, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_two_ranks_with_a_kill_give_the_reference_shards(reference, photo_shards, tiny_vlm, tmp_path):
    """Two rank processes (rank 0: shards 0 and 2, rank 1: shard 1); rank 0 is killed with -9 halfway through its
    first tar and rerun: every shard is byte for byte the one-process run's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "WORLD_SIZE": "2"}
    output = tmp_path / "ranks"
    ranks = [_caption_process(photo_shards, tiny_vlm, output, "--workers", "0", env={**env, "RANK": str(rank)})
             for rank in (0, 1)]
    deadline = time.monotonic() + 600  # rank 0's temporary is named after its process (unique per writer)
    partial = output / f".00000.tar.{socket.gethostname()}-{ranks[0].pid}.partial"
    while ranks[0].poll() is None and time.monotonic() < deadline and not (
            partial.exists() and partial.stat().st_size > 0):
        time.sleep(0.01)
    kill_tree(ranks[0].pid)
    ranks[0].communicate()
    assert not (output / "00000_stats.json").exists(), "rank 0 finished its first shard before it could be killed"
    _, stderr = ranks[1].communicate(timeout=600)
    assert ranks[1].returncode == 0, stderr
    run_cli("caption", photo_shards, "--model", tiny_vlm, "--output", output, "--rank", "0", "--world-size", "2",
            "--workers", "0", *CAPTION_ARGS)
    assert digests(output) == digests(reference)
    records = {path.name: json.loads(path.read_text())["rank"] for path in output.glob("*_stats.json")}
    assert records == {"00000_stats.json": 0, "00001_stats.json": 1, "00002_stats.json": 0}
    left = [path.name for path in output.iterdir() if path.name.startswith(".")]  # the killed one's temporary too
    assert sorted(left) == [".laionkit-caption-rank-0.lock", ".laionkit-caption-rank-1.lock"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_a_tar_cut_at_a_member_boundary_is_refused_once_read(tiny_vlm, realdata, tmp_path):
    """A recorded shard is planned from its record; what caption reads is held to it before its tar is finished."""
    shards = pack_folder(tmp_path / "shards", realdata)
    cut_before_sample(shards / "00001.tar", "000010002")  # 2 whole samples remain
    result = run_cli("caption", shards, "--model", tiny_vlm, "--output", tmp_path / "out", "--workers", "0",
                     *CAPTION_ARGS, check=False)
    one_line_error(result, "00001.tar holds 2 samples but its done record 00001_stats.json says 4")
    assert sorted(path.name for path in (tmp_path / "out").iterdir() if path.name.startswith("0000")) == [
        "00000.tar", "00000_stats.json"]


def test_vllm_backend_without_vllm_is_one_line(photo_shards, tiny_vlm, tmp_path):
    result = run_cli("caption", photo_shards, "--model", tiny_vlm, "--output", tmp_path / "out", "--backend", "vllm",
                     check=False)
    assert result.returncode == 2 and "vllm is not installed" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (("--name", "alt"), "--name 'alt'"),
    (("--name", "a:b"), "--name 'a:b'"),
    (("--name", "qwen2.5"), "--name 'qwen2.5': caption name 'qwen2.5' must be a letter then"),  # encode refused it
    (("--name", "text"), "--name 'text': caption name 'text' must be"),  # a stored tensor's name
    (("--backend", "onnx"), "--backend 'onnx'"),
    (("--max-new-tokens", "0"), "--max-new-tokens"),
])
def test_bad_flags_are_one_line(flags, message, tmp_path):
    result = run_cli("caption", tmp_path, "--model", "x/y", "--output", tmp_path / "out", *flags, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_json_without_a_json_member_gets_one():
    from laionkit.caption.writer import with_caption

    assert json.loads(with_caption({"jpg": b"x"}, "vlm", "a cat", "m")["json"]) == {
        "captions": {"vlm": "a cat"}, "caption_model": {"vlm": "m"}}
    earlier = {"jpg": b"x", "json": json.dumps({"url": "u", "captions": {"qwen": "a dog"}}).encode()}
    assert json.loads(with_caption(earlier, "florence", "a cat", "m")["json"])["captions"] == {
        "qwen": "a dog", "florence": "a cat"}
    # a json whose captions field is not an object cannot take one: a recorded skip, not a silent overwrite
    from laionkit.caption.reader import SampleSkip, decode_image

    with pytest.raises(SampleSkip, match="'captions' is a list") as skip:
        decode_image({"jpg": b"x", "json": b'{"captions": ["a dog"]}'})
    assert skip.value.reason == "bad_json"


def test_a_recipe_chains_caption_between_pack_and_encode(photo_shards, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""workdir: {tmp_path}
stages:
  caption:
    input: {photo_shards}
    output: "{{workdir}}/captioned"
    model: Qwen/Qwen2-VL-2B-Instruct
    max-new-tokens: 77
  encode:
    input: "{{workdir}}/captioned"
    output: "{{workdir}}/latents"
""")
    lines = run_cli("run", recipe, "--dry-run").stdout.splitlines()
    assert lines[0].startswith(f"laionkit caption {photo_shards} --output {tmp_path}/captioned --model Qwen/Qwen2-VL-2B-Instruct")
    assert "--max-new-tokens 77" in lines[0] and lines[1].startswith(f"laionkit encode {tmp_path}/captioned")


def test_run_says_where_the_loop_spent_its_time(photo_shards, tiny_vlm, tmp_path):
    """run()'s summary splits the loop: waits for the workers' batches, time in generate; both within its seconds."""
    from laionkit.caption import CaptionConfig, run

    summary = run(CaptionConfig(shards=(str(photo_shards / "00000.tar"),), output=str(tmp_path / "out"),
                                model=str(tiny_vlm), batch_size=2, max_new_tokens=4, workers=1, quiet=True),
                  log=lambda _: None)
    waits = summary["wait_seconds"]
    assert summary["captioned"] == 4 and set(waits) == {"data", "generate"}, summary
    assert waits["generate"] > 0 and waits["data"] >= 0, summary
    assert waits["data"] + waits["generate"] <= summary["seconds"], summary
