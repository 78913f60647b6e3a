"""What the syncer core is told: one typed event per thing that happened, each with the time it happened.

Both drivers hand the core these and nothing else (`SyncerCore.handle(event, now)`), and the real
syncer's journal records exactly these, so a replayed journal takes the decisions the live run took.
The core answers with actions (`actions.py`: Publish, Timer, Stop, ...). Everything the core decides (when a
round closes, when a learner is dead, when the run is over) follows from this sequence and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from diloco.core.messages import Progress, Push


@dataclass(frozen=True)
class PushArrived:
    """A learner's outer gradient for one fragment reached the syncer."""

    push: Push


@dataclass(frozen=True)
class PushesArrived:
    """Pushes that arrived while the syncer was busy merging, taken as one group (group commit): each is
    admitted or refused on its own, and the rounds they fill close together once all are in, so the
    per-round work (outer step, downlink, journal sync, answers) is paid once per group."""

    pushes: tuple[Push, ...]


@dataclass(frozen=True)
class ProgressArrived:
    """A learner's report of where it stands (after a step): budget, predictions, liveness."""

    report: Progress


@dataclass(frozen=True)
class HeartbeatArrived:
    """A learner's periodic sign of life (training or waiting): its interval is what silence is measured
    against. It carries the learner's counters, which count for the shared budget."""

    learner: int
    step: int
    tokens: int


@dataclass(frozen=True)
class TimerFired:
    """A time the core asked to be woken at (a round's bound, a liveness check) has come."""


@dataclass(frozen=True)
class LearnerLeft:
    """A learner said goodbye; `finished`: it trained its share of the run (it still counts in shares)."""

    learner: int
    finished: bool = False


@dataclass(frozen=True)
class LearnerRejoined:
    """A learner (re)starts and takes Θ: its pushes from now on are numbered above `after_seq`.
    `fragments`: the ones it takes now (None: all), as a broken transfer resumes one at a time."""

    learner: int
    after_seq: int
    fragments: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AnswerTaken:
    """The driver is ready to send `learner` its answer for `fragment` (the real syncer: that learner's
    update stream is free). The learner gets the fragment's current version, from the one it holds: an
    answer is made when it can leave, not when its round closed, so answers waiting on slow streams
    hold nothing (`SyncerCore.answers_when_taken`)."""

    learner: int
    fragment: int
    ack_seq: int
    next_push_at: float | None = None


@dataclass(frozen=True)
class StreamOpened:
    """`learner` opened its update stream, saying which version of each fragment it holds (the last
    answer it received whole). One the syncer counts it as holding above that was sent and lost (a
    stream that broke mid-answer): it is counted back and the answer made again from there."""

    learner: int
    holds: tuple[tuple[int, int], ...] = ()
    """(fragment, version) pairs."""


@dataclass(frozen=True)
class StreamLost:
    """`learner`'s update stream ended without its goodbye while it was its newest: its process died or its
    connection broke. It counts as dead now rather than after its allowance of silence (`liveness.py`),
    so that rounds stop waiting for it and their shares stop counting it; if it speaks again, it counts
    again. Not a sign of life: nothing of the learner arrived."""

    learner: int


@dataclass(frozen=True)
class SyncerResumed:
    """The syncer restarted from its saved state: every learner gets a fresh allowance of silence,
    since none could reach it while it was down."""


SyncerEvent = Union[PushArrived, PushesArrived, ProgressArrived, HeartbeatArrived, TimerFired, LearnerLeft, LearnerRejoined,
                    AnswerTaken, StreamOpened, StreamLost, SyncerResumed]


def sender(event: SyncerEvent) -> int | None:
    """The learner an event came from, if any (an answer taken comes from the driver)."""
    if isinstance(event, (AnswerTaken, PushesArrived, StreamLost)):  # a group is heard from push by push
        return None
    if isinstance(event, PushArrived):
        return event.push.learner
    if isinstance(event, ProgressArrived):
        return event.report.learner
    return getattr(event, "learner", None)
