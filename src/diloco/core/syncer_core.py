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
lives: `budget_spent` tells both drivers when the run is over. So is liveness (`liveness.py`): a
learner silent past its allowance stops counting, and counts again when it speaks. When every learner
has left, what is still open is merged and the run is over (`RunOver`).

Drivers hand every event to `handle(event, now)` (the typed events of `events.py`): it is the one entry
that keeps liveness and the end of the run, and the one the journal replays. The `on_*` methods below
take one kind of event each, for tests that drive a round by hand.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from diloco.codecs import Codec, get_codec
from diloco.core.accumulate import Sampler
from diloco.core.closing import all_finite, answer, answers_lost, close_round, join_round, release
from diloco.core.downlink import Downlink
from diloco.core.saving import load_saved_state, saved_state
from diloco.core.checks import check_progress, check_push
from diloco.core.claims import MAX_SEQ_JUMP, MAX_TOKENS_PER_STEP, Claims
from diloco.core.events import (AnswerTaken, HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived,
                                PushArrived, StreamOpened, SyncerEvent, SyncerResumed, TimerFired, sender)
from diloco.core.liveness import Liveness
from diloco.core.messages import Progress, Push
from diloco.core.outliers import NormHistory, bounded
from diloco.core.pacing import Pacer
from diloco.core.rounds import (Action, FragmentState, LearnerDead, LedgerEntry, OuterOptimizer,
                                ProtocolError, Publish, RoundRecord, RunOver, SendState, SendUpdate, Stop, Timer,
                                mean_cosine, token_weight)
from diloco.core.transaction import atomic
from diloco.fragments import Fragment
from diloco.outer.merge import MergeRule

__all__ = ["SyncerCore", "ProtocolError", "Publish", "SendUpdate", "Timer", "Stop", "LearnerDead", "SendState", "RunOver", "Action",
           "RoundRecord", "LedgerEntry", "token_weight", "mean_cosine"]

EMA = 0.3
"""Weight of the newest sample in the running estimates of ξ_step and ξ_sync."""


class SyncerCore:
    def __init__(self, params: dict[str, torch.Tensor], fragments: list[Fragment], members: Iterable[int], *,
                 optimizer: Callable[[], OuterOptimizer], merge_rule: MergeRule, embeddings: Iterable[str] = (),
                 quorum: int | None = None, grace: float = 0.0, grace_cap_steps: float = 2.0,
                 tau: int = 0, participation: bool = False, down_codec: Codec | None = None,
                 outlier: str = "off", outlier_factor: float = 5.0, pacing: bool = False, period: float = 1,
                 consolidate: bool = False, stale_weight: str = "full", budget: int | None = None,
                 detect_s: float = 5.0, max_tokens_per_step: int = MAX_TOKENS_PER_STEP) -> None:
        """`pacing`: wait for the learners about to push and align their next pushes (`period`: H, the
        fastest learner's steps per sync of a fragment). `budget`: the shared token budget, if any.
        `detect_s`: the silence after which a learner counts as dead (`liveness.py`).
        `max_tokens_per_step`: the most a learner may declare (`claims.tokens_per_step_ceiling`)."""
        self.theta = {n: t.detach().to(torch.float32).clone() for n, t in params.items()}
        self.down_codec = down_codec or get_codec("fp32")
        self.fragments = {f.index: FragmentState(f, optimizer(), Downlink(self.down_codec, f.names, self.theta),
                                                 Sampler({n: self.theta[n].numel() for n in f.names}))
                          for f in fragments}
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
        self.norms = NormHistory([f.index for f in fragments])
        """Per fragment and learner, the sizes of the latest pushes accepted as they were (`outliers.py`)."""
        self.last_weight: dict[int, float] = {}
        self.ledger = {m: LedgerEntry() for m in self.alive}
        self.held_versions: dict[int, dict[int, int]] = {m: dict.fromkeys(self.fragments, 0) for m in self.alive}
        """Per learner, the version of each fragment it holds: the starters hold the first, the others
        what they took (`rejoin_state`) or were answered. What it holds is kept once per version, not per
        learner (`downlink.py`)."""
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
        self.liveness = Liveness(detect_s=detect_s)
        self.claims = Claims(max_tokens_per_step)
        """Declared rates and accepted claims: what a learner's next counters are judged against."""
        self._in_transaction = False
        self.lost: set[int] = set()
        """Learners found dead by silence (not announced): they count again when they speak."""
        self.over = False
        """Every learner has left and the last rounds are merged."""
        self._wake_at: float | None = None
        """The liveness check the driver was asked to wake the core for."""
        self.defer: Callable[[int], bool] | None = None
        """Asked, as a round of a fragment closes, whether its answers wait for `release` (a regional syncer
        holds them until the global syncer's answer, so that its learners get the global Θ at once)."""
        self.answers_when_taken = False
        """Publish notices, and make each answer when the driver takes it (`events.AnswerTaken`): the real
        syncer, whose answers wait on streams. The simulator takes answers as rounds close."""

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

    def holds_state(self, learner: int) -> bool:
        """It took Θ (`rejoin_state`) or started from its first version."""
        return learner in self.held_versions

    def held_values(self, learner: int, fragment: int) -> dict[str, torch.Tensor] | None:
        """What `learner` holds of `fragment`, bit for bit, while that is the current version (older
        versions are not kept: the next answer brings it up to date, `downlink.py`); else None."""
        state = self.fragments[fragment]
        if self.held_versions.get(learner, {}).get(fragment) != state.version:
            return None
        return state.downlink.values(self.theta)

    def memory(self) -> dict[str, int]:
        """Bytes of tensors the core holds, by what they are for: none of it grows with the learners."""
        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        out = {"theta_bytes": nbytes(self.theta.values()),
               "optimizer_bytes": sum(nbytes(s.optimizer.tensors()) for s in self.fragments.values()),
               "accumulating_bytes": sum(s.sums.nbytes() + nbytes(s.sampler.indices.values())
                                         + nbytes(c.sample for c in s.pending.values())
                                         + nbytes((s.unjudged or {}).values()) for s in self.fragments.values()),
               "downlink_bytes": sum(s.downlink.nbytes() for s in self.fragments.values())}
        out["total_bytes"] = sum(out.values())
        return out

    def declare(self, learner: int, tokens_per_step: int, burst_steps: int = 0) -> None:
        """What a learner trains per inner step (batch × sequence × ranks), declared at join: its
        token claims are bounded by it. A regional syncer declares `burst_steps` too (`claims.py`)."""
        self.claims.declare(learner, tokens_per_step, burst_steps)

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
        last_seq = self.ledger[learner].last_seq if learner in self.ledger else 0
        if not 0 <= after_seq <= last_seq + MAX_SEQ_JUMP:
            raise ProtocolError(f"learner {learner} rejoins after push {after_seq}, more than {MAX_SEQ_JUMP} "
                                f"above its last ({last_seq})")
        values = {n: v for p in chosen for n, v in self.fragments[p].downlink.values(self.theta).items()}
        versions = {p: self.fragments[p].version for p in chosen}
        self.held_versions.setdefault(learner, {}).update(versions)
        self.session_start[learner] = after_seq
        self.ledger.setdefault(learner, LedgerEntry())
        if learner in self.tokens:  # a new life counts its tokens from zero; the earlier ones still count
            self.tokens_banked[learner] = self.tokens_banked.get(learner, 0) + self.tokens.pop(learner)
        self.claims.new_life(learner)
        if self.pacer is not None:
            self.pacer.forget(learner)
        return values, versions

    # ------------------------------------------------------------ saving and restoring

    def state_dict(self) -> dict:
        """Everything the core decides from, as tensors and plain data (loadable with
        torch.load(weights_only=True)): a restarted syncer continues exactly where this one was."""
        return saved_state(self)

    def load_state_dict(self, state: dict) -> None:
        load_saved_state(self, state)

    # ------------------------------------------------------------ membership

    def join(self, learner: int, now: float) -> None:
        """A learner counts for rounds again; it took its state from `rejoin_state` first."""
        if not self.holds_state(learner):
            raise ProtocolError(f"learner {learner} joins without having taken the current state")
        self.claims.tick(now)
        self.claims.joined_at.setdefault(learner, now)
        self.alive.add(learner)
        self.finished.discard(learner)
        self.lost.discard(learner)
        self.over = False
        self.liveness.hear(learner, now)

    @atomic
    def leave(self, learner: int, now: float, finished: bool = False) -> list[Action]:
        """A learner left or was found dead: rounds stop waiting for it (its pushes already in stay).
        One that `finished` its share of the run still counts in the rounds' shares: the fleet's
        average includes it, so the last learners still training do not speak for the whole fleet.
        Once nobody is left, every round still open is merged: the run is over."""
        self.alive.discard(learner)
        if finished and self.holds_state(learner):  # only one that took part has a share to keep
            self.finished.add(learner)
        actions = self._evaluate_all(now)
        if not self.alive and not self.over:
            self.over = True
            actions += [*self.flush(now), RunOver()]
        return actions

    # ------------------------------------------------------------ the one entry for drivers

    @atomic
    def handle(self, event: SyncerEvent, now: float) -> list[Action]:
        """Take one event (raising ProtocolError, with nothing changed, for one to refuse); return what
        the driver is to do. Besides the event's own effect: whoever it came from is heard from (and
        alive again if it was found dead), and a Timer asks for the next liveness check."""
        learner = sender(event)
        actions = self._dispatch[type(event)](self, event, now)
        self.claims.tick(now)
        self.liveness.start(now)
        if learner is not None and learner in self.ledger and not isinstance(event, LearnerLeft):
            self.liveness.hear(learner, now, heartbeat=isinstance(event, HeartbeatArrived))
            if learner in self.lost and self.holds_state(learner) and not self.over:
                self.join(learner, now)
                actions += self._evaluate_all(now)
        if isinstance(event, TimerFired):
            actions += self._check_liveness(now)
        return actions + self._liveness_timer()

    def _check_liveness(self, now: float) -> list[Action]:
        if self._wake_at is not None and now < self._wake_at:
            return []
        self._wake_at = None
        actions: list[Action] = []
        for m in self.liveness.silent(self.alive, now):
            actions.append(LearnerDead(m, self.liveness.silence(m, now), m in self.liveness.heard))
            self.lost.add(m)
            actions += self.leave(m, now)
        return actions

    def _liveness_timer(self) -> list[Action]:
        """A Timer for the next liveness check, unless one as early is already asked for."""
        due = self.liveness.next_check(self.alive)
        if due is None or (self._wake_at is not None and self._wake_at <= due):
            return []
        self._wake_at = due
        return [Timer(due)]

    def _on_push_event(self, event: PushArrived, now: float) -> list[Action]:
        return self.on_push(event.push, now)

    def _on_progress_event(self, event: ProgressArrived, now: float) -> list[Action]:
        return self.on_progress(event.report, now)

    def _on_heartbeat(self, event: HeartbeatArrived, now: float) -> list[Action]:
        self.check_progress(Progress(event.learner, event.step, event.tokens, 0.0), now)
        return self._count_tokens(event.learner, event.step, event.tokens, now)

    def _on_timer_event(self, event: TimerFired, now: float) -> list[Action]:
        return self.on_timer(now)

    def _on_leave(self, event: LearnerLeft, now: float) -> list[Action]:
        return self.leave(event.learner, now, finished=event.finished)

    def _on_rejoin(self, event: LearnerRejoined, now: float) -> list[Action]:
        """The learner takes Θ (the driver sends what `SendState` holds) and counts again."""
        values, versions = self.rejoin_state(event.learner, event.after_seq, event.fragments)
        self.join(event.learner, now)
        return [SendState(event.learner, values, versions), *self._evaluate_all(now)]

    def _on_answer_taken(self, event: AnswerTaken, now: float) -> list[Action]:
        if event.fragment not in self.fragments or not self.holds_state(event.learner):
            raise ProtocolError(f"no answer of fragment {event.fragment} can go to learner {event.learner}")
        state = self.fragments[event.fragment]
        (update,) = answer(self, state, {event.learner: event.ack_seq}, {event.learner: event.next_push_at}).values()
        return [SendUpdate(event.learner, update)]

    def _on_stream_opened(self, event: StreamOpened, now: float) -> list[Action]:
        return answers_lost(self, event.learner, event.holds)

    def _on_resumed(self, event: SyncerResumed, now: float) -> list[Action]:
        self.liveness.refresh(now)
        self._wake_at = None
        return []

    _dispatch = {PushArrived: _on_push_event, ProgressArrived: _on_progress_event, HeartbeatArrived: _on_heartbeat,
                 TimerFired: _on_timer_event, LearnerLeft: _on_leave, LearnerRejoined: _on_rejoin,
                 AnswerTaken: _on_answer_taken, StreamOpened: _on_stream_opened, SyncerResumed: _on_resumed}

    # ------------------------------------------------------------ moves decided elsewhere

    @atomic
    def stop(self) -> list[Action]:
        """The run is over by someone else's count (a regional syncer told by the global one): Stop,
        once, and the last rounds wait for every learner's final push as when the budget is spent here."""
        if self.stopped:
            return []
        self.stopped = True
        return [Stop()]

    @atomic
    def release(self, fragment: int) -> list[Action]:
        """Answer the learners of `fragment` whose answers were held back, with the correction waiting for it
        applied first (`closing.release`)."""
        published = release(self, self.fragments[fragment])
        return [] if published is None else [published]

    def correct(self, fragment: int, deltas: dict[str, torch.Tensor]) -> None:
        """Add `deltas` to Θ of `fragment` with its next round (`FragmentState.correction`): a move of Θ
        decided elsewhere reaches the learners in a version of its own, so what they hold stays exact."""
        state = self.fragments[fragment]
        if set(deltas) != set(state.fragment.names):
            raise ProtocolError(f"a correction of fragment {fragment} must carry exactly its tensors")
        if not all_finite(deltas.values()):
            raise ProtocolError(f"a correction of fragment {fragment} holds a value that is not finite")
        held = state.correction
        state.correction = {n: d.to(torch.float32, copy=True) if held is None else held[n] + d for n, d in deltas.items()}

    # ------------------------------------------------------------ events

    @atomic
    def on_progress(self, report: Progress, now: float) -> list[Action]:
        """Where a learner stands: its tokens count for the shared budget, and its schedule for the rounds
        waiting for it."""
        self.check_progress(report, now)
        self.claims.tick(now)
        if self.pacer is not None:
            self.pacer.on_progress(report, now)
        return self._count_tokens(report.learner, report.step, report.tokens, now) + self._evaluate_all(now)

    def _count_tokens(self, learner: int, step: int, tokens: int, now: float) -> list[Action]:
        """A learner's tokens in this life, as it reported them: Stop once the shared budget is spent."""
        self.claims.accept(learner, step, now, tokens)
        self.tokens[learner] = tokens
        if self.budget_spent and not self.stopped:
            self.stopped = True
            return [Stop()]
        return []

    @atomic
    def on_push(self, push: Push, now: float) -> list[Action]:
        """Take one push; return what to publish and when to call back."""
        self.check(push, now)
        self.claims.tick(now)
        entry = self.ledger[push.learner]
        if push.seq <= entry.last_seq:
            entry.duplicates += 1  # a retry of a push already taken: counted once
            return []
        state = self.fragments[push.fragment]
        entry.last_seq = push.seq
        entry.pushes += 1
        covered = self.claims.accept(push.learner, push.step, now).covered
        covered[push.fragment] = max(covered.get(push.fragment, push.step), push.step)
        push = bounded(self, push)
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
        join_round(self, state, push, now)
        return self._evaluate(state, now)

    @atomic
    def on_timer(self, now: float) -> list[Action]:
        self.claims.tick(now)
        return self._evaluate_all(now)

    @atomic
    def flush(self, now: float) -> list[Action]:
        """Close every round that holds anything, whatever the quorum: the run is over."""
        return [close_round(self, s, now, final=self._ending(s)) for s in self.fragments.values() if s.pending]

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
            return [close_round(self, state, now, final=True)] if self.alive <= finals else []
        everyone = self.alive <= state.pending.keys()
        if self.quorum is None:  # synchronous: every learner alive is in every round
            return [close_round(self, state, now)] if everyone else []
        if len(state.pending) < self.needed():
            return []
        if state.quorum_at is None:
            state.quorum_at = now
        if everyone:
            return [close_round(self, state, now)]
        if self.pacer is not None:
            return self._hold(state, now)
        if state.deadline is None:
            state.deadline = now + self.grace_window(state, now)
            if state.deadline > now:
                return [Timer(state.deadline)]
        if now >= state.deadline:
            return [close_round(self, state, now)]
        return []

    def _hold(self, state: FragmentState, now: float) -> list[Action]:
        """Wait for the learners about to push, until the round's bound; close when none is left."""
        missing = self.alive - state.pending.keys()
        opened = state.first_arrival
        bound = self.pacer.bound(opened, self.alive)
        if now >= bound or not self.pacer.waiting_for(state.fragment.index, missing, opened, self.alive):
            return [close_round(self, state, now)]
        if state.deadline != bound:
            state.deadline = bound
            return [Timer(bound)]
        return []

    # ------------------------------------------------------------ checks

    def check(self, push: Push, now: float | None = None) -> None:
        """Raise ProtocolError for a push this syncer must refuse; nothing changes either way. Without
        `now`, the latest time the core was told (a claim allowed then is allowed later too)."""
        check_push(self, push, self.claims.clock if now is None else now)

    def check_progress(self, report: Progress, now: float | None = None) -> None:
        """Raise ProtocolError for a progress report this syncer must refuse; nothing changes either way."""
        check_progress(self, report, self.claims.clock if now is None else now)
