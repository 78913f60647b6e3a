"""The Decoupled DiLoCo paper's simulated goodput (percent), the numbers we calibrate against."""

from __future__ import annotations

PUBLISHED_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)

PUBLISHED_GOODPUT: dict[str, tuple[float, ...]] = {
    "data-parallel": (72, 57, 38, 27, 18),
    "elastic data-parallel": (88, 80, 69, 58, 40),
    "decoupled M=2": (94, 88, 80, 70, 54),
    "decoupled M=4": (96, 93, 89, 82, 73),
    "decoupled M=8": (98, 96, 94, 88, 80),
    "decoupled M=16": (99, 98, 96, 93, 86),
}
"""Keyed by `Policy.label`; chip mean time between interruptions one year, quorum unknown (K=1 assumed)."""


def published(label: str, chips: int) -> float | None:
    """The paper's goodput in percent for this policy and size, or None where it has none."""
    row = PUBLISHED_GOODPUT.get(label)
    if row is None or chips not in PUBLISHED_CHIPS:
        return None
    return float(row[PUBLISHED_CHIPS.index(chips)])
