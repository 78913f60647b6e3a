"""Pushes held until a checkpoint records them: what makes a learner's own progress safe to resume.

A restarted learner resumes the progress its checkpoint says no push carried (`core/own_progress.py`).
If a push could reach the syncer before a checkpoint recording it was on disk, a kill in between would
leave a checkpoint that still counts that progress as unpushed, and the syncer's last push number would
say so: the learner would have to take Θ for the shard's fragments and lose what it trained since their
last pushes. So while checkpoints are on, each push waits on the link's encode thread (never on the
training thread) until a checkpoint numbered at or after it is written; the training loop takes one at
the first step a push is waiting (`pending`). A gate that waits longer than `GATE_BOUND_S` (a disk that
stopped writing) lets the push go: the learner then falls back on Θ for that shard, as it did before.
A learner that waits for its answers (synchronous strategies) does not hold its pushes: it waits inside
the step that pushed, before the loop could take the checkpoint the push would wait for.
"""

from __future__ import annotations

import threading

GATE_BOUND_S = 10.0
"""The longest a push waits for its checkpoint."""


class PushGate:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._written: int | None = None
        """The push number the last written checkpoint records; None: the gate is open (no checkpoints)."""
        self.let_go = 0
        """Pushes that left when `GATE_BOUND_S` ran out, not when their checkpoint was written."""

    def hold(self) -> None:
        """From now on, pushes wait for their checkpoint."""
        with self._changed:
            self._written = -1 if self._written is None else self._written

    def lift(self) -> None:
        """Pushes go at once (the learner's last pushes, at close: its last checkpoint follows them)."""
        with self._changed:
            self._written = None
            self._changed.notify_all()

    def written(self, seq: int) -> None:
        """A checkpoint recording every push up to `seq` is on disk."""
        with self._changed:
            if self._written is not None:
                self._written = max(self._written, seq)
                self._changed.notify_all()

    def pending(self, seq: int) -> bool:
        """Push `seq` (the latest made) is waiting for a checkpoint."""
        return self._written is not None and seq > self._written

    def wait(self, seq: int) -> None:
        """Called on the encode thread before push `seq` goes."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._written is None or self._written >= seq, timeout=GATE_BOUND_S):
                self.let_go += 1
