"""Where a config comes from: defaults, then a TOML file, then `--set key=value` overrides, then the rules.

Every key is checked against the dataclass field types (`typed_fields.py`), then against the sections'
rules (`run_config.validate`). A problem raises `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from diloco.config.failures_section import check_outage_targets
from diloco.config.learners_section import load_learners
from diloco.config.regions_section import load_regions
from diloco.config.run_config import Config, validate
from diloco.config.typed_fields import build_section
from diloco.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file, then each `key=value` override, then validation."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return config_from_dict(raw)


def _read_toml(path: Path) -> dict[str, Any]:
    """The file's TOML; a missing, unreadable, non-UTF-8 or malformed file is a one-line error."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}): TOML files are UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests too deeply to be a config") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value`: the value is read as TOML; a bare word that is not TOML is taken as a string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    text = text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = text
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(raw: dict[str, Any]) -> Config:
    """The config a parsed TOML document describes: sections by their types, then what they imply, then
    the rules (`validate`)."""
    config = build_section(Config, raw, prefix="")
    load_learners(config.learners, raw.get("learners", {}))
    if config.regions:
        load_regions(config.regions, config.link, config.learners, raw)
    check_outage_targets(raw)
    validate(config)
    return config
