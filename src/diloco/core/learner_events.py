"""What a learner's driver tells its core (events) and what the core asks of the driver (actions).

The real learner (`client/learner_client.py`) and the simulated one (`sim/`) both hand these to
`LearnerCore.handle` and carry out the actions in order, so the end of an inner step happens the same
way in both: `StepDone` (count the step, push what is due), then `Advance` (merge what arrived, push
what fell due, wait only where the strategy is synchronous, report where the learner stands).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from diloco.core.messages import Progress, Push, Update


@dataclass(frozen=True)
class StepDone:
    """An inner step ended, having trained `tokens` in `step_time_s`: count it, push what is due."""

    tokens: int
    step_time_s: float = 0.0


@dataclass(frozen=True)
class Advance:
    """The driver is done with the step (what arrived meanwhile is handed over): merge what is due, push
    what fell due, say whether to wait, report where the learner stands. `last`: it trains no more (told
    to stop, or its planned steps are done): nothing is merged or waited for, only the report is sent."""

    last: bool = False


@dataclass(frozen=True)
class UpdateArrived:
    """An answer reached the learner. While it waits, this is what it waited for: due merges happen now."""

    update: Update


@dataclass(frozen=True)
class PushRefused:
    """The syncer refused a push (an outlier, a non-finite value): its progress goes in a later push."""

    push: Push


@dataclass(frozen=True)
class Finished:
    """No more inner steps: push what no push has carried yet. A learner that waits for its answers (a
    waiting strategy) takes its last ones first, so that its last pushes follow them whatever the timing;
    `wait=False`: push now (it was told to stop while waiting)."""

    wait: bool = True


@dataclass(frozen=True)
class Tick:
    """Time passed while the learner waits and nothing arrived: an answer may now be given up on."""


LearnerEvent = Union[StepDone, Advance, UpdateArrived, PushRefused, Finished, Tick]


@dataclass(frozen=True)
class SendPush:
    push: Push


@dataclass(frozen=True)
class SendProgress:
    """Where the learner stands, for the syncer's predictions and the shared budget: sent after the
    step's pushes, on the same link."""

    progress: Progress


@dataclass(frozen=True)
class WaitFor:
    """Take no step before the answers of these fragments are merged (synchronous strategies)."""

    fragments: tuple[int, ...]


@dataclass(frozen=True)
class NextStep:
    """Nothing to wait for: the next inner step may start."""


LearnerAction = Union[SendPush, SendProgress, WaitFor, NextStep]
