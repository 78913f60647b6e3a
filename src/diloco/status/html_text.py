"""How the status page writes values: escaped text, thousands-separated numbers, durations, ids in
numeric order. Every string taken from a snapshot goes through `esc`."""

from __future__ import annotations

import html
import math
import re
from typing import Any


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def int_key(key: Any) -> tuple[int, Any]:
    """Sort numeric ids numerically ("10" after "9"), anything else after them."""
    try:
        return (0, int(key))
    except (TypeError, ValueError):
        return (1, str(key))


def number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:,.0f}" if value == int(value) else f"{value:,.2f}"
    return str(value)


def duration(seconds: Any) -> str:
    """12.3 -> '12.3 s', 125 -> '2 m 05 s', 3725 -> '1 h 02 m'."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "—"
    if not math.isfinite(s) or s < 0:
        return "—"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} m {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} m"


def ago(seconds: Any) -> str:
    d = duration(seconds)
    return d if d == "—" else f"{d} ago"


def slug(text: Any) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def as_float(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
