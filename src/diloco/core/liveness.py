"""Who is still alive, judged by silence: the one rule both drivers follow.

A learner is heard from whenever anything of it arrives (a heartbeat, a progress report, a push). It
is dead once it has been silent for longer than its allowance: `detect_s` (failures.detect_s), or
`heartbeats` of its own heartbeat intervals as measured here if those are longer (a learner on a slow
link beats slowly; it is not dead for that). A learner never heard from gets `join_bound_s` from the
start. A dead learner that speaks again is alive again (a partition healed, a stall ended).

Times are the caller's `now`: no clock is read here.
"""

from __future__ import annotations

import heapq

from diloco.core.undo import UndoLog

HEARTBEAT_S = 1.0
"""How often a learner says it is alive, training or waiting (the real runtime's heartbeat thread, the
simulator's heartbeat events)."""
EMA = 0.3
"""Weight of the newest heartbeat interval in the running estimate."""


class Liveness:
    def __init__(self, *, detect_s: float, heartbeats: int = 5, join_bound_s: float = 60.0,
                 undo: UndoLog | None = None) -> None:
        self.undo = undo or UndoLog()
        """Where a change made in a transaction keeps what it replaced (`undo.py`)."""
        self.detect_s, self.heartbeats, self.join_bound_s = detect_s, heartbeats, join_bound_s
        self.started: float | None = None
        self.heard: dict[int, float] = {}
        self.beat_at: dict[int, float] = {}
        self.interval: dict[int, float] = {}
        """Per learner, its heartbeat interval as measured (a running mean)."""
        self._asked: frozenset[int] = frozenset()
        self._deadlines: list[tuple[float, int]] | None = None
        """A heap of the deadlines of the learners last asked about (`next_check`), pushed as they are
        heard; an entry no longer the learner's deadline is dropped when it comes to the top. A check
        then costs the same whatever the number of learners."""

    def start(self, now: float) -> None:
        if self.started is None:
            self.undo.keep_attrs(self, "started", "_deadlines")
            self.started, self._deadlines = now, None

    def hear(self, learner: int, now: float, heartbeat: bool = False) -> None:
        self.start(now)
        self.undo.keep(self.heard, learner)
        if heartbeat:
            self.undo.keep(self.beat_at, learner)
            self.undo.keep(self.interval, learner)
            last = self.beat_at.get(learner)
            if last is not None and now > last:
                old = self.interval.get(learner)
                gap = now - last
                self.interval[learner] = gap if old is None else old + EMA * (gap - old)
            self.beat_at[learner] = now
        self.heard[learner] = max(now, self.heard.get(learner, now))
        if self._deadlines is not None and learner in self._asked:
            heapq.heappush(self._deadlines, (self.deadline(learner), learner))  # left there if undone: stale

    def allowance(self, learner: int) -> float:
        if learner not in self.heard:
            return self.join_bound_s
        return max(self.detect_s, self.heartbeats * self.interval.get(learner, 0.0))

    def deadline(self, learner: int) -> float:
        """When `learner` counts as dead if nothing of it arrives before."""
        since = self.heard.get(learner, self.started if self.started is not None else 0.0)
        return since + self.allowance(learner)

    def silence(self, learner: int, now: float) -> float:
        """How long `learner` has been silent (since the start, if never heard)."""
        return now - self.heard.get(learner, self.started if self.started is not None else now)

    def silent(self, learners: set[int], now: float) -> list[int]:
        """Those of `learners` silent for their whole allowance at `now`."""
        if self.started is None:
            return []
        return sorted(m for m in learners if now >= self.deadline(m))

    def next_check(self, learners: set[int]) -> float | None:
        """The earliest time one of `learners` may be found dead."""
        if self.started is None or not learners:
            return None
        heap = self._deadlines
        if heap is None or self._asked != learners or len(heap) > 4 * len(learners) + 64:
            self.undo.keep_attrs(self, "_deadlines", "_asked")
            self._asked = frozenset(learners)
            heap = self._deadlines = [(self.deadline(m), m) for m in learners]
            heapq.heapify(heap)
        while heap[0][0] != self.deadline(heap[0][1]):  # heard since: a later entry holds its deadline
            dropped = heapq.heappop(heap)
            self.undo.on_undo(lambda dropped=dropped: heapq.heappush(heap, dropped))
        return heap[0][0]

    def refresh(self, now: float) -> None:
        """Everyone counts as heard now (the syncer itself was away: silence says nothing)."""
        self.undo.keep_attrs(self, "started", "heard", "beat_at", "_deadlines")
        self.started, self._deadlines = now, None
        self.heard = dict.fromkeys(self.heard, now)
        self.beat_at = {}

    def state_dict(self) -> dict:
        return {"started": self.started, "heard": dict(self.heard), "beat_at": dict(self.beat_at),
                "interval": dict(self.interval)}

    def load_state_dict(self, state: dict) -> None:
        self.started, self._deadlines = state["started"], None
        self.heard, self.beat_at = dict(state["heard"]), dict(state["beat_at"])
        self.interval = dict(state["interval"])
