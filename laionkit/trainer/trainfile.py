"""`laionkit train --config FILE`: the train flags of a run kept in a YAML or TOML file.

Keys are the flag names (``max-steps``, ``transformer``) or TrainConfig's field names (``max_steps``,
``unet``), with or without the leading dashes; values are what the flag takes (a list for a repeatable
flag such as ``stage``; ``latents`` for the positional argument). Flags given on the command line
override the file, so one file serves many runs (``--resume latest``, another ``--output``). An unknown
key is an error naming it and the file: a misspelt key silently ignored would train with the default.
"""

from __future__ import annotations

from pathlib import Path

from laionkit.common import LaionkitError
from laionkit.common.options import command_keys


def read(path: Path) -> dict:
    """The mapping a .yaml / .yml / .toml file holds."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except OSError as error:
        raise LaionkitError(f"--config {path}: cannot read it ({error.strerror or error})") from None
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            found = yaml.safe_load(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            found = tomllib.loads(text)
        else:
            raise LaionkitError(f"--config {path}: a .yaml, .yml or .toml file")
    except LaionkitError:
        raise
    except Exception as error:  # noqa: BLE001 - yaml's and toml's parse errors have no common base
        raise LaionkitError(f"--config {path}: not valid {suffix[1:].upper()}: "
                            f"{' '.join(str(error).split())}") from None
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise LaionkitError(f"--config {path}: holds a {type(found).__name__}, not a mapping of train flags")
    return found


def merge(ctx, options: dict, path: Path | None) -> dict:
    """``options`` (the train command's parameters by name) with the file's values for every parameter
    the command line did not give; each value converted as the flag's own would be."""
    if path is None:
        return options
    keys = command_keys(ctx.command)
    merged = dict(options)
    for key, value in read(path).items():
        found = keys.get(str(key).lstrip("-"))
        if found is None or found.negates or found.param.name not in options:  # --no-x, --config itself
            raise LaionkitError(f"--config {path}: unknown key {key!r} (not a train flag; see laionkit train --help)")
        param, name = found.param, found.param.name
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        if param.multiple and not isinstance(value, list):
            value = [value]
        try:
            merged[name] = None if value is None else param.process_value(ctx, value)
        except Exception as error:  # noqa: BLE001 - the CLI's usage errors (typer vendors click)
            said = error.format_message() if hasattr(error, "format_message") else str(error)
            raise LaionkitError(f"--config {path}: {key}: {' '.join(said.split())}") from None
    return merged
