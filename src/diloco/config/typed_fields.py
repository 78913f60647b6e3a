"""Sections built from TOML tables by their dataclass field types: every key known, every value of its type
(a Literal one of its choices), else a one-line `ConfigError` that names the key."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from diloco.errors import ConfigError


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a section (a table)")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            where = f"'{prefix}{key}'"
            raise ConfigError(f"unknown config key {where} (known here: {', '.join(sorted(names))})")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        hint = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(hint):
            values[f.name] = build_section(hint, raw[f.name], prefix=key + ".")
        else:
            values[f.name] = coerce(raw[f.name], hint, key)
    return cls(**values)


def coerce(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            named = ", ".join('""' if c == "" else str(c) for c in choices)
            raise ConfigError(f"config key '{key}' must be one of {named}; got {value!r}")
        return value
    if origin in (list, typing.List):
        (item_hint,) = get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, e.g. [1, 1, 0.5]; got {value!r}")
        if dataclasses.is_dataclass(item_hint):
            return [build_section(item_hint, v, prefix=f"{key}[{i}].") for i, v in enumerate(value)]
        return [coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_hint, item_hint = get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a table, e.g. {{name = 1}}; got {value!r}")
        return {coerce(k, key_hint, key): coerce(v, item_hint, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported config type for {key}: {hint}")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false; got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer; got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number; got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string; got {value!r}")
        return value
    raise TypeError(f"unsupported config type for {key}: {hint}")
