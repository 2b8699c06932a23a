"""Settings errors in the user's words: one line each, naming where the bad value was written and what was meant.

A setting comes from a `CRL_*` variable, from the run config (YAML) or from the command line; pydantic reports a
location in the settings tree (`('actor_trainer', 'gruop_size')`). `explain` turns each error into one line that
names the place a person would go to fix it:

    actor_trainer.gruop_size in configs/x.yaml: unknown key; did you mean group_size?
    CRL_SCHEDULER__ARM: 'complementry' is not one of complementary, grpo, ...; did you mean complementary?

and suggests the closest valid name (`difflib`) for unknown keys and for values that must be one of a list (arms,
backends, env ids and every other choice).
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

Location = tuple[int | str, ...]

ENV_PREFIX = "CRL_"


def closest(given: object, choices: Sequence[str]) -> str | None:
    """The choice `given` most likely meant, or None when none is close."""
    found = difflib.get_close_matches(str(given), list(choices), n=1, cutoff=0.6)
    if not found:
        lowered = {choice.lower(): choice for choice in choices}
        found = difflib.get_close_matches(str(given).lower(), list(lowered), n=1, cutoff=0.6)
        found = [lowered[found[0]]] if found else []
    return found[0] if found else None


def did_you_mean(given: object, choices: Sequence[str]) -> str:
    """"; did you mean X?" for the closest of `choices`, else ""."""
    match = closest(given, choices)
    return f"; did you mean {match}?" if match is not None and match != str(given) else ""


def dotted(location: Location) -> str:
    """`('envs', 'tasks', 0, 'env_id')` as `envs.tasks[0].env_id`."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _variable(location: Location) -> str:
    return ENV_PREFIX + "__".join(str(part) for part in location).upper()


def _in_yaml(data: Any, location: Location) -> bool:
    for part in location:
        listed = isinstance(part, int) and isinstance(data, list) and part < len(data)
        named = isinstance(part, str) and isinstance(data, Mapping) and part in data
        if not (listed or named):
            return False
        data = data[part]
    return True


class Sources:
    """Where each setting of one `Settings(...)` call was written: the environment and the run config."""

    def __init__(self, config: Path | None, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.config = config
        self.data: Any = None
        if config is not None and config.is_file():
            try:
                self.data = yaml.safe_load(config.read_text())
            except (OSError, yaml.YAMLError):
                # Only naming suffers: an unreadable config was already reported by `RunConfigSource`, and
                # without its data each setting is named by its dotted path alone.
                self.data = None

    def where(self, location: Location) -> str:
        """`CRL_X__Y` when a variable set it (the variables win over the file), `x.y in FILE` when the run config
        did, else the setting's dotted name (a default, or a command-line option)."""
        for length in range(len(location), 0, -1):
            head = location[:length]
            if all(isinstance(part, str) for part in head) and _variable(head) in self.environ:
                rest = dotted(location[length:])
                return _variable(head) + (("" if rest.startswith("[") else ".") + rest if rest else "")
        if location and self.data is not None and _in_yaml(self.data, location):
            return f"{dotted(location)} in {self.config}"
        return dotted(location) or "settings"


def _model_at(root: type[BaseModel], location: Location) -> type[BaseModel] | None:
    """The settings model that holds the last part of `location` (None if the path leaves the models)."""
    annotation: Any = root
    for part in location:
        if isinstance(part, int):
            annotation = _item_of(annotation)
            continue
        model = _model_of(annotation)
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
    return _model_of(annotation)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (model := _model_of(arg)) is not None:
                return model
    return None


def _item_of(annotation: Any) -> Any:
    """The item type of a list or tuple annotation (`tuple[TaskMix, ...]`), through an Optional."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        items = [_item_of(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        return next((item for item in items if item is not None), None)
    args = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
    return args[0] if args else None


def _choices(expected: str) -> list[str]:
    """pydantic's "'all', 0 or 1" as ['all', '0', '1']."""
    return [part.strip().strip("'") for part in re.split(r", | or ", expected) if part.strip()]



def _line(item: Mapping[str, Any], root: type[BaseModel], sources: Sources) -> str:
    location: Location = tuple(item["loc"])
    kind = item["type"]
    given = item.get("input")
    where = sources.where(location)
    if kind == "extra_forbidden":
        parent = _model_at(root, location[:-1])
        hint = did_you_mean(location[-1], list(parent.model_fields)) if parent is not None else ""
        return f"{where}: unknown key{hint}"
    if kind in ("literal_error", "enum"):
        choices = _choices(str((item.get("ctx") or {}).get("expected", "")))
        return f"{where}: {given!r} is not one of {', '.join(choices)}{did_you_mean(given, choices)}"
    message = str(item["msg"]).removeprefix("Value error, ").replace("a valid tuple", "a list")
    if not location:  # a rule across settings: each line of its message begins with the setting it is about
        return "\n".join(_named_line(line, sources) for line in message.splitlines())
    if kind == "missing":
        return f"{where}: missing (required)"
    return f"{where}: {message}" + (f" (got {given!r})" if _shows_input(kind, given) else "")


NAMED = re.compile(r"^([a-z_]+(?:\.[a-z_]+|\[\d+\])*): (.*)$")
"""A message line about one setting: `envs.tasks[0].env_id: unknown env id ...`."""


def _named_line(line: str, sources: Sources) -> str:
    """`line`, its setting named where it was written (the variable, or the key in the run config)."""
    match = NAMED.match(line)
    if match is None:
        return line
    location: list[int | str] = []
    for name, index in re.findall(r"([a-z_]+)|\[(\d+)\]", match.group(1)):
        location.append(int(index) if index else name)
    return f"{sources.where(tuple(location))}: {match.group(2)}"


def _shows_input(kind: str, given: object) -> bool:
    return kind != "missing" and isinstance(given, str | int | float | bool)


def explain(exc: ValidationError, config: Path | None, root: type[BaseModel],
            environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per error of `exc`, raised validating `root` from `config` and the environment."""
    sources = Sources(config, environ)
    items = exc.errors(include_url=False)
    # A list whose only item failed is then too short as well: that follows from the item's error, which says more.
    failed = [tuple(item["loc"]) for item in items if item["type"] != "too_short"]
    shown = [item for item in items if item["type"] != "too_short"
             or not any(len(loc) > len(item["loc"]) and loc[:len(item["loc"])] == tuple(item["loc"]) for loc in failed)]
    return [line for item in shown for line in _line(item, root, sources).splitlines()]
