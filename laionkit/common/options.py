"""Options written once, on a stage's config dataclass: each field carries its flags and help (``option``),
and the typer command's parameters, the choices a field allows, and the keys `train --config` files and
`laionkit run` recipes accept are all derived from them, so a flag never has a second definition to drift.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Annotated, Any, Literal, NamedTuple, Optional, Union

from laionkit.common.errors import LaionkitError

# Options several commands share (the CLI's RankOption, ... and TrainConfig's fields use these texts).
RANK_HELP = "This process's rank (default: RANK, the Slurm array task's, SLURM_PROCID, else 0)."
WORLD_SIZE_HELP = ("Number of processes (default: WORLD_SIZE, the Slurm array's size, SLURM_NTASKS, else 1). "
                   "Alone in a Slurm array task: the task id is the rank.")
QUIET_HELP = "No progress bar."
ALLOW_INCOMPLETE_HELP = ("Use another stage's output that is not finished (some of its ranks did not run, or were killed) as it is; by default it is refused, naming what is missing.")
STORAGE_HELP = ('JSON options for URL paths, e.g. \'{"endpoint_url": "http://minio:9000"}\' or \'{"s3": {...}, '
                '"hf": {...}}\'; credentials otherwise come from AWS_* / fsspec config.')


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (), type: Any = None,
           argument: bool = False, group: str | None = None) -> Any:
    """A dataclass field that is also a command-line option: its ``help``, its ``flags`` (default: typer's,
    ``--field-name``, and ``--x/--no-x`` for a switch), and ``type`` where the command line parses another
    type than the field holds. ``argument``: the command's positional argument. A field without a default
    is optional on the command line (a --config file may give it); the command checks that it is given.
    ``group``: the --help panel an option is listed in (a concern: Model, Data, ...), so a command of many
    options reads by concern and the grouping lives with the option, not in a list beside it; arguments stay
    in typer's Arguments panel."""
    return dataclasses.field(default=default, metadata={"help": help, "flags": flags, "type": type,
                                                         "argument": argument, "group": group})


def flag(field: dataclasses.Field) -> str:
    """The flag that names ``field`` in messages: its first, else typer's."""
    flags = field.metadata.get("flags") or ()
    return flags[0] if flags else "--" + field.name.replace("_", "-")


@functools.cache
def choices(cls: type) -> dict[str, tuple]:
    """Field name -> the values a ``Literal[...]`` field allows (None first where it is optional)."""
    found = {}
    for name, hint in typing.get_type_hints(cls).items():
        options = hint.__args__ if _is_union(hint) else (hint,)
        literals = [value for part in options if typing.get_origin(part) is Literal for value in part.__args__]
        if literals:
            found[name] = (*([None] if type(None) in options else []), *literals)
    return found


def check_choices(config: Any) -> None:
    """One line naming the flag, the value and the choices, for the first field outside its Literal."""
    allowed_by_name = choices(type(config))
    for field in dataclasses.fields(config):
        allowed = allowed_by_name.get(field.name)
        if allowed is not None and getattr(config, field.name) not in allowed:
            raise LaionkitError(f"{flag(field)} {getattr(config, field.name)!r}: choose from "
                                f"{', '.join(a for a in allowed if a)}")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _cli_type(hint: Any) -> Any:
    """The type typer parses a field as: a Literal's values' type (the field checks the choice, in one line),
    a list for a variadic tuple (a repeatable flag), Optional[...] kept."""
    if typing.get_origin(hint) is Literal:
        return type(hint.__args__[0])
    if typing.get_origin(hint) is tuple and len(hint.__args__) == 2 and hint.__args__[1] is Ellipsis:
        return list[hint.__args__[0]]
    if _is_union(hint):
        inner = [_cli_type(part) for part in hint.__args__ if part is not type(None)]
        if len(inner) == 1:
            return Optional[inner[0]] if type(None) in hint.__args__ else inner[0]  # noqa: UP007 - typer's form
    return hint


def typer_parameters(cls: type) -> list[inspect.Parameter]:
    """One keyword parameter per field of ``cls``, annotated ``Annotated[type, typer.Option(...)]`` (or
    typer.Argument) with the field's default: set as a command function's ``__signature__``, typer builds
    the command from it."""
    import typer

    hints = typing.get_type_hints(cls)
    parameters = []
    for field in dataclasses.fields(cls):
        meta = field.metadata
        kind = meta.get("type") or _cli_type(hints[field.name])
        default = field.default
        if default is dataclasses.MISSING:
            kind, default = Optional[kind], None  # noqa: UP007 - typer's form
        info = (typer.Argument(help=meta["help"]) if meta.get("argument")
                else typer.Option(*meta.get("flags", ()), help=meta["help"], rich_help_panel=meta.get("group")))
        parameters.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=Annotated[kind, info]))
    return parameters


class Key(NamedTuple):
    """What a config-file or recipe key names: a command's parameter, and the flag the key spells ('' for the
    parameter's own name or a positional argument's), ``negates`` for a switch's --no-x."""

    param: Any
    flag: str
    negates: bool


def command_keys(command: Any) -> dict[str, Key]:
    """The keys a YAML / TOML mapping of a command's options may use, each as spelt (``max-steps``,
    ``max_steps``, ``transformer-config``, ``o``, ``latents``): every flag without its dashes and the
    parameter's name, each with dashes and with underscores. ``train --config`` reads these keys,
    `laionkit run` turns a recipe's keys into the flags they spell."""
    keys: dict[str, Key] = {}

    def add(spelling: str, key: Key) -> None:
        for variant in (spelling, spelling.replace("-", "_"), spelling.replace("_", "-")):
            keys[variant] = key

    for param in command.params:
        add(param.name, Key(param, "", False))
    for param in command.params:
        for option in (*param.opts, *param.secondary_opts):
            add(option.lstrip("-"), Key(param, option if option.startswith("-") else "",
                                        option in param.secondary_opts))
    return keys
