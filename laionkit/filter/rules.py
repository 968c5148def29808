"""What a filter rule is: the presets, the other datasets' column spellings rules may use, and the
check that a ``--where`` rule is one true/false expression over the row (read from DuckDB's parse tree).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb

from laionkit.common import LaionkitError
from laionkit.common.columns import COLUMN_ALIASES

# Rule sets used in practice (LAION's advice; Stable Diffusion 1.x and 2.0 training sets). Names are
# canonical: ALIASES makes them work on every LAION release's spelling.
# An entry "top:FRACTION:COLUMN" is a quantile rule (--top), the rest are SQL rules (--where).
PRESETS: dict[str, tuple[str, ...]] = {
    "laion-safe": ("punsafe < 0.5", "pwatermark < 0.8"),
    "sd1": ("pwatermark < 0.5", "aesthetic >= 5", "width >= 512", "height >= 512"),
    "sd2": ("punsafe < 0.1", "aesthetic >= 4.5"),
    # COYO-700M's own NSFW thresholds (its release already applied them; they guard merged or derived
    # copies) and LAION's watermark advice, on COYO's columns. sd1 / sd2 work on COYO through ALIASES
    # where the score is the same model (aesthetic v2, watermark); COYO has no punsafe (its NSFW scores
    # come from other detectors), so rules naming punsafe are refused on it.
    "coyo-safe": ("nsfw_score_opennsfw2 < 0.5", "nsfw_score_gantman < 0.5", "watermark_score < 0.8"),
    # DataComp's "basic filtering" baseline (Gadre et al. 2023, datacomp baselines.py) without its fastText
    # English test: more than 2 words (whitespace-split) and 5 characters, smaller side >= 200, aspect < 3.
    "datacomp-basic": (
        "length(text) > 5",
        "len(regexp_split_to_array(trim(text), '\\s+')) > 2",
        "least(original_width, original_height) >= 200",
        "greatest(original_width, original_height) < 3 * least(original_width, original_height)",
    ),
    # DataComp's CLIP-score baselines: the top 30 % of the pool by OpenAI CLIP L/14 (or B/32) similarity.
    "datacomp-clip-l14-30": ("top:0.3:clip_l14_similarity_score",),
    "datacomp-clip-b32-30": ("top:0.3:clip_b32_similarity_score",),
}
TOP_PREFIX = "top:"

# Filter-only spellings of other datasets' columns that hold the same quantity as LAION's: COYO-700M's
# LAION aesthetic v2 and watermark scores and CLIP ViT-B/32 similarity, DataComp's original sizes and
# ViT-B/32 similarity. NSFW scores of other detectors are not LAION's punsafe, so they get no alias.
FILTER_ALIASES: dict[str, tuple[str, ...]] = {
    "width": ("original_width",),
    "height": ("original_height",),
    "aesthetic": ("aesthetic_score_laion_v2",),
    "pwatermark": ("watermark_score",),
    "similarity": ("clip_similarity_vitb32", "clip_b32_similarity_score"),
}

# Groups of names for one column across LAION releases (the shared table in laionkit.common.columns).
# DuckDB matches names case-insensitively, so only names differing in more than case need an alias.
ALIASES: tuple[tuple[str, ...], ...] = tuple(
    tuple(dict.fromkeys(name.lower() for name in (canonical, *spellings, *FILTER_ALIASES.get(canonical, ()))))
    for canonical, spellings in COLUMN_ALIASES.items()
)


@dataclass(frozen=True)
class Rule:
    expr: str
    source: str  # "--where" or "preset <name>"


def preset_rules(presets: Sequence[str], where: Sequence[str]) -> list[Rule]:
    rules = []
    for name in presets:
        if name not in PRESETS:
            raise LaionkitError(f"unknown --preset {name!r}; known: {', '.join(PRESETS)}")
        rules += [Rule(expr, f"preset {name}") for expr in PRESETS[name] if not expr.startswith(TOP_PREFIX)]
    rules += [Rule(expr, "--where") for expr in where]
    unique = {rule.expr: rule for rule in reversed(rules)}  # a rule given twice is tested (and counted) once
    return [rule for rule in rules if unique[rule.expr] is rule]


def parse_renames(pairs: Sequence[str]) -> dict[str, str]:
    renames = {}
    for pair in pairs:
        old, eq, new = pair.partition("=")
        if not eq or not old or not new:
            raise LaionkitError(f"--rename {pair!r}: expected OLD=NEW")
        renames[old] = new
    return renames


def alias_names(columns: Sequence[str]) -> dict[str, str]:
    """Extra names -> present column, for each alias group member missing from ``columns``."""
    present = {name.lower(): name for name in columns}
    extra = {}
    for group in ALIASES:
        found = next((present[name] for name in group if name in present), None)
        if found is not None:
            extra.update({name: found for name in group if name not in present})
    return extra


# Parse-tree node classes a rule may not hold: a subquery reaches tables and table functions (files,
# URLs), COLUMNS(*) is several expressions, a window depends on how rows are split into units.
FORBIDDEN_NODES = {"SUBQUERY": "a subquery", "STAR": "COLUMNS(*) / *", "WINDOW": "a window function"}


def parse_rule(rule: Rule) -> set[str]:
    """Check that ``rule`` is ONE expression over the row (no alias, clause, statement, subquery) and
    return the column names it reads, from DuckDB's own parse tree (never by regex or eval).

    A rule is data from the user: with it parsed as a whole SELECT, trailing words would silently become
    an alias (``punsafe < 0.5 pwatermark``) and a subquery could read any file DuckDB can."""
    name = f"{rule.source} {rule.expr!r}"
    tree = json.loads(
        duckdb.sql("SELECT json_serialize_sql(?)", params=[f"SELECT {rule.expr}"]).fetchall()[0][0]
    )
    if tree.get("error"):
        raise LaionkitError(f"{name}: {tree.get('error_message', 'cannot parse')}")
    statements = tree["statements"]
    node = statements[0]["node"] if len(statements) == 1 else {}
    clauses = ("where_clause", "having", "qualify", "sample", "group_expressions", "modifiers")
    if (
        node.get("type") != "SELECT_NODE"
        or len(node["select_list"]) != 1
        or node["from_table"].get("type") != "EMPTY"
        or any(node.get(key) for key in clauses)
        or node["cte_map"]["map"]
    ):
        raise LaionkitError(f"{name}: a rule is one true/false expression over the input's columns, "
                            "with no statements, clauses or ';'")
    [expression] = node["select_list"]
    if expression.get("alias"):
        raise LaionkitError(f"{name}: unexpected words after the expression ({expression['alias']!r}); "
                            "join tests with AND / OR")
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            if value.get("class") in FORBIDDEN_NODES:
                raise LaionkitError(f"{name}: {FORBIDDEN_NODES[value['class']]} is not allowed in a rule")
            if value.get("class") == "COLUMN_REF":
                found.add(value["column_names"][-1])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(expression)
    return found
