"""Fit the data-parallel model to the paper's data-parallel row, reproducibly.

The data-parallel row constrains the *total* cost of a failure (detection + restart + rollback
+ checkpoint stalls) much better than its split, so we fit one parameter, ``restart_s``, with the
others held at their reasoned values (see docs/goodput.md for the reasoning and a sensitivity
table). The search is a coarse grid then a golden-section refinement of the RMSE in percentage
points; every evaluation is the same seeded simulation, so the answer is a pure function of the
inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from diloco.errors import DilocoError
from diloco.goodput.model import simulate
from diloco.goodput.params import GoodputParams
from diloco.goodput.policies import Policy
from diloco.goodput.published import PUBLISHED_CHIPS, PUBLISHED_GOODPUT

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class Calibration:
    """The fitted parameters and how well data-parallel then matches its target row."""

    params: GoodputParams
    chips: tuple[int, ...]
    target: tuple[float, ...]
    fitted: tuple[float, ...]
    rmse: float

    def as_dict(self) -> dict[str, object]:
        return {
            "fitted_parameter": "restart_s",
            "restart_s": self.params.restart_s,
            "rmse_points": round(self.rmse, 3),
            "chips": list(self.chips),
            "target_percent": list(self.target),
            "fitted_percent": [round(x, 2) for x in self.fitted],
        }


def data_parallel_fit(
    params: GoodputParams, chips: tuple[int, ...], target: tuple[float, ...]
) -> tuple[float, tuple[float, ...]]:
    """RMSE in percentage points of simulated data-parallel goodput against ``target``, and the values."""
    values = tuple(100.0 * simulate(Policy("data-parallel"), n, params).goodput for n in chips)
    rmse = math.sqrt(sum((v - t) ** 2 for v, t in zip(values, target)) / len(values))
    return rmse, values


def calibrate(
    base: GoodputParams,
    chips: tuple[int, ...] = PUBLISHED_CHIPS,
    target: tuple[float, ...] = PUBLISHED_GOODPUT["data-parallel"],
    low_s: float = 0.0,
    high_s: float = 300.0,
    grid_points: int = 13,
    tolerance_s: float = 0.05,
) -> Calibration:
    """Fit ``restart_s`` in [low_s, high_s] so simulated data-parallel goodput best matches ``target``."""
    base.validate()
    if len(chips) != len(target) or not chips:
        raise DilocoError("calibration needs one target goodput per chip count")
    if not 0.0 <= low_s < high_s or grid_points < 3:
        raise DilocoError("calibration needs 0 <= low < high and at least 3 grid points")

    cache: dict[float, float] = {}

    def loss(restart_s: float) -> float:
        if restart_s not in cache:
            cache[restart_s] = data_parallel_fit(replace(base, restart_s=restart_s), chips, target)[0]
        return cache[restart_s]

    step = (high_s - low_s) / (grid_points - 1)
    grid = [low_s + i * step for i in range(grid_points)]
    best = min(range(grid_points), key=lambda i: loss(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, grid_points - 1)]
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    while b - a > tolerance_s:
        if loss(c) <= loss(d):
            b, d = d, c
            c = b - _GOLDEN * (b - a)
        else:
            a, c = c, d
            d = a + _GOLDEN * (b - a)
    restart_s = round(min((a, b, (a + b) / 2.0, grid[best]), key=loss), 1)
    params = replace(base, restart_s=restart_s)
    rmse, fitted = data_parallel_fit(params, chips, target)
    return Calibration(params=params, chips=tuple(chips), target=tuple(target), fitted=fitted, rmse=rmse)
