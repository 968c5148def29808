"""caption's model: a vision-language model behind two calls, ``prepare`` (CPU, in the DataLoader workers:
images → model inputs) and ``generate`` (the device: inputs → caption strings), greedy.

``transformers``: AutoProcessor + AutoModelForImageTextToText, which load Qwen2-VL / Qwen2.5-VL / Qwen3-VL,
Florence-2, BLIP-2, LLaVA and the other image-text-to-text models transformers ships, batched
``generate`` with left padding. ``vllm``: vLLM's offline ``LLM.generate`` with the same prompt, where vllm is
installed (it is not a laionkit dependency: it pins its own torch).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import pickle
from pathlib import Path

import torch

from laionkit.caption.config import CaptionConfig
from laionkit.common import LaionkitError
from laionkit.common.models import refuse_missing_folder, sha256_file, weights_error

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The files that make a model folder what it is (weights, configs, tokenizer, chat template).
MODEL_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model", ".jinja", ".py")


def pick_dtype(config: CaptionConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def model_fingerprint(source: str) -> dict:
    """The model by content: the sha256 of its folder's files (a local folder, or the hub cache that loading
    just filled), so the same model reached through another path or a copy counts as the same; a hub id not in
    the cache is recorded by its name alone."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source, local_files_only=True))
        except Exception:  # noqa: BLE001 - no cache entry: the name is all there is to compare
            return {"source": source}
    return {"files": {file.name: sha256_file(file) for file in sorted(folder.iterdir())
                      if file.is_file() and file.name.endswith(MODEL_SUFFIXES)}}


def instruction(processor, prompt: str) -> str:
    """The text the model is given with each image: ``prompt`` as a user turn after the image through the
    processor's chat template (and the assistant turn opened), or ``prompt`` itself for a model without one."""
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt


class ProcessorInputs:
    """transformers' ``prepare``: the processor on a batch of images, each with the same instruction, and its
    floating inputs (pixel values) cast to the model's dtype here in the worker, as ``generate`` would cast them
    on the device (the same rounding): a bf16 model's pixels cross to the GPU in half the bytes (picklable:
    DataLoader workers run it)."""

    def __init__(self, processor, text: str, dtype: torch.dtype = torch.float32) -> None:
        self.processor = processor
        self.text = text
        self.dtype = dtype

    def __call__(self, images: list) -> dict:
        inputs = self.processor(text=[self.text] * len(images), images=images, return_tensors="pt", padding=True)
        return {name: value.to(self.dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                for name, value in inputs.items()}


class TransformersCaptioner:
    """AutoProcessor + AutoModelForImageTextToText; ``generate`` is greedy (do_sample off, one beam), so a
    batch's captions depend on its images alone."""

    backend = "transformers"

    def __init__(self, config: CaptionConfig, device: torch.device) -> None:
        try:
            from transformers import AutoModelForImageTextToText, AutoProcessor
        except ImportError as error:
            raise LaionkitError(f"laionkit caption needs a transformers with AutoModelForImageTextToText (4.46 or "
                                f"later): {error}") from None
        self.device = device
        self.dtype = pick_dtype(config, device)
        refuse_missing_folder(config.model)
        try:
            self.processor = AutoProcessor.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
            model = AutoModelForImageTextToText.from_pretrained(
                config.model, dtype=self.dtype, trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError, KeyError, pickle.UnpicklingError) as error:  # the last: a .bin torch refused
            raise LaionkitError(f"--model {config.model}: cannot load it with AutoProcessor + "
                                f"AutoModelForImageTextToText: {weights_error(error)}") from None
        self.model = model.to(device).eval().requires_grad_(False)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"  # batched generation continues every row from its last token
        self.text = instruction(self.processor, config.prompt)
        self.prepare = ProcessorInputs(self.processor, self.text, self.dtype)
        self.generation = copy.deepcopy(self.model.generation_config)
        self.generation.update(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None,
                               max_new_tokens=config.max_new_tokens)
        if self.generation.pad_token_id is None and tokenizer is not None:
            self.generation.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id

    def generate(self, inputs: dict) -> list[str]:
        moved = {name: value.to(self.device, dtype=self.dtype if value.is_floating_point() else None,
                                non_blocking=True)  # pinned by the loader on CUDA; generate waits for it
                 for name, value in inputs.items() if isinstance(value, torch.Tensor)}
        with torch.inference_mode():
            output = self.model.generate(**moved, generation_config=self.generation)
        prompt = moved.get("input_ids")
        if prompt is not None and output.shape[1] >= prompt.shape[1] and torch.equal(output[:, : prompt.shape[1]], prompt):
            output = output[:, prompt.shape[1]:]  # decoder-only models return the prompt before the caption
        return [text.strip() for text in self.processor.batch_decode(output, skip_special_tokens=True)]


def _images(images: list) -> list:
    return images


class VllmCaptioner:
    """vLLM's offline engine with the same instruction, greedy (temperature 0); one image per prompt."""

    backend = "vllm"

    def __init__(self, config: CaptionConfig, device: torch.device) -> None:
        from transformers import AutoProcessor

        vllm = importlib.import_module("vllm")  # undeclared on purpose: vllm pins its own torch
        self.device = device
        self.dtype = pick_dtype(config, device)
        self.text = instruction(AutoProcessor.from_pretrained(config.model, trust_remote_code=config.trust_remote_code),
                                config.prompt)
        self.llm = vllm.LLM(model=config.model, dtype=str(self.dtype).removeprefix("torch."), seed=0,
                            trust_remote_code=config.trust_remote_code, limit_mm_per_prompt={"image": 1})
        self.params = vllm.SamplingParams(temperature=0.0, max_tokens=config.max_new_tokens)
        self.prepare = _images

    def generate(self, images: list) -> list[str]:
        requests = [{"prompt": self.text, "multi_modal_data": {"image": image}} for image in images]
        return [result.outputs[0].text.strip() for result in self.llm.generate(requests, self.params, use_tqdm=False)]


def load_captioner(config: CaptionConfig, device: torch.device):
    """The backend --backend names, loaded; vllm refused in one line where it is not installed."""
    if config.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise LaionkitError("--backend vllm: vllm is not installed here (pip install vllm, into an environment "
                                "whose torch it supports); or use --backend transformers")
        return VllmCaptioner(config, device)
    return TransformersCaptioner(config, device)
