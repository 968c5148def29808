"""`laionkit run RECIPE`: the stages (filter, pack, score, dedup, caption, encode, train) chained from one YAML
file, through the real commands.

A recipe is validated whole before any stage runs (unknown stages or options, missing input paths),
because a typo found after an hour of downloading is an hour lost. Each stage is invoked exactly as
`laionkit STAGE ...` would be, so a recipe can always be replayed by hand. A stage whose last run
finished with the same options on the same inputs (the files' sizes and times) is skipped (a
`.laionkit-run/STAGE.json` record in the workdir); any other runs, resuming its own unfinished work and
refusing an input that changed under it, as the stage alone would. Inputs, outputs and the workdir may be URLs (s3://...);
their credentials come from the environment (AWS_*), as for the stages themselves.

A stage runs more than once under names `STAGE@NAME` (`filter@scores:` after `filter:`), because a curation
chain filters by metadata before pack and again by the scores `laionkit score` computes; YAML keys are
unique, so the name is what tells the runs apart (and names the run's record, `.laionkit-run/filter@scores.json`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from laionkit.common import LaionkitError, storage
from laionkit.common.options import command_keys
from laionkit.common.storage import Location

STAGES = ("filter", "pack", "score", "dedup", "caption", "encode", "train")
RECIPE_KEYS = {"workdir", "stages", "description"}
# Keys of a stage that are not options of its command.
INPUT_KEY, LAUNCH_KEY = "input", "launch"


@dataclass(frozen=True)
class Step:
    name: str  # the recipe's key: the stage, or STAGE@NAME for another run of it
    stage: str
    argv: list[str]
    launch: dict[str, Any] | None
    output: str  # a path or URL
    inputs: tuple[str, ...] = ()  # paths or URLs


def _as_list(value: Any) -> list:
    """Recipe values that may repeat (inputs, --where) are written as one value or a list."""
    return value if isinstance(value, list) else [value]


def _argv(stage: str, spec: dict[str, Any], command: Any, where: str) -> list[str]:
    """Stage options as the command line a user would type; unknown keys are refused by name. A key is a
    long flag without its dashes, `-` or `_` alike (options.command_keys, as `train --config` reads them).
    A list is several values of an option that repeats (--where); for any other the last would win."""
    keys = command_keys(command)
    argv = [stage]
    argv += [str(path) for path in _as_list(spec[INPUT_KEY])]
    for key, value in spec.items():
        if key in (INPUT_KEY, LAUNCH_KEY):
            continue
        found = keys.get(str(key).replace("_", "-"))
        if found is None or not found.flag.startswith("--"):
            known = sorted({k.flag[2:] for k in keys.values()
                            if k.flag.startswith("--") and not k.flag.startswith("--no-")})
            raise LaionkitError(f"{where}: `{key}` is not an option of `laionkit {stage}`; known: {', '.join(known)}")
        param, flag = found.param, found.flag
        if getattr(param, "is_flag", False):
            if not isinstance(value, bool):
                raise LaionkitError(f"{where}: `{key}` is a switch; give true or false, not {value!r}")
            if value != param.default:
                argv.append(flag if value else (param.secondary_opts or [flag])[0])
            continue
        if isinstance(value, list) and not getattr(param, "multiple", False):
            raise LaionkitError(f"{where}: `{key}` takes one value, not a list ({json.dumps(value)})")
        for item in _as_list(value):
            argv += [flag, str(item)]
    return argv


def load(path: Path, commands: dict[str, Any],
         variables: dict[str, str] | None = None) -> tuple[Location, list[Step]]:
    """Parse and validate a recipe into (workdir, steps); `{NAME}` is replaced by variable NAME in
    strings, `{workdir}` by the recipe's `workdir:` unless a variable overrides it."""
    if not path.is_file():
        raise LaionkitError(f"recipe not found: {path}")
    try:
        recipe = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise LaionkitError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from None  # one line
    if not isinstance(recipe, dict) or not isinstance(recipe.get("stages"), dict):
        raise LaionkitError(f"{path}: a recipe is a mapping with a `stages:` mapping")
    unknown = set(recipe) - RECIPE_KEYS
    if unknown:
        raise LaionkitError(f"{path}: unknown top-level keys {sorted(unknown)}; known: {sorted(RECIPE_KEYS)}")
    values = {"workdir": str(recipe.get("workdir", ".")), **(variables or {})}
    text = json.dumps(recipe["stages"])
    for name, value in values.items():
        text = text.replace("{" + name + "}", json.dumps(value)[1:-1])
    unset = sorted(set(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", text)))
    if unset:
        raise LaionkitError(f"{path}: " + ", ".join(f"{{{name}}}" for name in unset) + " not given: add "
                            + " ".join(f"--var {name}=VALUE" for name in unset))
    stages = json.loads(text)
    steps, produced = [], []
    for name, spec in stages.items():
        where = f"{path}: stages.{name}"
        stage, at, label = str(name).partition("@")
        if stage not in STAGES:
            raise LaionkitError(f"{path}: unknown stage `{stage}`; stages are {', '.join(STAGES)} "
                                "(STAGE@NAME for another run of one)")
        if at and not label.replace("-", "").replace("_", "").isalnum():
            raise LaionkitError(f"{where}: name `{label}` after `@`: use letters, digits, - or _")
        if not isinstance(spec, dict) or INPUT_KEY not in spec or "output" not in spec:
            raise LaionkitError(f"{where}: needs `input` and `output`")
        for item in _as_list(spec[INPUT_KEY]):
            if not _written_by(str(item), produced) and not Location.parse(str(item)).exists():
                raise LaionkitError(f"{where}: input `{item}` does not exist and no earlier stage writes it")
        steps.append(Step(str(name), stage, _argv(stage, spec, commands[stage], where), spec.get(LAUNCH_KEY),
                          str(spec["output"]), tuple(str(item) for item in _as_list(spec[INPUT_KEY]))))
        produced.append(str(spec["output"]))
    return Location.parse(values["workdir"]), steps


def _written_by(item: str, outputs: list[str]) -> bool:
    """An earlier stage's output folder or a file in it (dedup's `DIR/keep.parquet`)."""
    return any(item == output or item.startswith(output.rstrip("/") + "/") for output in outputs)


def _record_path(workdir: Location, name: str) -> Location:
    return workdir / ".laionkit-run" / f"{name}.json"


def _fingerprint(step: Step) -> str:
    return hashlib.sha256(json.dumps([step.argv, step.launch]).encode()).hexdigest()


# What identifies a file's content in a listing: local files and each object store's fields.
IDENTITY = ("size", "mtime", "ETag", "etag", "LastModified", "md5Hash", "generation")


def _inputs_state(step: Step) -> str:
    """The inputs as a skip sees them: every file under the step's inputs (dot-names, temporaries and
    locks, left out) with its size and modification time or etag. A skip on the record alone took an
    input replaced at the same path (other rows) as done; when this differs the stage runs instead, and
    its own checks decide (filter refuses a changed input, pack a changed shard), its finished units
    resumed as usual."""
    found = []
    for given in step.inputs:
        root = Location.parse(given)
        entries = _local_listing(Path(root.path)) if root.local else _store_listing(root)
        found += [[given, name, *(str(info[key]) for key in IDENTITY if key in info)]
                  for name, info in sorted(entries.items()) if not _hidden(name)]
    return hashlib.sha256(json.dumps(found).encode()).hexdigest()


def _hidden(name: str) -> bool:
    """A dot-name at any depth below the input (``.`` is the input file itself)."""
    return name != "." and any(part.startswith(".") for part in name.split("/"))


def _local_listing(root: Path) -> dict[str, dict]:
    """The files under ``root`` (or ``root`` itself) by path relative to it, with size and mtime."""
    paths = sorted(root.rglob("*")) if root.is_dir() else [root] if root.is_file() else []
    found = {}
    for path in filter(Path.is_file, paths):
        stat = path.stat()
        found[path.relative_to(root).as_posix()] = {"size": stat.st_size, "mtime": stat.st_mtime_ns}
    return found


def _store_listing(root: Location) -> dict[str, dict]:
    """The objects under ``root`` (or ``root`` itself) by key relative to it, with what the store lists."""
    if not root.exists():
        return {}
    if not root.is_dir():
        return {".": root.fs.info(root.path)}
    prefix = root.path.rstrip("/") + "/"
    return {key[len(prefix):]: info for key, info in root.fs.find(root.path, detail=True).items()
            if key.startswith(prefix)}


def _launch_argv(step: Step) -> list[str]:
    """`launch:` keys are `accelerate launch` options in its own spelling (num_processes, multi_gpu...)."""
    argv = [sys.executable, "-m", "accelerate.commands.launch"]
    for key, value in (step.launch or {}).items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False:
            argv += [f"--{key}", str(value)]
    return argv + ["-m", "laionkit.cli", *step.argv]


def command_line(step: Step) -> list[str]:
    """What the step runs, as a user would type it."""
    return _launch_argv(step) if step.launch else ["laionkit", *step.argv]


def _run_step(step: Step, invoke: Callable[[list[str]], None]) -> None:
    if not step.launch:
        invoke(step.argv)
        return
    result = subprocess.run(_launch_argv(step))
    if result.returncode != 0:
        raise LaionkitError(f"`accelerate launch` exited with {result.returncode}")


def check_options(step: Step, configure: Callable[[list[str]], None]) -> None:
    """``run --dry-run``: the step's command builds its stage's config (``configure``), so an option the stage
    refuses fails the dry run, not the real one after the stages before it ran for hours."""
    try:
        configure(step.argv)
    except LaionkitError as error:
        raise LaionkitError(f"stage `{step.name}` would fail: {error}; nothing run") from None


def until(steps: list[Step], name: str | None) -> list[Step]:
    """The steps up to and including the one named ``name`` (its recipe key: a stage, or STAGE@NAME); None: all."""
    if name is None:
        return steps
    names = [step.name for step in steps]
    if name not in names:
        raise LaionkitError(f"--until {name}: the recipe's stages are {', '.join(names)}")
    return steps[:names.index(name) + 1]


def execute(steps: list[Step], workdir: Location, invoke: Callable[[list[str]], None],
            echo: Callable[[str], None]) -> None:
    """Run the steps in order; `invoke` runs one laionkit command in-process and raises LaionkitError."""
    for step in steps:
        record, inputs = _record_path(workdir, step.name), _inputs_state(step)
        if record.is_complete() and record.read_json().get("fingerprint") == _fingerprint(step) \
                and record.read_json().get("inputs") == inputs and Location.parse(step.output).exists():
            echo(f"[{step.name}] complete with these options; skipped ({record})")
            continue
        echo(f"[{step.name}] {shlex.join(command_line(step))}")
        start = time.perf_counter()
        try:
            _run_step(step, invoke)
        except LaionkitError as error:
            raise LaionkitError(f"stage `{step.name}` failed: {error}; later stages not run") from None
        storage.write_json(record, {"fingerprint": _fingerprint(step), "inputs": inputs, "argv": step.argv,
                            "seconds": round(time.perf_counter() - start, 2)})
