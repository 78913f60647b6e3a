"""Exact wire bytes of a synchronous run, without training: the simulator's schedule replayed with its
own step timers (`sim/timing.py`), links (`network/links.py`) and event queue (`sim/event_queue.py`).

Most of a run's bytes follow from the schedule alone (every push, every progress report). Which answers
are sent does not: an answer goes only to a learner that has not finished, and near the end of a run
whether a round closes before its learners finish depends on the links' timing. So the replay walks the
run in virtual time, as the simulator does, with messages as byte counts instead of tensors, taking the
same decisions as the learner and syncer cores of a synchronous strategy:

- a learner pushes fragment p after the steps its schedule says (offset o_p, period H), sends a progress
  report after every step, waits at step t + τ until the answer to its push of step t is in, and at its
  last step pushes what no push has carried yet, then announces that it leaves;
- a round closes when every learner still in the run has pushed to it; its answers go to those of its
  participants that have not finished.

Each learner's messages take its ways to the fragments' homes over the simulator's own network
(`network/links.py`'s `Network`: with `[[regions]]` its LAN, then its region's WAN link to each home, shared with
the region's other learners), so that each link's bytes are the simulator's too (`ReplayResult.links`).

It covers `diloco` and `streaming` (every learner in every round) and data-parallel, without failures,
and without the regional tier (whose regional syncers decide from timings of their own).
Asynchronous strategies decide from timings the cores estimate as they go: for them the planner gives
steady-state rates, not totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco.config import Topology
from diloco.errors import DilocoError
from diloco.plan.layout import Layout, model_layout
from diloco.plan.wire import LEAVE_BYTES, all_reduce_share, progress_bytes, push_bytes, update_bytes
from diloco.results import traffic_fields
from diloco.sim.timing import Waiting

if TYPE_CHECKING:
    from diloco.config import Config
    from diloco.network.links import Routes
    from diloco.sim.timing import StepTimer
    from diloco.strategies import StrategySpec

MAX_EVENTS = 5_000_000
"""Steps × learners beyond which a replay would take minutes: the planner estimates instead."""


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
    steps = config.token_budget() // (len(config.speeds()) * config.train.batch_size * config.train.seq_len)
    if steps * len(config.speeds()) > MAX_EVENTS:
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
    return _SyncReplay(config, spec, layout).run()


# ---------------------------------------------------------------- data-parallel


def _data_parallel(config: Config, layout: Layout) -> ReplayResult:
    """Every step: each learner's step, then a ring all-reduce timed over the slowest link (a learner's
    whole route with regions: `sim/data_parallel.py`); its share is counted on every link, both ways."""
    from diloco.network.links import Network
    from diloco.sim.timing import StepTimer

    speeds = config.speeds()
    count, lc = len(speeds), config.learners
    steps = config.token_budget() // (count * config.train.batch_size * config.train.seq_len)
    grad_bytes = 4 * layout.parameters  # fp32 gradients of every trainable tensor
    share = all_reduce_share(grad_bytes, count)
    network = Network(config)
    links = [network.learner_link(m, []) for m in range(count)]
    bandwidth = min(min(lk.up.bandwidth_bps, lk.down.bandwidth_bps) for lk in links)
    latency = max(lk.up.latency_s for lk in links)
    duration = 2 * (count - 1) * (latency + grad_bytes / count * 8 / bandwidth) if count >= 2 else 0.0
    timers = [StepTimer(lc.step_time_s, v, lc.jitter, config.seed, m, lc.drift, lc.drift_steps)
              for m, v in enumerate(speeds)]
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
    next_due: list[int]
    steps_since: list[int]
    in_flight: dict[int, list] = field(default_factory=dict)
    """Per fragment in flight: [step at which its answer is merged, whether the answer is in]."""
    step: int = 0
    waiting_since: float | None = None
    waiting_s: float = 0.0
    finished: bool = False


class _SyncReplay:
    def __init__(self, config: Config, spec: StrategySpec, layout: Layout) -> None:
        from diloco.fragments import Schedule
        from diloco.sim.event_queue import EventQueue
        from diloco.network.links import Network
        from diloco.sim.timing import StepTimer

        c, lc = config.codec, config.learners
        fragments = layout.fragments
        self.count = len(fragments)
        self.push = [push_bytes(f.tensors, c.up, c.block) for f in fragments]
        self.update = [update_bytes(f.tensors, c.down, c.block) for f in fragments]
        self.progress = progress_bytes(self.count)
        self.tau = spec.tau
        speeds = config.speeds()
        self.steps = config.token_budget() // (len(speeds) * config.train.batch_size * config.train.seq_len)
        self.queue = EventQueue()
        self.schedules = [Schedule(spec.period(m), self.count) for m in range(len(speeds))]
        self.network = Network(config)
        home_of = Topology(config).fragment_homes(self.count)
        self.learners = [
            _Learner(m, StepTimer(lc.step_time_s, v, lc.jitter, config.seed, m, lc.drift, lc.drift_steps),
                     self.network.learner_link(m, [], home_of),
                     [self.schedules[m].next_due(p, 0) for p in range(self.count)], [0] * self.count)
            for m, v in enumerate(speeds)]
        self.alive = set(range(len(speeds)))
        self.pending: list[set[int]] = [set() for _ in range(self.count)]
        self.last_event = 0.0

    def run(self) -> ReplayResult:
        for learner in self.learners:
            self._start_step(learner)
        handlers = {"step": self._on_step_end, "push": self._on_push, "left": self._on_left,
                    "update": self._on_update}
        while self.queue:
            kind, m, p = self.queue.pop()
            handlers[kind](self.learners[m], p)
        return ReplayResult([lr.link.up.bytes_sent for lr in self.learners],
                            [lr.link.down.bytes_sent for lr in self.learners],
                            [lr.waiting_s for lr in self.learners], self.last_event,
                            max(lr.link.up.peak_message_bytes for lr in self.learners), self.steps,
                            traffic_fields(self.network.link_entries(self.last_event))["links"])

    @property
    def now(self) -> float:
        return self.queue.now

    # ---------------------------------------------------------- the learner's side

    def _start_step(self, learner: _Learner) -> None:
        self.queue.schedule(self.now + learner.timer.next(), ("step", learner.index, -1))

    def _on_step_end(self, learner: _Learner, _: int) -> None:
        self.last_event = max(self.last_event, self.now)
        learner.step += 1
        learner.steps_since = [s + 1 for s in learner.steps_since]
        self._push_due(learner)
        learner.link.up.send(self.now, self.progress)
        if learner.step >= self.steps:
            self._finish(learner)
        else:
            self._advance(learner)

    def _push_due(self, learner: _Learner) -> None:
        for p in range(self.count):
            if p not in learner.in_flight and learner.step >= learner.next_due[p]:
                self._send_push(learner, p)
                learner.in_flight[p] = [learner.step + self.tau, False]
                learner.next_due[p] = learner.step + self.schedules[learner.index].H

    def _send_push(self, learner: _Learner, p: int) -> None:
        learner.steps_since[p] = 0
        arrival = learner.link.up.send(self.now, self.push[p], p)
        self.queue.schedule(arrival, ("push", learner.index, p))

    def _merge_arrived(self, learner: _Learner, due_only: bool) -> None:
        for p, (merge_at, arrived) in sorted(learner.in_flight.items()):
            if arrived and (learner.step >= merge_at or not due_only):
                del learner.in_flight[p]

    def _advance(self, learner: _Learner) -> None:
        self._merge_arrived(learner, due_only=True)
        self._push_due(learner)
        if any(learner.step >= merge_at for merge_at, _ in learner.in_flight.values()):
            learner.wait(self.now)
        else:
            learner.resume(self.now)
            self._start_step(learner)

    def _finish(self, learner: _Learner) -> None:
        """The last step: merge what has arrived, push what no push carried yet, leave."""
        learner.finished = True
        learner.resume(self.now)
        self._merge_arrived(learner, due_only=False)
        for p in range(self.count):
            if learner.steps_since[p]:
                self._send_push(learner, p)
        arrival = learner.link.up.send(self.now, LEAVE_BYTES)
        self.queue.schedule(arrival, ("left", learner.index, -1))

    def _on_update(self, learner: _Learner, p: int) -> None:
        flight = learner.in_flight.get(p)
        if learner.finished or flight is None or flight[1]:
            return
        flight[1] = True
        if learner.waiting_since is not None:
            self._advance(learner)

    # ---------------------------------------------------------- the syncer's side

    def _on_push(self, learner: _Learner, p: int) -> None:
        self.pending[p].add(learner.index)
        self._evaluate(p)

    def _on_left(self, learner: _Learner, _: int) -> None:
        self.alive.discard(learner.index)
        for p in range(self.count):
            self._evaluate(p)

    def _evaluate(self, p: int) -> None:
        """Synchronous: a round closes once every learner still in the run has pushed to it."""
        if not self.pending[p] or not self.alive <= self.pending[p]:
            return
        self.last_event = max(self.last_event, self.now)
        for m in sorted(self.pending[p]):
            learner = self.learners[m]
            if not learner.finished:
                arrival = learner.link.down.send(self.now, self.update[p], p)
                self.queue.schedule(arrival, ("update", m, p))
        self.pending[p] = set()
