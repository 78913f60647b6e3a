"""Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo under chip failures.

A discrete-event model at datacenter scale (`diloco goodput`), calibrated against the
Decoupled DiLoCo paper's data-parallel row; see docs/goodput.md.
"""

from diloco.goodput.calibrate import Calibration, calibrate
from diloco.goodput.model import GoodputResult, data_parallel_closed_form, simulate, sweep
from diloco.goodput.params import HOURS_PER_YEAR, GoodputParams
from diloco.goodput.policies import Policy

__all__ = [
    "HOURS_PER_YEAR",
    "Calibration",
    "GoodputParams",
    "GoodputResult",
    "Policy",
    "calibrate",
    "data_parallel_closed_form",
    "simulate",
    "sweep",
]
