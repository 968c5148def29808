"""Stage 1: stream LAION parquet and keep the rows that pass SQL rules and custom CLIP-score thresholds.

Work units are (input file, contiguous row groups) in sorted-path order, split round-robin by rank.
Each unit is read one row group at a time, in two steps (late materialisation): first only the columns
the rules name, evaluated by DuckDB as one boolean column per rule; then, only if any row survives,
the remaining columns, of which only the kept rows are written. Peak memory is one row group.

Invariants: the union of ``part-*-<unit>.parquet`` over ranks equals a one-rank run row for row; a
unit is done iff its part file exists (written atomically, its stats in the parquet footer), so a
killed run is simply rerun; ``_laionkit/filter-plan.parquet`` pins inputs, units and rules so a rerun with
other arguments is refused instead of mixing outputs.

``--top FRACTION:COLUMN`` is global too, without a coordinator: every rank reads that one column of every
input and derives the same threshold (and tie cut, by input order), which then acts as a plain rule.

``--dedup COLUMN`` is global: among rows passing every rule, the first occurrence of a value in global
unit order is kept, with any number of ranks: the column is hash-partitioned to disk and resolved
bucket by bucket before the parts are written (laionkit.dedup says how ranks meet through files).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import math
import os
import queue
import re
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from laionkit.common import (
    LaionkitError,
    Rank,
    available_cpus,
    refuse_other_settings,
    resolve_rank,
    split,
    storage,
    versions,
)
from laionkit.common.columns import COLUMN_ALIASES
from laionkit.common.storage import Location
from laionkit.scores import ClipChoice, Scorer, ScoreSpec, build_scorer, score_embeddings

if TYPE_CHECKING:
    from laionkit.dedup import Dedup

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

# Sidecars (the plan, each rank's stats) live in _laionkit/ as parquet files with no rows, the parts'
# columns and the record in their footer: pandas, pyarrow.dataset and Spark skip "_" names, while
# polars.read_parquet(DIR) reads every file below DIR (refusing other extensions) and
# datasets.load_dataset(DIR) every non-hidden one; a parquet file with the same columns and no row group
# adds no row to either.
SIDECARS = "_laionkit"
PLAN_NAME = f"{SIDECARS}/filter-plan.parquet"
STATS_GLOB = "filter-stats-*.parquet"  # in SIDECARS
SIDECAR_KEY = "laionkit.filter.record"
JSON_PLAN_NAME = "_filter-plan.json"  # folders filtered before the sidecars moved: still read, resumed
JSON_STATS_GLOB = "_stats-*.json"
LEGACY_PLAN_NAME = "filter-plan.json"  # before sidecars were "_"-named
# Names the SQL built here uses: an input column with one of these would shadow it. file_row_number is
# DuckDB's parquet row number (a real column of that name hides it: such files are read via arrow).
ROW_NUMBER = "file_row_number"
INTERNAL_PREFIX = "__laionkit_"
STATS_KEY = "laionkit.filter.unit"
PART_NAME = re.compile(r"^part-(\d{5})-(\d{6})\.parquet$")
DEFAULT_UNIT_ROWS = 1_000_000


@dataclass(frozen=True)
class FilterConfig:
    inputs: tuple[str, ...]
    output: str
    where: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    top: tuple[str, ...] = ()  # --top FRACTION:COLUMN quantile rules
    rename: tuple[str, ...] = ()
    dedup: str | None = None
    embeddings: tuple[str, ...] = ()
    scores: tuple[str, ...] = ()
    clip_model: str = "ViT-L-14"
    clip_pretrained: str = "openai"
    unit_rows: int = DEFAULT_UNIT_ROWS
    threads: int | None = None  # DuckDB threads in all; None = every CPU this process may use
    rank: int | None = None
    world_size: int | None = None
    dedup_wait: float = 3600.0  # --dedup: seconds a rank waits for the other ranks' phase outputs
    dedup_bucket_rows: int = 4_000_000  # --dedup: input rows per bucket (bounds the memory of resolving one)
    skip_bad: bool = False
    overwrite: bool = False
    quiet: bool = False
    storage_options: str | None = None  # --storage-options JSON for s3:// and other URLs


@dataclass(frozen=True)
class Rule:
    expr: str
    source: str  # "--where" or "preset <name>"


@dataclass(frozen=True)
class InputFile:
    path: str
    rows: int
    row_group_rows: tuple[int, ...]
    schema: pa.Schema = field(compare=False, repr=False)
    embeddings: str | None = None
    location: Location | None = field(default=None, compare=False, repr=False)  # where to open ``path``
    embeddings_layout: storage.NpyLayout | None = field(default=None, compare=False, repr=False)

    def open(self) -> pq.ParquetFile:
        return pq.ParquetFile(self.location.open_read() if self.location else self.path)


@dataclass(frozen=True)
class Unit:
    """Row groups [start, stop) of input file ``file``; ``offset`` = the file row of its first row."""

    index: int
    file: int
    start: int
    stop: int
    offset: int
    rows: int


# ---------------------------------------------------------------------------------------------- pure parts


def preset_rules(presets: Sequence[str], where: Sequence[str]) -> list[Rule]:
    rules = []
    for name in presets:
        if name not in PRESETS:
            raise LaionkitError(f"unknown --preset {name!r}; known: {', '.join(PRESETS)}")
        rules += [Rule(expr, f"preset {name}") for expr in PRESETS[name] if not expr.startswith(TOP_PREFIX)]
    rules += [Rule(expr, "--where") for expr in where]
    unique = {rule.expr: rule for rule in reversed(rules)}  # a rule given twice is tested (and counted) once
    return [rule for rule in rules if unique[rule.expr] is rule]


@dataclass(frozen=True)
class TopSpec:
    """``--top FRACTION:COLUMN``: keep the rows whose COLUMN is among the top FRACTION of the pool."""

    fraction: str  # as given: the count kept is floor(Fraction(fraction) x pool), exact in decimal
    column: str
    source: str

    @classmethod
    def parse(cls, text: str, source: str = "--top") -> TopSpec:
        fraction, sep, column = text.partition(":")
        try:
            value = Fraction(fraction)
        except (ValueError, ZeroDivisionError):
            value = None
        if not sep or not column or value is None or not 0 < value <= 1:
            raise LaionkitError(f"{source} {text!r}: expected FRACTION:COLUMN with 0 < FRACTION <= 1, "
                                "e.g. 0.3:clip_l14_similarity_score")
        return cls(fraction, column, source)

    @property
    def label(self) -> str:
        """Its name in the stats and the plan."""
        return f"top({self.fraction}:{self.column})"


def top_specs(presets: Sequence[str], top: Sequence[str]) -> list[TopSpec]:
    specs = [TopSpec.parse(expr[len(TOP_PREFIX):], f"preset {name}") for name in presets
             for expr in PRESETS.get(name, ()) if expr.startswith(TOP_PREFIX)]
    specs += [TopSpec.parse(text) for text in top]
    unique = {(spec.fraction, spec.column): spec for spec in reversed(specs)}
    return [spec for spec in specs if unique[(spec.fraction, spec.column)] is spec]


def parse_renames(pairs: Sequence[str]) -> dict[str, str]:
    renames = {}
    for pair in pairs:
        old, eq, new = pair.partition("=")
        if not eq or not old or not new:
            raise LaionkitError(f"--rename {pair!r}: expected OLD=NEW")
        renames[old] = new
    return renames


def make_units(files: Sequence[InputFile], unit_rows: int) -> list[Unit]:
    """Cut each file into runs of row groups holding at least ``unit_rows`` rows (the last run may be
    smaller); a file without row groups still gets one empty unit, so it leaves a record."""
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        start, rows, offset = 0, 0, 0
        for group, group_rows in enumerate(file.row_group_rows):
            rows += group_rows
            if rows >= unit_rows or group == len(file.row_group_rows) - 1:
                units.append(Unit(len(units), file_index, start, group + 1, offset, rows))
                start, offset, rows = group + 1, offset + rows, 0
        if not file.row_group_rows:
            units.append(Unit(len(units), file_index, 0, 0, 0, 0))
    return units


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


def glob_literal(path: str) -> str:
    """``path`` as a DuckDB file pattern matching only itself: DuckDB globs every path it is given, so
    ``g[1].parquet`` would read ``g1.parquet``; each glob character becomes a one-character class."""
    return re.sub(r"([\[\]*?{}])", r"[\1]", path)


def lock_down(connection: duckdb.DuckDBPyConnection, readable: Sequence[str], writable: Path) -> None:
    """Let ``connection`` read only the planned inputs and write only under the output folder; no
    extension may be loaded or installed. Rules are user text, so this is the backstop behind
    parse_rule. DuckDB checks a file pattern as given, so each input is allowed literally and escaped."""
    paths = [spelling for path in readable for spelling in dict.fromkeys((path, glob_literal(path)))]
    folders = dict.fromkeys(str(path).rstrip("/") + "/" for path in (writable.absolute(), writable.resolve()))
    connection.execute(f"SET allowed_paths = [{', '.join(map(literal, paths))}]").fetchall()
    connection.execute(f"SET allowed_directories = [{', '.join(map(literal, folders))}]").fetchall()
    for setting in ("autoinstall_known_extensions", "autoload_known_extensions", "enable_external_access"):
        connection.execute(f"SET {setting} = false").fetchall()


# ------------------------------------------------------------------------------------------------ the plan


def find_inputs(paths: Sequence[str], options: dict | None = None) -> list[Location]:
    """Files given, plus every ``*.parquet`` under folders given; sorted by path (the unit order).

    Expanded here, once: a path that exists is literal (even ``star*.parquet``), one that does not is
    a glob pattern. Files and folders named with "." or "_" are skipped in folders, as dataset readers do."""
    found: set[Path] = set()
    remote: set[Location] = set()
    for given in paths:
        location = Location.parse(given, options)
        if not location.local:
            remote.update(find_remote_inputs(location, given))
            continue
        given = location.path
        matches = [given] if Path(given).exists() else sorted(glob.glob(given, recursive=True))
        if not matches:
            raise LaionkitError(f"input not found: {given}")
        for match in map(Path, matches):
            if match.is_dir():
                found.update(p for p in match.rglob("*.parquet") if p.is_file() and not any(
                    part.startswith((".", "_")) for part in p.relative_to(match).parts))
            elif match.is_file():
                found.add(match)
    if not found and not remote:
        raise LaionkitError(f"no parquet files in {', '.join(paths)}")
    return sorted([Location("", str(p.resolve())) for p in found] + list(remote), key=str)


def find_remote_inputs(location: Location, given: str) -> list[Location]:
    """``find_inputs`` for a URL. In a folder that holds done records (a laionkit output, possibly of a
    killed run) only objects with their record count; a folder uploaded by other tools has none, so
    all its ``*.parquet`` objects do."""
    if location.exists() and not location.is_dir():
        return [location]
    if not location.is_dir():
        matches = [m for m in location.parent.glob(location.name) if m.name.endswith(".parquet")]
        if not matches:
            raise LaionkitError(f"input not found: {given}")
        return matches
    try:
        names = [str(name) for name in location.fs.find(location.path)]
    except Exception as error:  # noqa: BLE001 -- storage errors of any fsspec backend, named in one line
        raise LaionkitError(f"cannot list {given}: {type(error).__name__}: {error}") from None
    relative = [name[len(location.path.rstrip("/")) + 1:] for name in names]
    done = set()
    for rel in relative:
        folder, _, name = rel.rpartition("/")
        if name.startswith(".") and name.endswith(storage.DONE_SUFFIX):
            done.add(f"{folder}/{name[1:-len(storage.DONE_SUFFIX)]}".lstrip("/"))
    return [location.join(rel) for rel in relative if rel.endswith(".parquet")
            and not any(part.startswith((".", "_")) for part in rel.split("/")) and (not done or rel in done)]


def read_footer(location: Location) -> tuple[pq.ParquetFile, dict]:
    """The file's footer, and what identifies this version of the file: size, mtime (an object's ETag)
    and a hash of the footer bytes (which hold every row group's offsets and statistics), so a replaced
    input is noticed."""
    try:
        with location.open_read(block_size=2**20) as file:
            footer = pq.ParquetFile(file)
            file.seek(-8, 2)
            length = int.from_bytes(file.read(4), "little")
            file.seek(-8 - length, 2)
            digest = hashlib.sha256(file.read(length + 8)).hexdigest()
        if location.local:
            stat = os.stat(location.path)
            identity = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        else:
            info = location.fs.info(location.path)
            identity = {"bytes": int(info["size"]), "etag": str(info.get("ETag") or info.get("etag") or "")}
    except (pa.ArrowException, OSError, ValueError) as error:
        raise LaionkitError(f"{location}: not a readable parquet file ({error})") from None
    return footer, {**identity, "footer_sha256": digest}


def embeddings_by_number(paths: Sequence[str], options: dict | None = None) -> list[Location]:
    """The ``.npy`` files given, or in the folders given (a local path or any fsspec URL)."""
    found: list[Location] = []
    for given in paths:
        location = Location.parse(given, options)
        if location.is_dir():
            found += location.list("*.npy", complete_only=None)
        elif location.exists():
            found.append(location)
        else:
            raise LaionkitError(f"--embeddings not found: {given}")
    if not found:
        raise LaionkitError(f"no .npy files in --embeddings {', '.join(paths)}")
    return found


def trailing_number(path: Path | Location) -> str | None:
    match = re.search(r"(\d+)$", Path(path.name).stem)
    return str(int(match.group(1))) if match else None


def match_embeddings(inputs: Sequence[Location], npys: Sequence[Location]) -> dict[Location, Location]:
    """LAION's layout: img_emb_0003.npy <-> metadata_0003.parquet by number; one file <-> one file."""
    if len(inputs) == 1 and len(npys) == 1:
        return {inputs[0]: npys[0]}
    by_number: dict[str, Location] = {}
    for npy in npys:
        number = trailing_number(npy)
        if number is None or number in by_number:
            raise LaionkitError(f"--embeddings {npy}: cannot pair it with an input by its number")
        by_number[number] = npy
    pairs = {}
    for parquet in inputs:
        number = trailing_number(parquet)
        if number is None or number not in by_number:
            raise LaionkitError(f"no embeddings file for {parquet} (looked for a .npy numbered {number})")
        pairs[parquet] = by_number[number]
    return pairs


def check_embeddings(npy: Location, parquet: Location, rows: int) -> storage.NpyLayout:
    """The array's header, checked against its parquet file (local: memory-mapped later; URL: row
    ranges read per unit, so no file is downloaded whole)."""
    layout = storage.npy_layout(npy)
    if len(layout.shape) != 2 or layout.dtype not in (np.float16, np.float32):
        raise LaionkitError(f"{npy}: expected a float16/float32 N x D array, got {layout.dtype} {layout.shape}")
    if layout.shape[0] != rows:
        raise LaionkitError(
            f"{npy} has {layout.shape[0]} rows but {parquet} has {rows}: they must align row by row"
        )
    return layout


@dataclass
class Plan:
    files: list[InputFile]
    bad_inputs: list[dict]
    units: list[Unit]
    rules: list[Rule]
    scores: list[ScoreSpec]
    renames: dict[str, str]
    record: dict  # what the plan sidecar holds; equal records = interchangeable runs
    staging: str | None = None  # local folder for parts on their way to an object store
    labels: dict[str, str] = field(default_factory=dict)  # rule expr -> its name in the stats (--top rules)

    @functools.cached_property
    def bases(self) -> list[int]:
        """Global position of each file's first row: the input order --top breaks ties by."""
        return [sum(f.rows for f in self.files[:i]) for i in range(len(self.files))]

    @property
    def plan_id(self) -> str:
        return plan_id(self.record)

    @functools.cached_property
    def parsed_rules(self) -> list[tuple[str, set[str]]]:
        """Each rule as DuckDB renders it (exactly one expression, comments gone) and the columns it reads.
        Parsed once, on the main thread: parse_rule uses DuckDB's default connection, which the
        unit threads cannot share."""
        return [(str(duckdb.SQLExpression(rule.expr)), parse_rule(rule)) for rule in self.rules]


def plan_id(record: dict) -> str:
    """Names a plan in every rank's stats, so stats of another (older) plan in the folder are ignored."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def make_plan(config: FilterConfig, connection: duckdb.DuckDBPyConnection, writable: Path | None = None) -> Plan:
    """Find and check the inputs, and lock ``connection`` down to them (and writes to ``writable``, by
    default the output folder) before any rule is bound."""
    rules = preset_rules(config.presets, config.where)
    for rule in rules:
        parse_rule(rule)
    renames = parse_renames(config.rename)
    scores = [ScoreSpec.parse(text) for text in config.scores]
    if scores and not config.embeddings:
        raise LaionkitError(
            "--score needs --embeddings (the CLIP image embeddings the scores are computed from)"
        )
    if config.unit_rows < 1:
        raise LaionkitError(f"--unit-rows must be >= 1, got {config.unit_rows}")
    if config.dedup_bucket_rows < 1:
        raise LaionkitError(f"--dedup-bucket-rows must be >= 1, got {config.dedup_bucket_rows}")
    if config.threads is not None and config.threads < 1:
        raise LaionkitError(f"--threads must be >= 1, got {config.threads}")
    locations = find_inputs(config.inputs, storage.parse_storage_options(config.storage_options))
    npys = match_embeddings(locations, embeddings_by_number(
        config.embeddings, storage.parse_storage_options(config.storage_options))) if config.embeddings else {}
    files, bad, versions_of = [], [], {}
    for location in locations:
        try:
            footer, version = read_footer(location)
        except LaionkitError as error:
            if not config.skip_bad:
                raise
            bad.append({"path": str(location), "error": str(error)})
            continue
        meta = footer.metadata
        rows = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        npy = npys.get(location)
        layout = check_embeddings(npy, location, meta.num_rows) if npy is not None else None
        files.append(InputFile(str(location), meta.num_rows, rows, footer.schema_arrow, npy and str(npy),
                               None if location.local else location, layout))
        versions_of[str(location)] = version
    if not files:
        raise LaionkitError(f"every input is unreadable: {'; '.join(b['error'] for b in bad)}")
    for location in {file.location.protocol: file.location for file in files if file.location}.values():
        storage.register_with_duckdb(connection, location)  # one fsspec filesystem per protocol
    lock_down(connection, [f.path for f in files], writable or Path(config.output))
    check_columns(files, rules, renames, scores, config.dedup, connection)
    tops = [top_rule(spec, files, renames, scores, connection) for spec in top_specs(config.presets, config.top)]
    rules += [rule for rule, _ in tops]
    units = make_units(files, config.unit_rows)
    uses_clip = any(spec.kind == "prompt" for spec in scores)
    record = {
        "inputs": [
            {"path": f.path, "rows": f.rows, "row_groups": len(f.row_group_rows), "embeddings": f.embeddings,
             **versions_of[f.path]}
            for f in files
        ],
        "bad_inputs": bad,
        "units": [[u.file, u.start, u.stop, u.rows] for u in units],
        "rules": [asdict(rule) for rule in rules],
        "scores": [asdict(spec) for spec in scores],
        "clip": [config.clip_model, config.clip_pretrained] if uses_clip else None,
        "rename": renames,
        "dedup": config.dedup,
    }
    if tops:  # only then, so plans of folders filtered before --top existed stay equal
        record["top"] = [found for _, found in tops]
    return Plan(files, bad, units, rules, scores, renames, record,
                labels={rule.expr: found["rule"] for rule, found in tops})


def top_rule(spec: TopSpec, files: Sequence[InputFile], renames: dict[str, str], scores: Sequence[ScoreSpec],
             connection: duckdb.DuckDBPyConnection) -> tuple[Rule, dict]:
    """``--top``: the threshold that keeps exactly floor(FRACTION x N) of the N input rows whose COLUMN has
    a value (null and NaN are never kept), as a plain rule every rank evaluates alike.

    Every rank reads COLUMN of every input (only that column) and derives the same threshold, so no rank
    waits for another. Ties: rows are ranked by value, then by input order (file order, then row), so
    among rows equal to the threshold value the earlier ones are kept, and the count is exact."""
    if spec.column.lower() in {s.name.lower() for s in scores}:
        raise LaionkitError(f"{spec.source} {spec.fraction}:{spec.column}: a --score column is computed per unit; "
                            "--top needs a column of the input files")
    selects, base = [], 0
    numeric = True
    floats = False
    for file in files:
        names = [renames.get(name, name) for name in file.schema.names]
        present = {name.lower(): original for name, original in zip(names, file.schema.names)}
        aliased = alias_names(names)
        target = present.get(spec.column.lower()) or (
            file.schema.names[names.index(aliased[spec.column.lower()])] if spec.column.lower() in aliased else None)
        if target is None:
            raise LaionkitError(f"{spec.source} {spec.fraction}:{spec.column}: {file.path} has no such column; "
                                f"available columns: {', '.join(names)}")
        kind = file.schema.field(target).type
        numeric = numeric and (pa.types.is_integer(kind) or pa.types.is_floating(kind))
        floats = floats or pa.types.is_floating(kind)
        if not numeric:
            raise LaionkitError(f"{spec.source} {spec.fraction}:{spec.column}: {file.path} holds {kind}; "
                                "--top ranks a number column")
        selects.append(f"SELECT {quote(target)}::DOUBLE AS v, file_row_number + {base} AS pos "
                       f"FROM read_parquet({literal(glob_literal(file.path))}, file_row_number = true)")
        base += file.rows
    valid = "v IS NOT NULL" + (" AND NOT isnan(v)" if floats else "")
    pool = f"(SELECT * FROM ({' UNION ALL '.join(selects)}) WHERE {valid})"
    [(rows,)] = connection.execute(f"SELECT count(*) FROM {pool}").fetchall()
    keep = math.floor(Fraction(spec.fraction) * rows)
    column = quote(spec.column)
    found = {"rule": spec.label, "source": spec.source, "fraction": spec.fraction, "column": spec.column,
             "pool_rows": rows, "kept": keep, "threshold": None, "ties_kept_through": None}
    if keep == 0:
        expr = f"{column} IS NULL AND false"
    elif keep == rows:
        expr = f"{column} IS NOT NULL"
    else:
        [(threshold,)] = connection.execute(f"SELECT v FROM {pool} ORDER BY v DESC LIMIT 1 OFFSET {keep - 1}").fetchall()
        value = f"CAST({literal(repr(float(threshold)))} AS DOUBLE)"
        [(above,)] = connection.execute(f"SELECT count(*) FROM {pool} WHERE v > {value}").fetchall()
        [(last,)] = connection.execute(
            f"SELECT pos FROM {pool} WHERE v = {value} ORDER BY pos LIMIT 1 OFFSET {keep - above - 1}").fetchall()
        found.update(threshold=float(threshold), ties_kept_through=int(last))
        expr = f"({column}::DOUBLE > {value} OR ({column}::DOUBLE = {value} AND __laionkit_gpos <= {int(last)}))"
    return Rule(expr, spec.source), found


def renamed_schema(schema: pa.Schema, renames: dict[str, str], scores: Sequence[ScoreSpec]) -> pa.Schema:
    names = [renames.get(name, name) for name in schema.names]
    taken = {name.lower() for name in names}
    for spec in scores:
        if spec.name.lower() in taken:
            raise LaionkitError(f"--score {spec.name}: the input already has a column named {spec.name}")
        taken.add(spec.name.lower())
    fields = [schema.field(i).with_name(name) for i, name in enumerate(names)]
    # pandas' metadata describes the input frame (its index, its names); it would mislead on the output.
    metadata = {k: v for k, v in (schema.metadata or {}).items() if k != b"pandas"}
    return pa.schema(
        fields + [pa.field(spec.name, pa.float32()) for spec in scores], metadata=metadata or None
    )


def check_columns(
    files: Sequence[InputFile],
    rules: Sequence[Rule],
    renames: dict[str, str],
    scores: Sequence[ScoreSpec],
    dedup: str | None,
    connection: duckdb.DuckDBPyConnection,
) -> None:
    """Bind every rule against every distinct input schema before anything is written: all rules in one
    DESCRIBE (one bind of the footer), and rule by rule only to name the one that fails."""
    for old in renames:
        if not any(old in f.schema.names for f in files):
            raise LaionkitError(f"--rename {old}=...: no input has a column {old!r}")
    seen: set[pa.Schema] = set()
    for file in files:
        check_names(file, renames, scores)
        schema = renamed_schema(file.schema, renames, scores)
        if schema in seen:
            continue
        seen.add(schema)
        available = ", ".join(schema.names)
        if dedup is not None and dedup not in schema.names:
            raise LaionkitError(
                f"--dedup {dedup}: {file.path} has no such column; available columns: {available}"
            )
        relation = empty_relation(file, renames, scores)

        def kinds(checked: Sequence[Rule], relation: str = relation) -> list[str]:
            exprs = ", ".join(f"({duckdb.SQLExpression(rule.expr)})" for rule in checked)  # one expression each
            return [row[1] for row in connection.execute(f"DESCRIBE SELECT {exprs} FROM ({relation})").fetchall()]

        try:
            all_kinds = kinds(rules) if rules else []
        except duckdb.Error:
            all_kinds = []
            for rule in rules:
                try:
                    all_kinds += kinds([rule])
                except duckdb.Error as error:
                    message = str(error).splitlines()[0]
                    raise LaionkitError(
                        f"{rule.source} {rule.expr!r} on {file.path}: {message}; available columns: {available}"
                    ) from None
        for rule, kind in zip(rules, all_kinds):
            if kind != "BOOLEAN":
                raise LaionkitError(f"{rule.source} {rule.expr!r} is not a true/false test (it gives {kind})")


def check_names(file: InputFile, renames: dict[str, str], scores: Sequence[ScoreSpec]) -> None:
    """Refuse names DuckDB would silently change or that collide with the SQL built here: two columns
    one name apart only in case (DuckDB would write the second as ``URL_1``) and laionkit's own prefix."""
    sources = {**{name: renames.get(name, name) for name in file.schema.names},
               **{f"--score {spec.name}": spec.name for spec in scores}}
    seen: dict[str, str] = {}
    for source, name in sources.items():
        for checked in (source, name):
            if checked.lower().startswith(INTERNAL_PREFIX):
                raise LaionkitError(f"{file.path}: column name {checked!r} is reserved (prefix {INTERNAL_PREFIX})")
        if name.lower() in seen:
            raise LaionkitError(
                f"{file.path}: columns {seen[name.lower()]!r} and {source!r} would both be named {name!r} "
                "(DuckDB matches names ignoring case); choose another --rename"
            )
        seen[name.lower()] = source


def empty_relation(file: InputFile, renames: dict[str, str], scores: Sequence[ScoreSpec]) -> str:
    """SQL for a unit's columns as rules see them (renamed, score columns, alias names), with no rows.

    DuckDB reads only the file's footer for it, and no pandas import (an arrow table would cost one)."""
    output = [renames.get(name, name) for name in file.schema.names] + [spec.name for spec in scores]
    columns = [f"{quote(name)} AS {quote(renames.get(name, name))}" for name in file.schema.names]
    columns += [f"NULL::FLOAT AS {quote(spec.name)}" for spec in scores]
    aliases = "".join(f", {quote(name)} AS {quote(alias)}" for alias, name in alias_names(output).items())
    source = f"read_parquet({literal(glob_literal(file.path))})"
    return f"SELECT *{aliases} FROM (SELECT {', '.join(columns)} FROM {source} LIMIT 0)"


# ----------------------------------------------------------------------------------------- the work


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def nullable(name: str) -> str:
    """The column as written. DuckDB would mark a column NOT NULL when the input's statistics show no
    nulls, so parts of one run would get different schemas; a CASE it cannot fold keeps them nullable."""
    return f"CASE WHEN __laionkit_row >= 0 THEN {quote(name)} END AS {quote(name)}"


@dataclass
class RuleCounts:
    """Per rule: rows it rejected (false) and rows it could not test (null / NaN), counted independently."""

    dropped: int = 0
    nulls: int = 0


class UnitFilter:
    """Filters one unit into one part file with two DuckDB queries over the parquet file itself: per-rule
    counts (reads only the rule columns), then ``COPY (SELECT ... WHERE all rules)``, which decodes the
    other columns only for surviving rows (late materialisation) and streams them to the part file.

    One UnitFilter (one cursor of the run's DuckDB database) filters one unit at a time; ``run`` keeps
    several busy."""

    def __init__(self, plan: Plan, scorers: list[Scorer], skip_bad: bool, dedup: Dedup | None,
                 connection: duckdb.DuckDBPyConnection):
        self.plan = plan
        self.scorers = scorers
        self.rules = plan.parsed_rules  # parsed on the thread that builds the workers
        self.skip_bad = skip_bad
        self.dedup = dedup
        self.connection = connection
        # A session setting, so one per cursor. Else DuckDB assumes a parquet float column holds no NaN
        # beyond its min/max statistics (which writers compute without NaN) and folds isnan() to false:
        # NaN scores would pass `>=` rules.
        self.connection.execute("SET parquet_can_have_nan = true").fetchall()

    def source_sql(self, unit: Unit, file: InputFile, via_arrow: bool) -> tuple[str, list[str]]:
        """A query yielding the unit's rows: renamed input columns, score columns, alias columns.

        ``via_arrow``: the unit is read by pyarrow and scanned from memory instead, for files whose
        string columns hold bytes that are not UTF-8 (DuckDB's parquet reader refuses them; pyarrow
        and DuckDB's arrow scan pass them through untouched). Costs one unit of memory.
        """
        if via_arrow:
            table = file.open().read_row_groups(range(unit.start, unit.stop), use_threads=True)
            rows = pa.array(np.arange(unit.offset, unit.offset + table.num_rows))
            self.connection.register("unit_rows", table.append_column("__laionkit_row", rows))
            source = "SELECT * FROM unit_rows"
        else:
            whole = unit.start == 0 and unit.stop == len(file.row_group_rows)
            rows = (
                ""
                if whole
                else f" WHERE file_row_number BETWEEN {unit.offset} AND {unit.offset + unit.rows - 1}"
            )
            source = (
                f"SELECT *, file_row_number AS __laionkit_row "
                f"FROM read_parquet({literal(glob_literal(file.path))}){rows}"
            )
        if self.scorers:
            self.connection.register("unit_scores", self.unit_scores(unit, file))
            source = f"SELECT * FROM ({source}) POSITIONAL JOIN unit_scores"
        output = [self.plan.renames.get(name, name) for name in file.schema.names] + [
            s.spec.name for s in self.scorers
        ]
        columns = [
            f"{quote(name)} AS {quote(self.plan.renames.get(name, name))}" for name in file.schema.names
        ]
        columns += [quote(s.spec.name) for s in self.scorers] + ["__laionkit_row"]
        columns.append(f"__laionkit_row + {self.plan.bases[unit.file]} AS __laionkit_gpos")  # --top's input order
        columns += [f"{quote(name)} AS {quote(alias)}" for alias, name in alias_names(output).items()]
        return f"SELECT {', '.join(columns)} FROM ({source})", output

    def unit_scores(self, unit: Unit, file: InputFile) -> pa.Table:
        embeddings = file.embeddings_layout.rows(unit.offset, unit.offset + unit.rows)
        return pa.table({s.spec.name: score_embeddings(s, embeddings, file.embeddings) for s in self.scorers})

    def tested_rules(self, file: InputFile) -> tuple[list[str], str]:
        """Each rule as SQL that is null where a float column it reads is NaN (NaN fails a rule, as
        null does; DuckDB orders NaN above every number, so ``NaN >= 5`` would otherwise pass), and
        the same AND-ed as a plain WHERE, which DuckDB pushes into the parquet scan (late decoding)."""
        schema = renamed_schema(file.schema, self.plan.renames, self.plan.scores)
        floats = {f.name.lower() for f in schema if pa.types.is_floating(f.type)}
        floats |= {alias for alias, name in alias_names(schema.names).items() if name.lower() in floats}
        tested, keep = [], []
        for rule, columns in self.rules:
            nan_columns = sorted(name for name in columns if name.lower() in floats)
            keep.append(f"({rule})")
            if nan_columns:
                test = " OR ".join(f"isnan({quote(name)})" for name in nan_columns)
                tested.append(f"CASE WHEN {test} THEN NULL ELSE ({rule}) END")
                keep += [f"coalesce(NOT isnan({quote(name)}), true)" for name in nan_columns]
            else:
                tested.append(f"({rule})")
        return tested, " AND ".join(keep) or "true"

    def run(self, unit: Unit, part: Location, progress: tqdm) -> dict:
        file = self.plan.files[unit.file]
        started = time.perf_counter()
        if self.dedup and (message := self.dedup.bad(unit)):  # unreadable in phase 1 (--skip-bad)
            progress.update(unit.rows)
            return self.record_bad_unit(unit, part, file, message)
        try:
            with storage.atomic_write(part, staging=self.plan.staging) as tmp:
                try:
                    stats = self.write_unit(unit, file, tmp, via_arrow=ROW_NUMBER in file.schema.names)
                except duckdb.InvalidInputException as error:
                    if "string encoding" not in str(error):
                        raise
                    stats = self.write_unit(unit, file, tmp, via_arrow=True)
        except duckdb.Error as error:
            bug = isinstance(error, duckdb.ProgrammingError) and not isinstance(error, duckdb.InvalidInputException)
            if bug or isinstance(error, duckdb.PermissionException):
                raise  # the SQL or sandbox built here, not bad data (a corrupt page is InvalidInput): traceback
            message = str(error).splitlines()[0]
            if not self.skip_bad:
                raise LaionkitError(
                    f"{file.path}: cannot read row groups {unit.start}-{unit.stop - 1}: {message}"
                ) from None
            return self.record_bad_unit(unit, part, file, message)
        finally:
            progress.update(unit.rows)
        return {**stats, "seconds": round(time.perf_counter() - started, 3)}

    def write_unit(self, unit: Unit, file: InputFile, tmp: Path, via_arrow: bool) -> dict:
        """Count per rule, then COPY the kept rows to ``tmp`` with the unit's stats in the footer."""
        stats = {
            "unit": unit.index,
            "input": file.path,
            "row_groups": [unit.start, unit.stop],
            "rows_in": unit.rows,
        }
        source, output = self.source_sql(unit, file, via_arrow)
        rules, where = self.tested_rules(file)
        keep = " AND ".join(f"__laionkit_r{i}" for i in range(len(rules))) or "true"  # null: not kept
        tested = (
            f"(SELECT {', '.join(f'{rule} AS __laionkit_r{i}' for i, rule in enumerate(rules))}"
            f"{', ' if rules else ''}* FROM ({source}))"
        )
        # count(r) = rows where r is not null, count_if(r) = rows where r is true: plain aggregates, about
        # twice as fast as count(*) FILTER (WHERE ...) pairs.
        # Rows kept need no count here: COPY returns it (a count_if of all rules costs a third of this scan).
        counts = ["count(*)"] + [f"count(__laionkit_r{i}), count_if(__laionkit_r{i})" for i in range(len(rules))]
        if self.dedup:
            counts.append(f"count_if({keep} AND {quote(self.dedup.column)} IS NULL)")
        row = [value or 0 for value in  # count_if over no rows is NULL
               self.connection.execute(f"SELECT {', '.join(counts)} FROM {tested}").fetchall()[0]]
        total = row[0]
        stats["rules"] = {
            self.plan.labels.get(rule.expr, rule.expr): asdict(RuleCounts(dropped=row[1 + 2 * i] - row[2 + 2 * i], nulls=total - row[1 + 2 * i]))
            for i, rule in enumerate(self.plan.rules)
        }
        kept = f"({source}) WHERE {where}"  # the rows passing: keep == where, row for row
        if self.dedup:  # phase 3: the rows phase 2 found taken by an earlier position are left out
            column = quote(self.dedup.column)
            [(dropped,)] = self.connection.execute(f"SELECT count(*) FROM ({self.dedup.dropped(unit)})").fetchall()
            stats["rules"][f"dedup({self.dedup.column})"] = asdict(RuleCounts(dropped, row[-1]))
            selected = (
                f"SELECT {', '.join(map(nullable, output))} FROM {kept} AND {column} IS NOT NULL "
                f"AND __laionkit_row NOT IN ({self.dedup.dropped(unit)}) ORDER BY __laionkit_row"
            )
        else:
            selected = f"SELECT {', '.join(map(nullable, output))} FROM {kept}"
        metadata = literal(json.dumps(stats))  # rows_out is the part's row count (unit_stats_from_part)
        options = f"FORMAT parquet, KV_METADATA {{{literal(STATS_KEY)}: {metadata}}}"
        [(written,)] = self.connection.execute(f"COPY ({selected}) TO {literal(str(tmp))} ({options})").fetchall()
        return {**stats, "rows_out": written}

    def record_bad_unit(self, unit: Unit, part: Location, file: InputFile, message: str) -> dict:
        """--skip-bad: an empty part marks the unit done; its footer says why, so the skip is counted."""
        stats = {
            "unit": unit.index,
            "input": file.path,
            "row_groups": [unit.start, unit.stop],
            "rows_in": 0,
            "rules": {},
            "bad": message,
            "bad_rows": unit.rows,
        }
        schema = renamed_schema(file.schema, self.plan.renames, self.plan.scores)
        with storage.atomic_write(part, staging=self.plan.staging) as tmp, pq.ParquetWriter(tmp, schema) as writer:
            writer.add_key_value_metadata({STATS_KEY: json.dumps(stats)})
        return {**stats, "rows_out": 0}


# ------------------------------------------------------------------------------------------ the folder


def existing_parts(output: Location) -> dict[int, Location]:
    """Finished parts (in an object store: those with their done record)."""
    parts = {}
    for path in output.list("part-*.parquet"):
        match = PART_NAME.match(path.name)
        if match:
            parts[int(match.group(2))] = path
    return parts


def unit_stats_from_part(path: Location) -> dict:
    """A finished unit's stats: the counts its footer records, and its rows kept, which the part holds."""
    with path.open_read(block_size=2**20) as handle:
        footer = pq.read_metadata(handle)
    metadata = footer.metadata or {}
    if STATS_KEY.encode() not in metadata:
        raise LaionkitError(f"{path}: no laionkit stats in its footer (not written by laionkit filter?)")
    return {**json.loads(metadata[STATS_KEY.encode()]), "rows_out": footer.num_rows}


def plan_location(folder: Location | Path | str) -> Location | None:
    """The folder's plan sidecar (an older folder's JSON one), None when it has none."""
    folder = Location.parse(folder)
    for path in (folder / PLAN_NAME, folder / JSON_PLAN_NAME):
        if path.is_complete() and not path.is_dir():
            return path
    return None


def stats_paths(folder: Location | Path | str) -> list[Location]:
    """The rank stats sidecars of a filter folder (an older folder's ``_stats-*.json``)."""
    folder = Location.parse(folder)
    return (folder / SIDECARS).list(STATS_GLOB) or folder.list(JSON_STATS_GLOB)


def write_sidecar(path: Location, record: dict, plan: Plan, connection: duckdb.DuckDBPyConnection,
                  shared: bool = False) -> None:
    """``record`` in the footer of a parquet file with the columns of a part of the plan's first input and
    no row group (DuckDB writes none for no rows): readers of the folder get the same schema, no row."""
    file = plan.files[0]
    columns = [f"{quote(name)} AS {quote(plan.renames.get(name, name))}" for name in file.schema.names]
    columns += [f"NULL::FLOAT AS {quote(spec.name)}" for spec in plan.scores]
    output = [plan.renames.get(name, name) for name in file.schema.names] + [spec.name for spec in plan.scores]
    source = (f"SELECT {', '.join(columns)}, 0::BIGINT AS __laionkit_row "
              f"FROM read_parquet({literal(glob_literal(file.path))}) LIMIT 0")
    metadata = literal(json.dumps(record, sort_keys=True, default=str))
    with storage.atomic_write(path, shared=shared, staging=plan.staging) as tmp:
        connection.execute(f"COPY (SELECT {', '.join(map(nullable, output))} FROM ({source})) TO {literal(str(tmp))} "
                           f"(FORMAT parquet, KV_METADATA {{{literal(SIDECAR_KEY)}: {metadata}}})").fetchall()


def read_record(path: Location) -> dict:
    """A sidecar record (plan or rank stats; parquet footer or older JSON), or a one-line error naming it."""
    try:
        if path.name.endswith(".parquet"):
            # Read whole (a footer and no row): one GET, and no stale listing cache of an object store
            metadata = pq.read_metadata(pa.BufferReader(path.read_bytes())).metadata or {}
            if SIDECAR_KEY.encode() not in metadata:
                raise ValueError(f"no {SIDECAR_KEY} in its footer")
            record = json.loads(metadata[SIDECAR_KEY.encode()])
        else:
            record = path.read_json()
    except (OSError, ValueError, pa.ArrowException, LaionkitError) as error:
        raise LaionkitError(f"{path}: unreadable ({error}); delete it and rerun the filter") from None
    if not isinstance(record, dict):
        raise LaionkitError(f"{path}: not a laionkit filter record; delete it and rerun the filter")
    return record


def refuse_changed_inputs(plan_path: Location, found: dict, wanted: dict) -> None:
    """An input replaced since the folder was filtered (same path, other size, mtime or footer) would mix
    rows of two files in one output: name it."""
    now = {entry["path"]: entry for entry in wanted["inputs"]}
    for entry in found.get("inputs", []):
        current = now.get(entry.get("path"))
        keys = ("bytes", "mtime_ns", "etag", "footer_sha256")
        if current is not None and any(entry.get(key) != current.get(key) for key in keys):
            raise LaionkitError(f"{entry['path']} changed since {plan_path.parent} was filtered from it "
                                "(size, mtime or footer differ); use --overwrite to redo it, or another --output")


def prepare_output(output: Location, plan: Plan, rank: Rank, overwrite: bool,
                   connection: duckdb.DuckDBPyConnection) -> None:
    """Refuse to mix runs; with --overwrite each rank clears only what it owns (no race between ranks)."""
    plan_path = plan_location(output)
    if (output / LEGACY_PLAN_NAME).is_complete() and not overwrite:
        raise LaionkitError(f"{output} was filtered by an older laionkit ({LEGACY_PLAN_NAME}); "
                            "use --overwrite to redo it, or another --output")
    if plan_path is not None and not overwrite:
        found = read_record(plan_path)
        refuse_changed_inputs(plan_path, found, plan.record)
        refuse_other_settings(plan_path, found, plan.record, "filtered",
                              "use --overwrite to redo it, or another --output")
    try:
        if output.local:
            Path(output.path).mkdir(parents=True, exist_ok=True)
        if overwrite:
            for unit, path in existing_parts(output).items():
                if unit % rank.world_size == rank.rank:
                    path.remove()
            for path in [*(output / SIDECARS).list(STATS_GLOB), *output.list(JSON_STATS_GLOB),
                         *output.list("stats-*.json")]:
                number = re.search(r"-(\d+)\.(json|parquet)$", path.name)
                if number is None or int(number.group(1)) % rank.world_size == rank.rank:
                    path.remove()
            (output / LEGACY_PLAN_NAME).remove()
        write_sidecar(output / PLAN_NAME, plan.record, plan, connection, shared=True)  # the same from every rank
        (output / JSON_PLAN_NAME).remove()  # an older folder's plan, now rewritten as the sidecar
    except OSError as error:
        raise LaionkitError(f"--output {output}: cannot write there ({error.strerror or error})") from None


def part_path(output: Location, rank: Rank, unit: Unit) -> Location:
    return output / f"part-{rank.rank:05d}-{unit.index:06d}.parquet"


def run(config: FilterConfig) -> dict:
    """Filter this rank's units into ``config.output``; return (and write) this rank's stats."""
    started = time.perf_counter()
    rank = resolve_rank(config.rank, config.world_size)
    # One database for the whole run, a cursor per worker: a cursor costs microseconds, a database ~25 ms.
    # A query runs on its calling thread plus the database's threads - 1 background threads.
    options = storage.parse_storage_options(config.storage_options)
    output = Location.parse(config.output, options)
    storage.refuse_overlap([Location.parse(given, options) for given in config.inputs], output, "filter")
    if output.exists() and not output.is_dir():
        raise LaionkitError(f"--output {output} is a file; filter writes a folder of parquet parts")
    storage.claim_output(output, "filter", config.overwrite)
    with tempfile.TemporaryDirectory(prefix="laionkit-filter-", dir=storage._staging(None)) \
            if not output.local else nullcontext() as staging:
        return run_in(config, rank, output, staging, started)


def run_in(config: FilterConfig, rank: Rank, output: Location, staging: str | None, started: float) -> dict:
    """``run`` once the output is known; ``staging``: where parts bound for an object store are written."""
    database = duckdb.connect(config={"threads": 1})
    plan = make_plan(config, database, Path(staging) if staging else None)
    plan.staging = staging
    prepare_output(output, plan, rank, config.overwrite, database)
    clip = ClipChoice(
        config.clip_model, None if config.clip_pretrained.lower() == "none" else config.clip_pretrained
    )
    scorers = [build_scorer(spec, clip) for spec in plan.scores]
    mine = split(plan.units, rank)
    done = existing_parts(output)
    todo = [unit for unit in mine if unit.index not in done]
    if not config.quiet:
        tqdm.write(
            f"laionkit filter: rank {rank.rank}/{rank.world_size}, {len(mine)} of {len(plan.units)} units "
            f"({len(mine) - len(todo)} already done), "
            f"{len(plan.rules)} rules, {len(plan.scores)} scores -> {output}"
        )
    threads = config.threads or available_cpus()
    progress = tqdm(total=sum(u.rows for u in todo), unit="rows", unit_scale=True, disable=config.quiet,
                    desc="filter")
    dedup = None
    if config.dedup is not None:
        from laionkit.dedup import Dedup

        dedup = Dedup(plan, output, config.dedup, config.dedup_bucket_rows, staging)
    if dedup is not None and len(done) < len(plan.units):  # phases 1-2, until every part exists
        workers = [UnitFilter(plan, scorers, config.skip_bad, None, database.cursor()) for _ in range(threads)]
        dedup.prepare(workers, rank, config.dedup_wait, config.overwrite, config.skip_bad)
    with progress:
        filtered = filter_in_parallel(todo, plan, scorers, config, database, threads, output, rank, progress, dedup)
    if dedup is not None:
        dedup.finish(set(existing_parts(output)))
    unit_records = [filtered[u.index] if u.index in filtered else unit_stats_from_part(done[u.index]) for u in mine]
    stats = rank_stats(unit_records, plan, rank, config, time.perf_counter() - started)
    write_sidecar(output / SIDECARS / f"filter-stats-{rank.rank:05d}.parquet", stats, plan, database)
    (output / f"_stats-{rank.rank:05d}.json").remove()  # an older folder's stats of this rank, now rewritten
    return stats


def filter_in_parallel(todo: list[Unit], plan: Plan, scorers: list[Scorer], config: FilterConfig,
                       database: duckdb.DuckDBPyConnection, threads: int, output: Location, rank: Rank,
                       progress: tqdm, dedup: Dedup | None = None) -> dict[int, dict]:
    """Several units at once, one DuckDB thread each: this beats one unit on every thread, whose COPY
    leaves cores idle while its pipeline starts and its writer flushes (10M rows, 2 cores: 1.3 s vs 1.9 s).
    Outputs do not depend on the schedule: each unit writes its own part, in its own row order."""
    parallel = max(1, min(threads, len(todo)))
    idle: queue.SimpleQueue[UnitFilter] = queue.SimpleQueue()
    database.execute(f"SET threads = {threads - parallel + 1}").fetchall()  # + one calling thread per unit
    workers = [UnitFilter(plan, scorers, config.skip_bad, dedup, database.cursor()) for _ in range(parallel)]
    for worker in workers:
        idle.put(worker)

    def filter_unit(unit: Unit) -> dict:
        worker = idle.get()
        try:
            return worker.run(unit, part_path(output, rank, unit), progress)
        finally:
            idle.put(worker)

    with ThreadPoolExecutor(parallel, thread_name_prefix="laionkit-filter") as pool:
        try:
            return dict(zip([unit.index for unit in todo], pool.map(filter_unit, todo)))
        except BaseException:  # a failed unit or Ctrl-C: start no more units, stop the running ones
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.connection.interrupt()
            raise


def rank_stats(units: list[dict], plan: Plan, rank: Rank, config: FilterConfig, seconds: float) -> dict:
    rules: dict[str, RuleCounts] = {}
    for unit in units:
        for name, count in unit["rules"].items():
            total = rules.setdefault(name, RuleCounts())
            total.dropped += count["dropped"]
            total.nulls += count["nulls"]
    return {
        "stage": "filter",
        "plan_id": plan.plan_id,
        "rank": rank.rank,
        "world_size": rank.world_size,
        "units_total": len(plan.units),
        "rows_in": sum(u["rows_in"] for u in units),
        "rows_out": sum(u["rows_out"] for u in units),
        "rows_filtered_now": sum(u["rows_in"] for u in units if "seconds" in u),  # not resumed
        "rules": {name: asdict(count) for name, count in rules.items()},
        "top": plan.record.get("top", []),  # each --top rule's pool, count kept, threshold and tie cut
        "bad_inputs": plan.bad_inputs,
        "bad_units": [
            {"unit": u["unit"], "input": u["input"], "rows": u["bad_rows"], "error": u["bad"]}
            for u in units
            if "bad" in u
        ],
        "seconds": round(seconds, 3),
        "units": units,
        "arguments": asdict(config),
        "versions": versions(),
    }
