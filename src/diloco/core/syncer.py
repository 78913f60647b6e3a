"""The syncer's side of outer synchronisation, as a sans-I/O state machine.

It keeps the global parameters Θ in fp32 with one outer optimizer per fragment. Each fragment has one
open round at a time that collects pushes; the round closes, is merged, takes an outer step and
publishes the next version of the fragment to the learners that took part.

When a round closes:
- it needs at least K contributions (K = `quorum`; None means every learner alive: synchronous);
- once K are in, it closes at once if every learner alive has pushed, or if the grace window is off;
- otherwise it waits a grace window, grace = clamp(γ·ξ_slack, 0, cap·ξ_step), with
  ξ_slack = τ·ξ_step − (ξ_quorum + ξ_sync): ξ_step is the fastest participant's step time (reported
  in its pushes), ξ_quorum the time since the round's first arrival, ξ_sync the measured one-way trip
  of a push (the answer takes about as long back; a merge takes no time in the simulator, and the real
  driver will add its measured merge time). The answer then still
  reaches the fastest learner by the time it needs it, τ steps after sending.

A round speaks for the learners it heard from (`participation`): its share is the weight of its
contributions over that weight plus the last known weight of every other learner alive, and the outer
optimizer scales its step by it. A round with everyone has share 1 (synchronous DiLoCo); a round with
one of M equal learners moves Θ by 1/M of that learner's progress, as its part of an average. Without
this, M rounds of one learner each would move Θ by the sum of the learners' progress, M times too far.
The delayed-Nesterov optimizer also moves its momentum only once the shares add up to a full round.

A push is never thrown away. One that arrives after the round it was based on has closed (its base
version is behind) joins the round now open; its Δ is the learner's progress since its own anchor,
which no merge has counted yet, so nothing is counted twice. Its tokens are accounted as *late*.
Several pushes from one learner in one round add up to one contribution.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from diloco.codecs import Codec, get_codec
from diloco.core.messages import Push, Update
from diloco.fragments import Fragment
from diloco.outer.merge import MergeRule, merge_fragment

MAX_STEP_TIME_S = 3600.0
"""A reported inner step longer than an hour is taken for a broken clock, not a slow chip."""
OUTLIER_WINDOW = 16
"""Accepted pushes per fragment that the outlier rule takes its median from (it needs 3 at least)."""
EMA = 0.3
"""Weight of the newest sample in the running estimates of ξ_step and ξ_sync."""


class ProtocolError(Exception):
    """A message that breaks the protocol; the syncer's state is left as it was."""


class OuterOptimizer(Protocol):
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], share: float = 1.0) -> None: ...


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
    """Call `on_timer` at (or after) this time: a grace window ends."""

    at: float


Action = Publish | Timer


@dataclass
class LedgerEntry:
    """What the syncer has counted from one learner, per fragment."""

    pushes: int = 0
    merged: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Tokens merged in the round their push was based on."""
    late: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Tokens of pushes that arrived after their round closed, merged in a later one."""
    steps_merged: int = 0
    duplicates: int = 0
    last_seq: int = 0

    @property
    def tokens_merged(self) -> int:
        """Merged on time or late, summed over fragments."""
        return sum(self.merged.values()) + sum(self.late.values())


@dataclass(frozen=True)
class RoundRecord:
    fragment: int
    version: int
    opened_at: float
    closed_at: float
    participants: tuple[int, ...]
    late: int
    grace_s: float
    time_to_quorum_s: float = 0.0
    update_norm: float = 0.0
    """L2 norm of the change this round made to Θ."""
    cosine: float | None = None
    """Mean pairwise cosine similarity of the participants' outer gradients; None with one participant."""
    tokens: int = 0


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


@dataclass
class Contribution:
    learner: int
    base_version: int
    deltas: dict[str, torch.Tensor]
    tokens: int
    steps: int
    last_seq: int

    def add(self, push: Push) -> None:
        self.last_seq = max(self.last_seq, push.seq)
        for name, delta in push.deltas.items():
            self.deltas[name] = self.deltas[name] + delta
        self.base_version = min(self.base_version, push.base_version)
        self.tokens += push.tokens
        self.steps += push.steps


@dataclass
class FragmentState:
    fragment: Fragment
    optimizer: OuterOptimizer
    version: int = 0
    pending: dict[int, Contribution] = field(default_factory=dict)
    first_arrival: float | None = None
    quorum_at: float | None = None
    deadline: float | None = None
    grace_s: float = 0.0


class SyncerCore:
    def __init__(self, params: dict[str, torch.Tensor], fragments: list[Fragment], members: Iterable[int], *,
                 optimizer: Callable[[], OuterOptimizer], merge_rule: MergeRule, embeddings: Iterable[str] = (),
                 quorum: int | None = None, grace: float = 0.0, grace_cap_steps: float = 2.0,
                 tau: int = 0, participation: bool = False, down_codec: Codec | None = None,
                 outlier: str = "off", outlier_factor: float = 5.0) -> None:
        self.theta = {n: t.detach().to(torch.float32).clone() for n, t in params.items()}
        self.fragments = {f.index: FragmentState(f, optimizer()) for f in fragments}
        """By global fragment index: a shard of a sharded syncer holds some fragments only."""
        self.alive = set(members)
        self.finished: set[int] = set()
        """Learners that left having trained their share."""
        self.merge_rule = merge_rule
        self.embeddings = frozenset(embeddings)
        self.quorum, self.grace, self.grace_cap_steps, self.tau = quorum, grace, grace_cap_steps, tau
        self.participation = participation
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

    @property
    def rounds_closed(self) -> int:
        return len(self.rounds)

    def version(self, p: int) -> int:
        return self.fragments[p].version

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
        return values, versions

    # ------------------------------------------------------------ saving and restoring

    def state_dict(self) -> dict:
        """Everything the core decides from, as tensors and plain data (loadable with
        torch.load(weights_only=True)): a restarted syncer continues exactly where this one was."""
        return {
            "theta": {n: t.clone() for n, t in self.theta.items()},
            "fragments": {p: {"version": s.version, "optimizer": s.optimizer.state_dict(),
                              "first_arrival": s.first_arrival, "quorum_at": s.quorum_at,
                              "deadline": s.deadline, "grace_s": s.grace_s,
                              "pending": {m: {"base_version": c.base_version, "deltas": dict(c.deltas),
                                              "tokens": c.tokens, "steps": c.steps, "last_seq": c.last_seq}
                                          for m, c in s.pending.items()}}
                          for p, s in self.fragments.items()},
            "alive": sorted(self.alive), "finished": sorted(self.finished), "last_weight": dict(self.last_weight),
            "ledger": {m: {"pushes": e.pushes, "merged": dict(e.merged), "late": dict(e.late),
                           "steps_merged": e.steps_merged, "duplicates": e.duplicates, "last_seq": e.last_seq}
                       for m, e in self.ledger.items()},
            "held": {m: {n: t.clone() for n, t in h.items()} for m, h in self.held.items()},
            "held_versions": {m: dict(v) for m, v in self.held_versions.items()},
            "session_start": dict(self.session_start), "step_time": dict(self.step_time),
            "one_way_s": self.one_way_s,
            "rounds": [dataclasses.astuple(r) for r in self.rounds],
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["fragments"]) != set(self.fragments) or set(state["theta"]) != set(self.theta):
            raise ProtocolError("the saved state holds other fragments or tensors than this syncer")
        self.theta = {n: t.clone().to(torch.float32) for n, t in state["theta"].items()}
        for p, saved in state["fragments"].items():
            s = self.fragments[p]
            s.version = saved["version"]
            s.optimizer.load_state_dict(saved["optimizer"])
            s.first_arrival, s.quorum_at = saved["first_arrival"], saved["quorum_at"]
            s.deadline, s.grace_s = saved["deadline"], saved["grace_s"]
            s.pending = {m: Contribution(m, c["base_version"], dict(c["deltas"]), c["tokens"], c["steps"],
                                         c["last_seq"]) for m, c in saved["pending"].items()}
        self.alive, self.finished = set(state["alive"]), set(state["finished"])
        self.last_weight = dict(state["last_weight"])
        self.ledger = {}
        for m, e in state["ledger"].items():
            entry = self.ledger[m] = LedgerEntry(e["pushes"], steps_merged=e["steps_merged"],
                                                 duplicates=e["duplicates"], last_seq=e["last_seq"])
            entry.merged.update(e["merged"])
            entry.late.update(e["late"])
        self.held = {m: {n: t.clone() for n, t in h.items()} for m, h in state["held"].items()}
        self.held_versions = {m: dict(v) for m, v in state["held_versions"].items()}
        self.session_start, self.step_time = dict(state["session_start"]), dict(state["step_time"])
        self.one_way_s = state["one_way_s"]
        self.rounds = [RoundRecord(*r) for r in state["rounds"]]

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
        if state.first_arrival is None:
            state.first_arrival = now
        held = state.pending.get(push.learner)
        if held is None:
            state.pending[push.learner] = Contribution(push.learner, push.base_version,
                                                       dict(push.deltas), push.tokens, push.steps, push.seq)
        else:
            held.add(push)
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
        return [self._close(s, now) for s in self.fragments.values() if s.pending]

    # ------------------------------------------------------------ rounds

    def needed(self) -> int:
        """Pushes a round needs before it may close: K, or fewer when fewer learners are alive."""
        return max(1, min(self.quorum or len(self.alive), len(self.alive)))

    def grace_window(self, state: FragmentState, now: float) -> float:
        """clamp(γ·ξ_slack, 0, cap·ξ_step), from what was measured so far."""
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

    def _evaluate(self, state: FragmentState, now: float) -> list[Action]:
        if not state.pending:
            return []
        everyone = self.alive <= state.pending.keys()
        if self.quorum is None:  # synchronous: every learner alive is in every round
            return [self._close(state, now)] if everyone else []
        if len(state.pending) < self.needed():
            return []
        if state.quorum_at is None:
            state.quorum_at = now
        if everyone:
            return [self._close(state, now)]
        if state.deadline is None:
            state.grace_s = self.grace_window(state, now)
            state.deadline = now + state.grace_s
            if state.grace_s > 0:
                return [Timer(state.deadline)]
        if now >= state.deadline:
            return [self._close(state, now)]
        return []

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
        if push.tokens < 0 or push.steps < 0:
            raise ProtocolError(f"push of fragment {push.fragment} with negative counters")
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

    def _close(self, state: FragmentState, now: float) -> Publish:
        contributions = [state.pending[m] for m in sorted(state.pending)]
        weights = [token_weight(c.tokens, c.steps) for c in contributions]
        if sum(weights) <= 0:
            weights = [1.0] * len(contributions)
        merged = merge_fragment([c.deltas for c in contributions], weights, self.merge_rule, self.embeddings)
        share = self._participation_share(contributions, weights)
        names = state.fragment.names
        before = {n: self.theta[n].clone() for n in names}
        state.optimizer.step({n: self.theta[n] for n in names}, merged, share)
        update_norm = math.sqrt(sum(float((self.theta[n] - before[n]).pow(2).sum()) for n in names))
        late = 0
        for c in contributions:
            entry = self.ledger[c.learner]
            if c.base_version < state.version:
                entry.late[state.fragment.index] += c.tokens
                late += 1
            else:
                entry.merged[state.fragment.index] += c.tokens
            entry.steps_merged += c.steps
        opened = state.first_arrival if state.first_arrival is not None else now
        self.rounds.append(RoundRecord(
            state.fragment.index, state.version + 1, opened, now, tuple(c.learner for c in contributions), late,
            state.grace_s, time_to_quorum_s=(state.quorum_at if state.quorum_at is not None else now) - opened,
            update_norm=update_norm, cosine=mean_cosine([c.deltas for c in contributions]),
            tokens=sum(c.tokens for c in contributions)))
        state.version += 1
        state.pending, state.first_arrival, state.quorum_at, state.deadline, state.grace_s = {}, None, None, None, 0.0
        updates = {c.learner: self._answer(c.learner, state, c.last_seq) for c in contributions
                   if c.last_seq > self.session_start.get(c.learner, 0)}
        return Publish(state.fragment.index, state.version, updates)

    def _answer(self, learner: int, state: FragmentState, ack_seq: int) -> Update:
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
                      wire=wire, relative=relative)
