"""The one place the real runtime reads time from (the simulator has its own virtual clock).

Every runtime piece takes a `Clock` (the system's by default) instead of calling `time` itself, so a
test can drive a syncer shard's liveness and timers with a `ManualClock` and wait for conditions,
never for a fixed sleep.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """The system clock: wall time for what crosses machines, monotonic time for durations."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, condition: threading.Condition, timeout: float | None) -> None:
        """Wait on `condition` (held by the caller) at most `timeout` seconds of this clock."""
        condition.wait(timeout)


class ManualClock(Clock):
    """A clock that moves only when told: waits return at once, sleeps advance it."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def wait(self, condition: threading.Condition, timeout: float | None) -> None:
        condition.wait(0.01)  # let other threads run; time itself does not move


SYSTEM_CLOCK = Clock()
