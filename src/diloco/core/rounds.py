"""What the syncer core keeps per fragment and per learner, and what it tells its driver to do.

Plain data: the core (`syncer.py`) decides, these only hold. Actions are typed and dispatched by type.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from diloco.core.messages import Push, Update
from diloco.fragments import Fragment


class ProtocolError(Exception):
    """A message that breaks the protocol; the syncer's state is left as it was."""


class RoundRefused(ProtocolError):
    """Closing a round would have made Θ or the outer optimizer's state non-finite: the call that
    closed it is undone whole (its push or report included) and refused."""


class OuterOptimizer(Protocol):
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], share: float = 1.0) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class Publish:
    """A new version of a fragment, as each participant of its round is to receive it."""

    fragment: int
    version: int
    updates: dict[int, Update]

    @property
    def recipients(self) -> tuple[int, ...]:
        return tuple(self.updates)


@dataclass(frozen=True)
class Timer:
    """Call `on_timer` at (or after) this time: a round stops waiting."""

    at: float


@dataclass(frozen=True)
class Stop:
    """The shared token budget is spent: every learner should stop training and push what it has."""


@dataclass(frozen=True)
class LearnerDead:
    """A learner was silent past its allowance (`liveness.py`): rounds no longer count on it."""

    learner: int
    silent_s: float
    joined: bool
    """False: it was never heard from at all."""


@dataclass(frozen=True)
class SendState:
    """Θ of the fragments a (re)starting learner takes, whole, with their versions: what it now holds."""

    learner: int
    values: dict[str, torch.Tensor]
    versions: dict[int, int]


@dataclass(frozen=True)
class RunOver:
    """Every learner has left and what was still open is merged: the syncer has nothing more to do."""


Action = Publish | Timer | Stop | LearnerDead | SendState | RunOver


# ---------------------------------------------------------------- records


@dataclass
class LedgerEntry:
    """What the syncer has counted from one learner, per fragment."""

    pushes: int = 0
    merged: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Tokens merged in the round their push was based on."""
    stale: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Tokens of pushes based on an older version than their round's (they arrived after the round they
    were based on had closed), merged in a later one."""
    steps_merged: int = 0
    duplicates: int = 0
    last_seq: int = 0
    clipped: int = 0
    """Pushes the outlier rule scaled down to its bound before they were merged."""

    @property
    def tokens_merged(self) -> int:
        """Merged on time or stale, summed over fragments."""
        return sum(self.merged.values()) + sum(self.stale.values())

    def plain(self) -> dict:
        return {"pushes": self.pushes, "merged": dict(self.merged), "stale": dict(self.stale),
                "steps_merged": self.steps_merged, "duplicates": self.duplicates, "last_seq": self.last_seq,
                "clipped": self.clipped}

    @classmethod
    def of(cls, plain: dict) -> LedgerEntry:
        entry = cls(plain["pushes"], steps_merged=plain["steps_merged"], duplicates=plain["duplicates"],
                    last_seq=plain["last_seq"], clipped=plain.get("clipped", 0))
        entry.merged.update(plain["merged"])
        entry.stale.update(plain["stale"])
        return entry


@dataclass(frozen=True)
class RoundRecord:
    fragment: int
    version: int
    opened_at: float
    closed_at: float
    participants: tuple[int, ...]
    stale: int
    """Participants whose push was based on an older version than this round's."""
    held_s: float
    """How long the round stayed open after it had its quorum, waiting for more learners."""
    time_to_quorum_s: float = 0.0
    update_norm: float = 0.0
    """L2 norm of the change this round made to Θ."""
    cosine: float | None = None
    """Mean pairwise cosine similarity of the participants' outer gradients; None with one participant."""
    tokens: int = 0
    staleness: tuple[int, ...] = ()
    """Per participant, versions its push was behind this round's base (0: on time)."""
    final: bool = False
    """The run's last round of this fragment (the consolidation when it is on)."""


def mean_cosine(deltas: list[dict[str, torch.Tensor]]) -> float | None:
    """Mean pairwise cosine similarity of whole-fragment outer gradients: how far learners agree."""
    if len(deltas) < 2:
        return None
    names = list(deltas[0])
    gram = torch.zeros(len(deltas), len(deltas), dtype=torch.float64)
    for name in names:
        flat = torch.stack([d[name].reshape(-1) for d in deltas]).to(torch.float64)
        gram += flat @ flat.T
    norms = gram.diagonal().sqrt().clamp_min(1e-30)
    cosines = gram / norms[:, None] / norms[None, :]
    pairs = [float(cosines[i, j]) for i in range(len(deltas)) for j in range(i + 1, len(deltas))]
    return sum(pairs) / len(pairs)


def token_weight(tokens: int, steps: int) -> float:
    """Quantity × quality: more tokens, and more tokens per step (larger batches), weigh more."""
    return tokens * (tokens / steps) if steps else 0.0


# ---------------------------------------------------------------- per fragment


@dataclass
class Contribution:
    """One learner's pushes in the open round of a fragment, added up."""

    learner: int
    base_version: int
    deltas: dict[str, torch.Tensor]
    tokens: int
    steps: int
    last_seq: int
    arrived: float = 0.0
    """When its latest push here arrived."""
    final: bool = False
    trip: float | None = None
    """Its latest push's arrival (our clock) less its sending (the learner's clock)."""

    @classmethod
    def of(cls, push: Push, now: float) -> Contribution:
        return cls(push.learner, push.base_version, dict(push.deltas), push.tokens, push.steps, push.seq,
                   now, push.final, _trip(push, now))

    def add(self, push: Push, now: float) -> None:
        self.last_seq = max(self.last_seq, push.seq)
        for name, delta in push.deltas.items():
            self.deltas[name] = self.deltas[name] + delta
        self.base_version = min(self.base_version, push.base_version)
        self.tokens += push.tokens
        self.steps += push.steps
        self.arrived, self.trip = now, _trip(push, now)
        self.final = self.final or push.final

    def plain(self) -> dict:
        return {"base_version": self.base_version, "deltas": dict(self.deltas), "tokens": self.tokens,
                "steps": self.steps, "last_seq": self.last_seq, "arrived": self.arrived, "final": self.final,
                "trip": self.trip}


def _trip(push: Push, now: float) -> float | None:
    return None if push.sent_at is None else now - push.sent_at


@dataclass
class FragmentState:
    fragment: Fragment
    optimizer: OuterOptimizer
    version: int = 0
    pending: dict[int, Contribution] = field(default_factory=dict)
    first_arrival: float | None = None
    quorum_at: float | None = None
    deadline: float | None = None
    target: float | None = None
    """When this fragment's next round is meant to gather its pushes: the pacing grid."""

    def reset(self) -> None:
        """The open round closed: the next one starts empty."""
        self.pending, self.first_arrival, self.quorum_at, self.deadline = {}, None, None, None

    def plain(self) -> dict:
        return {"version": self.version, "optimizer": self.optimizer.state_dict(),
                "first_arrival": self.first_arrival, "quorum_at": self.quorum_at, "deadline": self.deadline,
                "target": self.target, "pending": {m: c.plain() for m, c in self.pending.items()}}

    def load(self, plain: dict) -> None:
        self.version = plain["version"]
        self.optimizer.load_state_dict(plain["optimizer"])
        self.first_arrival, self.quorum_at = plain["first_arrival"], plain["quorum_at"]
        self.deadline, self.target = plain["deadline"], plain["target"]
        self.pending = {m: Contribution(m, **c) for m, c in plain["pending"].items()}
