"""Friendly quantities on the command line: "12B" parameters, "5Gbit" links, "80GiB" shards, "40ms".

Each parser takes the flag's name so that a bad value is refused in one line that names it. Every
value must be finite and positive (latency: zero or positive).
"""

from __future__ import annotations

import math
import re

from diloco.errors import DilocoError

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")

COUNT_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
"""Parameter and token counts: 12B = 12e9 (B for billion, as model sizes are written)."""
BANDWIDTH_SUFFIXES = {"": 1e9, "gbit": 1e9, "gbps": 1e9, "gbit/s": 1e9, "gb/s": 8e9,
                      "mbit": 1e6, "mbps": 1e6, "mbit/s": 1e6, "mb/s": 8e6,
                      "tbit": 1e12, "tbps": 1e12, "tbit/s": 1e12, "kbit": 1e3, "kbps": 1e3, "kbit/s": 1e3}
"""Bits per second; a bare number is Gbit/s. GB/s and MB/s are bytes."""
MEMORY_SUFFIXES = {"": 2**30, "gib": 2**30, "gb": 1e9, "tib": 2**40, "tb": 1e12, "mib": 2**20, "mb": 1e6}
"""Bytes; a bare number is GiB."""
FLOPS_SUFFIXES = {"": 1.0, "t": 1e12, "tflop/s": 1e12, "p": 1e15, "pflop/s": 1e15, "eflop/s": 1e18}
"""FLOP/s: 25P = 25e15; a bare number is FLOP/s."""
TIME_SUFFIXES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0, "h": 3600.0}


def _split(flag: str, text: str) -> tuple[float, str]:
    match = _NUMBER.match(str(text))
    if not match:
        raise DilocoError(f"{flag}: expected a positive number, got {text!r}")
    value = float(match.group(1))
    if not math.isfinite(value):
        raise DilocoError(f"{flag}: must be a finite number, got {text!r}")
    return value, match.group(2).lower()


def _scaled(flag: str, text: str, suffixes: dict[str, float], example: str, allow_zero: bool = False) -> float:
    value, suffix = _split(flag, text)
    if suffix not in suffixes:
        known = ", ".join(s for s in suffixes if s)
        raise DilocoError(f"{flag}: unknown unit {suffix!r} in {text!r} (known: {known}; e.g. {example})")
    scaled = value * suffixes[suffix]
    if not math.isfinite(scaled) or scaled < 0 or (scaled == 0 and not allow_zero):
        raise DilocoError(f"{flag}: must be {'zero or ' if allow_zero else ''}positive and finite, got {text!r}")
    return scaled


def count(flag: str, text: str) -> int:
    """A parameter or token count: 12B, 1.5e12, 350M, 7e9."""
    value = _scaled(flag, text, COUNT_SUFFIXES, "12B")
    if value < 1:
        raise DilocoError(f"{flag}: must be at least 1, got {text!r}")
    return int(round(value))


def integer(flag: str, text: str, minimum: int = 1) -> int:
    """A plain whole number (learners, fragments, H, τ, shards), at least `minimum`."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise DilocoError(f"{flag}: expected a whole number, got {text!r}") from None
    if value < minimum:
        raise DilocoError(f"{flag}: must be at least {minimum}, got {value}")
    return value


def bandwidth_bps(flag: str, text: str) -> float:
    """Bits per second: 5Gbit, 500Mbit, 2.5 (Gbit/s), 1GB/s."""
    return _scaled(flag, text, BANDWIDTH_SUFFIXES, "5Gbit")


def memory_bytes(flag: str, text: str) -> float:
    """Bytes: 80GiB, 512GB, 1TiB, 64 (GiB)."""
    return _scaled(flag, text, MEMORY_SUFFIXES, "80GiB")


def seconds(flag: str, text: str, default_unit: str = "s", allow_zero: bool = False) -> float:
    """A duration: 1.5s, 1500ms, 40 (in `default_unit`)."""
    suffixes = {**TIME_SUFFIXES, "": TIME_SUFFIXES[default_unit]}
    return _scaled(flag, text, suffixes, f"1.5{default_unit}", allow_zero=allow_zero)


def flops(flag: str, text: str) -> float:
    """Effective FLOP/s: 25P, 800T, 2.5e16."""
    return _scaled(flag, text, FLOPS_SUFFIXES, "25P")


def positive(flag: str, text: str) -> float:
    """A plain positive number (cores: 16, 0.5)."""
    return _scaled(flag, text, {"": 1.0}, "16")
