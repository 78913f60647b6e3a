"""Where a push's bytes are received: the bytearrays of earlier pushes that nobody holds any more.

A new bytearray is zeroed memory that the kernel faults in a page at a time, and the socket then overwrites
all of it. With fp32 pushes of 5M-parameter fragments that was about a tenth of a shard's CPU (`perf`: page
faults, the kernel zeroing pages, `memset`). A push's bytes are read in place until they are folded (the
core's views of them keep the bytearray alive), so a buffer is handed out again only once its reference
count says that this pool alone holds it, as `core/scratch.py` does for tensors. The pool also knows the
buffers in use (they are the pushes' own memory, held whether or not it knows them); at each take, of those
that came free it keeps at most KEPT times the largest push and never more than KEPT_BYTES, the oldest
dropped first (so a shard that no push reaches any more keeps what its last pushes left, at most as much as
they held at once). What a shard keeps for this is bounded by its own pushes' size, not by how many learners
push (a push's size was checked against its fragment and codec before a byte of it is read).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

UPLOADS_AT_ONCE = 16
"""Pushes' buffers being filled or taken at once (each the size its header declared); more wait their turn."""
KEPT = 8
"""Free buffers' bytes kept, in the largest push's: a round's close lets go of a group's pushes at once, and
as many arrive again."""
KEPT_BYTES = 1 << 30
"""The most free bytes kept, whatever the pushes' size: beyond it pushes are received into new memory (a
page fault per page, small beside merging pushes of that size)."""


def _references(buffers: list[bytearray], index: int) -> int:
    return sys.getrefcount(buffers[index])


class ReceiveBuffers:
    def __init__(self) -> None:
        self.limit_bytes = 0
        """Free bytes kept at most: KEPT times the largest push taken, at most KEPT_BYTES."""
        self.lock = threading.Lock()
        self.kept: list[bytearray] = []
        """In use or free, the longest untaken first."""
        self.made = 0
        self._unheld = _references([bytearray(1)], 0)
        """The count of a buffer that only the list holds, read the way `_free` reads it."""

    def take(self, nbytes: int) -> bytearray:
        """A bytearray of `nbytes` whose contents are to be overwritten: a kept one that nobody holds, else a
        new one. Free ones beyond the limit are dropped first."""
        with self.lock:
            self.limit_bytes = min(max(self.limit_bytes, KEPT * nbytes), KEPT_BYTES)
            free = self._free()
            spare = sum(len(self.kept[i]) for i in free)
            dropped = set()
            for i in free:  # the oldest free first
                if spare <= self.limit_bytes:
                    break
                dropped.add(i)
                spare -= len(self.kept[i])
            found = next((i for i in free if i not in dropped and len(self.kept[i]) == nbytes), None)
            buffer = bytearray(nbytes) if found is None else self.kept[found]
            self.made += found is None
            self.kept = [b for i, b in enumerate(self.kept) if i not in dropped and i != found] + [buffer]
            return buffer

    def free_bytes(self) -> int:
        with self.lock:
            return sum(len(self.kept[i]) for i in self._free())

    def _free(self) -> list[int]:
        return [i for i in range(len(self.kept)) if _references(self.kept, i) == self._unheld]


def held_bytes(push_bytes: Sequence[int], senders: int, whole: int) -> int:
    """The most bytes a shard's pushes hold at once, for owned fragments whose pushes are `push_bytes` each:
    as many being received and taken as the port takes at once (UPLOADS_AT_ONCE, at most one per sender) of
    the largest; the pushes an open round keeps whole until it can weigh them, read in place (`whole` per
    fragment: the first push of a fragment's first round, before any learner has a weight to judge it
    against, or every learner's push in a reproducible run); and the free buffers kept for the next ones.
    `diloco plan` counts it in a shard's peak (`plan/memory.py`)."""
    if not push_bytes or senders <= 0:
        return 0
    largest = max(push_bytes)
    return (min(UPLOADS_AT_ONCE, senders) * largest + min(whole, senders) * sum(push_bytes)
            + min(KEPT * largest, KEPT_BYTES))
