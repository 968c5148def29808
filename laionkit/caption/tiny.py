"""A tiny random-init vision-language model in Qwen2-VL's real layout, for tests and smoke runs of `caption`.

Written as Qwen/Qwen2-VL-2B-Instruct's folder is: config.json + model.safetensors (Qwen2VLForConditionalGeneration),
generation_config.json, and a Qwen2VLProcessor (preprocessor_config.json for Qwen2VLImageProcessor, its video
processor, chat_template) whose tokenizer is a byte-level BPE trained with the `tokenizers` library on the
captions of laionkit's shipped LAION sample (laionkit.families.tokenizers.qwen2_vl_tokenizer, which Qwen-Image's
tiny text encoder shares), saved in Qwen2's tokenizer layout (tokenizer.json, vocab.json, merges.txt,
tokenizer_config.json) with Qwen2-VL's special tokens (<|im_start|>, <|image_pad|>, ...). `AutoProcessor` +
`AutoModelForImageTextToText.from_pretrained(folder)` load it as they load the real one, offline. Random weights generate gibberish tokens: the folder tests the plumbing, not captions.
``QWEN2_VL_2B`` is the real 2B architecture (Qwen2-VL-2B's config.json), for benchmarks at real size.
"""

from __future__ import annotations

from pathlib import Path

from laionkit.families.tokenizers import QWEN2_VL_CHAT_TEMPLATE as CHAT_TEMPLATE
from laionkit.families.tokenizers import QWEN2_VL_SPECIALS as SPECIAL_TOKENS
from laionkit.families.tokenizers import captions, qwen2_vl_tokenizer

# Qwen/Qwen2-VL-2B-Instruct's config.json (the real architecture, 2.2B parameters), in transformers 5's layout.
QWEN2_VL_2B = {
    "text_config": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_act": "silu",
                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 32768,
                    "max_window_layers": 28, "use_sliding_window": False, "bos_token_id": 151643,
                    "eos_token_id": 151645,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16,
                      "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
}
# The tiny model's image budget: 28 x 28 px patches after merging, 4 to 16 image tokens per image.
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 112 * 112


def write_tiny_vlm(output: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init Qwen2-VL (model + processor) to ``output``; returns the folder."""
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen2_vl_tokenizer(captions())
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    size = {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(size=size),
                                 video_processor=Qwen2VLVideoProcessor(size=size),
                                 tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    # initializer_range 0.3 (transformers' default 0.02): at 0.02 the logits are nearly flat and every image
    # generated the same run of newlines; at 0.3 the greedy tokens depend on the image, so tests see it.
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "initializer_range": 0.3,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": ids["<|endoftext|>"],
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"initializer_range": 0.3, "depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2,
                       "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False
    model.save_pretrained(output, safe_serialization=True)
    processor.save_pretrained(output)
    tokenizer.backend_tokenizer.model.save(str(output))  # vocab.json + merges.txt, as the hub repo ships them
    return output
