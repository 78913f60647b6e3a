"""A virtual clock: events in time order, ties broken by the order they were scheduled."""

from __future__ import annotations

import heapq
import itertools
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._counter = itertools.count()
        self.now = 0.0

    def schedule(self, at: float, event: Any) -> None:
        if at < self.now:
            raise ValueError(f"cannot schedule an event at {at} before now ({self.now})")
        heapq.heappush(self._heap, (at, next(self._counter), event))

    def pop(self) -> Any:
        at, _, event = heapq.heappop(self._heap)
        self.now = at
        return event

    def __bool__(self) -> bool:
        return bool(self._heap)
