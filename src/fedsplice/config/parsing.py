"""TOML tables into config dataclasses: unknown keys and wrong types fail with the dotted field.

`from_dict` walks a table against a dataclass's fields and type hints (Literal choices, lists,
nested dataclasses, finite numbers); `apply_overrides` applies `--set a.b=value` items to the raw
table first, so overrides go through exactly the same checks as the file.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from fedsplice.errors import ConfigError


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: unknown value {value!r}; choose one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{where}: union types are not supported in configs")
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    raise ConfigError(f"{where}: unsupported type {tp}")


# Fields that moved: the old key gets a one-line error naming the new one.
MOVED = {"model.class_prompt": "data.class_prompt", "model.class_prompts": "data.class_prompts"}


def from_dict(cls, table: dict, where: str = ""):
    """Build dataclass `cls` from a TOML table; unknown keys and wrong types are errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        name = unknown[0] if unknown[0].isprintable() else ascii(unknown[0])  # one line, always
        key = f"{where}.{name}" if where else name
        if key in MOVED:
            raise ConfigError(f"{key} moved to {MOVED[key]} (the prompt belongs to the data set); move "
                              f"the line to the [{MOVED[key].split('.')[0]}] table")
        known = f"known fields here: {', '.join(sorted(names))}" if names else "this table takes no fields"
        raise ConfigError(f"{key}: unknown config field; {known}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in table.items()}
    return cls(**kwargs)


def parse_value(text: str) -> Any:
    """A --set value is TOML (numbers, booleans, lists, quoted strings); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(table: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set server.rounds=2")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = table
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is not a table")
        node[parts[-1]] = parse_value(text.strip())
    return table


def read_toml(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass a path to a .toml file "
                          f"(see configs/) or no CONFIG for the embedded default")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
