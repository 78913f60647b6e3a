"""A push joining its round, and closing a round: the merge, the outer step (or the final consolidation),
the record, the answers.

The syncer core (`syncer.py`) decides when a round closes; this is what taking a push into its round and
closing it do. A push is folded into its round's running sums as it arrives (`outer.merge.MergeSums`), so
its weight is fixed then: its token weight, at most WEIGHT_CAP × the typical weight (the lower median of
its own, the weights already in the round and the other learners' last known ones: one learner claiming
a huge batch cannot own a merge), divided by 1 + its staleness under the `inverse` rule. The
new values of the fragment and of its outer optimizer are computed on copies and checked finite before
anything is committed; if they are not, RoundRefused is raised and nothing has changed (the core undoes
the whole call that closed the round, `syncer._atomic`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from diloco.core.accumulate import Contribution, trip_of
from diloco.core.messages import Push, Update
from diloco.core.rounds import (FragmentState, ProtocolError, Publish, RoundRecord, RoundRefused, mean_cosine,
                                token_weight)
from diloco.outer.merge import tensor_norm

if TYPE_CHECKING:
    from diloco.core.syncer_core import SyncerCore


WEIGHT_CAP = 16.0
"""Most a contribution may weigh, in typical weights. Honest pushes in the default runs weigh at most
4.2× the typical (learners at different speeds push different token counts): 16 leaves 4× margin."""


def judged_weight(core: SyncerCore, state: FragmentState, contribution: Contribution, raw: float,
                  arriving: tuple[float, ...] = ()) -> float:
    """A contribution's weight in the merge: its token weight `raw`, capped against the typical weight
    of the others in the round (`arriving`: one not in yet) and of the learners absent from it, lowered by
    staleness if asked."""
    others = [c.weight for m, c in state.pending.items() if m != contribution.learner]
    others += [w for m, w in core.last_weight.items() if m not in state.pending]
    pool = sorted([raw, *arriving, *others])
    weight = min(raw, WEIGHT_CAP * pool[(len(pool) - 1) // 2])
    if core.stale_weight == "inverse":
        weight /= 1 + state.version - contribution.base_version
    return weight


def join_round(core: SyncerCore, state: FragmentState, push: Push, now: float) -> None:
    """Fold a push into its fragment's open round: its sums, and its learner's counters there.

    A first push with nothing to judge its weight against (the round is empty and no other learner's
    weight is known yet: the run's first rounds) is kept whole until something is, so that a huge
    claim cannot weigh uncapped: at most one fragment's copy, whatever the number of learners."""
    held = state.pending.get(push.learner)
    if held is not None:
        if state.unjudged is not None:  # more of the push kept whole
            state.unjudged = {n: state.unjudged[n] + d for n, d in push.deltas.items()}
        else:
            state.sums.fold(push.deltas, held.weight, radial=held.norms, weighted=_keeps_weighted(core),
                            plain=core.merge_rule == "mean", new=False)
        held.add(push, now, state.sampler.sample(push.deltas))
        return
    raw = token_weight(push.tokens, push.steps) or 1.0  # weightless pushes still average, as equals
    norms = {n: tensor_norm(d) for n, d in push.deltas.items()
             if core.merge_rule == "rda" and n not in core.embeddings}
    contribution = Contribution(push.learner, push.base_version, push.tokens, push.steps, push.seq, raw, norms,
                                state.sampler.sample(push.deltas), now, push.final, trip_of(push, now))
    if not state.pending and not any(m != push.learner for m in core.last_weight):
        state.pending[push.learner] = contribution
        state.unjudged = dict(push.deltas)
        return
    judge_unjudged(core, state, extra=raw)
    contribution.weight = judged_weight(core, state, contribution, raw)
    state.pending[push.learner] = contribution
    _fold(core, state, push.deltas, contribution)


def judge_unjudged(core: SyncerCore, state: FragmentState, extra: float | None = None) -> None:
    """Weigh and fold the push kept whole, now that there is something to judge it against (`extra`,
    the raw weight of the push arriving) or the round closes."""
    if state.unjudged is None:
        return
    (first,) = state.pending.values()
    first.weight = judged_weight(core, state, first, first.weight, () if extra is None else (extra,))
    _fold(core, state, state.unjudged, first)
    state.unjudged = None


def _fold(core: SyncerCore, state: FragmentState, deltas: dict[str, torch.Tensor], contribution: Contribution
          ) -> None:
    state.sums.fold(deltas, contribution.weight, radial=contribution.norms, weighted=_keeps_weighted(core),
                    plain=core.merge_rule == "mean")


def _keeps_weighted(core: SyncerCore) -> bool:
    """Σ w·Δ is the merge of every rule but the plain mean, and the final consolidation's."""
    return core.merge_rule != "mean" or core.consolidate


def _participation_share(core: SyncerCore, contributions: list[Contribution]) -> float:
    """The round's weight over the weight of every learner alive (absent ones at their last known)."""
    if not core.participation:
        return 1.0
    present = {c.learner for c in contributions}
    known = list({**core.last_weight, **{c.learner: c.weight for c in contributions}}.values())
    typical = sum(known) / len(known)
    absent = sum(core.last_weight.get(m, typical) for m in (core.alive | core.finished) - present)
    weight = sum(c.weight for c in contributions)
    return weight / (weight + absent)


def all_finite(tensors) -> bool:
    """Every element finite: NaN or ±Inf shows in a tensor's extremes, found in one pass without a mask."""
    for t in tensors:
        if t.numel():
            low, high = torch.aminmax(t.reshape(-1))
            if not (math.isfinite(float(low)) and math.isfinite(float(high))):
                return False
    return True


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    distance = float(torch.dist(a, b))
    return distance if math.isfinite(distance) else float(torch.dist(a.double(), b.double()))


def close_round(core: SyncerCore, state: FragmentState, now: float, final: bool = False) -> Publish:
    """Merge the round, take the outer step (or consolidate), record it, answer its participants."""
    judge_unjudged(core, state)
    contributions = [state.pending[m] for m in sorted(state.pending)]
    staleness = tuple(state.version - c.base_version for c in contributions)
    names = list(state.fragment.names)
    share = _participation_share(core, contributions)
    after = {n: core.theta[n].clone() for n in names}
    optimizer = state.optimizer
    if final and core.consolidate:  # Θ becomes the weighted mean of the learners' models
        merged = {n: state.sums.weighted_mean(n) for n in names}
        for n in names:
            after[n].sub_(merged[n])
    else:
        merged = state.sums.merged(names, core.merge_rule, core.embeddings)
        optimizer = state.optimizer.fork()
        optimizer.step(after, merged, share)
    if state.correction is not None:
        for n in names:
            after[n].add_(state.correction[n])
    if not (all_finite(after.values()) and all_finite(optimizer.tensors())):
        raise RoundRefused(f"round {state.version + 1} of fragment {state.fragment.index} would make Θ or the "
                           f"outer optimizer's state non-finite: refused, nothing changed")
    update_norm = math.sqrt(sum(_distance(after[n], core.theta[n]) ** 2 for n in names))
    core.theta.update(after)
    state.optimizer = optimizer
    for c in contributions:
        core.last_weight[c.learner] = c.weight
    for c, behind in zip(contributions, staleness):
        entry = core.ledger[c.learner]
        (entry.stale if behind else entry.merged)[state.fragment.index] += c.tokens
        entry.steps_merged += c.steps
    opened = state.first_arrival if state.first_arrival is not None else now
    quorum_at = state.quorum_at if state.quorum_at is not None else now
    core.rounds.append(RoundRecord(
        state.fragment.index, state.version + 1, opened, now, tuple(c.learner for c in contributions),
        sum(1 for b in staleness if b), now - quorum_at, time_to_quorum_s=quorum_at - opened,
        update_norm=update_norm, cosine=mean_cosine([c.sample for c in contributions]),
        tokens=sum(c.tokens for c in contributions), staleness=staleness, final=final,
        tokens_each=tuple(c.tokens for c in contributions), steps=sum(c.steps for c in contributions)))
    next_push = _pace(core, state, contributions, now)
    state.version += 1
    state.correction = None
    state.reset()
    state.downlink.publish(state.version, core.theta)
    answered = {c.learner: c.last_seq for c in contributions if c.last_seq > core.session_start.get(c.learner, 0)}
    if not final and core.defer is not None and core.defer(state.fragment.index):
        state.deferred.update({m: (ack, next_push.get(m)) for m, ack in answered.items()})
        updates = {}
    else:
        updates = _answers(core, state, answered, next_push)
    return Publish(state.fragment.index, state.version, updates)


def _answers(core: SyncerCore, state: FragmentState, acks: dict[int, int], next_push: dict[int, float | None]
             ) -> dict[int, Update]:
    """The answers to `acks` now: notices for a driver that makes each when its stream takes it, else made."""
    if core.answers_when_taken:
        return {m: Update(state.fragment.index, state.version, {}, ack_seq=ack, next_push_at=next_push.get(m))
                for m, ack in acks.items()}
    return answer(core, state, acks, next_push)


def release(core: SyncerCore, state: FragmentState) -> Publish | None:
    """Answer the learners whose answers were held back (`SyncerCore.defer`): first the correction waiting
    for the fragment, if any, becomes a version of its own, so that they get it now rather than a round
    later. None when nobody waits."""
    if not state.deferred:
        return None
    if state.correction is not None:
        after = {n: core.theta[n] + state.correction[n] for n in state.fragment.names}
        if not all_finite(after.values()):
            raise RoundRefused(f"a correction of fragment {state.fragment.index} would make Θ non-finite: refused")
        core.theta.update(after)
        state.version += 1
        state.correction = None
        state.downlink.publish(state.version, core.theta)
    waiting, state.deferred = state.deferred, {}
    acks = {m: ack for m, (ack, _) in waiting.items() if ack > core.session_start.get(m, 0)}
    next_push = {m: at for m, (_, at) in waiting.items()}
    return Publish(state.fragment.index, state.version, _answers(core, state, acks, next_push))


def _pace(core: SyncerCore, state: FragmentState, contributions: list[Contribution], now: float
          ) -> dict[int, float | None]:
    """The next round's target on the grid, and when each participant should push next (its clock)
    to land on it."""
    if core.pacer is None:
        return {}
    period = core.pacer.sync_period_s(core.alive | {c.learner for c in contributions})
    if period is None:
        return {}
    arrivals = [c.arrived for c in contributions]
    target = state.target if state.target is not None else sum(arrivals) / len(arrivals)
    # The next point of the grid at least half a period ahead: a round that closed early (a push
    # that missed the previous round, merged alone) leaves the grid point it came before in place.
    while target <= now + period / 2:
        target += period
    state.target = target
    return {c.learner: core.pacer.ask(c.learner, target, c.trip) for c in contributions if not c.final}


def answer(core: SyncerCore, state: FragmentState, acks: dict[int, int], next_push: dict[int, float | None]
           ) -> dict[int, Update]:
    """Each learner's answer (by learner: the seq it acknowledges): the fragment's current version, from
    the one it holds; what it holds from now on is recorded, so both ends agree bit for bit."""
    p = state.fragment.index
    held = {m: core.held_versions.get(m, {}).get(p, 0) for m in acks}
    answers = state.downlink.answers(held, state.version, core.theta)
    updates = {}
    for m, ack in acks.items():
        a = answers[m]
        core.held_versions.setdefault(m, {})[p] = state.version
        updates[m] = Update(p, state.version, a.values, ack_seq=ack, payload_bytes=a.payload_bytes, wire=a.wire,
                            relative=a.relative, next_push_at=next_push.get(m), base_version=held[m])
    alive_held = [core.held_versions.get(m, {}).get(p, 0) for m in core.alive]
    state.downlink.forget_before(min(alive_held, default=state.version))
    return updates


def answers_lost(core: SyncerCore, learner: int, holds: tuple[tuple[int, int], ...]) -> list[Publish]:
    """A learner says what it holds (it opened its update stream again): each fragment it holds an older
    version of than it was sent lost its answer on the way, so it counts as holding what it says and
    gets that answer again (a notice, or the answer itself), made from there. A claim of a version it
    was never sent is refused whole (ProtocolError), with nothing changed."""
    if not core.holds_state(learner):
        raise ProtocolError(f"learner {learner} holds nothing of this shard: it must rejoin first")
    sent = core.held_versions[learner]
    lowered = {}
    for p, version in holds:
        if p not in core.fragments:
            raise ProtocolError(f"learner {learner} claims fragment {p}, which is not held here")
        if version > sent.get(p, 0):
            raise ProtocolError(f"learner {learner} claims version {version} of fragment {p}; it was sent "
                                f"version {sent.get(p, 0)}")
        if version < sent.get(p, 0):
            lowered[p] = version
    ack = core.ledger[learner].last_seq if learner in core.ledger else 0
    if ack <= core.session_start.get(learner, 0):
        ack = 0  # nothing pushed in this life: no answer is owed
    publishes = []
    for p, version in lowered.items():
        sent[p] = version
        if not ack:
            continue
        state = core.fragments[p]
        if core.answers_when_taken:
            updates = {learner: Update(p, state.version, {}, ack_seq=ack)}
        else:
            updates = answer(core, state, {learner: ack}, {})
        publishes.append(Publish(p, state.version, updates))
    return publishes
