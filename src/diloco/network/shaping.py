"""Emulated slow links for the real runtime: the simulator's link model on the real clock.

Each direction is a FIFO: a message waits for the ones ahead of it, takes size/bandwidth to cross (a
token bucket of one message's depth) and lands `latency` later. The sender computes when its message
lands and a delivery queue hands it over then, so later messages are not held up by earlier ones'
latency. With no shaping, messages land at once. Bytes are counted either way.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Generic, TypeVar

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.network.links import Direction

T = TypeVar("T")


class ShapedDirection:
    """One direction of a learner's link; thread-safe."""

    def __init__(self, bandwidth_mbit: float | None, latency_ms: float = 0.0) -> None:
        self.shaped = bandwidth_mbit is not None
        self._model = Direction((bandwidth_mbit or 1.0) * 1e6, latency_ms / 1e3)
        self._lock = threading.Lock()

    def send(self, nbytes: int, now: float | None = None) -> float:
        """Queue `nbytes` on the link now; return the `clock.monotonic()` at which they have arrived."""
        now = clock.monotonic() if now is None else now
        with self._lock:
            if not self.shaped:
                self._model.record(nbytes)
                return now
            return self._model.send(now, nbytes)

    @property
    def bytes_sent(self) -> int:
        return self._model.bytes_sent

    @property
    def messages(self) -> int:
        return self._model.messages

    @property
    def peak_message_bytes(self) -> int:
        return self._model.peak_message_bytes


class DeliveryQueue(Generic[T]):
    """Items that become available at given monotonic times; thread-safe."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, at: float, item: T) -> None:
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._order), item))
            self._cond.notify_all()

    def ready(self, now: float | None = None) -> list[T]:
        """Every item whose time has come, in order; never blocks."""
        now = clock.monotonic() if now is None else now
        out = []
        with self._cond:
            while self._heap and self._heap[0][0] <= now:
                out.append(heapq.heappop(self._heap)[2])
        return out

    def get(self, timeout: float | None = None) -> T | None:
        """The next item once its time has come; None if the queue is closed and empty, or on timeout."""
        deadline = None if timeout is None else clock.monotonic() + timeout
        with self._cond:
            while True:
                now = clock.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                if self._closed and not self._heap:
                    return None
                wait = self._heap[0][0] - now if self._heap else None
                if deadline is not None:
                    if now >= deadline:
                        return None
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self._cond.wait(wait)

    def clear(self) -> None:
        """Drop every item, due or not."""
        with self._cond:
            self._heap.clear()

    def close(self) -> None:
        """No more items will come: `get` returns None once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)
