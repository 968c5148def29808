"""Flux cut into pipeline stages (laionkit/trainer/pipeline_parallel.py, FamilySpec.pipeline_cut): each stage
runs its run of the transformer's blocks as FluxTransformer2DModel.forward runs them; the first stage also
embeds the latents, timestep, guidance and text, the last also projects out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from laionkit.families.flux import image_ids, pack


class FluxStage(nn.Module):
    """Blocks of one stage. Between stages travel the image and text streams and the time embedding
    (``temb``, so its gradient reaches the first stage's embedders); each stage makes the rotary embedding
    from the ids itself (it has no weights)."""

    def __init__(self, denoiser, blocks: list, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(blocks)
        self.pos_embed = denoiser.pos_embed
        if first:
            self.x_embedder = denoiser.x_embedder
            self.time_text_embed = denoiser.time_text_embed
            self.context_embedder = denoiser.context_embedder
        if last:
            self.norm_out, self.proj_out = denoiser.norm_out, denoiser.proj_out

    def forward(self, hidden_states, encoder_hidden_states=None, temb=None, *, timestep, text_states,
                pooled_projections, guidance, txt_ids, img_ids):
        if self.first:
            hidden_states = self.x_embedder(hidden_states)
            timestep = timestep.to(hidden_states.dtype) * 1000
            temb = (self.time_text_embed(timestep, pooled_projections) if guidance is None else
                    self.time_text_embed(timestep, guidance.to(hidden_states.dtype) * 1000, pooled_projections))
            encoder_hidden_states = self.context_embedder(text_states)
        rotary = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        for block in self.blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb,
                image_rotary_emb=rotary, joint_attention_kwargs=None)
        if self.last:
            return self.proj_out(self.norm_out(hidden_states, temb))
        return hidden_states, encoder_hidden_states, temb


def stage(denoiser, blocks: list, first: bool, last: bool) -> FluxStage:
    return FluxStage(denoiser, blocks, first, last)


def inputs(noisy, timestep, conditioning: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The packed latents (the first stage's input) and what every stage takes besides, as flux.denoise
    hands them to the transformer."""
    _, _, height, width = noisy.shape
    return (pack(noisy),), {
        "timestep": timestep, "text_states": conditioning["encoder_hidden_states"],
        "pooled_projections": conditioning["pooled_projections"], "guidance": conditioning["guidance"],
        "txt_ids": conditioning["txt_ids"], "img_ids": image_ids(height, width).to(noisy.device, noisy.dtype)}


def layout(latents):
    """A latent [B, C, h, w] as the last stage's output lays it out (packed 2x2)."""
    return pack(latents)
