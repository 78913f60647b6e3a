"""The syncer's side of outer synchronisation, as a sans-I/O state machine.

It keeps the global parameters Θ in fp32 with one outer optimizer per fragment, collects the
learners' pushes for each fragment's current round, merges them when the round closes, takes the
outer step and publishes the next version of that fragment. Rounds here are synchronous: a round
closes once every member has pushed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from diloco.core.messages import Push, Update
from diloco.fragments import Fragment
from diloco.outer.merge import MergeRule, merge_fragment
from diloco.outer.nesterov import Nesterov


class ProtocolError(Exception):
    """A message that breaks the protocol; the syncer's state is left as it was."""


@dataclass(frozen=True)
class Publish:
    update: Update
    recipients: tuple[int, ...]


@dataclass
class LedgerEntry:
    """What the syncer has counted from one learner."""

    pushes: int = 0
    tokens_merged: int = 0
    steps_merged: int = 0
    duplicates: int = 0
    last_seq: int = 0


def token_weight(push: Push) -> float:
    """Quantity × quality: more tokens, and more tokens per step (larger batches), weigh more."""
    return push.tokens * (push.tokens / push.steps) if push.steps else 0.0


@dataclass
class FragmentState:
    fragment: Fragment
    optimizer: Nesterov
    version: int = 0
    pending: dict[int, Push] = field(default_factory=dict)


class SyncerCore:
    def __init__(self, params: dict[str, torch.Tensor], fragments: list[Fragment], members: Iterable[int], *,
                 outer_lr: float, momentum: float, merge_rule: MergeRule,
                 embeddings: Iterable[str] = ()) -> None:
        self.theta = {n: t.detach().to(torch.float32).clone() for n, t in params.items()}
        self.fragments = [FragmentState(f, Nesterov(outer_lr, momentum)) for f in fragments]
        self.members = set(members)
        self.merge_rule = merge_rule
        self.embeddings = frozenset(embeddings)
        self.ledger = {m: LedgerEntry() for m in self.members}
        self.rounds_closed = 0

    def version(self, p: int) -> int:
        return self.fragments[p].version

    def snapshot(self, p: int) -> dict[str, torch.Tensor]:
        return {n: self.theta[n].clone() for n in self.fragments[p].fragment.names}

    # ------------------------------------------------------------ events

    def on_push(self, push: Push) -> list[Publish]:
        """Take one push; return what to publish (nothing until its round closes)."""
        self._check(push)
        entry = self.ledger[push.learner]
        if push.seq <= entry.last_seq:
            entry.duplicates += 1  # a retry of a push already taken: counted once
            return []
        state = self.fragments[push.fragment]
        if push.learner in state.pending:
            raise ProtocolError(f"learner {push.learner} pushed fragment {push.fragment} twice in one round")
        entry.last_seq = push.seq
        entry.pushes += 1
        state.pending[push.learner] = push
        if self.members <= state.pending.keys():
            return [self._close_round(state)]
        return []

    def _check(self, push: Push) -> None:
        if push.learner not in self.members:
            raise ProtocolError(f"push from learner {push.learner}, which is not a member")
        if not 0 <= push.fragment < len(self.fragments):
            raise ProtocolError(f"push for fragment {push.fragment}, which does not exist")
        state = self.fragments[push.fragment]
        if push.base_version != state.version:
            raise ProtocolError(f"push of fragment {push.fragment} from version {push.base_version}, "
                                f"but the round open is for version {state.version}")
        for name in state.fragment.names:
            delta = push.deltas.get(name)
            if delta is None or delta.shape != self.theta[name].shape:
                raise ProtocolError(f"push of fragment {push.fragment} lacks tensor {name!r} or has a wrong shape")
        if set(push.deltas) != set(state.fragment.names):
            raise ProtocolError(f"push of fragment {push.fragment} carries tensors outside the fragment")

    def _close_round(self, state: FragmentState) -> Publish:
        pushes = [state.pending[m] for m in sorted(state.pending)]
        weights = [token_weight(p) for p in pushes]
        if sum(weights) <= 0:
            weights = [1.0] * len(pushes)
        merged = merge_fragment([p.deltas for p in pushes], weights, self.merge_rule, self.embeddings)
        names = state.fragment.names
        state.optimizer.step({n: self.theta[n] for n in names}, merged)
        state.version += 1
        for push in pushes:
            entry = self.ledger[push.learner]
            entry.tokens_merged += push.tokens
            entry.steps_merged += push.steps
        state.pending = {}
        self.rounds_closed += 1
        update = Update(state.fragment.index, state.version, self.snapshot(state.fragment.index))
        return Publish(update, tuple(p.learner for p in pushes))
