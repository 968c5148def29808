"""score's caption embeddings, each caption run over its own tokens rather than the whole context.

CLIP pads every caption to its context (77 tokens for OpenAI's and LAION's models), but a text tower with a
causal mask that pools the end-of-text token (``argmax`` / ``eos``: OpenAI CLIP, LAION's open_clip models) gives
each caption's embedding from the tokens up to that one alone: the padding after it changes nothing. LAION's
alt-texts are short (median 12 tokens, 90 % under 26 on the shipped sample), so a batch sorted by length and cut
into a few chunks, each run only as long as its longest caption, costs about a third of the full-context forward
(``TextEncoder``). The model's own ``encode_text`` runs each chunk, with its positional embedding and causal
mask cut to the chunk's length for that call: the same function, fewer padding tokens. Towers this does not
hold for (no causal mask, pooling at a fixed position, a class token: SigLIP, CoCa) run the whole context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from laionkit.common.background import device_tensor
from laionkit.common.cudagraphs import Graphed

# A chunk is one more pass of the tower's Python, launched by the thread that also launches the image forward:
# up to 4 chunks of at least 128 captions (8 cost ~0.28 of the full context on the shipped alt-texts, 4 ~0.37)
CHUNK_ROWS = 128
MAX_CHUNKS = 4
GRAPH_LENGTHS = 8  # with CUDA graphs, chunk lengths round up to a multiple of this: a graph per (rows, length)


def trimmable(clip) -> tuple[torch.nn.Module, str, int | None] | None:
    """(text tower, pool type, end-of-text id) of an open_clip model whose text tower can run on tokens cut
    after the pooled one (a causal mask, argmax / eos pooling, no class token); None otherwise."""
    for tower in (clip, getattr(clip, "text", None)):  # CLIP holds its text tower's parts; CustomTextCLIP a module
        if tower is None or "positional_embedding" not in getattr(tower, "_parameters", {}):
            continue
        pool = getattr(tower, "text_pool_type", getattr(tower, "pool_type", None))
        if tower._buffers.get("attn_mask") is None or pool not in ("argmax", "eos") \
                or getattr(tower, "cls_emb", None) is not None:
            return None
        return tower, pool, getattr(tower, "text_eos_id", getattr(tower, "eos_id", None))
    return None


@contextmanager
def cut(tower, length: int) -> Iterator[None]:
    """``tower``'s positional embedding and causal mask cut to ``length`` tokens while the block runs: its own
    entries swapped for views and put back (what torch.func.functional_call does, without walking the whole
    model's modules on every call: that cost ~8 ms of host time a call for ViT-L/14)."""
    parameters, buffers = tower._parameters, tower._buffers
    embedding, mask = parameters["positional_embedding"], buffers["attn_mask"]
    parameters["positional_embedding"], buffers["attn_mask"] = embedding[:length], mask[:length, :length]
    try:
        yield
    finally:
        parameters["positional_embedding"], buffers["attn_mask"] = embedding, mask


def chunks(lengths: np.ndarray) -> list[np.ndarray]:
    """Row indices sorted by length, cut into up to MAX_CHUNKS chunks of at least CHUNK_ROWS rows."""
    order = np.argsort(lengths, kind="stable")
    return np.array_split(order, max(1, min(MAX_CHUNKS, len(order) // CHUNK_ROWS)))


class TextEncoder:
    """``clip.encode_text`` of a batch of token ids (on the host), chunked by length where the tower allows it
    (module docstring); the features in the batch's row order, on the device, L2-normalised."""

    def __init__(self, clip, cuda_graphs: bool = False, log=lambda _: None) -> None:
        self.clip = clip
        self.trim = trimmable(clip)
        # padding after the pooled token changes nothing, so graphed chunks round their length up (fewer graphs)
        self.round = GRAPH_LENGTHS if cuda_graphs else 1
        self.forward = Graphed(self._forward, "score's CLIP caption forward", log=log) if cuda_graphs else self._forward

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """encode_text of token ids cut after ``tokens.shape[1]`` positions (the whole context: as they are)."""
        if self.trim is None or tokens.shape[1] == self.trim[0].positional_embedding.shape[0]:
            return self.clip.encode_text(tokens)
        with cut(self.trim[0], tokens.shape[1]):
            return self.clip.encode_text(tokens)

    def lengths(self, tokens: torch.Tensor) -> np.ndarray:
        """Each caption's tokens up to and including the pooled one."""
        _, pool, eos = self.trim
        ids = tokens.cpu().numpy()  # numpy's argmax: torch's on the host fans out to its intra-op threads, slow
        # on a host whose cores decode images, on the thread that launches the device's work (BENCHMARKS: score)
        pooled = ids.argmax(-1) if pool == "argmax" else (ids == eos).argmax(-1)
        return pooled + 1

    def __call__(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved = tokens.to(device, non_blocking=True)
        if self.trim is None or not len(tokens):
            return torch.nn.functional.normalize(self.forward(moved).float(), dim=-1)
        context = self.trim[0].positional_embedding.shape[0]
        lengths = self.lengths(tokens)
        parts = chunks(lengths)
        where = device_tensor(np.concatenate(parts).tolist(), torch.long, device)  # one copy, sliced per chunk
        features, start = None, 0
        for part in parts:
            length = min(context, -(-int(lengths[part].max()) // self.round) * self.round)
            rows = where[start: start + len(part)]
            start += len(part)
            chunk = self.forward(moved[rows, :length])
            if features is None:
                features = torch.empty((len(tokens), chunk.shape[1]), dtype=torch.float32, device=device)
            features[rows] = chunk.float()
        return torch.nn.functional.normalize(features, dim=-1)
