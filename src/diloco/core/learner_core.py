"""The learner's side of outer synchronisation, as a sans-I/O state machine.

A driver (the real learner, the simulated one) hands it typed events (`core/learner_events.py`) through
`handle` and carries out the actions it returns, in order; the end of an inner step is the same
sequence for both: `StepDone` (count it, push what is due), then, once the driver has handed over what
arrived meanwhile, `Advance` (merge what is due, push what fell due, wait or go on, report progress). The core decides which fragments are
due, computes their outer gradients Δ = anchor − θ, merges answers τ steps after sending with
θ ← α·θ + (1 − α)·Θ̃, and re-anchors on exactly the values received.

- When a fragment is due: after the steps of its schedule (staggered offsets, period H), until the
  syncer says otherwise. Each answer may name the time of the fragment's next push, on the learner's
  own clock (`Update.next_push_at`), chosen so that every learner's next push of it lands at about the
  same time whatever their speeds; the learner pushes at the end of the step nearest to that time. A
  learner that (re)joins is named its first pushes' times the same way (`push_at`), once rounds have set
  the grid. Without an answer, it pushes again H of its steps after the last push.
- Counters for a fragment restart when it is *sent*, not when its answer is merged: the τ steps
  taken in between belong to the next push of that fragment, so each token is reported once.
- With `keep_progress`, a merge keeps what the learner trained since sending: θ ← Θ̃ + (θ − θ_sent)
  (then mixed with α). Those steps are in no push yet; overwriting θ with Θ̃ would throw them away
  while their tokens are still counted in the next push. A late answer then costs nothing but staleness.
- A fragment has at most one push in flight. If it falls due again before its answer came back
  (a slow syncer or link), it is pushed as soon as that answer is merged; the learner does not stop.
- A learner that waits (`wait_for_updates`, synchronous strategies) stops at step t + τ until the
  answer to what it sent at t is in. One that does not wait merges answers whenever they arrive.
- `finish` never waits: what was trained since each fragment's last push is pushed as it is, marked
  final; for a fragment still in flight, only the progress made since sending it (θ_sent − θ), so
  nothing is counted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from diloco.codecs import Codec, Encoded, ErrorFeedback, get_codec
from diloco.core.learner_events import (Advance, Finished, LearnerAction, LearnerEvent, NextStep, PushRefused,
                                        SendProgress, SendPush, StepDone, Tick, UpdateArrived, WaitFor)
from diloco.core.messages import Progress, Push, Update
from diloco.fragments import Fragment, Schedule

STEP_TIME_EMA = 0.2

ANSWER_PATIENCE = 4.0
"""A push whose answer has not come within this many times the longer of the sync period (H measured
steps) and the slowest answer measured so far is given up: the learner trains on without it."""
GIVEN_UP_KEPT = 16  # pushes given up on whose send times a fragment keeps, to measure late answers
ANSWER_FLOOR_S = 60.0
"""A synchronous learner never gives up its round sooner: what it cannot measure from its side. Its round
rightly waits for the slowest learner and for a silent one to be declared dead (seconds of missed
heartbeats, up to the syncer's 60 s bound for a learner never heard from). A learner that does not wait
(decoupled, async) has no floor: giving up only lets that fragment's next push go, its progress kept."""


@dataclass
class InFlight:
    push: Push
    merge_at_step: int
    sent_deltas: dict[str, torch.Tensor]
    """anchor − θ when it was sent, before any encoding: θ_sent is anchor − this."""
    update: Update | None = None


@dataclass(frozen=True)
class Poll:
    """What the driver should do now: send `pushes`, then wait for `waiting_for` or take the next step."""

    pushes: list[Push] = field(default_factory=list)
    waiting_for: tuple[int, ...] = ()
    """Fragments whose answer the learner must merge before its next step (waiting strategies)."""


class LearnerCore:
    def __init__(self, learner: int, params: dict[str, torch.Tensor], fragments: list[Fragment],
                 schedule: Schedule, *, tau: int, alpha: float, wait_for_updates: bool,
                 versions: list[int] | None = None, step: int = 0, first_seq: int = 0,
                 codec: Codec | None = None, error_feedback: bool = False, encode_later: bool = False,
                 keep_progress: bool = False) -> None:
        """`params` are the live model tensors; they are the anchors too, at `versions` (a fresh start
        or a rejoin from the syncer's current Θ). `step` resumes the fragment schedule.

        With `encode_later`, pushes carry the raw outer gradients and the driver encodes them with
        `encode` off the training thread (the real driver); otherwise they carry what the syncer will
        decode (the simulator)."""
        self.learner, self.params, self.fragments, self.schedule = learner, params, fragments, schedule
        self.tau, self.alpha, self.wait_for_updates, self.keep_progress = tau, alpha, wait_for_updates, keep_progress
        self.codec = codec or get_codec("fp32")
        self.feedback = ErrorFeedback(self.codec) if error_feedback else None
        self.encode_later, self.step, self.seq = encode_later, step, first_seq
        self.anchors = [{n: params[n].detach().to(torch.float32).clone() for n in f.names} for f in fragments]
        self.anchor_versions = list(versions) if versions is not None else [0] * len(fragments)
        self.tokens_since, self.steps_since = [0] * len(fragments), [0] * len(fragments)
        self.next_due = [schedule.next_due(p, step) for p in range(len(fragments))]
        """Per fragment, the step after which it is pushed next when the syncer named no time."""
        self.next_due_at: list[float | None] = [None] * len(fragments)
        """Per fragment, the time (own clock) the syncer asked for its next push."""
        self.in_flight: dict[int, InFlight] = {}
        self.tokens = 0
        """Tokens trained in this life."""
        self.step_time_s = 0.0
        self.now: float | None = None
        self.finished = False
        self.stale_updates = self.refused = 0
        self._last_push_norm: torch.Tensor | None = None
        self.last_staleness: int | None = None
        """Versions the fragment had moved on by others when the latest merge arrived."""
        self.merge_lags: list[int] = []
        """Per merge, inner steps from sending the push to merging its answer (τ at best)."""
        self.answer_delay_s = 0.0
        """The slowest answer so far, from sending the push to its arrival (own clock), late ones included."""
        self.answer_floor_s = ANSWER_FLOOR_S
        """The least time an answer is waited for (`ANSWER_FLOOR_S`; a test of the give-up lowers it)."""
        self.answers_given_up = 0
        self.given_up: dict[int, dict[int, float]] = {}  # per fragment, by seq: send times of pushes given up on
        self.waiting = False
        """The last `Advance` said to wait: an answer that arrives now may let the learner go on."""
        self.closing = False
        """`Finished` came: what it waits for, if anything, is its last answers (then it pushes the rest)."""

    # ------------------------------------------------------------ the driver's entry

    def handle(self, event: LearnerEvent, now: float | None = None) -> list[LearnerAction]:
        """Take one event; return what the driver must do, in order."""
        if isinstance(event, StepDone):
            self.waiting = False  # a driver that steps on has stopped waiting
            return [SendPush(p) for p in self.on_step(event.tokens, step_time_s=event.step_time_s, now=now)]
        if isinstance(event, Advance):
            actions = [] if event.last else self._advance(now)
            return actions + [SendProgress(self.progress())]
        if isinstance(event, UpdateArrived):
            self.on_update(event.update, now)
            return self._go_on(now) if self.waiting else []
        if isinstance(event, Tick):
            return self._go_on(now) if self.waiting else []
        if isinstance(event, PushRefused):
            self.on_refused(event.push)
            return []
        if isinstance(event, Finished):
            self.closing = True
            return self._close(now, wait=event.wait)
        raise TypeError(f"a learner core takes no {type(event).__name__}")

    def _go_on(self, now: float | None) -> list[LearnerAction]:
        """While waiting: a step's wait (merge and step on when its answers are in), or the close's."""
        return self._close(now) if self.closing else self._advance(now)

    def _close(self, now: float | None, wait: bool = True) -> list[LearnerAction]:
        """The last pushes, where the strategy waits for answers once the answers in flight that a last push
        would follow are in: the same pushes whenever those answers land (at τ or later), so that timing
        decides nothing. A fragment with no progress since its push in flight has no last push to wait for."""
        if wait and self.wait_for_updates:
            if now is not None:
                self.now = now
            self._give_up_late_answers()
            unanswered = tuple(p for p, flight in sorted(self.in_flight.items())
                               if flight.update is None and self.steps_since[p] > 0)
            if unanswered:
                self.waiting = True
                return [WaitFor(unanswered)]
        self.waiting = False
        return [SendPush(p) for p in self.finish(now)]

    def _advance(self, now: float | None) -> list[LearnerAction]:
        poll = self.poll(now)
        self.waiting = bool(poll.waiting_for)
        return [SendPush(p) for p in poll.pushes] + [WaitFor(poll.waiting_for) if self.waiting else NextStep()]

    # ------------------------------------------------------------ events

    def on_step(self, tokens: int, *, step_time_s: float = 0.0, now: float | None = None) -> list[Push]:
        """One inner step is done: count it, and push every fragment that is now due."""
        if self.finished:
            raise RuntimeError(f"learner {self.learner} reported a step after finish()")
        self.step += 1
        self.now = now
        if step_time_s > 0:
            old = self.step_time_s
            self.step_time_s = step_time_s if old == 0 else old + STEP_TIME_EMA * (step_time_s - old)
        self.tokens += tokens
        for p in range(len(self.fragments)):
            self.tokens_since[p] += tokens
            self.steps_since[p] += 1
        return self._push_due()

    def _push_due(self) -> list[Push]:
        return [self._push(p) for p in range(len(self.fragments)) if p not in self.in_flight and self._due(p)]

    def _due(self, p: int) -> bool:
        at = self.next_due_at[p]
        if at is None or self.now is None:
            return self.step >= self.next_due[p]
        return self.now >= at - self.step_time_s / 2  # this step's end is nearer to it than the next one's

    @property
    def overdue(self) -> set[int]:
        """Fragments due while their previous push is still in flight: pushed once its answer is merged."""
        return {p for p in self.in_flight if self._due(p)}

    def progress(self) -> Progress:
        """Where this learner stands, for the syncer's predictions and the shared budget."""
        return Progress(self.learner, self.step, self.tokens, self.step_time_s,
                        tuple(self._steps_to_push(p) * self.step_time_s for p in range(len(self.fragments))))

    def _steps_to_push(self, p: int) -> int:
        """Steps from now until the end of the step after which fragment p will be pushed."""
        at = self.next_due_at[p]
        if at is None or self.now is None or self.step_time_s <= 0:
            steps = self.next_due[p] - self.step
        else:
            steps = math.ceil((at - self.step_time_s / 2 - self.now) / self.step_time_s)
        flight = self.in_flight.get(p)
        if flight is not None:  # pushed again only once this answer is merged
            steps = max(steps, flight.merge_at_step - self.step)
        return max(1, steps)

    def credit(self, p: int, tokens: int, steps: int, step: int, due: bool) -> list[Push]:
        """For a learner driven by events rather than inner steps (a regional syncer, whose steps are
        its learners'): fragment p gained `tokens` over `steps`, the step counter is now `step`, and
        with `due` p is to be pushed: now, or once the answer to its push in flight is merged."""
        self.tokens_since[p] += tokens
        self.steps_since[p] += steps
        self.tokens += tokens
        self.step = max(self.step, step)
        if due:
            self.next_due[p], self.next_due_at[p] = self.step, None
        return self._push_due()

    def resume_at(self, step: int) -> None:
        """The driver restored a checkpoint taken after inner step `step`: the schedule by steps continues
        there (times the syncer named at the join stand: `push_at`)."""
        self.step = step
        self.next_due = [self.schedule.next_due(p, step) for p in range(len(self.fragments))]

    def push_at(self, times: dict[int, float]) -> None:
        """The syncer's grid, named at the join (`SendState.push_in_s`): when (own clock) to push these first."""
        for p, at in times.items():
            self.next_due_at[p] = at

    def on_update(self, update: Update, now: float | None = None) -> bool:
        """Keep an answer to the push in flight; drop (and return False) one that answers none, such as one
        to a push sent before a restart, or given up on (`ANSWER_PATIENCE`): its delay still counts, else a
        fast learner whose answers come late would give up every push, drop every answer, never merge."""
        flight = self.in_flight.get(update.fragment)
        if flight is None or flight.update is not None or update.ack_seq < flight.push.seq:
            self.stale_updates += 1
            late = self.given_up.get(update.fragment, {})
            answered = max((seq for seq in late if seq <= update.ack_seq), default=None)
            if answered is not None and now is not None:  # the push it answers, given up on: measured all the same
                self.answer_delay_s = max(self.answer_delay_s, now - late[answered])
                self.given_up[update.fragment] = {seq: t for seq, t in late.items() if seq > answered}
            return False
        flight.update = update
        if now is not None and flight.push.sent_at is not None:
            self.answer_delay_s = max(self.answer_delay_s, now - flight.push.sent_at)
        return True

    def _give_up_late_answers(self) -> None:
        """Push in flight whose answer is later than `ANSWER_PATIENCE` allows (a syncer that cannot make
        it): the learner trains on. Its progress was sent, so the anchor moves to what was sent, and the
        fragment's next push carries only what came after (based on the old version: merged as stale)."""
        if self.now is None or self.step_time_s <= 0:
            return
        measured = ANSWER_PATIENCE * max(self.schedule.H * self.step_time_s, self.answer_delay_s)
        bound = max(measured, self.answer_floor_s) if self.wait_for_updates else measured
        for p, flight in list(self.in_flight.items()):
            if flight.update is None and flight.push.sent_at is not None and self.now - flight.push.sent_at > bound:
                for name, sent in flight.sent_deltas.items():
                    self.anchors[p][name] = self.anchors[p][name] - sent
                del self.in_flight[p]
                (late := self.given_up.setdefault(p, {}))[flight.push.seq] = flight.push.sent_at
                if len(late) > GIVEN_UP_KEPT:
                    del late[min(late)]
                self.answers_given_up += 1

    def poll(self, now: float | None = None) -> Poll:
        """Merge every answer whose time has come; push what fell due meanwhile; say whether to wait."""
        if now is not None:
            self.now = now
        self._give_up_late_answers()
        for p, flight in sorted(self.in_flight.items()):
            if flight.update is not None and self.step >= flight.merge_at_step:
                self._merge(p, flight)
                del self.in_flight[p]
        pushes = self._push_due()
        if self.wait_for_updates:
            blocking = tuple(p for p, f in sorted(self.in_flight.items()) if self.step >= f.merge_at_step)
            return Poll(pushes, waiting_for=blocking)
        return Poll(pushes)

    def finish(self, now: float | None = None) -> list[Push]:
        """No more inner steps: push whatever progress no push has carried yet. An answer that has
        arrived is merged first, without waiting out τ (no step is left to overlap it with): the last
        push is then based on the newest version, and the final consolidation lands on the learners'
        own models rather than on an outer step they never merged. They ask for no answer: none is merged."""
        pushes = [push for p in range(len(self.fragments)) for push in self.finish_fragment(p, now, answered=False)]
        self.finished = True
        return pushes

    def finish_fragment(self, p: int, now: float | None = None, answered: bool = True) -> list[Push]:
        """`finish` for fragment p alone (a regional syncer's last round of p closed while its others go on;
        it merges the global answer): its last push, marked final, unless no progress is left to carry."""
        if now is not None:
            self.now = now
        flight = self.in_flight.get(p)
        if flight is not None and flight.update is not None:
            self._merge(p, flight)
            del self.in_flight[p]
            flight = None
        if self.steps_since[p] == 0:
            return []
        if flight is None:
            return [self._push(p, final=True, answered=answered)]
        deltas = {n: d - flight.sent_deltas[n] for n, d in self._deltas(p).items()}
        return [self._make_push(p, flight.push.base_version, deltas, final=True, answered=answered)]

    def on_refused(self, push: Push) -> None:
        """The syncer refused `push` (an outlier, a non-finite value): its progress is not merged. The
        fragment is free to be pushed again, and that push carries this progress (Δ is measured from
        the anchor) and its tokens."""
        flight = self.in_flight.get(push.fragment)
        if flight is not None and flight.push.seq == push.seq:
            del self.in_flight[push.fragment]
        self.tokens_since[push.fragment] += push.tokens
        self.steps_since[push.fragment] += push.steps
        self.refused += 1

    @property
    def last_push_norm(self) -> float | None:
        """L2 norm of the latest push's outer gradient (before encoding)."""
        return None if self._last_push_norm is None else float(self._last_push_norm)

    def unpushed_tokens(self) -> list[int]:
        """Per fragment, tokens trained that no push has carried: what a crash now would lose."""
        return list(self.tokens_since)

    # ------------------------------------------------------------ tensor work

    @torch.no_grad()
    def _deltas(self, p: int) -> dict[str, torch.Tensor]:
        anchor = self.anchors[p]
        return {n: anchor[n] - self.params[n].detach().to(torch.float32) for n in self.fragments[p].names}

    def encode(self, deltas: dict[str, torch.Tensor]) -> dict[str, Encoded]:
        """The uplink's encoding of one push, with error feedback when it is on. Calls must come in
        push order (the residuals carry over), from one thread at a time."""
        if self.feedback:
            return {name: self.feedback.encode(name, delta) for name, delta in deltas.items()}
        return {name: self.codec.encode(delta) for name, delta in deltas.items()}

    def _encode(self, deltas: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """What the syncer will decode, and the bytes it takes; or, encoding later, the raw deltas and
        the bytes they will take."""
        if self.encode_later:
            return deltas, sum(self.codec.wire_bytes(d.numel()) for d in deltas.values())
        encoded = self.encode(deltas)
        decoded = {name: self.codec.decode(e, device=deltas[name].device) for name, e in encoded.items()}
        return decoded, sum(e.wire_bytes() for e in encoded.values())

    def _make_push(self, p: int, base_version: int, deltas: dict[str, torch.Tensor], final: bool = False,
                   answered: bool = True) -> Push:
        self.seq += 1
        # Kept on the device and read only when asked: reading it would wait for the device.
        self._last_push_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d)
                                                                     for d in deltas.values()]))
        decoded, nbytes = self._encode(deltas)
        push = Push(self.learner, p, base_version, self.seq, decoded, self.tokens_since[p], self.steps_since[p],
                    step_time_s=self.step_time_s, sent_at=self.now, payload_bytes=nbytes, step=self.step,
                    final=final, answered=answered)
        self.tokens_since[p] = self.steps_since[p] = 0
        return push

    def _push(self, p: int, final: bool = False, answered: bool = True) -> Push:
        deltas = self._deltas(p)
        push = self._make_push(p, self.anchor_versions[p], deltas, final=final, answered=answered)
        self.in_flight[p] = InFlight(push, merge_at_step=self.step + self.tau, sent_deltas=deltas)
        self.next_due[p] = self.step + self.schedule.H
        self.next_due_at[p] = None
        return push

    @torch.no_grad()
    def _merge(self, p: int, flight: InFlight) -> None:
        update = flight.update
        anchor = self.anchors[p]
        for name in self.fragments[p].names:
            value = update.values[name]
            param = self.params[name]
            target = value.to(param.dtype)
            if self.keep_progress:  # Θ̃ + (θ − θ_sent), with θ_sent = anchor − sent Δ
                target = target + (param - anchor[name].to(param.dtype) + flight.sent_deltas[name].to(param.dtype))
            if self.alpha == 0.0:
                param.copy_(target)
            else:
                param.mul_(self.alpha).add_(target, alpha=1.0 - self.alpha)
            anchor[name] = value.to(torch.float32).clone()
        self.last_staleness = max(0, update.version - self.anchor_versions[p] - 1)
        self.merge_lags.append(self.step - flight.push.step)
        self.anchor_versions[p] = update.version
        if update.next_push_at is not None:
            self.next_due_at[p] = update.next_push_at
