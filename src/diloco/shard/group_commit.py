"""Group commit on the real shard: pushes that arrive while the shard is busy (merging a round, syncing
its journal) wait in a queue, encoded; whichever push call takes the shard's lock next takes every queued
push as one group (`core.events.PushesArrived`), journaled as one record, so the per-round work and the
journal's sync are paid once per group rather than once per push. The group's pushes are decoded one at a
time as the core takes them in (`wire_messages.DecodedOnUse`): the shard holds one decoded push at a
time, whatever the group's size or the number of learners.

What the core decides for a group (which pushes are refused, which rounds close) is the core's
(`SyncerCore._on_pushes`); this module only forms the group and hands each caller its own outcome. A
push the core refuses inside a group stays in the group's journal record: replay refuses it again and it
changes nothing either time. A group whose round would not be finite (RoundRefused) is taken again one
push at a time, so one bad push cannot take the others down with it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from diloco.core.actions import PushRefused
from diloco.core.events import PushArrived, PushesArrived
from diloco.core.messages import Push
from diloco.core.refusals import ProtocolError, RoundRefused
from diloco.shard.journal import JournalError, group_payload
from diloco.shard.shard_view import ShardView

GROUP_PUSHES = 16
"""Most pushes taken as one group: bounds the encoded pushes one journal record holds."""


@dataclass
class QueuedPush:
    """One push call waiting for its group, and what became of it."""

    push: Push
    frames: bytes
    """Its frames as the journal keeps them (empty without a journal)."""
    outcome: str | None = None
    """"taken", "refused" or "unavailable" once its group was taken."""
    why: str = ""
    duplicate: bool = False
    clipped: bool = False


class PushQueue:
    def __init__(self, most: int = GROUP_PUSHES) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._items: list[QueuedPush] = []

    def put(self, item: QueuedPush) -> None:
        with self._lock:
            self._items.append(item)

    def waiting(self) -> int:
        """Pushes queued for a group now."""
        with self._lock:
            return len(self._items)

    def take(self) -> list[QueuedPush]:
        """The oldest waiting pushes, at most `most` of them."""
        with self._lock:
            group, self._items = self._items[:self.most], self._items[self.most:]
        return group


def take_group(shard: ShardView, group: list[QueuedPush], now: float) -> None:
    """Apply `group` as one event (under the shard's lock) and set each push's outcome."""
    if not group:
        return
    ledger = shard.core.ledger
    before = {q.push.learner: (e.duplicates, e.clipped) if (e := ledger.get(q.push.learner)) else (0, 0)
              for q in group}
    if len(group) == 1:
        event, frames = PushArrived(group[0].push), group[0].frames
    else:
        event = PushesArrived(tuple(q.push for q in group))
        frames = group_payload([q.frames for q in group]) if shard.store is not None else b""
    try:
        actions = shard.apply(event, now, frames)
    except RoundRefused as exc:
        if len(group) > 1:
            for item in group:
                take_group(shard, [item], now)
            return
        _settle(group, "refused", str(exc))
        return
    except ProtocolError as exc:  # a push alone, refused by the checks
        _settle(group, "refused", str(exc))
        return
    except JournalError as exc:  # not on disk, so not taken: the callers try the same again later
        _settle(group, "unavailable", f"shard {shard.plan.index} cannot journal: {exc}")
        return
    except BaseException:
        _settle(group, "unavailable", "the shard failed while taking this push")
        raise
    refused = {(a.learner, a.seq): a.reason for a in actions if isinstance(a, PushRefused)}
    for item in group:
        why = refused.get((item.push.learner, item.push.seq))
        if why is not None:
            item.outcome, item.why = "refused", why
            continue
        entry = ledger[item.push.learner]
        duplicates, clipped = before[item.push.learner]
        item.outcome = "taken"
        item.duplicate, item.clipped = entry.duplicates > duplicates, entry.clipped > clipped


def _settle(group: list[QueuedPush], outcome: str, why: str) -> None:
    for item in group:
        if item.outcome is None:
            item.outcome, item.why = outcome, why
