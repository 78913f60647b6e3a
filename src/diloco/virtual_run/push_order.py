"""A syncer core takes each sender's pushes in the order the sender numbered them.

The core counts a push numbered at or below the last it took from that sender as a retry, taken once. In
the real runtime that holds: a learner's pushes reach a shard over one ordered stream, and with homes
spread over regions (`placement = "links"`) every shard is a core of its own. The simulator runs one core
for all fragments while a sender's pushes for different homes travel different routes, so a push can
overtake an earlier one. The driver holds such a push until the ones numbered before it have arrived:
each home's shard would have taken it at once, so the held push is late by at most the gap between the
two routes, and none is mistaken for a retry and dropped.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Generic, TypeVar

Event = TypeVar("Event")


class InOrder(Generic[Event]):
    """Per sender, the numbers of the pushes on their way, in sending order, and those that overtook."""

    def __init__(self) -> None:
        self._on_the_way: defaultdict[int, deque[int]] = defaultdict(deque)
        self._held: defaultdict[int, dict[int, Event]] = defaultdict(dict)

    def sent(self, sender: int, seq: int) -> None:
        self._on_the_way[sender].append(seq)

    def arrived(self, sender: int, seq: int, event: Event) -> list[Event]:
        """What the core takes now, in order: this push and any it released, or nothing while an earlier
        one is still on its way. A push not announced by `sent` passes at once."""
        on_the_way, held = self._on_the_way[sender], self._held[sender]
        if seq not in on_the_way:
            return [event]
        held[seq] = event
        ready = []
        while on_the_way and on_the_way[0] in held:
            ready.append(held.pop(on_the_way.popleft()))
        return ready

    @property
    def holding(self) -> int:
        return sum(len(h) for h in self._held.values())
