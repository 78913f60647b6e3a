"""The pool of hot spare chips that every policy draws from when a chip fails."""

from __future__ import annotations

from collections import deque


class SparePool:
    """Hot spares shared by the whole job, refilled by repairs.

    A failure retires one chip for ``repair_s``. The failed unit needs a replacement once the
    failure is detected: a free spare arrives after ``swap_s``; with none free, the unit waits for
    the earliest chip still in repair. Repairs finish in the order the chips failed (constant
    ``repair_s``), so a deque of completion times is the whole state.
    """

    def __init__(self, spares: int, swap_s: float, repair_s: float) -> None:
        self.free = spares
        self.swap_s = swap_s
        self.repair_s = repair_s
        self._repairing: deque[float] = deque()

    def replace(self, failed_at: float, needed_at: float) -> float:
        """Retire the chip that failed at ``failed_at``; return when its replacement is in place."""
        self._repairing.append(failed_at + self.repair_s)
        while self._repairing and self._repairing[0] <= needed_at:
            self._repairing.popleft()
            self.free += 1
        if self.free > 0:
            self.free -= 1
            return needed_at + self.swap_s
        return self._repairing.popleft() + self.swap_s
