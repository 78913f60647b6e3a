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
from time import perf_counter
from typing import Callable

from diloco.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger("diloco.syncer")

RETRY_S = 1.0
"""How soon a wake or a save that failed is tried again."""
SAVE_SHARE = 0.05
"""At most this share of the shard's time goes to saving its state (a save holds its lock): the next save
comes the last one's own duration over this after it, within the shard's bounds. A restart replays the
journal since the last save, so a cheap save made often keeps that short."""


class Waker:
    def __init__(self, condition: threading.Condition, on_time: Callable[[float], None],
                 on_save: Callable[[float], None] | None = None, save_every_s: float = 10.0,
                 clock: Clock = SYSTEM_CLOCK, save_min_s: float | None = None) -> None:
        """`condition` wraps the shard's lock: `on_time` and `on_save` run with it held. Saves come at most
        `save_every_s` apart, and as often as `SAVE_SHARE` of the time allows, but not under `save_min_s`
        apart (default: `save_every_s`, a fixed interval)."""
        self.condition, self.on_time, self.on_save = condition, on_time, on_save
        self.save_every_s, self.clock = save_every_s, clock
        self.save_min_s = save_every_s if save_min_s is None else min(save_min_s, save_every_s)
        self._due: list[float] = []
        self._next_save = clock.now() + self.save_min_s
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
            began = perf_counter()  # what the save costs in real time, whatever the clock
            if not self._survive("save", self.on_save, now):
                self._next_save = now + min(RETRY_S, self.save_every_s)
            else:
                cost = perf_counter() - began
                self._next_save = now + min(max(cost / SAVE_SHARE, self.save_min_s), self.save_every_s)

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
