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

The core is three parts, each owning its state and its saved state, composed here:
- `Admission` (`checks.py`, with `claims.py` and `outliers.py`): what is refused, clipped, believed;
- `Merging` (`merging.py`, with `closing.py`, `answering.py`, `pacing.py`, `downlink.py`): Θ and the
  rounds: taking pushes in, deciding when a round closes, closing it, answering;
- `Membership` (`membership.py`, with `liveness.py`): who is alive, what each learner holds and has
  pushed, the shared budget.
A call that ends in RoundRefused leaves the core exactly as it was: the parts record what they change
in one undo log (`undo.py`), so the cost is what the call changed, not what the core holds.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from diloco.codecs import Codec, get_codec
from diloco.core.actions import Action, LearnerDead, Publish, PushRefused, RunOver, SendState, SendUpdate, Stop, Timer
from diloco.core.checks import Admission
from diloco.core.claims import MAX_SEQ_JUMP, MAX_TOKENS_PER_STEP
from diloco.core.closing import all_finite
from diloco.core.events import (AnswerTaken, HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived, PushArrived,
                                PushesArrived, StreamLost, StreamOpened, SyncerEvent, SyncerResumed, TimerFired,
                                sender)
from diloco.core.membership import Membership
from diloco.core.merging import Merging
from diloco.core.parts import Of
from diloco.core.messages import Progress, Push
from diloco.core.refusals import ProtocolError, RoundRefused
from diloco.core.rounds import LedgerEntry, OuterOptimizer, RoundRecord, mean_cosine, token_weight
from diloco.core.undo import UndoLog, atomic
from diloco.fragments import Fragment
from diloco.outer.merge import MergeRule

__all__ = ["SyncerCore", "ProtocolError", "Publish", "SendUpdate", "Timer", "Stop", "LearnerDead", "SendState",
           "RunOver", "Action", "RoundRecord", "LedgerEntry", "token_weight", "mean_cosine"]


class SyncerCore:
    def __init__(self, params: dict[str, torch.Tensor], fragments: list[Fragment], members: Iterable[int], *,
                 optimizer: Callable[[], OuterOptimizer], merge_rule: MergeRule, embeddings: Iterable[str] = (),
                 quorum: int | None = None, grace: float = 0.0, grace_cap_steps: float = 2.0,
                 tau: int = 0, participation: bool = False, down_codec: Codec | None = None,
                 outlier: str = "off", outlier_factor: float = 5.0, pacing: bool = False, period: float = 1,
                 consolidate: bool = False, stale_weight: str = "full", budget: int | None = None,
                 detect_s: float = 5.0, max_tokens_per_step: int = MAX_TOKENS_PER_STEP,
                 in_learner_order: bool = False) -> None:
        """`pacing`: wait for the learners about to push and align their next pushes (`period`: H, the
        fastest learner's steps per sync of a fragment). `budget`: the shared token budget, if any.
        `detect_s`: the silence after which a learner counts as dead (`liveness.py`).
        `max_tokens_per_step`: the most a learner may declare (`claims.tokens_per_step_ceiling`).
        `in_learner_order`: a round's sums do not depend on the order its pushes came in (`Merging`)."""
        self.undo = UndoLog()
        self.down_codec = down_codec or get_codec("fp32")
        self.membership = Membership(members, [f.index for f in fragments], budget=budget, detect_s=detect_s,
                                     undo=self.undo)
        self.merging = Merging(params, fragments, self.membership, undo=self.undo, optimizer=optimizer,
                               merge_rule=merge_rule, embeddings=embeddings, down_codec=self.down_codec,
                               quorum=quorum, grace=grace, grace_cap_steps=grace_cap_steps, tau=tau,
                               participation=participation, pacing=pacing, period=period,
                               consolidate=consolidate, stale_weight=stale_weight,
                               in_learner_order=in_learner_order)
        self.admission = Admission(self.membership, self.merging, undo=self.undo, outlier=outlier,
                                   outlier_factor=outlier_factor, max_tokens_per_step=max_tokens_per_step)

    # The parts' state under the names drivers and tests use.
    theta, fragments, rounds = Of("merging"), Of("merging"), Of("merging", "records")
    merge_rule, embeddings, quorum, grace = Of("merging"), Of("merging"), Of("merging"), Of("merging")
    grace_cap_steps, tau, participation = Of("merging"), Of("merging"), Of("merging")
    consolidate, stale_weight, pacer, defer = Of("merging"), Of("merging"), Of("merging"), Of("merging")
    step_time, one_way_s, last_weight = Of("merging"), Of("merging"), Of("merging")
    answers_when_taken = Of("merging.answering")
    alive, finished, lost, over = Of("membership"), Of("membership"), Of("membership"), Of("membership")
    ledger, held_versions, session_start = Of("membership"), Of("membership"), Of("membership")
    tokens, tokens_banked, budget, stopped = Of("membership"), Of("membership"), Of("membership"), Of("membership")
    liveness, budget_spent = Of("membership"), Of("membership")
    claims, norms, outlier, outlier_factor = Of("admission"), Of("admission"), Of("admission"), Of("admission")

    @property
    def rounds_closed(self) -> int:
        return len(self.rounds)

    def version(self, p: int) -> int:
        return self.fragments[p].version

    def tokens_reported(self, learner: int | None = None) -> int:
        """Tokens the learners reported over all their lives (one learner's, or everyone's)."""
        return self.membership.tokens_reported(learner)

    def holds_state(self, learner: int) -> bool:
        """It took Θ (`rejoin_state`) or started from its first version."""
        return self.membership.holds_state(learner)

    def held_values(self, learner: int, fragment: int) -> dict[str, torch.Tensor] | None:
        """What `learner` holds of `fragment`, bit for bit, while that is the current version (older
        versions are not kept: the next answer brings it up to date, `downlink.py`); else None."""
        state = self.fragments[fragment]
        if self.held_versions.get(learner, {}).get(fragment) != state.version:
            return None
        return state.downlink.values(self.theta)

    def memory(self) -> dict[str, int]:
        """Bytes of tensors the core holds, by what they are for: none of it grows with the learners but a
        reproducible run's pushes kept whole (`Merging.in_learner_order`)."""
        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        out = {"theta_bytes": nbytes(self.theta.values()),
               "optimizer_bytes": sum(nbytes(s.optimizer.tensors()) for s in self.fragments.values()),
               "accumulating_bytes": sum(s.sums.nbytes() + nbytes(s.sampler.indices.values())
                                         + nbytes(c.sample for c in s.pending.values())
                                         + nbytes(t for w in s.whole.values() for t in w.values())
                                         for s in self.fragments.values()),
               "downlink_bytes": sum(s.downlink.nbytes() for s in self.fragments.values()),
               "scratch_bytes": self.merging.scratch.nbytes()}
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
        last_seq = self.membership.last_seq(learner)
        if not 0 <= after_seq <= last_seq + MAX_SEQ_JUMP:
            raise ProtocolError(f"learner {learner} rejoins after push {after_seq}, more than {MAX_SEQ_JUMP} "
                                f"above its last ({last_seq})")
        values = {n: v for p in chosen for n, v in self.fragments[p].downlink.values(self.theta).items()}
        versions = {p: self.fragments[p].version for p in chosen}
        self.membership.hold(learner, versions)
        self.membership.new_life(learner, after_seq)
        self.claims.new_life(learner)
        if self.pacer is not None:
            self.pacer.forget(learner)
        return values, versions

    # ------------------------------------------------------------ saving and restoring

    def state_dict(self) -> dict:
        """Everything the core decides from, as tensors and plain data (loadable with
        torch.load(weights_only=True)): a restarted syncer continues exactly where this one was. The
        parts' saved states, side by side (their keys do not overlap)."""
        return {**self.merging.state_dict(), **self.membership.state_dict(), **self.admission.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state["fragments"]) != set(self.fragments) or set(state["theta"]) != set(self.theta):
            raise ProtocolError("the saved state holds other fragments or tensors than this syncer")
        if "held" in state:
            raise ProtocolError("the saved state keeps a copy of Θ per learner, as earlier versions did: "
                                "resume it with the version that saved it")
        self.merging.load_state_dict(state)
        self.membership.load_state_dict(state)
        self.admission.load_state_dict(state)

    # ------------------------------------------------------------ membership

    def join(self, learner: int, now: float) -> None:
        """A learner counts for rounds again; it took its state from `rejoin_state` first."""
        if not self.holds_state(learner):
            raise ProtocolError(f"learner {learner} joins without having taken the current state")
        self.claims.tick(now)
        self.claims.joined(learner, now)
        self.membership.join(learner, now)

    @atomic
    def leave(self, learner: int, now: float, finished: bool = False) -> list[Action]:
        """A learner left or was found dead: rounds stop waiting for it (its pushes already in stay).
        One that `finished` its share of the run still counts in the rounds' shares: the fleet's
        average includes it, so the last learners still training do not speak for the whole fleet.
        Once nobody is left, every round still open is merged: the run is over."""
        self.membership.leave(learner, finished)
        actions = self.merging.evaluate_all(now)
        if self.membership.end():
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
        self.membership.liveness.start(now)
        if learner is not None and not isinstance(event, LearnerLeft):
            actions += self._heard(learner, now, heartbeat=isinstance(event, HeartbeatArrived))
        if isinstance(event, TimerFired):
            for m in self.membership.found_dead(now):
                actions.append(LearnerDead(m, self.liveness.silence(m, now), m in self.liveness.heard))
                actions += self.leave(m, now)
        timer = self.membership.next_check()
        return actions if timer is None else [*actions, timer]

    def _heard(self, learner: int, now: float, heartbeat: bool = False) -> list[Action]:
        """`learner` spoke: it is alive (again, if it was found dead, and counts for rounds)."""
        if learner in self.ledger and self.membership.heard(learner, now, heartbeat=heartbeat):
            self.join(learner, now)
            return self.merging.evaluate_all(now)
        return []

    def _on_push_event(self, event: PushArrived, now: float) -> list[Action]:
        return self.on_push(event.push, now)

    def _on_pushes(self, event: PushesArrived, now: float) -> list[Action]:
        """Group commit: each push in turn (one refused is a PushRefused, nothing changed by it), no round
        closing until all are in, then every round evaluated once. A round that would not be finite
        refuses the whole group (RoundRefused): the driver takes its pushes one at a time instead."""
        actions: list[Action] = []
        with self.merging.grouped():
            for push in event.pushes:
                try:
                    actions += self.on_push(push, now)
                except RoundRefused:
                    raise
                except ProtocolError as exc:  # raised by the checks, before anything changed
                    actions.append(PushRefused(push.learner, push.fragment, push.seq, str(exc)))
                    continue
                finally:  # values decoded when used are dropped once taken: one push decoded at a time
                    getattr(push.deltas, "release", lambda: None)()
                actions += self._heard(push.learner, now)
        return actions + self.merging.evaluate_all(now)

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
        """The learner takes Θ (`SendState`) and counts again; its first pushes judged with its old pace."""
        push_in_s = self.merging.join_schedule(event.fragments or self.fragments, event.learner, now)
        values, versions = self.rejoin_state(event.learner, event.after_seq, event.fragments)
        self.join(event.learner, now)
        return [SendState(event.learner, values, versions, push_in_s), *self.merging.evaluate_all(now)]

    def _on_answer_taken(self, event: AnswerTaken, now: float) -> list[Action]:
        if event.fragment not in self.fragments or not self.holds_state(event.learner):
            raise ProtocolError(f"no answer of fragment {event.fragment} can go to learner {event.learner}")
        state = self.fragments[event.fragment]
        (update,) = self.merging.answering.answer(state, self.theta, {event.learner: event.ack_seq},
                                                  {event.learner: event.next_push_at}).values()
        return [SendUpdate(event.learner, update)]

    def _on_stream_opened(self, event: StreamOpened, now: float) -> list[Action]:
        return self.merging.answering.answers_lost(event.learner, event.holds, self.fragments, self.theta)

    def _on_stream_lost(self, event: StreamLost, now: float) -> list[Action]:
        """Found dead by its connection ending: what its silence would have told later (`events.StreamLost`)."""
        m = event.learner
        if not self.membership.lose(m):
            return []
        return [LearnerDead(m, self.liveness.silence(m, now), True, connection_lost=True), *self.leave(m, now)]

    def _on_resumed(self, event: SyncerResumed, now: float) -> list[Action]:
        """Its outage counts against nobody: not the learners' silence, nor an open round's wait."""
        self.membership.resumed(now)
        for state in self.fragments.values():
            state.wait_afresh(self.undo, now)
        return self.merging.evaluate_all(now)

    _dispatch = {PushArrived: _on_push_event, PushesArrived: _on_pushes, ProgressArrived: _on_progress_event, HeartbeatArrived: _on_heartbeat,
                 TimerFired: _on_timer_event, LearnerLeft: _on_leave, LearnerRejoined: _on_rejoin,
                 AnswerTaken: _on_answer_taken, StreamOpened: _on_stream_opened, StreamLost: _on_stream_lost,
                 SyncerResumed: _on_resumed}

    # ------------------------------------------------------------ moves decided elsewhere

    @atomic
    def stop(self) -> list[Action]:
        """The run is over by someone else's count (a regional syncer told by the global one): Stop,
        once, and the last rounds wait for every learner's final push as when the budget is spent here."""
        return [Stop()] if self.membership.stop() else []

    @atomic
    def release(self, fragment: int) -> list[Action]:
        """Answer the learners of `fragment` whose answers were held back, with the correction waiting for it
        applied first (`Merging.release`)."""
        published = self.merging.release(fragment)
        return [] if published is None else [published]

    def correct(self, fragment: int, deltas: dict[str, torch.Tensor]) -> None:
        """Add `deltas` to Θ of `fragment` with its next round (`FragmentState.correction`): a move of Θ
        decided elsewhere reaches the learners in a version of its own, so what they hold stays exact."""
        state = self.fragments[fragment]
        if set(deltas) != set(state.fragment.names):
            raise ProtocolError(f"a correction of fragment {fragment} must carry exactly its tensors")
        if not all_finite(deltas.values()):
            raise ProtocolError(f"a correction of fragment {fragment} holds a value that is not finite")
        self.merging.correct(fragment, deltas)

    # ------------------------------------------------------------ events

    @atomic
    def on_progress(self, report: Progress, now: float) -> list[Action]:
        """Where a learner stands: its tokens count for the shared budget, and its schedule for the rounds
        waiting for it."""
        self.check_progress(report, now)
        self.claims.tick(now)
        if self.pacer is not None:
            self.pacer.on_progress(report, now)
        return self._count_tokens(report.learner, report.step, report.tokens, now) + self.merging.evaluate_all(now)

    def _count_tokens(self, learner: int, step: int, tokens: int, now: float) -> list[Action]:
        """A learner's tokens in this life, as far as they are believed: Stop once the shared budget is spent."""
        step, tokens = self.admission.believe_progress(learner, step, tokens, now)
        return [Stop()] if self.membership.count_tokens(learner, tokens) else []

    @atomic
    def on_push(self, push: Push, now: float) -> list[Action]:
        """Take one push; return what to publish and when to call back."""
        self.check(push, now)
        taken = self.admission.admit_push(push, now)
        if taken is None:
            return []  # a retry of a push already taken: counted once
        self.merging.measure(taken, now)
        return self.merging.join_round(taken, now)

    @atomic
    def on_timer(self, now: float) -> list[Action]:
        self.claims.tick(now)
        return self.merging.evaluate_all(now)

    @atomic
    def flush(self, now: float) -> list[Action]:
        """Close every round that holds anything, whatever the quorum: the run is over."""
        return self.merging.flush(now)

    def needed(self) -> int:
        """Pushes a round needs before it may close: K, or fewer when fewer learners are alive."""
        return self.merging.needed()

    # ------------------------------------------------------------ checks

    def check(self, push: Push, now: float | None = None) -> None:
        """Raise ProtocolError for a push this syncer must refuse; nothing changes either way. Without
        `now`, the latest time the core was told (a claim allowed then is allowed later too)."""
        self.admission.check_push(push, self.claims.clock if now is None else now)

    def check_progress(self, report: Progress, now: float | None = None) -> None:
        """Raise ProtocolError for a progress report this syncer must refuse; nothing changes either way."""
        self.admission.check_progress(report, self.claims.clock if now is None else now)
