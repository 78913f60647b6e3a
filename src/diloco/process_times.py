"""Where a process's times count from: the run's time origin, and how long this process has lived.

Kept apart from the learner loop so that the launcher, a syncer and a pre-started spare read them without
importing a training loop.
"""

from __future__ import annotations

import os

from diloco.clock import SYSTEM_CLOCK as clock

ORIGIN_ENV = "DILOCO_RUN_ORIGIN"
"""Unix time at which `diloco run` started, for every child's metrics to share one time axis."""
HANDED_OVER_ENV = "DILOCO_HANDED_OVER_UNIX"
"""Set in a pre-started spare (`launch/spare.py`) as it becomes a learner: the Unix time the launcher handed
it over. This life's start metrics count from then: the process itself started long before."""

_IMPORTED = clock.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was imported), or since
    it was handed over, for a spare that became this learner."""
    if HANDED_OVER_ENV in os.environ:
        return max(0.0, clock.now() - float(os.environ[HANDED_OVER_ENV]))
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return clock.monotonic() - _IMPORTED


def run_origin() -> float:
    """Time 0 of the run's metrics: the launcher's start when there is one, else now."""
    return float(os.environ.get(ORIGIN_ENV, clock.now()))
