"""Column names across LAION releases: one canonical name per field and the spellings seen in the wild.

laion2B-en says ``URL``/``TEXT``/``WIDTH``, the improved-aesthetics sets say ``AESTHETIC_SCORE``, and
img2dataset's own output (the embeddings metadata) says ``url``/``caption``/``width``. Every stage
finds its columns here, so a name the user must map by hand is refused with the columns that exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from laionkit.common.errors import LaionkitError

# Canonical name -> known spellings, in order of preference when several are present.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "url": ("URL", "url"),
    "caption": ("TEXT", "caption", "text", "TEXT_CAPTION"),
    "width": ("WIDTH", "width"),
    "height": ("HEIGHT", "height"),
    "aesthetic": ("AESTHETIC_SCORE", "aesthetic", "aesthetic_score"),
    "similarity": ("similarity", "SIMILARITY"),
    "punsafe": ("punsafe", "PUNSAFE"),
    "pwatermark": ("pwatermark", "PWATERMARK"),
    "key": ("key", "KEY", "SAMPLE_ID", "sample_id"),
    "hash": ("hash", "HASH"),
}


def find_column(
    columns: Iterable[str],
    canonical: str,
    override: str | None = None,
    source: str = "input",
    aliases: Mapping[str, tuple[str, ...]] = COLUMN_ALIASES,
) -> str:
    """The column of ``columns`` that holds ``canonical``: ``override`` if given, else its first alias.

    Raises LaionkitError naming ``source``, the names tried and the columns available.
    """
    available = list(columns)
    if override is not None:
        if override not in available:
            raise LaionkitError(
                f"{source}: column {override!r} (given for {canonical}) not found; "
                f"available columns: {', '.join(available)}"
            )
        return override
    if canonical not in aliases:
        raise LaionkitError(f"unknown column kind {canonical!r}; known: {', '.join(sorted(aliases))}")
    for alias in aliases[canonical]:
        if alias in available:
            return alias
    raise LaionkitError(
        f"{source}: no {canonical} column (tried {', '.join(aliases[canonical])}); "
        f"available columns: {', '.join(available)}; name it explicitly"
    )


def find_optional_column(
    columns: Iterable[str], canonical: str, aliases: Mapping[str, tuple[str, ...]] = COLUMN_ALIASES
) -> str | None:
    """Like find_column without an override, but None when no alias is present."""
    available = set(columns)
    return next((alias for alias in aliases.get(canonical, ()) if alias in available), None)
