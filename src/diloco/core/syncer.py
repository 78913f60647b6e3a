"""The syncer's side of outer synchronisation, as a sans-I/O state machine.

It keeps the global parameters Θ in fp32 with one outer optimizer per fragment. Each fragment has one
open round at a time that collects pushes; the round closes, is merged, takes an outer step and
publishes the next version of the fragment to the learners that took part.

When a round closes:
- it needs at least K contributions (K = `quorum`; None means every learner alive: synchronous);
- once K are in, it closes at once if every learner alive has pushed, or if waiting is off;
- otherwise it waits. With `pacing` (Decoupled DiLoCo here), it waits for the learners whose reports
  say they are about to push, and each answer tells its recipient when to push next so that the next
  round gathers everyone (`pacing.py`). Without, it waits the paper's grace window,
  grace = clamp(γ·ξ_slack, 0, cap·ξ_step), ξ_slack = τ·ξ_step − (ξ_quorum + ξ_sync).
- once the shared budget is spent, a round that holds a learner's final push waits for the final
  push of every learner alive, or its leaving. With `consolidate`, that last round sets Θ to the
  weighted mean of the learners' models (Θ ← Θ − Δ̄: no momentum, no outer learning rate), so the run
  ends on the average of what the learners hold, not on an extrapolation past it.

A round speaks for the learners it heard from (`participation`): its share is the weight of its
contributions over that weight plus the last known weight of every other learner alive, and the outer
optimizer scales its step by it. A round with everyone has share 1 (synchronous DiLoCo); a round with
one of M equal learners moves Θ by 1/M of that learner's progress, as its part of an average. Without
this, M rounds of one learner each would move Θ by the sum of the learners' progress, M times too far.
The delayed-Nesterov optimizer also moves its momentum only once the shares add up to a full round.

A push is never thrown away. One based on an older version than the open round's (it arrived after
the round it was based on had closed: it is *stale* by that many versions) joins the round now open;
its Δ is the learner's progress since its own anchor, which no merge has counted yet, so nothing is
counted twice. Its tokens are accounted as stale. Several pushes from one learner in one round add
up to one contribution.

The shared token budget is counted here too, from the learners' progress reports over all their
lives: `budget_spent` tells both drivers when the run is over.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Callable, Iterable

import torch

from diloco.codecs import Codec, get_codec
from diloco.core.messages import Progress, Push, Update
from diloco.core.pacing import Pacer
from diloco.core.rounds import (Action, Contribution, FragmentState, LedgerEntry, OuterOptimizer, ProtocolError,
                                Publish, RoundRecord, Stop, Timer, mean_cosine, token_weight)
from diloco.fragments import Fragment
from diloco.outer.merge import MergeRule, merge_fragment

__all__ = ["SyncerCore", "ProtocolError", "Publish", "Timer", "Stop", "Action", "RoundRecord", "LedgerEntry",
           "token_weight", "mean_cosine"]

MAX_STEP_TIME_S = 3600.0
"""A reported inner step longer than an hour is taken for a broken clock, not a slow chip."""
MAX_COUNTER = 2**63 - 1
"""Steps and tokens a learner may claim: past this, a counter is a lie (or a wrapped integer)."""
MAX_DUE_S = 1e9
"""Longest a learner may say it will take to push a fragment again."""
MAX_FRAGMENTS = 1 << 16
"""Fragments a learner's schedule may name."""
OUTLIER_WINDOW = 16
"""Accepted pushes per fragment that the outlier rule takes its median from (it needs 3 at least)."""
EMA = 0.3
"""Weight of the newest sample in the running estimates of ξ_step and ξ_sync."""


class SyncerCore:
    def __init__(self, params: dict[str, torch.Tensor], fragments: list[Fragment], members: Iterable[int], *,
                 optimizer: Callable[[], OuterOptimizer], merge_rule: MergeRule, embeddings: Iterable[str] = (),
                 quorum: int | None = None, grace: float = 0.0, grace_cap_steps: float = 2.0,
                 tau: int = 0, participation: bool = False, down_codec: Codec | None = None,
                 outlier: str = "off", outlier_factor: float = 5.0, pacing: bool = False, period: int = 1,
                 consolidate: bool = False, stale_weight: str = "full", budget: int | None = None) -> None:
        """`pacing`: wait for the learners about to push and align their next pushes (`period`: H, the
        fastest learner's steps per sync of a fragment). `budget`: the shared token budget, if any."""
        self.theta = {n: t.detach().to(torch.float32).clone() for n, t in params.items()}
        self.fragments = {f.index: FragmentState(f, optimizer()) for f in fragments}
        """By global fragment index: a shard of a sharded syncer holds some fragments only."""
        self.alive = set(members)
        self.finished: set[int] = set()
        """Learners that left having trained their share."""
        self.merge_rule = merge_rule
        self.embeddings = frozenset(embeddings)
        self.quorum, self.grace, self.grace_cap_steps, self.tau = quorum, grace, grace_cap_steps, tau
        self.participation, self.consolidate, self.stale_weight = participation, consolidate, stale_weight
        self.pacer = Pacer(period, grace, grace_cap_steps) if pacing else None
        self.outlier, self.outlier_factor = outlier, outlier_factor
        self.recent_norms: dict[int, deque[float]] = {f.index: deque(maxlen=OUTLIER_WINDOW) for f in fragments}
        """Per fragment, the norms of the latest accepted pushes: what an outlier is measured against."""
        self.last_weight: dict[int, float] = {}
        self.ledger = {m: LedgerEntry() for m in self.alive}
        self.down_codec = down_codec or get_codec("fp32")
        self.held: dict[int, dict[str, torch.Tensor]] = {m: self._copy_theta() for m in self.alive}
        """Per learner, the values it holds as anchors, bit for bit: the downlink sends differences to them."""
        self.held_versions: dict[int, dict[int, int]] = {m: dict.fromkeys(self.fragments, 0) for m in self.alive}
        self.session_start: dict[int, int] = {m: 0 for m in self.alive}
        """Per learner, the last sequence number of its previous life: answers to those pushes are not sent."""
        self.step_time: dict[int, float] = {}
        self.one_way_s: float | None = None
        self.rounds: list[RoundRecord] = []
        self.budget = budget
        self.tokens: dict[int, int] = {}
        """Per learner, tokens trained in its current life (its latest progress report)."""
        self.tokens_banked: dict[int, int] = {}
        """Per learner, tokens trained in its earlier lives."""
        self.stopped = False
        """The shared budget is spent: the run is ending."""

    @property
    def rounds_closed(self) -> int:
        return len(self.rounds)

    def version(self, p: int) -> int:
        return self.fragments[p].version

    def tokens_reported(self, learner: int | None = None) -> int:
        """Tokens the learners reported over all their lives (one learner's, or everyone's)."""
        if learner is not None:
            return self.tokens.get(learner, 0) + self.tokens_banked.get(learner, 0)
        return sum(self.tokens.values()) + sum(self.tokens_banked.values())

    @property
    def budget_spent(self) -> bool:
        return self.budget is not None and self.tokens_reported() >= self.budget

    def _copy_theta(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.theta.items()}

    def rejoin_state(self, learner: int, after_seq: int, fragments: Iterable[int] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        """Θ and the versions of `fragments` (default: all), sent whole (fp32) to a learner that
        (re)starts; its pushes from now on are numbered above `after_seq`. From here on the syncer
        counts it as holding these. Fragments may be taken one call at a time (a transfer that breaks
        resumes with the ones still missing): each is recorded as held when it is sent."""
        chosen = list(self.fragments) if fragments is None else list(fragments)
        for p in chosen:
            if p not in self.fragments:
                raise ProtocolError(f"fragment {p} is not held here")
        names = [n for p in chosen for n in self.fragments[p].fragment.names]
        held = self.held.setdefault(learner, {})
        values = {n: self.theta[n].clone() for n in names}
        held.update({n: v.clone() for n, v in values.items()})
        versions = {p: self.fragments[p].version for p in chosen}
        self.held_versions.setdefault(learner, {}).update(versions)
        self.session_start[learner] = after_seq
        self.ledger.setdefault(learner, LedgerEntry())
        if learner in self.tokens:  # a new life counts its tokens from zero; the earlier ones still count
            self.tokens_banked[learner] = self.tokens_banked.get(learner, 0) + self.tokens.pop(learner)
        if self.pacer is not None:
            self.pacer.forget(learner)
        return values, versions

    # ------------------------------------------------------------ saving and restoring

    def state_dict(self) -> dict:
        """Everything the core decides from, as tensors and plain data (loadable with
        torch.load(weights_only=True)): a restarted syncer continues exactly where this one was."""
        return {
            "theta": {n: t.clone() for n, t in self.theta.items()},
            "fragments": {p: s.plain() for p, s in self.fragments.items()},
            "alive": sorted(self.alive), "finished": sorted(self.finished), "last_weight": dict(self.last_weight),
            "ledger": {m: e.plain() for m, e in self.ledger.items()},
            "held": {m: {n: t.clone() for n, t in h.items()} for m, h in self.held.items()},
            "held_versions": {m: dict(v) for m, v in self.held_versions.items()},
            "session_start": dict(self.session_start), "step_time": dict(self.step_time),
            "one_way_s": self.one_way_s,
            "rounds": [dataclasses.astuple(r) for r in self.rounds],
            "tokens": dict(self.tokens), "tokens_banked": dict(self.tokens_banked), "stopped": self.stopped,
            "pacer": self.pacer.state_dict() if self.pacer else {},
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["fragments"]) != set(self.fragments) or set(state["theta"]) != set(self.theta):
            raise ProtocolError("the saved state holds other fragments or tensors than this syncer")
        self.theta = {n: t.clone().to(torch.float32) for n, t in state["theta"].items()}
        for p, saved in state["fragments"].items():
            self.fragments[p].load(saved)
        self.alive, self.finished = set(state["alive"]), set(state["finished"])
        self.last_weight = dict(state["last_weight"])
        self.ledger = {m: LedgerEntry.of(e) for m, e in state["ledger"].items()}
        self.held = {m: {n: t.clone() for n, t in h.items()} for m, h in state["held"].items()}
        self.held_versions = {m: dict(v) for m, v in state["held_versions"].items()}
        self.session_start, self.step_time = dict(state["session_start"]), dict(state["step_time"])
        self.one_way_s = state["one_way_s"]
        self.rounds = [RoundRecord(*r) for r in state["rounds"]]
        self.tokens, self.tokens_banked = dict(state["tokens"]), dict(state["tokens_banked"])
        self.stopped = state["stopped"]
        if self.pacer is not None:
            self.pacer.load_state_dict(state["pacer"])

    # ------------------------------------------------------------ membership

    def join(self, learner: int, now: float) -> None:
        """A learner counts for rounds again; it took its state from `rejoin_state` first."""
        if learner not in self.held:
            raise ProtocolError(f"learner {learner} joins without having taken the current state")
        self.alive.add(learner)
        self.finished.discard(learner)

    def leave(self, learner: int, now: float, finished: bool = False) -> list[Action]:
        """A learner left or was found dead: rounds stop waiting for it (its pushes already in stay).
        One that `finished` its share of the run still counts in the rounds' shares: the fleet's
        average includes it, so the last learners still training do not speak for the whole fleet."""
        self.alive.discard(learner)
        if finished and learner in self.held:  # only one that took part has a share to keep
            self.finished.add(learner)
        return self._evaluate_all(now)

    # ------------------------------------------------------------ events

    def on_progress(self, report: Progress, now: float) -> list[Action]:
        """Where a learner stands: its tokens count for the shared budget, and its schedule for the rounds
        waiting for it."""
        self.check_progress(report)
        self.tokens[report.learner] = report.tokens
        if self.pacer is not None:
            self.pacer.on_progress(report, now)
        actions: list[Action] = []
        if self.budget_spent and not self.stopped:
            self.stopped = True
            actions.append(Stop())
        return actions + self._evaluate_all(now)

    def on_push(self, push: Push, now: float) -> list[Action]:
        """Take one push; return what to publish and when to call back."""
        self.check(push)
        entry = self.ledger[push.learner]
        if push.seq <= entry.last_seq:
            entry.duplicates += 1  # a retry of a push already taken: counted once
            return []
        state = self.fragments[push.fragment]
        entry.last_seq = push.seq
        entry.pushes += 1
        push = self._bounded(push)
        if push.step_time_s > 0:
            old = self.step_time.get(push.learner)
            self.step_time[push.learner] = push.step_time_s if old is None else old + EMA * (push.step_time_s - old)
        if push.sent_at is not None and now >= push.sent_at:
            trip = now - push.sent_at
            self.one_way_s = trip if self.one_way_s is None else self.one_way_s + EMA * (trip - self.one_way_s)
        if self.pacer is not None:
            self.pacer.on_push(push.learner, push.fragment)
        if state.first_arrival is None:
            state.first_arrival = now
        held = state.pending.get(push.learner)
        if held is None:
            state.pending[push.learner] = Contribution.of(push, now)
        else:
            held.add(push, now)
        return self._evaluate(state, now)

    def outlier_bound(self, push: Push) -> tuple[float, float | None]:
        """The push's norm, and the most the outlier rule allows (None while it is off or warming up)."""
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in push.deltas.values()))
        recent = sorted(self.recent_norms.get(push.fragment, ()))
        if self.outlier == "off" or len(recent) < 3:
            return norm, None
        return norm, self.outlier_factor * recent[len(recent) // 2]

    def _bounded(self, push: Push) -> Push:
        """Clip an outlier (rule `clip`); remember the norm of what is accepted."""
        norm, bound = self.outlier_bound(push)
        if bound is not None and norm > bound and self.outlier == "clip":
            push = dataclasses.replace(push, deltas={n: d * (bound / norm) for n, d in push.deltas.items()})
            norm = bound
        self.recent_norms[push.fragment].append(norm)
        return push

    def on_timer(self, now: float) -> list[Action]:
        return self._evaluate_all(now)

    def flush(self, now: float) -> list[Action]:
        """Close every round that holds anything, whatever the quorum: the run is over."""
        return [self._close(s, now, final=self._ending(s)) for s in self.fragments.values() if s.pending]

    # ------------------------------------------------------------ rounds

    def needed(self) -> int:
        """Pushes a round needs before it may close: K, or fewer when fewer learners are alive."""
        return max(1, min(self.quorum or len(self.alive), len(self.alive)))

    def grace_window(self, state: FragmentState, now: float) -> float:
        """Without pacing: clamp(γ·ξ_slack, 0, cap·ξ_step), from what was measured so far."""
        steps = [self.step_time[m] for m in state.pending if m in self.step_time]
        if not steps or self.grace <= 0:
            return 0.0
        step = min(steps)
        sync = self.one_way_s or 0.0  # the answer takes about as long back; merging takes no time here
        waited = now - state.first_arrival if state.first_arrival is not None else 0.0
        slack = self.tau * step - (waited + sync)
        return min(max(self.grace * slack, 0.0), self.grace_cap_steps * step)

    def _evaluate_all(self, now: float) -> list[Action]:
        return [a for s in self.fragments.values() for a in self._evaluate(s, now)]

    def _ending(self, state: FragmentState) -> bool:
        """The run is over and this round holds someone's last push: it is the fragment's final round."""
        return self.stopped and any(c.final for c in state.pending.values())

    def _evaluate(self, state: FragmentState, now: float) -> list[Action]:
        if not state.pending:
            return []
        if self._ending(state):  # the last round of the run waits for every learner's last push
            finals = {m for m, c in state.pending.items() if c.final}
            return [self._close(state, now, final=True)] if self.alive <= finals else []
        everyone = self.alive <= state.pending.keys()
        if self.quorum is None:  # synchronous: every learner alive is in every round
            return [self._close(state, now)] if everyone else []
        if len(state.pending) < self.needed():
            return []
        if state.quorum_at is None:
            state.quorum_at = now
        if everyone:
            return [self._close(state, now)]
        if self.pacer is not None:
            return self._hold(state, now)
        if state.deadline is None:
            state.deadline = now + self.grace_window(state, now)
            if state.deadline > now:
                return [Timer(state.deadline)]
        if now >= state.deadline:
            return [self._close(state, now)]
        return []

    def _hold(self, state: FragmentState, now: float) -> list[Action]:
        """Wait for the learners about to push, until the round's bound; close when none is left."""
        missing = self.alive - state.pending.keys()
        opened = state.first_arrival
        bound = self.pacer.bound(opened, self.alive)
        if now >= bound or not self.pacer.waiting_for(state.fragment.index, missing, opened, self.alive):
            return [self._close(state, now)]
        if state.deadline != bound:
            state.deadline = bound
            return [Timer(bound)]
        return []

    # ------------------------------------------------------------ checks

    def check(self, push: Push) -> None:
        """Raise ProtocolError for a push this syncer must refuse; nothing changes either way."""
        if push.learner not in self.ledger:
            raise ProtocolError(f"push from learner {push.learner}, which never joined")
        if push.fragment not in self.fragments:
            raise ProtocolError(f"push for fragment {push.fragment}, which this syncer does not hold")
        state = self.fragments[push.fragment]
        if not 0 <= push.base_version <= state.version:
            raise ProtocolError(f"push of fragment {push.fragment} based on version {push.base_version}, "
                                f"but the latest is {state.version}")
        if not (0 <= push.tokens <= MAX_COUNTER and 0 <= push.steps <= MAX_COUNTER and 0 <= push.step <= MAX_COUNTER):
            raise ProtocolError(f"push of fragment {push.fragment} with counters out of range (tokens "
                                f"{push.tokens}, steps {push.steps}, step {push.step})")
        if not (math.isfinite(push.step_time_s) and 0 <= push.step_time_s <= MAX_STEP_TIME_S) or \
                (push.sent_at is not None and not math.isfinite(push.sent_at)):
            raise ProtocolError(f"push of fragment {push.fragment} with an impossible step time "
                                f"({push.step_time_s!r} s) or send time ({push.sent_at!r})")
        if set(push.deltas) != set(state.fragment.names):
            raise ProtocolError(f"push of fragment {push.fragment} does not carry exactly the fragment's tensors")
        for name, delta in push.deltas.items():
            if delta.shape != self.theta[name].shape:
                raise ProtocolError(f"push of fragment {push.fragment}: tensor {name!r} has shape "
                                    f"{tuple(delta.shape)}, expected {tuple(self.theta[name].shape)}")
        if self.outlier == "reject" and push.seq > self.ledger[push.learner].last_seq:
            norm, bound = self.outlier_bound(push)
            if bound is not None and norm > bound:
                raise ProtocolError(f"push of fragment {push.fragment} refused as an outlier: its norm {norm:.4g} "
                                    f"is above {self.outlier_factor:g} x the median of recent pushes ({bound:.4g})")

    def check_progress(self, report: Progress) -> None:
        """Raise ProtocolError for a progress report this syncer must refuse; nothing changes either way."""
        if report.learner not in self.ledger:
            raise ProtocolError(f"progress from learner {report.learner}, which never joined")
        if not (0 <= report.step <= MAX_COUNTER and 0 <= report.tokens <= MAX_COUNTER):
            raise ProtocolError(f"progress of learner {report.learner} with counters out of range "
                                f"(step {report.step}, tokens {report.tokens})")
        if not (math.isfinite(report.step_time_s) and 0 <= report.step_time_s <= MAX_STEP_TIME_S):
            raise ProtocolError(f"progress of learner {report.learner} with an impossible step time "
                                f"({report.step_time_s!r} s)")
        if len(report.due_in_s) > MAX_FRAGMENTS or \
                not all(math.isfinite(d) and 0 <= d <= MAX_DUE_S for d in report.due_in_s):
            raise ProtocolError(f"progress of learner {report.learner} with an impossible schedule "
                                f"({len(report.due_in_s)} fragments, due in {list(report.due_in_s)[:4]} s)")

    # ------------------------------------------------------------ closing a round

    def _participation_share(self, contributions: list[Contribution], weights: list[float]) -> float:
        """The round's weight over the weight of every learner alive (absent ones at their last known)."""
        for c, w in zip(contributions, weights):
            self.last_weight[c.learner] = w
        if not self.participation:
            return 1.0
        present = {c.learner for c in contributions}
        known = list(self.last_weight.values())
        typical = sum(known) / len(known)
        absent = sum(self.last_weight.get(m, typical) for m in (self.alive | self.finished) - present)
        return sum(weights) / (sum(weights) + absent)

    def _close(self, state: FragmentState, now: float, final: bool = False) -> Publish:
        contributions = [state.pending[m] for m in sorted(state.pending)]
        staleness = tuple(state.version - c.base_version for c in contributions)
        weights = [token_weight(c.tokens, c.steps) for c in contributions]
        if sum(weights) <= 0:
            weights = [1.0] * len(contributions)
        if self.stale_weight == "inverse":
            weights = [w / (1 + behind) for w, behind in zip(weights, staleness)]
        names = state.fragment.names
        before = {n: self.theta[n].clone() for n in names}
        deltas = [c.deltas for c in contributions]
        share = self._participation_share(contributions, weights)
        if final and self.consolidate:  # Θ becomes the weighted mean of the learners' models
            merged = merge_fragment(deltas, weights, "weighted", self.embeddings)
            for n in names:
                self.theta[n].sub_(merged[n])
        else:
            merged = merge_fragment(deltas, weights, self.merge_rule, self.embeddings)
            state.optimizer.step({n: self.theta[n] for n in names}, merged, share)
        update_norm = math.sqrt(sum(float((self.theta[n] - before[n]).pow(2).sum()) for n in names))
        for c, behind in zip(contributions, staleness):
            entry = self.ledger[c.learner]
            (entry.stale if behind else entry.merged)[state.fragment.index] += c.tokens
            entry.steps_merged += c.steps
        opened = state.first_arrival if state.first_arrival is not None else now
        quorum_at = state.quorum_at if state.quorum_at is not None else now
        self.rounds.append(RoundRecord(
            state.fragment.index, state.version + 1, opened, now, tuple(c.learner for c in contributions),
            sum(1 for b in staleness if b), now - quorum_at, time_to_quorum_s=quorum_at - opened,
            update_norm=update_norm, cosine=mean_cosine(deltas), tokens=sum(c.tokens for c in contributions),
            staleness=staleness, final=final))
        next_push = self._pace(state, contributions, now)
        state.version += 1
        state.reset()
        updates = {c.learner: self._answer(c.learner, state, c.last_seq, next_push.get(c.learner))
                   for c in contributions if c.last_seq > self.session_start.get(c.learner, 0)}
        return Publish(state.fragment.index, state.version, updates)

    def _pace(self, state: FragmentState, contributions: list[Contribution], now: float
              ) -> dict[int, float | None]:
        """The next round's target on the grid, and when each participant should push next (its clock)
        to land on it."""
        if self.pacer is None:
            return {}
        period = self.pacer.sync_period_s(self.alive | {c.learner for c in contributions})
        if period is None:
            return {}
        arrivals = [c.arrived for c in contributions]
        target = state.target if state.target is not None else sum(arrivals) / len(arrivals)
        # The next point of the grid at least half a period ahead: a round that closed early (a push
        # that missed the previous round, merged alone) leaves the grid point it came before in place.
        while target <= now + period / 2:
            target += period
        state.target = target
        return {c.learner: self.pacer.ask(c.learner, target, c.trip) for c in contributions if not c.final}

    def _answer(self, learner: int, state: FragmentState, ack_seq: int, next_push_at: float | None = None
                ) -> Update:
        """The new version for one learner: the encoded difference to what it holds. What it will hold
        next is computed here, once, and recorded, so both ends agree bit for bit."""
        held = self.held[learner]
        values, wire = {}, {}
        relative = self.down_codec.name != "fp32"
        for name in state.fragment.names:
            if relative:
                wire[name] = self.down_codec.encode(self.theta[name] - held[name])
                held[name] = held[name] + self.down_codec.decode(wire[name], device=held[name].device)
            else:  # lossless: send and hold Θ itself, free of the rounding of a difference
                wire[name] = self.down_codec.encode(self.theta[name])
                held[name] = self.theta[name].clone()
            values[name] = held[name]
        self.held_versions[learner][state.fragment.index] = state.version
        nbytes = sum(e.wire_bytes() for e in wire.values())
        return Update(state.fragment.index, state.version, values, ack_seq=ack_seq, payload_bytes=nbytes,
                      wire=wire, relative=relative, next_push_at=next_push_at)
