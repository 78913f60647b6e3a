"""What a learner back from a crash takes from its own checkpoint: the one policy both drivers follow.

Its parameters come from the syncer's current Θ, which is newer than anything it saved; the real
runtime's learners then put back on top of it the progress their checkpoint holds and no push carried
(`own_progress.py`; the simulator's crashed learners take Θ alone); a learner that does not sync has
no Θ and takes the parameters its checkpoint saved. Its data
position and step count come from the checkpoint, so it neither repeats nor skips its shard and its
learning-rate schedule goes on. Its inner optimizer's state (AdamW moments) follows
`failures.restore`: `checkpoint` takes the saved moments, `fresh` starts AdamW over (moments that
belong to parameters Θ has since replaced may do more harm than good; the choice is measurable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RestorePolicy = Literal["checkpoint", "fresh"]


@dataclass(frozen=True)
class Restore:
    optimizer: bool
    """Load the inner optimizer's saved state."""
    data: bool
    """Resume the data shard where it was."""
    steps: bool
    """Resume the step count (and with it the learning-rate schedule)."""


def restore_plan(policy: RestorePolicy, has_checkpoint: bool) -> Restore:
    if not has_checkpoint:
        return Restore(optimizer=False, data=False, steps=False)
    return Restore(optimizer=policy == "checkpoint", data=True, steps=True)
