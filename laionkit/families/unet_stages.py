"""SD and SDXL (UNet2DConditionModel) cut into pipeline stages (laionkit/trainer/pipeline_parallel.py,
FamilySpec.pipeline_cut): the cut's units are the UNet's down blocks, its mid block and its up blocks, in the
order UNet2DConditionModel.forward runs them; each stage runs its run of them as that forward does. The first
stage also embeds the timestep (and SDXL's text_embeds and time_ids) and runs conv_in, the last also runs
conv_norm_out / conv_act / conv_out.

The skip connections cross the cuts: between stages travel the hidden state, the time embedding (so its
gradient reaches the first stage's embedders) and every residual the down blocks pushed that no up block has
popped yet, as one tuple (torch's PipelineStage sends a tuple of tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from laionkit.common import LaionkitError

# UNet2DConditionModel options whose forward steps the stages do not run: refused where set.
UNRUN = ("class_embed_type", "encoder_hid_dim_type", "time_embedding_act_fn", "center_input_sample")


def blocks(denoiser) -> list:
    """The cut's units: the down blocks, the mid block, the up blocks."""
    return [*denoiser.down_blocks, *([denoiser.mid_block] if denoiser.mid_block is not None else []), *denoiser.up_blocks]


class UNetStage(nn.Module):
    """Units of one stage (``blocks``'s, contiguous), each knowing whether it is a down, the mid or an up block
    (and which up block: the last one never passes an upsample size)."""

    def __init__(self, denoiser, units: list, first: bool, last: bool) -> None:
        super().__init__()
        config = denoiser.config
        given = [name for name in UNRUN if config.get(name)]
        if given or config.addition_embed_type not in (None, "text_time"):
            raise LaionkitError(f"--pipeline-stages: the UNet's config sets "
                                f"{(given or ['addition_embed_type'])[0]}, which its pipeline cut does not run")
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(units)
        self.kinds = [_kind(denoiser, unit) for unit in units]
        self.upsamplers = denoiser.num_upsamplers
        if first:
            self.time_proj, self.time_embedding = denoiser.time_proj, denoiser.time_embedding
            self.conv_in = denoiser.conv_in
            if denoiser.config.addition_embed_type == "text_time":
                self.add_time_proj, self.add_embedding = denoiser.add_time_proj, denoiser.add_embedding
        if last:
            self.conv_norm_out, self.conv_act = denoiser.conv_norm_out, denoiser.conv_act
            self.conv_out = denoiser.conv_out

    def forward(self, sample, emb=None, *residuals, timestep, encoder_hidden_states, text_embeds=None,
                time_ids=None):
        if self.first:
            emb = self._embed(sample, timestep, text_embeds, time_ids)
            sample = self.conv_in(sample)
            residuals = (sample,)
        for (kind, final), block in zip(self.kinds, self.blocks):
            cross = {"encoder_hidden_states": encoder_hidden_states} if getattr(block, "has_cross_attention", False) \
                else {}
            if kind == "down":
                sample, pushed = block(hidden_states=sample, temb=emb, **cross)
                residuals = (*residuals, *pushed)
            elif kind == "mid":
                sample = block(sample, emb, **cross)
            else:
                count = len(block.resnets)
                popped, residuals = residuals[-count:], residuals[:-count]
                size = None if final or self._exact(residuals[0]) else residuals[-1].shape[2:]
                sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=popped,
                               upsample_size=size, **cross)
        if self.last:
            if self.conv_norm_out is not None:
                sample = self.conv_act(self.conv_norm_out(sample))
            return self.conv_out(sample)
        return (sample, emb, *residuals)

    def _exact(self, first_residual) -> bool:
        """The UNet's forward_upsample_size negated: its input's size (conv_in's output, the first residual,
        still held before the last up block) divides by every upsampler's 2."""
        return all(size % 2 ** self.upsamplers == 0 for size in first_residual.shape[-2:])

    def _embed(self, sample, timestep, text_embeds, time_ids):
        """The time embedding (plus SDXL's added conditioning), as UNet2DConditionModel.forward makes it."""
        emb = self.time_embedding(self.time_proj(timestep.expand(sample.shape[0])).to(sample.dtype))
        if hasattr(self, "add_embedding"):
            ids = self.add_time_proj(time_ids.flatten()).reshape(text_embeds.shape[0], -1)
            emb = emb + self.add_embedding(torch.cat([text_embeds, ids], dim=-1).to(emb.dtype))
        return emb


def _kind(denoiser, unit) -> tuple[str, bool]:
    if unit is denoiser.mid_block:
        return "mid", False
    ups = list(denoiser.up_blocks)
    if any(unit is up for up in ups):
        return "up", unit is ups[-1]
    return "down", False


def stage(denoiser, units: list, first: bool, last: bool) -> UNetStage:
    return UNetStage(denoiser, units, first, last)


def inputs(noisy, timestep, conditioning: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The noisy latents (the first stage's input) and what every stage takes besides: the text states, and
    SDXL's added conditioning (the first stage's)."""
    added = conditioning.get("added_cond_kwargs", {})
    return (noisy,), {"timestep": timestep, "encoder_hidden_states": conditioning["encoder_hidden_states"],
                      "text_embeds": added.get("text_embeds"), "time_ids": added.get("time_ids")}


def layout(latents):
    """The UNet's output is laid out as its input latents."""
    return latents
