"""Tiny T5-, Gemma- and Qwen-style tokenizers trained on the shipped captions, saved in the real layouts.

T5, Gemma and Qwen tokenizers cannot be downloaded here, yet tests must load them through the same
``T5TokenizerFast.from_pretrained`` / ``GemmaTokenizerFast.from_pretrained`` / ``Qwen2Tokenizer.from_pretrained``
calls users make on a hub folder. So the ``tokenizers`` library trains small ones on
``laionkit/data/laion-sample.parquet``'s captions with each family's pipeline (T5: SentencePiece-style Unigram,
Metaspace, ``</s>`` appended; Gemma: byte-fallback BPE, ``<bos>`` prepended; Qwen: byte-level BPE behind Qwen2's
pre-tokenizer regex, nothing added, ChatML specials and a chat template) and they are saved as tokenizer.json,
tokenizer_config.json and special_tokens_map.json. Training reads the captions in file order and the
Unigram trainer's floating-point noise is rounded away, so the same data gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "laion-sample.parquet"
T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in t5-base / google/t5-v1_1-xxl
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3 as in google/gemma-2-2b


def captions(parquet: Path = SAMPLE) -> list[str]:
    """The non-empty TEXT captions of the shipped sample, in file order."""
    import pyarrow.parquet as pq

    return [text for text in pq.read_table(parquet, columns=["TEXT"]).column("TEXT").to_pylist() if text]


def _save(tokenizer, output: Path, config: dict, specials: dict) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output / "tokenizer.json"))
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (output / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
    return output


def write_t5(output: str | Path, vocab_size: int = 1000, max_length: int = 512) -> Path:
    """A T5TokenizerFast folder: Unigram over Metaspace pieces, ``</s>`` appended, pad 0 / eos 1 / unk 2."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import Unigram

    tokenizer = Tokenizer(Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(r"\s+", " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(T5_SPECIALS),
                                      unk_token="<unk>", show_progress=False)
    tokenizer.train_from_iterator(captions(), trainer=trainer)
    # Two sources of run-to-run noise in the Unigram trainer: its EM sums in parallel (scores differ in
    # the last bits: rounded away), and it appends the rare characters EM pruned with made-up scores in
    # hash-set order. Those characters get one score below every learned piece (a lone character has a
    # single segmentation, so their order never mattered) and the files become reproducible.
    trained = [(piece, round(score, 6)) for piece, score in json.loads(tokenizer.to_str())["model"]["vocab"]
               if piece not in T5_SPECIALS]
    floor = min(score for piece, score in trained if len(piece) > 1)
    pieces = sorted(((piece, score if len(piece) > 1 or score > floor else floor - 1.0)
                     for piece, score in trained), key=lambda item: (-item[1], item[0]))
    tokenizer.model = Unigram([(piece, 0.0) for piece in T5_SPECIALS] + pieces, unk_id=2)
    eos = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)])
    specials = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": max_length, "extra_ids": 0,
              "additional_special_tokens": [], **specials}
    return _save(tokenizer, Path(output), config, specials)


def write_gemma(output: str | Path, vocab_size: int = 1000, max_length: int = 300) -> Path:
    """A GemmaTokenizerFast folder: byte-fallback BPE on "▁"-joined text, ``<bos>`` prepended, no eos added."""
    from tokenizers import Tokenizer, decoders, normalizers, processors, trainers
    from tokenizers.models import BPE

    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=list(GEMMA_SPECIALS),
                                  show_progress=False)
    learner = Tokenizer(BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Replace(" ", "▁")
    learner.train_from_iterator(captions(), trainer=trainer)
    # Byte-fallback pieces are ordinary vocabulary entries right after the specials (as in Gemma's own
    # tokenizer.json), not added special tokens: decode(skip_special_tokens=True) must keep them.
    learned = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    pieces = [*GEMMA_SPECIALS, *(f"<0x{value:02X}>" for value in range(256))]
    pieces += [piece for piece, _ in learned if piece not in GEMMA_SPECIALS]
    merges = [tuple(merge) for merge in json.loads(learner.to_str())["model"]["merges"]]
    tokenizer = Tokenizer(BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=merges,
                              unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.add_special_tokens(list(GEMMA_SPECIALS))
    tokenizer.normalizer = learner.normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "GemmaTokenizer", "model_max_length": max_length, "add_bos_token": True,
              "add_eos_token": False, "padding_side": "right", **specials}
    return _save(tokenizer, Path(output), config, specials)


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # the first three added tokens of Qwen2 / Qwen3
# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX), before the byte-level map.
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen3's chat template for the messages a pipeline renders (system and user turns, earlier assistant turns
# without reasoning, the generation prompt and its enable_thinking switch); Qwen3's full template also renders
# tools and tool calls, which no text-to-image pipeline sends. For [{"role": "user", "content": C}] with
# add_generation_prompt=True, enable_thinking=True it gives "<|im_start|>user\nC<|im_end|>\n<|im_start|>assistant\n",
# as Qwen3's does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def write_qwen(output: str | Path, vocab_size: int = 1000, max_length: int = 131072) -> Path:
    """A Qwen2Tokenizer folder (what Qwen3 ships): byte-level BPE after Qwen2's split regex and NFC, no bos and no
    eos added, ``<|endoftext|>`` as pad, ``<|im_end|>`` as eos, Qwen3's chat template (``QWEN3_CHAT_TEMPLATE``) and
    Qwen3's model_max_length (131,072)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(captions(), trainer=trainer)
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": max_length, "bos_token": None,
              "unk_token": None, "errors": "replace", "add_prefix_space": False, "split_special_tokens": False,
              "chat_template": QWEN3_CHAT_TEMPLATE, "additional_special_tokens": list(QWEN_SPECIALS[1:]),
              **specials}
    return _save(tokenizer, Path(output), config, {**specials, "additional_special_tokens": list(QWEN_SPECIALS[1:])})


# Qwen2-VL's special tokens, in the hub tokenizer's order (ids 151643.. there; after the trained vocabulary here).
QWEN2_VL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                     "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL-2B-Instruct's chat template (tokenizer_config.json / chat_template.json of the hub repo; Qwen2.5-VL's
# is the same).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type']"
    " == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in "
    "content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_vl_tokenizer(texts: list[str], vocab_size: int = 2048, specials: tuple[str, ...] = QWEN2_VL_SPECIALS):
    """A Qwen2-VL-style tokenizer in memory (the VLM of `laionkit caption`'s tiny model, Qwen-Image's text
    encoder): byte-level BPE after Qwen2's split regex (QWEN_SPLIT) trained on ``texts``, with ``specials``
    after its vocabulary, as a transformers Qwen2TokenizerFast (eos <|im_end|>, pad <|endoftext|>, Qwen2-VL's
    chat template, as Qwen2-VL-Instruct's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2TokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return Qwen2TokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, bos_token=None, errors="replace", model_max_length=32768,
                              chat_template=QWEN2_VL_CHAT_TEMPLATE)


# Mistral's tekken tokenizer (Mistral-Small-3.x, the text encoder FLUX.2-dev ships): byte-level BPE after this split
# (tiktoken's pattern as tekken's config gives it), the control tokens first; PixtralProcessor wraps it.
MISTRAL_SPLIT = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"""
                 r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
# Mistral-Small-3.1's chat template for what text-to-image pipelines send (a system turn and user turns whose
# content is a string or a list of {"type": "text"} parts, as diffusers' Flux2Pipeline format_input builds them;
# images and tools are not rendered): "<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]C[/INST]".
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + content + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + content + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- content + eos_token }}{%- endif %}"
    "{%- endfor %}")


def write_mistral(output: str | Path, vocab_size: int = 1000, max_length: int = 131072) -> Path:
    """A tekken-style tokenizer folder (what PixtralProcessor loads with AutoTokenizer): byte-level BPE after
    tekken's split, ``<s>`` prepended by the chat template (and by plain calls, as Mistral's HF tokenizer
    does), ``<pad>`` for padding, Mistral-Small-3.1's control tokens and ``MISTRAL_CHAT_TEMPLATE``."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(MISTRAL_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(MISTRAL_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(captions(), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "padding_side": "right",
              "chat_template": MISTRAL_CHAT_TEMPLATE, "processor_class": "PixtralProcessor", **specials}
    return _save(tokenizer, Path(output), config, specials)
