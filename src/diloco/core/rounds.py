"""What the syncer core keeps per fragment and per learner: plain data, which the core's parts change.

ProtocolError and RoundRefused (`refusals.py`) are importable from here too, as the drivers always have.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from diloco.core.accumulate import Contribution, Sampler
from diloco.core.downlink import Downlink
from diloco.core.refusals import ProtocolError, RoundRefused
from diloco.core.undo import UndoLog
from diloco.fragments import Fragment
from diloco.outer.merge import MergeSums


__all__ = ["ProtocolError", "RoundRefused", "OuterOptimizer", "LedgerEntry", "RoundRecord", "FragmentState",
           "mean_cosine", "token_weight"]


class OuterOptimizer(Protocol):
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], share: float = 1.0
             ) -> list[torch.Tensor]:
        """Returns the new state tensors not known to be finite."""

    def fork(self) -> OuterOptimizer: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


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
    fragment_seqs: dict[int, int] = field(default_factory=dict)
    """Per fragment, the newest push of it counted: a restarted learner resumes its own progress of every
    fragment not pushed after its checkpoint (`core/own_progress.usable`), not only of whole shards."""
    fragment_floor: int = 0
    """Pushes up to it were counted before this entry kept `fragment_seqs` (a state an older shard wrote):
    any fragment's newest may be that late."""
    clipped: int = 0
    """Pushes the outlier rule scaled down to its bound before they were merged."""

    @property
    def tokens_merged(self) -> int:
        """Merged on time or stale, summed over fragments."""
        return sum(self.merged.values()) + sum(self.stale.values())

    def plain(self) -> dict:
        return {"pushes": self.pushes, "merged": dict(self.merged), "stale": dict(self.stale),
                "steps_merged": self.steps_merged, "duplicates": self.duplicates, "last_seq": self.last_seq,
                "fragment_seqs": dict(self.fragment_seqs), "fragment_floor": self.fragment_floor,
                "clipped": self.clipped}

    def copy(self) -> LedgerEntry:
        return LedgerEntry.of(self.plain())

    @classmethod
    def of(cls, plain: dict) -> LedgerEntry:
        entry = cls(plain["pushes"], steps_merged=plain["steps_merged"], duplicates=plain["duplicates"],
                    last_seq=plain["last_seq"], clipped=plain.get("clipped", 0))
        entry.merged.update(plain["merged"])
        entry.stale.update(plain["stale"])
        entry.fragment_seqs.update(plain.get("fragment_seqs", {}))
        entry.fragment_floor = plain.get("fragment_floor", 0 if "fragment_seqs" in plain else entry.last_seq)
        return entry

    def pushed(self, fragment: int) -> int:
        """The newest push of `fragment` this entry may have counted."""
        return max(self.fragment_seqs.get(fragment, 0), self.fragment_floor)


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
    tokens_each: tuple[int, ...] = ()
    """Per participant (in `participants`' order), the tokens its pushes brought."""
    steps: int = 0
    """Inner steps the participants' pushes covered, summed."""


def mean_cosine(samples: list[torch.Tensor]) -> float | None:
    """Mean pairwise cosine similarity of the participants' outer gradients (on the fragment's fixed
    sample of coordinates, `accumulate.Sampler`): how far learners agree. None with one participant."""
    if len(samples) < 2:
        return None
    flat = torch.stack([s.reshape(-1).to(torch.float64) for s in samples])
    gram = flat @ flat.T
    norms = gram.diagonal().sqrt().clamp_min(1e-30)
    cosines = gram / norms[:, None] / norms[None, :]
    pairs = [float(cosines[i, j]) for i in range(len(samples)) for j in range(i + 1, len(samples))]
    return sum(pairs) / len(pairs)


def token_weight(tokens: int, steps: int) -> float:
    """Quantity × quality: more tokens, and more tokens per step (larger batches), weigh more."""
    return tokens * (tokens / steps) if steps else 0.0


# ---------------------------------------------------------------- per fragment


@dataclass
class FragmentState:
    fragment: Fragment
    optimizer: OuterOptimizer
    downlink: Downlink
    sampler: Sampler
    version: int = 0
    pending: dict[int, Contribution] = field(default_factory=dict)
    """Per learner in the open round, its counters and weight; its pushes are folded into `sums`."""
    sums: MergeSums = field(default_factory=MergeSums)
    whole: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Pushes kept whole, not yet weighed nor folded, by learner (its pushes summed): the round's only
    learner so far, while there is no weight to judge its own against; in a reproducible run, all of them
    until the round closes (`Merging.join_round`)."""
    first_arrival: float | None = None
    quorum_at: float | None = None
    deadline: float | None = None
    target: float | None = None
    """When this fragment's next round is meant to gather its pushes: the pacing grid."""
    deferred: dict[int, tuple[int, float | None]] = field(default_factory=dict)
    """Per learner of a round closed with its answers held back (`SyncerCore.defer`): the push its answer
    acknowledges and when it should push next. `Merging.release` answers them."""
    correction: dict[str, torch.Tensor] | None = None
    """A move of Θ decided elsewhere (a regional syncer's answer from the global one), added to Θ by the
    next round of the fragment, so that it reaches learners as part of a version like any other."""

    def keep(self, undo: UndoLog) -> None:
        """Its round is about to change: keep what it holds now (`undo.py`), a few fields and the sums'
        dicts (by tensor), none of it by learner. Contributions are kept one by one (`keep_contribution`)."""
        undo.keep_attrs(self, "version", "optimizer", "correction", "target", "pending", "first_arrival",
                        "quorum_at", "deadline")
        undo.keep_attrs(self, "whole", copy=dict)
        undo.keep_attrs(self, "sums", copy=lambda s: replace(s, weighted=dict(s.weighted), plain_sum=dict(s.plain_sum),
                                                             directions=dict(s.directions), radius=dict(s.radius),
                                                             waiting=list(s.waiting)))

    def keep_contribution(self, undo: UndoLog, learner: int) -> None:
        """`learner`'s contribution to the open round is about to change or appear."""
        self.keep(undo)
        undo.keep(self.pending, learner, copy.copy)

    def wait_afresh(self, undo: UndoLog, now: float) -> None:
        """The syncer was down: its open round's wait starts again at `now`, with what it holds kept. Nobody
        could push meanwhile; else the round closes at once with the pushes it held, before the learners it
        waited for reconnect, and their pushes then make a stale round of their own."""
        if not self.pending:
            return
        self.keep(undo)
        self.first_arrival, self.deadline = now, None
        if self.quorum_at is not None:
            self.quorum_at = now

    def reset(self) -> None:
        """The open round closed: the next one starts empty."""
        self.pending, self.sums, self.whole = {}, MergeSums(), {}
        self.first_arrival, self.quorum_at, self.deadline = None, None, None

    def _whole_before_s46(self, plain: dict) -> dict[int, dict[str, torch.Tensor]]:
        """A state saved with the round's single push kept whole under its older name."""
        return {} if plain.get("unjudged") is None else {next(iter(self.pending)): plain["unjudged"]}

    def plain(self) -> dict:
        return {"version": self.version, "optimizer": self.optimizer.state_dict(),
                "first_arrival": self.first_arrival, "quorum_at": self.quorum_at, "deadline": self.deadline,
                "target": self.target, "pending": {m: c.plain() for m, c in self.pending.items()},
                "sums": self.sums.plain(), "whole": dict(self.whole), "downlink": self.downlink.plain(),
                "correction": self.correction, "deferred": {m: list(d) for m, d in self.deferred.items()}}

    def load(self, plain: dict) -> None:
        self.version = plain["version"]
        self.optimizer.load_state_dict(plain["optimizer"])
        self.first_arrival, self.quorum_at = plain["first_arrival"], plain["quorum_at"]
        self.deadline, self.target = plain["deadline"], plain["target"]
        self.pending = {m: Contribution(**c) for m, c in plain["pending"].items()}
        self.sums = MergeSums.of(plain["sums"])
        self.whole = plain["whole"] if "whole" in plain else self._whole_before_s46(plain)
        self.downlink.load(plain["downlink"])
        self.correction = plain.get("correction")
        self.deferred = {m: (d[0], d[1]) for m, d in plain.get("deferred", {}).items()}
