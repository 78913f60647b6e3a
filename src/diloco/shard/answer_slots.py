"""Whole answers in flight from one shard at once: what bounds its memory when learners hold different
versions.

A relative answer is made of differences every learner shares (`core/downlink.py`); a whole one is
the fragment's current values in fp32, and each version made whole stays alive until its last byte is
sent. When every push closes its own round (quorum 1), each learner holds a different version, and
sixteen streams would keep sixteen versions of the fragment alive. So a stream takes a slot before it
makes an answer (it cannot know beforehand which kind it gets), gives it back at once for a relative
answer, and keeps it until a whole one is sent.

A slot is never held by a reader that does not read: a whole answer that is not sent within its
deadline (`MIN_SEND_S`, plus its bytes at `MIN_SEND_RATE`) ends its stream. The learner opens the
stream again saying what it holds, and the lost answer is made again (`core.events.StreamOpened`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

WHOLE_ANSWERS_IN_FLIGHT = 2
MIN_SEND_S = 30.0
MIN_SEND_RATE = 4e6
"""Bytes per second: a whole answer slower than this (after `MIN_SEND_S`) frees its slot for others."""
POLL_S = 0.5


def send_deadline_s(nbytes: int) -> float:
    return MIN_SEND_S + nbytes / MIN_SEND_RATE


class AnswerSlots:
    def __init__(self, slots: int = WHOLE_ANSWERS_IN_FLIGHT):
        self._free = threading.Semaphore(slots)

    def take(self, keep_waiting: Callable[[], bool]) -> Slot | None:
        """A slot, once one is free; None when `keep_waiting` turns false first (the stream ended)."""
        while keep_waiting():
            if self._free.acquire(timeout=POLL_S):
                return Slot(self._free)
        return None


class Slot:
    """One slot taken: `release` gives it back, once however often it is called (by the stream, its
    deadline or the RPC's end)."""

    def __init__(self, free: threading.Semaphore):
        self._free = free
        self._lock = threading.Lock()
        self._held = True
        self._passed = False
        self._deadline: threading.Timer | None = None

    def hold_until_sent(self, nbytes: int, on_overrun: Callable[[], None]) -> None:
        """Keep the slot while `nbytes` are sent; past their deadline, call `on_overrun` (end the stream)
        and give the slot back."""
        def overrun() -> None:
            on_overrun()
            self._give_back()
        self._deadline = threading.Timer(send_deadline_s(nbytes), overrun)
        self._deadline.daemon = True
        self._deadline.start()

    def pass_on(self) -> Callable[[], None]:
        """Hand the slot to whatever sends the answer's bytes later (a bulk port's ticket): the stream's
        `release` no longer frees it; the callable returned does, or the deadline."""
        self._passed = True
        return self._give_back

    def release(self) -> None:
        if not self._passed:
            self._give_back()

    def _give_back(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        if self._deadline is not None:
            self._deadline.cancel()
        self._free.release()
