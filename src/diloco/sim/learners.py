"""A simulated learner's own state: its replica, step timer and link, and what the driver tracks of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.core.learner_core import LearnerCore
from diloco.network.links import Routes
from diloco.training import Replica
from diloco.virtual_run.step_timer import StepTimer, Waiting


@dataclass
class Checkpoint:
    """What a learner saves of its own: inner-optimizer state, data position, step count, and the progress
    no push has carried yet (`core/own_progress.export_progress`; None before its core exists)."""

    optimizer: dict[str, Any]
    data: dict[str, Any]
    steps: int
    own: dict[str, Any] | None = None


@dataclass
class SimLearner(Waiting):
    index: int
    speed: float
    replica: Replica
    timer: StepTimer
    link: Routes
    last_step: int
    """It stops by itself after this many steps (`driver_kit/schedule.py`)."""
    core: LearnerCore | None = None
    tokens: int = 0
    busy_s: float = 0.0
    waiting_s: float = 0.0
    down_s: float = 0.0
    waiting_since: float | None = None
    step_ends_at: float | None = None
    incarnation: int = 0
    """Bumped at every crash: events meant for an earlier life are dropped."""
    alive: bool = True
    down_since: float | None = None
    back_at: float = 0.0
    """When a crashed learner's process is due back."""
    finished: bool = False
    stop_requested: bool = False
    """The syncer said the shared budget is spent: the learner finishes at the end of this step."""
    crashes: int = 0
    rejoins: int = 0
    """Times it rejoined after a crash: the end of a connection is news of the life that held it only."""
    last_seq: int = 0
    sent_seqs: dict[int, int] = field(default_factory=dict)
    """Per fragment, the last push it sent: a push on the link reaches the syncer even if its sender dies."""
    lost_tokens: list[int] = field(default_factory=list)
    checkpoint: Checkpoint | None = None

    @property
    def closing(self) -> bool:
        """Trains no more, and waits for its last answers before its last pushes (a waiting strategy)."""
        return self.finished and self.core is not None and self.core.waiting

    @property
    def gone(self) -> bool:
        """Takes no more answers: finished and not closing, or down."""
        return (self.finished and not self.closing) or not self.alive

    def abort_step(self, now: float) -> None:
        """A step in progress is cut short: the time it would still have taken was never spent."""
        if self.step_ends_at is not None:
            self.busy_s -= self.step_ends_at - now
            self.step_ends_at = None
        self.incarnation += 1
