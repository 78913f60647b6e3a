"""Merging, the syncer core's part that keeps Θ and each fragment's open round: it takes pushes into
rounds, decides when a round closes, closes it (the merge, the outer step or the final consolidation,
the record) and has its participants answered (`answering.py`).

When a round closes (`SyncerCore`'s docstring says why):
- it needs at least K contributions (K = `quorum`; None means every learner alive: synchronous);
- once K are in, it closes at once if every learner alive has pushed, or if waiting is off;
- otherwise it waits: with `pacing`, for the learners whose reports say they are about to push
  (`pacing.py`); without, the paper's grace window (`grace_window`);
- once the shared budget is spent, a round that holds a learner's final push waits for the final
  push of every learner alive, or its leaving.

A first push with nothing to judge its weight against (the round is empty and no other learner's weight
is known yet: the run's first rounds) is kept whole until something is, so that a huge claim cannot
weigh uncapped: at most one fragment's copy, whatever the number of learners.
"""

from __future__ import annotations

import contextlib
import math
import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Callable, Iterable, Iterator

import torch

from diloco.cache_chunks import coded_of
from diloco.codecs import Codec
from diloco.core.accumulate import Contribution, Sampler, delta_norm, trip_of
from diloco.core.actions import Action, Publish, Timer
from diloco.core.answering import Answering
from diloco.core.closing import corrected_theta, judged_weight, next_theta, participation_share
from diloco.core.downlink import Downlink
from diloco.core.membership import Membership
from diloco.core.messages import Push
from diloco.core.pacing import Pacer
from diloco.core.scratch import ROUND_COPIES, Scratch
from diloco.core.sum_writes import SumWrites
from diloco.core.rounds import FragmentState, OuterOptimizer, RoundRecord, mean_cosine, token_weight
from diloco.core.undo import UndoLog
from diloco.fragments import Fragment
from diloco.outer.merge import WAIT_SHARE, MergeRule

EMA = 0.3
"""Weight of the newest sample in the running estimates of ξ_step and ξ_sync."""


class Merging:
    def __init__(self, params: dict[str, torch.Tensor], fragments: list[Fragment], membership: Membership, *,
                 undo: UndoLog, optimizer: Callable[[], OuterOptimizer], merge_rule: MergeRule,
                 embeddings: Iterable[str], down_codec: Codec, quorum: int | None, grace: float,
                 grace_cap_steps: float, tau: int, participation: bool, pacing: bool, period: float,
                 consolidate: bool, stale_weight: str, in_learner_order: bool = False) -> None:
        self.undo, self.membership = undo, membership
        self.in_learner_order = in_learner_order
        """Keep a round's pushes whole, then weigh and fold them in learner order as it closes: its float
        sums do not depend on which push came first (a reproducible run; it holds the round's pushes)."""
        self.theta = {n: t.detach().to(torch.float32).clone() for n, t in params.items()}
        self.scratch = Scratch(ROUND_COPIES * max((4 * f.numel for f in fragments), default=0),
                               Counter(tuple(self.theta[n].shape) for f in fragments for n in f.names))
        """Where a round's fragment-sized tensors come from: buffers taken again once nobody holds them."""
        self.fragments = {f.index: FragmentState(f, optimizer(),
                                                 Downlink(down_codec, f.names, self.theta, undo, self.scratch.take),
                                                 Sampler({n: self.theta[n].numel() for n in f.names}))
                          for f in fragments}
        """By global fragment index: a shard of a sharded syncer holds some fragments only."""
        self.merge_rule, self.embeddings = merge_rule, frozenset(embeddings)
        self.quorum, self.grace, self.grace_cap_steps, self.tau = quorum, grace, grace_cap_steps, tau
        self.participation, self.consolidate, self.stale_weight = participation, consolidate, stale_weight
        self.pacer = Pacer(period, grace, grace_cap_steps, undo) if pacing else None
        self.answering = Answering(membership)
        self.records: list[RoundRecord] = []
        self.last_weight: dict[int, float] = {}
        self.step_time: dict[int, float] = {}
        self.one_way_s: float | None = None
        self.writes = SumWrites(self.scratch, undo)
        self.grouping = False
        """A group of pushes is being taken (`grouped`): no round closes until all of it is in."""
        self.defer: Callable[[int], bool] | None = None
        """Asked, as a round of a fragment closes, whether its answers wait for `release` (a regional syncer
        holds them until the global syncer's answer, so that its learners get the global Θ at once)."""

    # ------------------------------------------------------------ taking a push

    def measure(self, push: Push, now: float) -> None:
        """A push's step time and trip: what the grace windows are sized from."""
        if push.step_time_s > 0:
            self.undo.keep(self.step_time, push.learner)
            old = self.step_time.get(push.learner)
            self.step_time[push.learner] = push.step_time_s if old is None else old + EMA * (push.step_time_s - old)
        if push.sent_at is not None and now >= push.sent_at:
            self.undo.keep_attrs(self, "one_way_s")
            trip = now - push.sent_at
            self.one_way_s = trip if self.one_way_s is None else self.one_way_s + EMA * (trip - self.one_way_s)

    def join_round(self, push: Push, now: float) -> list[Action]:
        """Fold a push into its fragment's open round (its sums, its learner's counters there); return what
        the round then does."""
        state = self.fragments[push.fragment]
        state.keep_contribution(self.undo, push.learner)
        if self.pacer is not None:
            self.pacer.on_push(push.learner, push.fragment)
        if state.first_arrival is None:
            state.first_arrival = now
        held = state.pending.get(push.learner)
        if held is not None:
            kept = state.whole.get(push.learner)
            if kept is not None:  # more of a push kept whole
                state.whole[push.learner] = {n: kept[n] + d for n, d in push.deltas.items()}
            else:
                self._fold(state, push.deltas, held, new=False)
            held.add(push, now, state.sampler.sample(push.deltas))
            return self.evaluate(state, now)
        raw = token_weight(push.tokens, push.steps) or 1.0  # weightless pushes still average, as equals
        norms = {n: delta_norm(push.deltas, n) for n in push.deltas
                 if self.merge_rule == "rda" and n not in self.embeddings}
        contribution = Contribution(push.learner, push.base_version, push.tokens, push.steps, push.seq, raw, norms,
                                    state.sampler.sample(push.deltas), now, push.final, trip_of(push, now),
                                    push.answered)
        alone = not state.pending and not any(m != push.learner for m in self.last_weight)
        if alone or self.in_learner_order:
            state.pending[push.learner] = contribution
            state.whole[push.learner] = dict(push.deltas)
            return self.evaluate(state, now)
        self.judge_whole(state, extra=raw)
        contribution.weight = judged_weight(state, contribution, raw, self.last_weight, self.stale_weight)
        state.pending[push.learner] = contribution
        self._fold(state, push.deltas, contribution, own_norms=True)
        return self.evaluate(state, now)

    def judge_whole(self, state: FragmentState, extra: float | None = None) -> None:
        """Weigh and fold the pushes kept whole, in learner order, now that there is something to judge them
        against (`extra`, the raw weight of a push arriving) or the round closes."""
        for learner in sorted(state.whole):
            state.keep_contribution(self.undo, learner)
            contribution = state.pending[learner]
            contribution.weight = judged_weight(state, contribution, contribution.weight, self.last_weight,
                                                self.stale_weight, () if extra is None else (extra,))
            self._fold(state, state.whole[learner], contribution)
        state.whole = {}

    def _fold(self, state: FragmentState, deltas: Mapping[str, torch.Tensor], contribution: Contribution,
              own_norms: bool = False, new: bool = True) -> None:
        """A coded push's adds wait, and are made with the others' as the round closes, or once those waiting
        hold more than WAIT_SHARE of the fragment (a group's: as it ends, `grouped`). Anything else is folded
        now, after those waiting. The sums are the same either way, made in the order the pushes came."""
        later = all(coded_of(deltas, n) is not None for n in deltas)
        if not later:
            self._settle(state)
        state.sums.fold(deltas, contribution.weight, radial=contribution.norms, weighted=self._keeps_weighted(),
                        plain=self.merge_rule == "mean", own_norms=own_norms, new=new, add=self.writes.add,
                        later=later)
        if not self.grouping:
            self._settle(state, WAIT_SHARE)

    def _settle(self, state: FragmentState, share: float = 0.0) -> None:
        """Make the adds waiting, if their pushes hold more than `share` of the fragment's fp32 bytes."""
        if state.sums.waiting and state.sums.waiting_bytes() > share * 4 * state.fragment.numel:
            state.sums.settle(self.writes.add, self.writes.add_group)

    def _keeps_weighted(self) -> bool:
        """Σ w·Δ is the merge of every rule but the plain mean, and the final consolidation's."""
        return self.merge_rule != "mean" or self.consolidate

    # ------------------------------------------------------------ when a round closes

    def needed(self) -> int:
        """Pushes a round needs before it may close: K, or fewer when fewer learners are alive."""
        alive = len(self.membership.alive)
        return max(1, min(self.quorum or alive, alive))

    def grace_window(self, state: FragmentState, now: float) -> float:
        """Without pacing: clamp(γ·ξ_slack, 0, cap·ξ_step), ξ_slack = τ·ξ_step − (ξ_quorum + ξ_sync),
        from what was measured so far."""
        steps = [self.step_time[m] for m in state.pending if m in self.step_time]
        if not steps or self.grace <= 0:
            return 0.0
        step = min(steps)
        sync = self.one_way_s or 0.0  # the answer takes about as long back; merging takes no time here
        waited = now - state.first_arrival if state.first_arrival is not None else 0.0
        slack = self.tau * step - (waited + sync)
        return min(max(self.grace * slack, 0.0), self.grace_cap_steps * step)

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """Rounds wait while a group of pushes is taken in; the caller evaluates them all after. A refused
        group leaves them waiting no longer: the driver takes its pushes one at a time next."""
        self.grouping = True
        try:
            yield
            for state in self.fragments.values():
                self._settle(state, WAIT_SHARE)
        finally:
            self.grouping = False

    def evaluate_all(self, now: float) -> list[Action]:
        return [a for s in self.fragments.values() for a in self.evaluate(s, now)]

    def ending(self, state: FragmentState) -> bool:
        """The run is over and this round holds someone's last push: it is the fragment's final round."""
        return self.membership.stopped and any(c.final for c in state.pending.values())

    def evaluate(self, state: FragmentState, now: float) -> list[Action]:
        if not state.pending or self.grouping:
            return []
        alive = self.membership.alive
        if self.ending(state):  # the last round of the run waits for every learner's last push
            finals = {m for m, c in state.pending.items() if c.final}
            return [self.close(state, now, final=True)] if alive <= finals else []
        everyone = alive <= state.pending.keys()
        if self.quorum is None:  # synchronous: every learner alive is in every round
            return [self.close(state, now)] if everyone else []
        if len(state.pending) < self.needed():
            return []
        if state.quorum_at is None:
            state.keep(self.undo)
            state.quorum_at = now
        if everyone:
            return [self.close(state, now)]
        if self.pacer is not None:
            return self._hold(state, now)
        if state.deadline is None:
            state.keep(self.undo)
            state.deadline = now + self.grace_window(state, now)
            if state.deadline > now:
                return [Timer(state.deadline)]
        if now >= state.deadline:
            return [self.close(state, now)]
        return []

    def _hold(self, state: FragmentState, now: float) -> list[Action]:
        """Wait for the learners about to push, until the round's bound; close when none is left."""
        alive = self.membership.alive
        missing = alive - state.pending.keys()
        opened = state.first_arrival
        bound = self.pacer.bound(opened, alive, first=state.target is None)
        if now >= bound or not self.pacer.anyone_due(state.fragment.index, missing, bound):
            return [self.close(state, now)]
        if state.deadline != bound:
            state.keep(self.undo)
            state.deadline = bound
            return [Timer(bound)]
        return []

    def flush(self, now: float) -> list[Action]:
        """Close every round that holds anything, whatever the quorum: the run is over."""
        return [self.close(s, now, final=self.ending(s)) for s in self.fragments.values() if s.pending]

    # ------------------------------------------------------------ closing

    def close(self, state: FragmentState, now: float, final: bool = False) -> Publish:
        """Merge the round, take the outer step (or consolidate), record it, answer its participants."""
        state.keep(self.undo)
        self.scratch.trim()
        self.judge_whole(state)
        self._settle(state)
        contributions = [state.pending[m] for m in sorted(state.pending)]
        staleness = tuple(state.version - c.base_version for c in contributions)
        members = self.membership
        share = participation_share(contributions, self.last_weight, members.alive | members.finished) \
            if self.participation else 1.0
        after, optimizer, update_norm = next_theta(state, self.theta, rule=self.merge_rule, embeddings=self.embeddings,
                                                   share=share, consolidate=final and self.consolidate,
                                                   new=self.scratch.take)
        self._set_theta(after)
        state.optimizer = optimizer
        for c, behind in zip(contributions, staleness):
            self.undo.keep(self.last_weight, c.learner)
            self.last_weight[c.learner] = c.weight
            entry = members.entry(c.learner)
            (entry.stale if behind else entry.merged)[state.fragment.index] += c.tokens
            entry.steps_merged += c.steps
        opened = state.first_arrival if state.first_arrival is not None else now
        quorum_at = state.quorum_at if state.quorum_at is not None else now
        self.undo.keep_length(self.records)
        self.records.append(RoundRecord(
            state.fragment.index, state.version + 1, opened, now, tuple(c.learner for c in contributions),
            sum(1 for b in staleness if b), now - quorum_at, time_to_quorum_s=quorum_at - opened,
            update_norm=update_norm, cosine=mean_cosine([c.sample for c in contributions]),
            tokens=sum(c.tokens for c in contributions), staleness=staleness, final=final,
            tokens_each=tuple(c.tokens for c in contributions), steps=sum(c.steps for c in contributions)))
        next_push = self._pace(state, contributions, now)
        state.version += 1
        state.correction = None
        state.reset()
        state.downlink.publish(state.version, self.theta)
        answered = self.answering.owed({c.learner: c.last_seq for c in contributions if c.answered})
        if not final and self.defer is not None and self.defer(state.fragment.index):
            self.undo.keep_attrs(state, "deferred", copy=dict)
            state.deferred.update({m: (ack, next_push.get(m)) for m, ack in answered.items()})
            updates = {}
        else:
            updates = self.answering.answers(state, self.theta, answered, next_push)
        return Publish(state.fragment.index, state.version, updates)

    def _set_theta(self, values: dict[str, torch.Tensor]) -> None:
        for n in values:
            self.undo.keep(self.theta, n)
        self.theta.update(values)

    def _pace(self, state: FragmentState, contributions: list[Contribution], now: float
              ) -> dict[int, float | None]:
        """The next round's target on the grid, and when each participant should push next (its clock)
        to land on it."""
        if self.pacer is None:
            return {}
        period = self.pacer.sync_period_s(self.membership.alive | {c.learner for c in contributions})
        if period is None:
            return {}
        arrivals = [c.arrived for c in contributions]
        # A round that closed early (a push that missed the previous round, merged alone) leaves the grid
        # point it came before in place.
        state.target = target = next_grid_point(
            state.target if state.target is not None else sum(arrivals) / len(arrivals), now, period)
        return {c.learner: self.pacer.ask(c.learner, target, c.trip) for c in contributions if not c.final}

    def join_schedule(self, fragments: Iterable[int], learner: int, now: float) -> dict[int, float]:
        """For `learner`, (re)joining now: per fragment whose grid has a point within about a period, how long
        from now its first push should land there. By its steps alone that push would land anywhere in the
        period, where it missed the round the others make and was merged alone, stale. The period counts
        the learner's pace from before its restart: a grid spaced out while it and its peers were down (the
        fastest alive slower) is not one to wait for, nor is a fragment with no round yet (the run's start);
        those are left to its steps."""
        if self.pacer is None:
            return {}
        period = self.pacer.sync_period_s(self.membership.alive | {learner})
        if period is None:
            return {}
        due = {p: next_grid_point(self.fragments[p].target, now, period, JOIN_LEAD) - now for p in fragments
               if p in self.fragments and self.fragments[p].target is not None}
        return {p: d for p, d in due.items() if d <= (1 + JOIN_LEAD) * period}

    # ------------------------------------------------------------ moves decided elsewhere

    def release(self, fragment: int) -> Publish | None:
        """Answer the learners whose answers were held back (`defer`): first the correction waiting for the
        fragment, if any, becomes a version of its own, so that they get it now rather than a round
        later. None when nobody waits."""
        state = self.fragments[fragment]
        if not state.deferred:
            return None
        state.keep(self.undo)
        if state.correction is not None:
            self._set_theta(corrected_theta(state, self.theta))
            state.version += 1
            state.correction = None
            state.downlink.publish(state.version, self.theta)
        self.undo.keep_attrs(state, "deferred")
        waiting, state.deferred = state.deferred, {}
        acks = self.answering.owed({m: ack for m, (ack, _) in waiting.items()})
        next_push = {m: at for m, (_, at) in waiting.items()}
        return Publish(state.fragment.index, state.version, self.answering.answers(state, self.theta, acks, next_push))

    def correct(self, fragment: int, deltas: dict[str, torch.Tensor]) -> None:
        """Add `deltas` to Θ of `fragment` with its next round (`FragmentState.correction`)."""
        state = self.fragments[fragment]
        state.keep(self.undo)
        held = state.correction
        state.correction = {n: d.to(torch.float32, copy=True) if held is None else held[n] + d for n, d in deltas.items()}

    # ------------------------------------------------------------ saved state

    def state_dict(self) -> dict:
        for state in self.fragments.values():  # the same sums, whole: a state file keeps no pushes
            self._settle(state)
        return {"theta": {n: t.clone() for n, t in self.theta.items()},
                "fragments": {p: s.plain() for p, s in self.fragments.items()},
                "rounds": [dataclasses.astuple(r) for r in self.records], "last_weight": dict(self.last_weight),
                "step_time": dict(self.step_time), "one_way_s": self.one_way_s,
                "pacer": self.pacer.state_dict() if self.pacer else {}}

    def load_state_dict(self, state: dict) -> None:
        self.theta.clear()
        self.theta.update({n: t.clone().to(torch.float32) for n, t in state["theta"].items()})
        for p, saved in state["fragments"].items():
            self.fragments[p].load(saved)
        self.records[:] = [RoundRecord(*r) for r in state["rounds"]]
        self.last_weight, self.step_time = dict(state["last_weight"]), dict(state["step_time"])
        self.one_way_s = state["one_way_s"]
        if self.pacer is not None:
            self.pacer.load_state_dict(state["pacer"])


JOIN_LEAD = 0.25
"""A joining learner's first push goes to the first grid point at least this share of a period ahead: time
for its first steps (their warm-up included), and no later, since a round closing before its push would
leave that push a version behind."""


def next_grid_point(target: float, now: float, period: float, lead: float = 0.5) -> float:
    """The first point of the pacing grid through `target` (one `period` apart) more than `lead` periods after
    `now` (half a period: far enough ahead for every participant of the round that just closed)."""
    behind = now + lead * period - target
    if behind > 1000 * period:  # far behind (a long pause, a tiny reported step time): jump, do not step
        target += math.floor(behind / period) * period
    while target <= now + lead * period:
        target += period
    return target
