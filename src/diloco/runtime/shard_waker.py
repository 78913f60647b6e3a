"""A syncer shard's one background thread: it wakes the core at the times the core asked for (its Timer
actions: a round's bound, a liveness check) and has the shard's state saved now and then.

It holds no decision: when to wake is the core's, what a wake does is the shard's (`on_time`).
"""

from __future__ import annotations

import heapq
import threading
from typing import Callable

from diloco.clock import SYSTEM_CLOCK, Clock


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
        if due:
            self.on_time(now)
        if self.on_save is not None and now >= self._next_save:
            self._next_save = now + self.save_every_s
            self.on_save(now)

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
