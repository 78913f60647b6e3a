"""Exact wire bytes of a synchronous run, without training: the simulator's run replayed with its own
cores, step timers (`virtual_run/step_timer.py`), links (`network/links.py`) and event queue
(`virtual_run/event_queue.py`).

Most of a run's bytes follow from the schedule alone (every push, every progress report). Which answers
are sent does not: an answer goes only to a learner that has not left (one that waits for its answers
takes the last ones before its last pushes), and near the end of a run
whether a round closes before its learners finish depends on the links' timing. So the replay walks the
run in virtual time, as the simulator does, with messages as byte counts instead of tensors, and the
strategy's own learner and syncer cores (`spec.learner_core`, `spec.syncer_core`) decide every push,
round and answer, as they do in both drivers: nothing is decided here.

Each learner's messages take its ways to the fragments' homes over the simulator's own network
(`network/links.py`'s `Network`: with `[[regions]]` its LAN, then its region's WAN link to each home, shared with
the region's other learners), so that each link's bytes are the simulator's too (`ReplayResult.links`).

It covers `diloco` and `streaming` (every learner in every round) and data-parallel, without failures,
and without the regional tier (whose regional syncers decide from timings of their own).
Asynchronous strategies decide from timings the cores estimate as they go: for them the planner gives
steady-state rates, not totals.
"""

from __future__ import annotations

from diloco.config import Topology
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from diloco.core.events import (HeartbeatArrived, LearnerLeft, ProgressArrived, PushArrived, SyncerEvent,
                                TimerFired)
from diloco.core.learner_core import LearnerCore
from diloco.core.learner_events import Finished, LearnerAction, SendPush, UpdateArrived
from diloco.core.liveness import HEARTBEAT_S
from diloco.core.messages import Push, Update
from diloco.core.syncer_core import Action, Publish, Timer
from diloco.driver_kit.schedule import learner_plans
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.network.links import Network
from diloco.plan.layout import Layout, model_layout
from diloco.plan.wire import LEAVE_BYTES, all_reduce_share, push_bytes, update_bytes
from diloco.results import traffic_fields
from diloco.virtual_run.event_queue import EventQueue
from diloco.virtual_run.push_order import InOrder
from diloco.virtual_run.step_timer import StepTimer, Waiting

if TYPE_CHECKING:
    from diloco.config import Config
    from diloco.network.links import Routes
    from diloco.strategies import StrategySpec

MAX_EVENTS = 500_000
"""Steps × learners beyond which a replay (the real cores, a fraction of a millisecond a learner-step) would take
minutes: the planner estimates instead."""


@dataclass
class ReplayResult:
    bytes_up: list[int]
    bytes_down: list[int]
    waiting_s: list[float]
    training_time_s: float
    peak_sync_bytes: int
    steps: int
    links: list[dict] = field(default_factory=list)
    """Per link (with regions), as `diloco sim`'s summary lists them: name, kind, bytes each way."""

    @property
    def wire_bytes(self) -> tuple[int, int]:
        return sum(self.bytes_up), sum(self.bytes_down)


def replay_problem(config: Config, spec: StrategySpec | None = None) -> str | None:
    """Why this config cannot be replayed exactly, or None when it can."""
    from diloco.strategies import build_strategy

    spec = spec or build_strategy(config)
    f = config.failures
    if f.crashes or f.mtbf_s > 0 or f.outages:
        return "failures are configured (crashes or outages)"
    if spec.exchange == "gradients":
        return None
    if Topology(config).tiered:
        return "the regional tier's syncers decide from timings of their own"
    if spec.quorum is not None or spec.shared_budget or spec.pacing or not spec.wait_for_updates:
        return f"{spec.name} is asynchronous: its rounds depend on timings the syncer estimates as it goes"
    plans = learner_plans(config, spec=spec)
    steps = max(p.last_step for p in plans)
    if steps * len(plans) > MAX_EVENTS:
        return f"the run is too long to replay ({steps:,} steps per learner)"
    return None


def predicted_wire_bytes(config: Config, layout: Layout | None = None) -> tuple[int, int]:
    """(wire_bytes_up, wire_bytes_down) of `diloco sim` on this config, exactly."""
    return replay(config, layout).wire_bytes


def replay(config: Config, layout: Layout | None = None) -> ReplayResult:
    """Replay the run; DilocoError if it is not one the replay covers."""
    from diloco.strategies import build_strategy

    spec = build_strategy(config)
    problem = replay_problem(config, spec)
    if problem is not None:
        raise DilocoError(f"cannot replay this run exactly: {problem}")
    layout = layout or model_layout(config, spec.fragments)
    if spec.exchange == "gradients":
        return _data_parallel(config, layout)
    return _CoreReplay(config, spec, layout).run()


# ---------------------------------------------------------------- data-parallel


def _data_parallel(config: Config, layout: Layout) -> ReplayResult:
    """Every step: each learner's step, then a ring all-reduce timed over the slowest link (a learner's
    whole route with regions: `sim/data_parallel.py`); its share is counted on every link, both ways."""
    plans = learner_plans(config)
    count, lc = len(plans), config.learners
    steps = plans[0].last_step
    grad_bytes = 4 * layout.parameters  # fp32 gradients of every trainable tensor
    share = all_reduce_share(grad_bytes, count)
    network = Network(config)
    links = [network.learner_link(m, []) for m in range(count)]
    bandwidth = min(min(lk.up.bandwidth_bps, lk.down.bandwidth_bps) for lk in links)
    latency = max(lk.up.latency_s for lk in links)
    duration = 2 * (count - 1) * (latency + grad_bytes / count * 8 / bandwidth) if count >= 2 else 0.0
    timers = [StepTimer(lc.step_time_s, p.speed, lc.jitter, config.seed, m, lc.drift, lc.drift_steps)
              for m, p in enumerate(plans)]
    now, waiting = 0.0, [0.0] * count
    for _ in range(steps):
        ends = [now + timer.next() for timer in timers]
        now = max(ends) + duration
        for m, end in enumerate(ends):
            waiting[m] += now - end
    total = steps * share
    for link in links:  # every step's share, counted at once
        link.up.record(total)
        link.down.record(total)
    return ReplayResult([total] * count, [total] * count, waiting, now, share, steps,
                        traffic_fields(network.link_entries(now))["links"])


# ---------------------------------------------------------------- synchronous outer strategies


@dataclass
class _Learner(Waiting):
    index: int
    timer: StepTimer
    link: Routes
    core: LearnerCore
    waiting_since: float | None = None
    waiting_s: float = 0.0
    finished: bool = False


class _CoreReplay:
    """The simulator's run with its own cores (`spec.learner_core`, `spec.syncer_core`) deciding, and
    messages as byte counts: the cores hold stand-in tensors of one element per tensor of the model, since
    what they decide (pushes, rounds, answers) does not depend on the values, and each message's bytes
    come from the layout. The learners' side follows the simulator's step sequence
    (`sim/learner_steps.py`); the syncer's, its shell (`sim/syncer_shell.py`)."""

    def __init__(self, config: Config, spec: StrategySpec, layout: Layout) -> None:
        c, lc, t = config.codec, config.learners, config.train
        fragments = [Fragment(f.index, tuple(f"{f.index}.{i}" for i in range(len(f.tensors))), f.numel, f.embedding)
                     for f in layout.fragments]
        stand_in = {n: torch.zeros(1) for f in fragments for n in f.names}
        embeddings = {n for f in fragments if f.embedding for n in f.names}
        self.push = [push_bytes(f.tensors, c.up, c.block) for f in layout.fragments]
        self.update = [update_bytes(f.tensors, c.down, c.block) for f in layout.fragments]
        self.tokens_per_step = t.batch_size * t.seq_len
        plans = learner_plans(config, spec=spec)
        self.last_step = [p.last_step for p in plans]
        self.queue = EventQueue()
        self.network = Network(config)
        home_of = Topology(config).fragment_homes(len(fragments))
        self.syncer = spec.syncer_core(stand_in, fragments, range(len(plans)), embeddings=embeddings)
        self.learners = []
        for m, plan in enumerate(plans):
            self.syncer.declare(m, self.tokens_per_step)
            self.syncer.rejoin_state(m, after_seq=0)
            params = {n: v.clone() for n, v in stand_in.items()}
            self.learners.append(_Learner(
                m, StepTimer(lc.step_time_s, plan.speed, lc.jitter, config.seed, m, lc.drift, lc.drift_steps),
                self.network.learner_link(m, [], home_of), spec.learner_core(m, params, fragments)))
        self.in_order: InOrder = InOrder()
        self.last_event = 0.0

    def run(self) -> ReplayResult:
        for learner in self.learners:
            self._start_step(learner)
            self.queue.schedule(HEARTBEAT_S, ("beat", learner.index, None))
        handlers = {"step": self._on_step_end, "beat": self._on_beat, "syncer": self._on_arrival,
                    "update": self._on_update}
        while self.queue:
            kind, m, payload = self.queue.pop()
            handlers[kind](self.learners[m] if m is not None else None, payload)
        return ReplayResult([lr.link.up.bytes_sent for lr in self.learners],
                            [lr.link.down.bytes_sent for lr in self.learners],
                            [lr.waiting_s for lr in self.learners], self.last_event,
                            max(lr.link.up.peak_message_bytes for lr in self.learners), max(self.last_step),
                            traffic_fields(self.network.link_entries(self.last_event))["links"])

    @property
    def now(self) -> float:
        return self.queue.now

    # ---------------------------------------------------------- the learner's side

    def _start_step(self, learner: _Learner) -> None:
        self.queue.schedule(self.now + learner.timer.next(), ("step", learner.index, None))

    def _on_beat(self, learner: _Learner, _: None) -> None:
        if learner.finished and not learner.core.waiting:
            return
        report = learner.core.progress()
        beat = HeartbeatArrived(learner.index, step=report.step, tokens=report.tokens)
        self.queue.schedule(learner.link.up.signal(self.now), ("syncer", None, beat))
        self.queue.schedule(self.now + HEARTBEAT_S, ("beat", learner.index, None))

    def _on_step_end(self, learner: _Learner, _: None) -> None:
        self.last_event = max(self.last_event, self.now)
        for push in learner.core.on_step(self.tokens_per_step, step_time_s=learner.timer.last_s, now=self.now):
            self._send_push(learner, push)
        if learner.core.step >= self.last_step[learner.index]:
            self._send_progress(learner)
            self._finish(learner)
            return
        self._advance(learner)
        self._send_progress(learner)

    def _send_progress(self, learner: _Learner) -> None:
        report = learner.core.progress()
        arrival = learner.link.up.send(self.now, report.wire_bytes())
        self.queue.schedule(arrival, ("syncer", None, ProgressArrived(report)))

    def _send_push(self, learner: _Learner, push: Push) -> None:
        self.in_order.sent(learner.index, push.seq)
        arrival = learner.link.up.send(self.now, self.push[push.fragment], push.fragment)
        self.queue.schedule(arrival, ("syncer", None, PushArrived(push)))

    def _advance(self, learner: _Learner) -> None:
        poll = learner.core.poll(self.now)
        for push in poll.pushes:
            self._send_push(learner, push)
        if poll.waiting_for:
            learner.wait(self.now)
        else:
            learner.resume(self.now)
            self._start_step(learner)

    def _finish(self, learner: _Learner) -> None:
        """The last step: push what no push carried yet (a learner that waits for its answers takes its last
        ones first, as its core decides), then leave."""
        learner.finished = True
        learner.resume(self.now)
        self._closing(learner, learner.core.handle(Finished(), self.now))

    def _closing(self, learner: _Learner, actions: list[LearnerAction]) -> None:
        for action in actions:
            if isinstance(action, SendPush):
                self._send_push(learner, action.push)
        if learner.core.waiting:  # not a wait of training (there is none left): not in `waiting_s`
            return
        arrival = learner.link.up.send(self.now, LEAVE_BYTES)
        self.queue.schedule(arrival, ("syncer", None, LearnerLeft(learner.index, finished=True)))

    def _on_update(self, learner: _Learner, update: Update) -> None:
        if learner.finished:
            if learner.core.waiting:  # its last answers, before its last pushes
                self._closing(learner, learner.core.handle(UpdateArrived(update), self.now))
            return
        learner.core.on_update(update)
        if learner.waiting_since is not None:
            self._advance(learner)

    # ---------------------------------------------------------- the syncer's side

    def _on_arrival(self, _: None, event: SyncerEvent) -> None:
        events = self.in_order.arrived(event.push.learner, event.push.seq, event) \
            if isinstance(event, PushArrived) else [event]
        for event in events:
            self._carry_out(self.syncer.handle(event, self.now))

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Timer):
                self.queue.schedule(action.at, ("syncer", None, TimerFired()))
            elif isinstance(action, Publish):
                self.last_event = max(self.last_event, self.now)
                for m, update in action.updates.items():
                    learner = self.learners[m]
                    if not learner.finished or learner.core.waiting:
                        arrival = learner.link.down.send(self.now, self.update[update.fragment], update.fragment)
                        self.queue.schedule(arrival, ("update", m, update))
