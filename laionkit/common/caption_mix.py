"""Several captions per sample: the names encode stores (``encode --captions alt,vlm``), the tar members
that hold each, and the policy train picks one with per sample (``train --caption-mix``); pure functions.

Names. ``alt`` is the sample's alt-text as encode always found it (``reader.caption_of``); any other
NAME is the image shard's json ``captions[NAME]`` (what ``laionkit caption`` writes), with an optional
CLIP score in json ``caption_scores[NAME]``, or in the column ``similarity_NAME`` of ``laionkit score --captions``
(joined by ``encode --caption-scores``, laionkit.encode.caption_scores). A latent sample stores its *first* caption (in the folder's
name order, of those it has) in the members a single-caption folder has (``text.npy``, ``pooled.npy``,
``mask.npy``, ``ids_*.npy``), so every reader that knows no caption names reads that one, and each other
caption it has as ``NAME.<member>`` (``vlm.text.npy``). Its json names them: ``caption_name`` (the first)
and ``captions`` {NAME: {text, num_tokens, truncated, score?}}.

The pick. Per sample per epoch, one of its captions, drawn from a uniform number that is a hash of (seed,
epoch, sample id): not a stateful generator, so that exact and elastic resume (laionkit.trainer.latent_order)
give every sample the caption it had in the uninterrupted run, whatever ranks or workers read it.
``weights`` (``alt:0.2,vlm:0.8``) are renormalised over the captions the sample has; ``clip[:T]`` weighs
them by softmax(score / T) over the captions with a score, as Sana samples its captions. A sample with
no caption of positive weight (or, for clip, none with a score) trains on its first caption.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from laionkit.common.errors import LaionkitError

ALT = "alt"
# A name is part of tar member names (NAME.text.npy): no dots, and none that old readers would take for
# one of their own members (ids_*.npy is online text's token ids).
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
_RESERVED = {"moments", "text", "pooled", "mask", "json"}
CLIP_TEMPERATURE = 1.0  # Sana's default clip_thr_temperature


def similarity_column(name: str) -> str:
    """The score parquet column of caption ``name``'s CLIP similarity (``score --captions``)."""
    return f"similarity_{name}"


def check_name(name: str, flag: str) -> str:
    if not _NAME.match(name) or name.lower() in _RESERVED or name.startswith("ids_"):
        raise LaionkitError(f"{flag}: caption name {name!r} must be a letter then letters, digits, _ or - (at most "
                            f"64), not ids_* nor one of {', '.join(sorted(_RESERVED))}")
    return name


def parse_names(spec: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``--captions alt,vlm`` as a tuple of names; None for none given or ``alt`` alone, which is encode as
    it always was (the same shards and settings, byte for byte)."""
    names = list_names(spec)
    return None if names == (ALT,) else names


def list_names(spec: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``--captions alt,vlm`` as a tuple of names, checked; None for none given."""
    if spec is None:
        return None
    parts = [part.strip() for part in (spec.split(",") if isinstance(spec, str) else spec)]
    names = tuple(check_name(part, f"--captions {spec!r}" if isinstance(spec, str) else "--captions")
                  for part in parts if part)
    if not names:
        raise LaionkitError("--captions: give at least one caption name (alt, or a json captions key)")
    if len(set(names)) != len(names):
        raise LaionkitError(f"--captions {','.join(names)}: a caption is named twice")
    return names


def member(name: str, plain: str, first: bool) -> str:
    """The tar member of a stored text member ``plain`` (text.npy, ids_tokenizer.npy) for caption ``name``:
    the plain member for a sample's first caption, ``NAME.plain`` for the others."""
    return plain if first else f"{name}.{plain}"


def scored(meta: Mapping | None, name: str) -> float | None:
    """A caption's CLIP score from an image sample's json ``caption_scores[NAME]``; None when absent or not a
    finite number."""
    scores = meta.get("caption_scores") if isinstance(meta, Mapping) else None
    value = scores.get(name) if isinstance(scores, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class CaptionMix:
    """A train policy: ``weights`` by caption name, or ``temperature`` for the clip policy."""

    spec: str  # as given, normalised (what the run records and a resume compares)
    weights: tuple[tuple[str, float], ...] = ()
    temperature: float | None = None  # clip: softmax(score / temperature)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.weights)

    def pick(self, seed: int, epoch: int, sample_id: int, captions: Mapping[str, Mapping],
             order: Sequence[str]) -> str:
        """The caption sample ``sample_id`` trains on in ``epoch``: one of ``captions`` (the sample's json
        captions), ``order`` the folder's names (the first the sample has is its fallback)."""
        have = [name for name in order if name in captions]
        if not have:
            raise ValueError("a sample without captions")
        if self.temperature is not None:
            scores = [(name, captions[name].get("score")) for name in have]
            scores = [(name, float(score)) for name, score in scores if isinstance(score, (int, float))]
            if not scores:
                return have[0]
            top = max(score for _, score in scores)
            weighted = [(name, math.exp((score - top) / self.temperature)) for name, score in scores]
        else:
            weights = dict(self.weights)
            weighted = [(name, weights.get(name, 0.0)) for name in have]
        total = sum(weight for _, weight in weighted)
        if not total > 0:
            return have[0]
        u = uniform(seed, epoch, sample_id) * total
        for name, weight in weighted:
            if weight > 0:
                if u < weight:
                    return name
                u -= weight
        return next(name for name, weight in reversed(weighted) if weight > 0)  # rounding at the top end

    def check(self, stored: Sequence[str], scored_names: Sequence[str], where: str) -> None:
        """Refuse a policy the latent folder ``where`` cannot serve: a name it does not store, or clip
        without a scored caption."""
        for name in self.names:
            if name not in stored:
                raise LaionkitError(f"--caption-mix {self.spec}: caption {name!r} is not stored in {where} "
                                    f"(its captions: {', '.join(stored)}); encode it with --captions "
                                    f"{','.join([*stored, name])}")
        if self.temperature is not None and not scored_names:
            raise LaionkitError(f"--caption-mix {self.spec}: no caption in {where} has a CLIP score (laionkit score "
                                "--captions NAMES, then encode --captions NAMES --caption-scores DIR; or json "
                                "caption_scores[NAME] of the image shards); give weights instead, e.g. --caption-mix "
                                + ",".join(f"{name}:1" for name in stored))


def parse_mix(spec: str | None) -> CaptionMix | None:
    """``--caption-mix alt:0.2,vlm:0.8`` (weights >= 0, any sum > 0, renormalised per sample over its
    captions) or ``clip`` / ``clip:TEMPERATURE``; None when not given."""
    if spec is None:
        return None
    text = spec.strip()
    head, colon, rest = text.partition(":")
    if head == "clip" and "," not in text:
        temperature = CLIP_TEMPERATURE
        if colon:
            try:
                temperature = float(rest)
            except ValueError:
                temperature = math.nan
            if not (math.isfinite(temperature) and temperature > 0):
                raise LaionkitError(f"--caption-mix {spec!r}: clip:TEMPERATURE takes a number > 0, e.g. clip:0.5")
        return CaptionMix(f"clip:{temperature:g}", temperature=temperature)
    weights = []
    for part in (part.strip() for part in text.split(",")):
        name, colon, value = part.partition(":")
        try:
            weight = float(value) if colon else math.nan
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight >= 0):
            raise LaionkitError(f"--caption-mix {spec!r}: give NAME:WEIGHT pairs, weights >= 0 (e.g. alt:0.2,vlm:0.8), "
                                "or clip / clip:TEMPERATURE")
        weights.append((check_name(name.strip(), f"--caption-mix {spec!r}"), weight))
    names = [name for name, _ in weights]
    if len(set(names)) != len(names):
        raise LaionkitError(f"--caption-mix {spec!r}: a caption is named twice")
    if not sum(weight for _, weight in weights) > 0:
        raise LaionkitError(f"--caption-mix {spec!r}: at least one weight must be > 0")
    # the spec a run records and a resume compares: by name, since the order given does not change a pick
    return CaptionMix(",".join(f"{name}:{weight:g}" for name, weight in sorted(weights)), weights=tuple(weights))


def uniform(seed: int, epoch: int, sample_id: int) -> float:
    """A number in [0, 1) that depends on (seed, epoch, sample id) only: the pick's draw."""
    return int(np.random.SeedSequence([seed, epoch, sample_id, 2]).generate_state(1)[0]) / 2**32
