"""A mailbox that holds only the newest item: for messages where the latest says all (a heartbeat), so a
reader that is held up (its call hangs on a shard that does not answer) finds one item waiting when it
is free again, never a backlog."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Newest(Generic[T]):
    """One item at most: `put` replaces what was not yet taken; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: T | None = None
        self._closed = False

    def put(self, item: T) -> None:
        with self._cond:
            self._item = item
            self._cond.notify_all()

    def take(self) -> T | None:
        """The newest item, once there is one; None once closed (what was waiting then is dropped)."""
        with self._cond:
            self._cond.wait_for(lambda: self._item is not None or self._closed)
            if self._closed:
                return None
            item, self._item = self._item, None
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
