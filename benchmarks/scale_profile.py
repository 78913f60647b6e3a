"""scale.py --profile: where each shard's CPU went in the window, by Python frame (`diloco.cpu_profile`).

Each shard writes its profile's cumulative counters to a file as it runs (every `cpu_profile.WRITE_EVERY_S`);
the window's shares are the difference of the first snapshot written after the window opens and the first
written after it closes: the same span, up to a quarter of a second later."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from diloco.cpu_profile import PROFILE_ENV, difference

SHOWN = 12
"""Frames printed per shard; the JSON keeps what the snapshots hold."""


def profile_env(work: Path, shard: int, on: bool) -> dict[str, str]:
    return {PROFILE_ENV: str(work / f"shard-{shard}-cpu-profile.json")} if on else {}


def read_profiles(work: Path, shards: int, on: bool, timeout_s: float = 2.0) -> list[dict | None]:
    """Each shard's first snapshot written from now on (None where none came within `timeout_s`, or --profile
    is off)."""
    if not on:
        return [None] * shards
    now, deadline = time.time(), time.monotonic() + timeout_s
    found: list[dict | None] = [None] * shards
    while any(f is None for f in found) and time.monotonic() < deadline:
        for i in range(shards):
            if found[i] is None:
                try:
                    snapshot = json.loads(Path(profile_env(work, i, True)[PROFILE_ENV]).read_text())
                except (OSError, ValueError):
                    continue
                found[i] = snapshot if snapshot["unix"] >= now else None
        time.sleep(0.02)
    return found


def window_profiles(opened: list[dict | None], closed: list[dict | None]) -> list[dict | None]:
    return [None if end is None else difference(end, start) for start, end in zip(opened, closed)]


def print_profiles(console: Any, record: dict) -> None:
    for shard in record.get("per_shard", []):
        profile = shard.get("cpu_profile")
        if not profile:
            continue
        console.print(f"    shard {shard['shard']}: {profile['cpu_s']:.2f} CPU-s sampled in the window, by frame "
                      f"(leaf <- caller):")
        for name, share in profile["leaf"][:SHOWN]:
            console.print(f"      {100 * share:5.1f}%  {name}")
