"""A syncer shard's one background thread: it wakes the core at the times the core asked for (its Timer
actions: a round's bound, a liveness check) and has the shard's state saved now and then.

It holds no decision: when to wake is the core's, what a wake does is the shard's (`on_time`).

It outlives what its work runs into: a wake or a save that fails (no file descriptors left, a full
disk) is logged in one line and tried again a moment later, so liveness checks and saves resume once
the cause is gone. A thread that died would leave the shard deciding nothing and saving nothing.
"""

from __future__ import annotations

import heapq
import logging
import threading
from typing import Callable

from diloco.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger("diloco.syncer")

RETRY_S = 1.0
"""How soon a wake or a save that failed is tried again."""


class Waker:
    def __init__(self, condition: threading.Condition, on_time: Callable[[float], None],
                 on_save: Callable[[float], None] | None = None, save_every_s: float = 10.0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """`condition` wraps the shard's lock: `on_time` and `on_save` run with it held."""
        self.condition, self.on_time, self.on_save = condition, on_time, on_save
        self.save_every_s, self.clock = save_every_s, clock
        self._due: list[float] = []
        self._next_save = clock.now() + save_every_s
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failures = 0
        """Wakes and saves that failed (each was tried again)."""

    def wake_at(self, at: float) -> None:
        """Call `on_time` at `at` or soon after (with the lock held by the caller)."""
        heapq.heappush(self._due, at)
        self.condition.notify_all()

    def tick(self, now: float) -> None:
        """Do what is due at `now`: one `on_time` for every wake that came due, a save if one is due."""
        due = False
        while self._due and self._due[0] <= now:
            heapq.heappop(self._due)
            due = True
        if due and not self._survive("wake", self.on_time, now):
            heapq.heappush(self._due, now + RETRY_S)
        if self.on_save is not None and now >= self._next_save:
            self._next_save = now + self.save_every_s
            if not self._survive("save", self.on_save, now):
                self._next_save = now + min(RETRY_S, self.save_every_s)

    def _survive(self, what: str, work: Callable[[float], None], now: float) -> bool:
        """Run `work`; on an error, log one line and return False (the caller tries again soon)."""
        try:
            work(now)
            return True
        except Exception as exc:  # noqa: BLE001 — whatever it is, the thread must go on
            self.failures += 1
            log.error("shard %s failed (%s: %s); trying again in %g s", what, type(exc).__name__, exc, RETRY_S)
            return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncer-waker", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        with self.condition:
            self._stopping = True
            self.condition.notify_all()

    def _run(self) -> None:
        with self.condition:
            while not self._stopping:
                now = self.clock.now()
                self.tick(now)
                until = [self._next_save] if self.on_save is not None else []
                until += self._due[:1]
                self.clock.wait(self.condition, max(0.0, min(until) - now) if until else None)
