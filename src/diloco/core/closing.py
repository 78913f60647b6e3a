"""Closing a round: the merge, the outer step (or the final consolidation), the record, the answers.

The syncer core (`syncer.py`) decides when a round closes; this is what closing it does.

A contribution weighs at most WEIGHT_CAP × the typical weight (the lower median of this round's weights
and the other learners' last known ones): one learner claiming a huge batch cannot own a merge. The
new values of the fragment and of its outer optimizer are computed on copies and checked finite before
anything is committed; if they are not, RoundRefused is raised and nothing has changed (the core undoes
the whole call that closed the round, `syncer._atomic`).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch

from diloco.core.messages import Update
from diloco.core.rounds import (Contribution, FragmentState, Publish, RoundRecord, RoundRefused, mean_cosine,
                                token_weight)
from diloco.outer.merge import merge_fragment

if TYPE_CHECKING:
    from diloco.core.syncer import SyncerCore


WEIGHT_CAP = 16.0
"""Most a contribution may weigh, in typical weights. Honest pushes in the default runs weigh at most
4.2× the typical (learners at different speeds push different token counts): 16 leaves 4× margin."""


def capped_weights(core: SyncerCore, contributions: list[Contribution]) -> list[float]:
    """Each contribution's token weight, at most WEIGHT_CAP × the lower median of this round's weights
    and the absent learners' last known ones (one learner cannot raise it: with two, it is the smaller)."""
    weights = [token_weight(c.tokens, c.steps) for c in contributions]
    present = {c.learner for c in contributions}
    pool = sorted(weights + [w for m, w in core.last_weight.items() if m not in present])
    typical = pool[(len(pool) - 1) // 2]
    return [min(w, WEIGHT_CAP * typical) for w in weights]


def _participation_share(core: SyncerCore, contributions: list[Contribution], weights: list[float]) -> float:
    """The round's weight over the weight of every learner alive (absent ones at their last known)."""
    if not core.participation:
        return 1.0
    present = {c.learner for c in contributions}
    known = list({**core.last_weight, **{c.learner: w for c, w in zip(contributions, weights)}}.values())
    typical = sum(known) / len(known)
    absent = sum(core.last_weight.get(m, typical) for m in (core.alive | core.finished) - present)
    return sum(weights) / (sum(weights) + absent)


def _all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if isinstance(t, torch.Tensor))


def _optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of an outer optimizer's state_dict, flattened (Nesterov's or Delayed Nesterov's)."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update({f"{key}.{k}": v for k, v in _optimizer_tensors(value).items()})
        elif isinstance(value, torch.Tensor):
            found[key] = value
    return found

def close_round(core: SyncerCore, state: FragmentState, now: float, final: bool = False) -> Publish:
    """Merge the round, take the outer step (or consolidate), record it, answer its participants."""
    contributions = [state.pending[m] for m in sorted(state.pending)]
    staleness = tuple(state.version - c.base_version for c in contributions)
    weights = capped_weights(core, contributions)
    if sum(weights) <= 0:
        weights = [1.0] * len(contributions)
    if core.stale_weight == "inverse":
        weights = [w / (1 + behind) for w, behind in zip(weights, staleness)]
    names = state.fragment.names
    deltas = [c.deltas for c in contributions]
    share = _participation_share(core, contributions, weights)
    after = {n: core.theta[n].clone() for n in names}
    optimizer = state.optimizer
    if final and core.consolidate:  # Θ becomes the weighted mean of the learners' models
        merged = merge_fragment(deltas, weights, "weighted", core.embeddings)
        for n in names:
            after[n].sub_(merged[n])
    else:
        merged = merge_fragment(deltas, weights, core.merge_rule, core.embeddings)
        optimizer = copy.deepcopy(state.optimizer)
        optimizer.step(after, merged, share)
    if not (_all_finite(after) and _all_finite(_optimizer_tensors(optimizer.state_dict()))):
        raise RoundRefused(f"round {state.version + 1} of fragment {state.fragment.index} would make Θ or the "
                           f"outer optimizer's state non-finite: refused, nothing changed")
    update_norm = math.sqrt(sum(float(torch.linalg.vector_norm(after[n].double() - core.theta[n].double())) ** 2
                                for n in names))
    core.theta.update(after)
    state.optimizer = optimizer
    for c, w in zip(contributions, weights):
        core.last_weight[c.learner] = w
    for c, behind in zip(contributions, staleness):
        entry = core.ledger[c.learner]
        (entry.stale if behind else entry.merged)[state.fragment.index] += c.tokens
        entry.steps_merged += c.steps
    opened = state.first_arrival if state.first_arrival is not None else now
    quorum_at = state.quorum_at if state.quorum_at is not None else now
    core.rounds.append(RoundRecord(
        state.fragment.index, state.version + 1, opened, now, tuple(c.learner for c in contributions),
        sum(1 for b in staleness if b), now - quorum_at, time_to_quorum_s=quorum_at - opened,
        update_norm=update_norm, cosine=mean_cosine(deltas), tokens=sum(c.tokens for c in contributions),
        staleness=staleness, final=final))
    next_push = _pace(core, state, contributions, now)
    state.version += 1
    state.reset()
    updates = {c.learner: _answer(core, c.learner, state, c.last_seq, next_push.get(c.learner))
               for c in contributions if c.last_seq > core.session_start.get(c.learner, 0)}
    return Publish(state.fragment.index, state.version, updates)

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

def _answer(core: SyncerCore, learner: int, state: FragmentState, ack_seq: int, next_push_at: float | None = None
            ) -> Update:
    """The new version for one learner: the encoded difference to what it holds. What it will hold
    next is computed here, once, and recorded, so both ends agree bit for bit."""
    held = core.held.setdefault(learner, {})
    values, wire = {}, {}
    relative = core.down_codec.name != "fp32"
    for name in state.fragment.names:
        if relative:  # a starter not answered yet holds Θ's first version
            anchor = held.get(name, core.initial_theta.get(name))
            wire[name] = core.down_codec.encode(core.theta[name] - anchor)
            held[name] = anchor + core.down_codec.decode(wire[name], device=anchor.device)
        else:  # lossless: send and hold Θ itself, free of the rounding of a difference
            wire[name] = core.down_codec.encode(core.theta[name])
            held[name] = core.theta[name].clone()
        values[name] = held[name]
    core.held_versions.setdefault(learner, {})[state.fragment.index] = state.version
    nbytes = sum(e.wire_bytes() for e in wire.values())
    return Update(state.fragment.index, state.version, values, ack_seq=ack_seq, payload_bytes=nbytes,
                  wire=wire, relative=relative, next_push_at=next_push_at)
