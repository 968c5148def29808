"""SD3 cut into pipeline stages (laionkit/trainer/pipeline_parallel.py, FamilySpec.pipeline_cut): each stage runs
its run of the joint transformer blocks as SD3Transformer2DModel.forward runs them; the first stage also embeds
the patches, timestep and text, the last also projects out (its output: the patch tokens, unpatchified by
``layout``'s inverse only in the loss's view)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


class SD3Stage(nn.Module):
    """Blocks of one stage. Between stages travel the image and text streams and the time embedding
    (``temb``, so its gradient reaches the first stage's embedders)."""

    def __init__(self, denoiser, blocks: list, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(blocks)
        if first:
            self.pos_embed = denoiser.pos_embed
            self.time_text_embed = denoiser.time_text_embed
            self.context_embedder = denoiser.context_embedder
        if last:
            self.norm_out, self.proj_out = denoiser.norm_out, denoiser.proj_out

    def forward(self, hidden_states, encoder_hidden_states=None, temb=None, *, timestep, text_states,
                pooled_projections):
        if self.first:
            hidden_states = self.pos_embed(hidden_states)
            temb = self.time_text_embed(timestep, pooled_projections)
            encoder_hidden_states = self.context_embedder(text_states)
        for block in self.blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb,
                joint_attention_kwargs=None)
        if self.last:  # the patch tokens [B, h/p * w/p, p * p * C]
            return self.proj_out(self.norm_out(hidden_states, temb))
        return hidden_states, encoder_hidden_states, temb


def stage(denoiser, blocks: list, first: bool, last: bool) -> SD3Stage:
    return SD3Stage(denoiser, blocks, first, last)


def inputs(noisy, timestep, conditioning: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The latents (the first stage's input) and what every stage takes besides."""
    return (noisy,), {"timestep": timestep, "text_states": conditioning["encoder_hidden_states"],
                      "pooled_projections": conditioning["pooled_projections"]}


def layout(latents, patch: int = 2):
    """A latent [B, C, h, w] as the last stage's patch tokens lay it out: the inverse of the transformer's
    unpatchify (tokens row by row, each p x p x C)."""
    b, c, h, w = latents.shape
    tokens = latents.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    return tokens.reshape(b, (h // patch) * (w // patch), patch * patch * c)
