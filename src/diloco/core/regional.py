"""A regional syncer: the syncer of its region's learners, and one learner of the global syncer.

The learners of a region push to it over their LAN and are answered by it. It merges their pushes into
the region's copy of Θ (Θ_r) in rounds of its own, a `SyncerCore` with everything the global syncer
does (quorum, pacing, liveness, checks, the ledger), and carries the region's progress to the global
syncer over the WAN as one learner would, a `LearnerCore` whose parameters are Θ_r:

- After every `push_every`-th regional round of a fragment it pushes Δ = anchor − Θ_r: the region's
  merged progress since the version of Θ it last took, with the tokens and steps those rounds merged.
  One push per region instead of one per learner is where the WAN bytes go down.
- The global answer Θ̃ is merged as a learner merges with keep-progress: Θ_r ← Θ̃ + (Θ_r − Θ_r,sent).
  The difference reaches the region's learners with the fragment's next regional round
  (`SyncerCore.correct`), in a version like any other, so what each learner holds stays known bit for
  bit.
- A regional round's own step is an average by default (lr 1, no momentum: Θ_r moves by its learners'
  mean progress, scaled by the round's share), so the outer optimizer is the global syncer's alone.

Counting: the global syncer checks the region's counters as any learner's (`claims.py`). Its step counter
is the inner steps its learners reported plus the steps its rounds merged (both only rise), so tokens
≤ steps × tokens-per-step holds of every report and push; a round merges many steps at once, which the
region declares as its burst. Per learner and fragment, tokens merged here but not yet sent up are
`pending`: what this syncer's death loses (`lose`). Tokens in a push on its way are not lost: the
global syncer merges it whether or not its sender is still there to hear the answer.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from diloco.core.events import (HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived, PushArrived,
                                SyncerEvent)
from diloco.core.learner_core import LearnerCore
from diloco.core.messages import Progress, Push, Update
from diloco.core.actions import Action, RunOver, Timer
from diloco.core.syncer_core import SyncerCore

__all__ = ["RegionalSyncer", "Upstream"]

HOLD_FALLBACK_S = 30.0
"""Longest answers wait for the global answer before the region's pacing has measured its period."""


class Upstream:
    """An action: carry `event` to the global syncer, over the region's route to it."""

    __slots__ = ("event",)

    def __init__(self, event: SyncerEvent) -> None:
        self.event = event

    def __repr__(self) -> str:
        return f"Upstream({self.event!r})"


class RegionalSyncer:
    def __init__(self, region: int, down: SyncerCore, up: LearnerCore, *, push_every: int = 1,
                 global_period: int = 1) -> None:
        """`region`: its id among the global syncer's learners. `global_period`: H, which turns the
        regional sync period into the step time the global syncer's pacing expects."""
        self.region, self.down, self.up = region, down, up
        self.push_every, self.global_period = push_every, global_period
        self.rounds_since = dict.fromkeys(down.fragments, 0)
        self.pending: dict[int, dict[int, list[int]]] = {p: {} for p in down.fragments}
        """Per fragment and learner, tokens merged here (on time, stale) since the fragment's last push up."""
        self.sent: dict[int, tuple[int, dict[int, list[int]]]] = {}
        """By sequence number of a push on its way up: its fragment and its learners' tokens."""
        self.sent_total: dict[int, dict[int, list[int]]] = {}
        """Per learner and fragment, tokens (on time, stale) that went up in this life: what outlives it."""
        self.heard_steps = 0
        self.merged_steps = 0
        self._life_step: dict[int, int] = {}
        """Per learner, the highest step it reported in this life."""
        self._life_tokens: dict[int, int] = {}
        """Per learner, the most tokens it reported in this life."""
        self._tokens_banked = 0
        """Tokens its learners reported in their earlier lives."""
        self._forwarded_at = 0
        self._rounds_seen = len(down.rounds)
        self.held_since: dict[int, float] = {}
        """Per fragment whose last round's answers wait for the global answer, since when."""
        down.defer = self._holds
        self.left = False
        """It pushed its final progress and left the global syncer."""

    # ------------------------------------------------------------ counters

    @staticmethod
    def burst_steps(learners: int, H: int, push_every: int) -> int:
        """The most one of a region's claims may add at once: a round of every learner's push of a fragment,
        a few periods each (a learner whose push waited on an answer pushes more steps)."""
        return 4 * max(1, learners) * H * push_every

    @property
    def step(self) -> int:
        """The region's step counter, as the global syncer sees it."""
        return self.heard_steps + self.merged_steps

    def tokens(self) -> int:
        """The region's tokens as it claims them: each learner's highest report in each of its lives. Reports
        can arrive out of order; a claim that went down and up again would look like tokens without steps."""
        return self._tokens_banked + sum(self._life_tokens.values())

    def progress(self, now: float) -> Progress:
        down = self.down
        period = down.pacer.sync_period_s(down.alive) if down.pacer is not None else None
        steps = [down.step_time[m] for m in down.alive if m in down.step_time]
        step_time = period / self.global_period if period else (min(steps) if steps else 0.0)
        return Progress(self.region, self.step, self.tokens(), step_time,
                        tuple(self._due_in(p, now, period) for p in sorted(down.fragments)))

    def _due_in(self, p: int, now: float, period: float | None) -> float:
        """How long until the region pushes fragment p next: when its next round has every learner's push
        (as its learners predict them), else when the pacing grid says, else a period from now."""
        down = self.down
        if down.pacer is not None:
            predicted = [down.pacer.predict(m, p) for m in down.alive - down.fragments[p].pending.keys()]
            if predicted and all(t is not None for t in predicted):
                return max(0.0, max(predicted) - now)
        target = down.fragments[p].target
        return max(0.0, target - now) if target is not None else (period or 0.0)

    def _hear(self, learner: int, step: int, tokens: int) -> None:
        """A learner's accepted report: its steps count for the region's."""
        last = self._life_step.get(learner)
        if last is None:  # a new life: its tokens so far, in steps
            rise = math.ceil(tokens / self.down.claims.tokens_per_step(learner))
        else:
            rise = max(0, step - last)
        self._life_step[learner] = step if last is None else max(last, step)
        self._life_tokens[learner] = max(self._life_tokens.get(learner, 0), tokens)
        self.heard_steps += rise

    # ------------------------------------------------------------ holding answers for the global one

    def _holds(self, p: int) -> bool:
        """A round that will be pushed up holds its answers until the global answer is merged: its learners
        then get the global Θ (with the region's progress since) at once, as they would without the tier,
        rather than a round later. Rounds that stay in the region are answered at once."""
        return self.rounds_since[p] + 1 >= self.push_every

    def hold_s(self) -> float:
        """Longest a round's answers wait for the global answer (it was lost, or the global syncer is
        down): then they go with the region's Θ alone; the global answer, when it comes, rides the next round."""
        down = self.down
        period = down.pacer.sync_period_s(down.alive) if down.pacer is not None else None
        return period if period else HOLD_FALLBACK_S

    def _release(self, p: int) -> list[Action]:
        self.held_since.pop(p, None)
        return self.down.release(p)

    # ------------------------------------------------------------ from its learners

    def handle(self, event: SyncerEvent, now: float) -> list[Action | Upstream]:
        """An event from one of its learners (or its own timer), as `SyncerCore.handle` takes it; the
        actions for its learners come back with those for the global syncer (`Upstream`)."""
        actions = self.down.handle(event, now)  # a refused event raises here, with nothing changed
        if isinstance(event, LearnerRejoined):  # a new life: its counters start again
            self._life_step.pop(event.learner, None)
            self._tokens_banked += self._life_tokens.pop(event.learner, 0)
        elif isinstance(event, ProgressArrived):
            self._hear(event.report.learner, event.report.step, event.report.tokens)
        elif isinstance(event, HeartbeatArrived):
            self._hear(event.learner, event.step, event.tokens)
        out = self._after(actions, now)
        for p, since in list(self.held_since.items()):
            if now >= since + self.hold_s():
                out += self._release(p)
        if self.step - self._forwarded_at >= max(1, len(self.down.alive)) and not self.left:
            self._forwarded_at = self.step
            out.append(Upstream(ProgressArrived(self.progress(now))))
        return out

    def beat(self, now: float) -> list[Upstream]:
        """Its own heartbeat to the global syncer (every HEARTBEAT_S): the region lives while it does."""
        if self.left:
            return []
        return [Upstream(HeartbeatArrived(self.region, step=self.step, tokens=self.tokens()))]

    def _after(self, actions: list[Action], now: float) -> list[Action | Upstream]:
        out: list[Action | Upstream] = []
        over = False
        for action in actions:
            over |= isinstance(action, RunOver)
            out.append(action)
        for record in self.down.rounds[self._rounds_seen:]:
            out += self._merged_round(record.fragment, record.participants, record.tokens_each, record.staleness,
                                      record.steps, record.final, now)
        self._rounds_seen = len(self.down.rounds)
        for p, state in self.down.fragments.items():
            if state.deferred and p not in self.held_since:
                self.held_since[p] = now
                out.append(Timer(now + self.hold_s()))
        if over and self.down.stopped and not self.left:
            out += self._leave(now)
        return out

    def _merged_round(self, p: int, participants: tuple[int, ...], tokens: tuple[int, ...],
                      staleness: tuple[int, ...], steps: int, final: bool, now: float) -> list[Upstream]:
        """A regional round of fragment p closed: Θ_r moved, the region's progress grew. The region's last
        round of p (`final`) goes up at once, marked final like a learner's last push, so that the global
        syncer's last round of p gathers every region's as soon as each has it (not when the region's
        other fragments are done too and it leaves)."""
        for m, t, behind in zip(participants, tokens, staleness):
            self.pending[p].setdefault(m, [0, 0])[1 if behind else 0] += t
        self.merged_steps += steps
        with torch.no_grad():
            for n in self.down.fragments[p].fragment.names:
                self.up.params[n].copy_(self.down.theta[n])
        self.rounds_since[p] += 1
        due = self.rounds_since[p] >= self.push_every and not final
        if due:
            self.rounds_since[p] = 0
        pushes = self.up.credit(p, sum(tokens), steps, self.step, due=due)
        if final:
            pushes += self.up.finish_fragment(p, now)
        return self._sent(pushes)

    def _sent(self, pushes: list[Push]) -> list[Upstream]:
        for push in pushes:
            carried = self.pending[push.fragment]
            self.sent[push.seq] = (push.fragment, carried)
            self.pending[push.fragment] = {}
            for m, (on_time, stale) in carried.items():
                total = self.sent_total.setdefault(m, {}).setdefault(push.fragment, [0, 0])
                total[0], total[1] = total[0] + on_time, total[1] + stale
        return [Upstream(PushArrived(push)) for push in pushes]

    def _leave(self, now: float) -> list[Upstream]:
        """Its learners are done and the run is over: push what is left, marked final, and leave."""
        self.left = True
        out = self._sent(self.up.finish(now))
        return out + [Upstream(LearnerLeft(self.region, finished=True))]

    # ------------------------------------------------------------ from the global syncer

    def on_upstream(self, update: Update, now: float) -> list[Action | Upstream]:
        """The global syncer's answer to the region's push: merged into Θ_r (as a correction that its
        learners get with their next round), and what fell due meanwhile pushed."""
        p = update.fragment
        flight = self.up.in_flight.get(p)
        # The global syncer's pacing is for learners on a step schedule: the region pushes after its rounds.
        if not self.up.on_update(replace(update, next_push_at=None)):
            return []
        names = self.down.fragments[p].fragment.names
        before = {n: self.up.params[n].clone() for n in names}
        pushes = self.up.poll(now).pushes
        out: list[Action | Upstream] = []
        if self.up.in_flight.get(p) is not flight:  # merged
            self.down.correct(p, {n: self.up.params[n] - before[n] for n in names})
            for seq in [s for s, (q, _) in self.sent.items() if q == p and s <= update.ack_seq]:
                del self.sent[seq]
            out += self._release(p)
        return out + self._sent(pushes)

    def on_refused(self, push: Push) -> list[Action]:
        """The global syncer refused a push: its progress and tokens go with the fragment's next one, and
        the answers held for it go now."""
        self.up.on_refused(push)
        _, back = self.sent.pop(push.seq, (push.fragment, {}))
        for m, (on_time, stale) in back.items():
            kept = self.pending[push.fragment].setdefault(m, [0, 0])
            kept[0], kept[1] = kept[0] + on_time, kept[1] + stale
            total = self.sent_total[m][push.fragment]
            total[0], total[1] = total[0] - on_time, total[1] - stale
        return self._release(push.fragment)

    def on_stop(self) -> list[Action | Upstream]:
        """The global syncer's word that the budget is spent: its learners stop and push their last."""
        actions = self.down.stop()
        if not self.down.alive and not self.left:  # nobody left here to push a last time
            return [*actions, *self._leave(self.down.claims.clock)]
        return actions

    def lose(self) -> dict[int, dict[int, tuple[int, int]]]:
        """It dies: per learner and fragment, the tokens merged here (on time, stale) that never went up."""
        lost: dict[int, dict[int, tuple[int, int]]] = {}
        for p, tokens in self.pending.items():
            for m, (on_time, stale) in tokens.items():
                lost.setdefault(m, {})[p] = (on_time, stale)
        return lost
