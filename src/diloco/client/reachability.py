"""When a shard stopped answering a client, and when it answered again, as the client saw it: the last piece
of a shard's outage (after it is restarted and serving, every learner must get through to it again), and the
one a user cannot see from the shard's side. `diloco chaos` puts each learner's figures in its timeline of
every shard kill.

Kept per shard and per kind of call (a push, a heartbeat): a heartbeat gets through within a beat of the
shard's return, a push waits on its retry; the one that carries the learner's progress is the push.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.errors import DilocoError
from diloco.transport.calls import SyncerUnavailable


@dataclass(frozen=True)
class Reconnect:
    """One outage of a shard, for one kind of call: from its first failure to the first that got through."""

    shard: int
    call: str
    lost_at: float
    """Unix time of the first call of this kind that failed."""
    back_at: float
    """Unix time the first call of this kind after it got through."""


KEPT = 256
"""Outages kept until taken: a client that never takes them (a regional uplink) holds no more than these."""


class Reachability:
    """Calls' outcomes per shard and kind, turned into `Reconnect`s (thread-safe: every link thread reports)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: dict[tuple[int, str], float] = {}
        self._back: deque[Reconnect] = deque(maxlen=KEPT)

    def failed(self, shard: int, call: str) -> None:
        """A call found the shard unavailable (the first one since it last answered starts an outage)."""
        with self._lock:
            self._lost.setdefault((shard, call), clock.now())

    def answered(self, shard: int, call: str) -> None:
        """A call got through: it ends that kind's outage, if one was open."""
        with self._lock:
            lost_at = self._lost.pop((shard, call), None)
            if lost_at is not None:
                self._back.append(Reconnect(shard, call, lost_at, clock.now()))

    def call(self, shard: int, call: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, a call of kind `call` to `shard`, its outcome told here (a refusal is an answer too)."""
        try:
            result = fn()
        except SyncerUnavailable:
            self.failed(shard, call)
            raise
        except DilocoError:
            self.answered(shard, call)
            raise
        self.answered(shard, call)
        return result

    def take(self) -> list[Reconnect]:
        """The outages that ended since the last `take`."""
        with self._lock:
            back = list(self._back)
            self._back.clear()
        return back
