"""What the syncer core tells its driver to do: typed, dispatched by type."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.core.messages import Update


@dataclass(frozen=True)
class Publish:
    """A new version of a fragment, as each participant of its round is to receive it: the answer
    itself, or with `answers_when_taken` a notice (no values, no wire) the driver turns into the answer
    when it can send it (`events.AnswerTaken`)."""

    fragment: int
    version: int
    updates: dict[int, Update]

    @property
    def recipients(self) -> tuple[int, ...]:
        return tuple(self.updates)


@dataclass(frozen=True)
class SendUpdate:
    """An answer made when taken (`events.AnswerTaken`): send it to `learner` now."""

    learner: int
    update: Update


@dataclass(frozen=True)
class Timer:
    """Call `on_timer` at (or after) this time: a round stops waiting."""

    at: float


@dataclass(frozen=True)
class Stop:
    """The shared token budget is spent: every learner should stop training and push what it has."""


@dataclass(frozen=True)
class LearnerDead:
    """A learner was silent past its allowance (`liveness.py`), or its connection ended without a goodbye:
    rounds no longer count on it."""

    learner: int
    silent_s: float
    joined: bool
    """False: it was never heard from at all."""
    connection_lost: bool = False
    """Found dead by its connection ending (`events.StreamLost`), not by its silence."""


@dataclass(frozen=True)
class SendState:
    """Θ of the fragments a (re)starting learner takes, whole, with their versions: what it now holds."""

    learner: int
    values: dict[str, torch.Tensor]
    versions: dict[int, int]
    push_in_s: dict[int, float] = field(default_factory=dict)
    """Per fragment with a pacing grid: seconds from now to the learner's first push of it
    (`Merging.join_schedule`); the others by its steps."""


@dataclass(frozen=True)
class RunOver:
    """Every learner has left and what was still open is merged: the syncer has nothing more to do."""


@dataclass(frozen=True)
class PushRefused:
    """One push of a group (`events.PushesArrived`) refused, with nothing changed by it: tell its sender."""

    learner: int
    fragment: int
    seq: int
    reason: str


Action = Publish | SendUpdate | Timer | Stop | LearnerDead | SendState | RunOver | PushRefused
