"""The simulated driver: every learner really trains, in virtual-time order, over simulated links.

One process runs all learners. Each inner step takes a virtual duration from its learner's step
timer; the real forward and backward pass runs when the step's end event is processed, so events
interleave exactly as they would in time. Messages take `latency + bytes / bandwidth` on their
learner's link. The same seed gives the same run, event for event.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from diloco.config import Config
from diloco.core.learner import LearnerCore
from diloco.core.messages import Push, Update
from diloco.core.syncer import SyncerCore
from diloco.data import EvalBatches, ShardSampler, load_corpus
from diloco.fragments import Schedule, embedding_names, partition
from diloco.models.factory import ModelFactory, build_model
from diloco.sim.clock import EventQueue
from diloco.sim.link import Link
from diloco.sim.timing import StepTimer
from diloco.strategies import StrategySpec, build_strategy
from diloco.training import Replica, evaluate

Progress = Callable[[int, int], None]
"""Called with (tokens trained so far, token budget) as the run goes."""


@dataclass
class LearnerReport:
    learner: int
    speed: float
    tokens: int
    steps: int
    busy_s: float
    waiting_s: float
    busy_fraction: float
    bytes_up: int
    bytes_down: int


@dataclass
class RunResult:
    strategy: str
    learners: int
    tokens: int
    final_eval_loss: float
    virtual_wall_clock_s: float
    wire_bytes_up: int
    wire_bytes_down: int
    goodput: float
    """Fraction of all learners' time spent in inner steps."""
    peak_sync_bytes: int
    """Largest single sync message one learner sent (for data-parallel: one step's all-reduce share)."""
    rounds: int
    parameters: int
    per_learner: list[LearnerReport]
    eval_curve: list[dict[str, float]]
    config: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimLearner:
    index: int
    speed: float
    replica: Replica
    timer: StepTimer
    link: Link
    planned_steps: int
    core: LearnerCore | None = None
    tokens: int = 0
    busy_s: float = 0.0
    waiting_s: float = 0.0
    waiting_since: float | None = None
    finished: bool = False

    def wait(self, now: float) -> None:
        if self.waiting_since is None:
            self.waiting_since = now

    def resume(self, now: float) -> None:
        if self.waiting_since is not None:
            self.waiting_s += now - self.waiting_since
            self.waiting_since = None


class Simulation:
    def __init__(self, config: Config, factory: ModelFactory | None = None,
                 progress: Progress | None = None) -> None:
        self.config = config
        self.spec: StrategySpec = build_strategy(config)
        self.progress = progress
        t, d = config.train, config.data
        corpus = load_corpus(d.source, dtype=d.dtype, vocab_size=d.vocab_size, eval_fraction=d.eval_fraction)
        self.eval_batches = EvalBatches(corpus.eval, seq_len=t.seq_len, batch_size=t.batch_size,
                                        batches=t.eval_batches).batches
        base = build_model(config, corpus.vocab_size, factory)
        self.eval_model = copy.deepcopy(base)
        speeds = config.speeds()
        count = len(speeds)
        steps = t.tokens // (count * t.batch_size * t.seq_len)
        self.queue = EventQueue()
        self.learners = []
        for m, speed in enumerate(speeds):
            sampler = ShardSampler(corpus.train, learner=m, learners=count, seq_len=t.seq_len,
                                   batch_size=t.batch_size, seed=config.seed)
            self.learners.append(SimLearner(
                index=m, speed=speed, replica=Replica(copy.deepcopy(base), t, sampler, steps),
                timer=StepTimer(config.learners.step_time_s, speed, config.learners.jitter, config.seed, m),
                link=Link(config.link.bandwidth_mbit, config.link.latency_ms), planned_steps=steps))
        self.parameters = sum(p.numel() for p in base.parameters() if p.requires_grad)
        self.syncer: SyncerCore | None = None
        if self.spec.exchange == "outer":
            self._build_cores(base)
        self.budget = steps * count * t.batch_size * t.seq_len
        self.tokens_trained = 0
        self.eval_curve: list[dict[str, float]] = []
        self._eval_marks = [self.budget * k // t.eval_points for k in range(1, t.eval_points)]
        self.last_event_s = 0.0
        self._gradients_in: dict[int, float] = {}

    def _build_cores(self, base: nn.Module) -> None:
        spec = self.spec
        embeddings = embedding_names(base)
        fragments = partition(base, spec.fragments, embeddings)
        schedule = Schedule(spec.H, spec.fragments)
        for learner in self.learners:
            learner.core = LearnerCore(learner.index, learner.replica.named_params(), fragments, schedule,
                                       tau=spec.tau, alpha=spec.alpha, wait_for_updates=spec.wait_for_updates)
        params = {n: p for n, p in base.named_parameters() if p.requires_grad}
        self.syncer = SyncerCore(params, fragments, range(len(self.learners)), outer_lr=spec.outer_lr,
                                 momentum=spec.outer_momentum, merge_rule=spec.merge_rule, embeddings=embeddings)

    # ------------------------------------------------------------ the event loop

    def run(self) -> RunResult:
        torch.manual_seed(self.config.seed)
        for learner in self.learners:
            self._start_step(learner)
        handlers = {"step_end": self._on_step_end, "push": self._on_push, "update": self._on_update,
                    "allreduce_done": self._on_allreduce_done}
        while self.queue:
            kind, payload = self.queue.pop()
            handlers[kind](payload)
        return self._result()

    @property
    def now(self) -> float:
        return self.queue.now

    def _start_step(self, learner: SimLearner) -> None:
        duration = learner.timer.next()
        learner.busy_s += duration
        self.queue.schedule(self.now + duration, ("step_end", learner.index))

    def _on_step_end(self, m: int) -> None:
        learner = self.learners[m]
        self.last_event_s = max(self.last_event_s, self.now)
        if self.spec.exchange == "gradients":
            learner.tokens += learner.replica.compute_gradients()
            self._gradients_in[m] = self.now
            learner.wait(self.now)
            if len(self._gradients_in) == len(self.learners):
                self._all_reduce()
            return
        tokens = learner.replica.train_step()
        learner.tokens += tokens
        self._count_tokens(tokens)
        for push in learner.core.on_step(tokens):
            self._send_push(learner, push)
        if learner.replica.steps >= learner.planned_steps:
            learner.core.finish()
        self._advance(learner)

    def _advance(self, learner: SimLearner) -> None:
        poll = learner.core.poll()
        for push in poll.pushes:
            self._send_push(learner, push)
        if poll.done:
            learner.finished = True
        elif poll.waiting_for:
            learner.wait(self.now)
        else:
            self._start_step(learner)

    def _send_push(self, learner: SimLearner, push: Push) -> None:
        arrival = learner.link.up.send(self.now, push.wire_bytes())
        self.queue.schedule(arrival, ("push", push))

    def _on_push(self, push: Push) -> None:
        for publish in self.syncer.on_push(push):
            self.last_event_s = max(self.last_event_s, self.now)
            for m in publish.recipients:
                arrival = self.learners[m].link.down.send(self.now, publish.update.wire_bytes())
                self.queue.schedule(arrival, ("update", (m, publish.update)))

    def _on_update(self, payload: tuple[int, Update]) -> None:
        m, update = payload
        learner = self.learners[m]
        learner.core.on_update(update)
        if learner.waiting_since is not None and not learner.finished:
            learner.resume(self.now)
            self._advance(learner)

    # ------------------------------------------------------------ data-parallel

    def _all_reduce(self) -> None:
        """Average the gradients over learners; time a ring all-reduce over the slowest link."""
        replicas = [lr.replica for lr in self.learners]
        count = len(replicas)
        grad_bytes = 0
        with torch.no_grad():
            for params in zip(*(r.model.parameters() for r in replicas)):
                if params[0].grad is None:
                    continue
                mean = torch.stack([p.grad for p in params]).mean(dim=0)
                for p in params:
                    p.grad.copy_(mean)
                grad_bytes += mean.numel() * mean.element_size()
        share = 2 * (count - 1) * grad_bytes // count
        duration = 0.0
        if count > 1:
            bandwidth = min(min(lr.link.up.bandwidth_bps, lr.link.down.bandwidth_bps) for lr in self.learners)
            latency = max(lr.link.up.latency_s for lr in self.learners)
            duration = 2 * (count - 1) * (latency + grad_bytes / count * 8 / bandwidth)
            for learner in self.learners:
                learner.link.up.record(share)
                learner.link.down.record(share)
        self.queue.schedule(max(self._gradients_in.values()) + duration, ("allreduce_done", None))

    def _on_allreduce_done(self, _: None) -> None:
        self._gradients_in.clear()
        self.last_event_s = max(self.last_event_s, self.now)
        self._count_tokens(sum(lr.replica.sampler.batch_size * lr.replica.sampler.seq_len for lr in self.learners))
        for learner in self.learners:
            learner.resume(self.now)
            learner.replica.apply_gradients()
            if learner.replica.steps < learner.planned_steps:
                self._start_step(learner)
            else:
                learner.finished = True

    # ------------------------------------------------------------ evaluation and results

    def _count_tokens(self, tokens: int) -> None:
        self.tokens_trained += tokens
        while self._eval_marks and self.tokens_trained >= self._eval_marks[0]:
            self._eval_marks.pop(0)
            self._record_eval()
        if self.progress:
            self.progress(self.tokens_trained, self.budget)

    def global_model(self) -> nn.Module:
        """The model the run produced so far: Θ from the syncer, or the data-parallel replica."""
        if self.syncer is None:
            return self.learners[0].replica.model
        with torch.no_grad():
            for name, p in self.eval_model.named_parameters():
                if name in self.syncer.theta:
                    p.copy_(self.syncer.theta[name])
        return self.eval_model

    def _record_eval(self) -> None:
        loss = evaluate(self.global_model(), self.eval_batches)
        self.eval_curve.append({"time_s": self.now, "tokens": self.tokens_trained, "loss": loss})

    def _result(self) -> RunResult:
        unfinished = [lr.index for lr in self.learners if not lr.finished]
        if unfinished:
            raise RuntimeError(f"simulation ended with learners {unfinished} still waiting: a round never closed")
        wall = self.last_event_s
        self._record_eval()
        self.eval_curve[-1]["time_s"] = wall
        reports = [LearnerReport(
            learner=lr.index, speed=lr.speed, tokens=lr.tokens, steps=lr.replica.steps, busy_s=lr.busy_s,
            waiting_s=lr.waiting_s, busy_fraction=lr.busy_s / wall if wall else 1.0,
            bytes_up=lr.link.up.bytes_sent, bytes_down=lr.link.down.bytes_sent) for lr in self.learners]
        return RunResult(
            strategy=self.spec.name, learners=len(self.learners), tokens=sum(r.tokens for r in reports),
            final_eval_loss=self.eval_curve[-1]["loss"], virtual_wall_clock_s=wall,
            wire_bytes_up=sum(r.bytes_up for r in reports), wire_bytes_down=sum(r.bytes_down for r in reports),
            goodput=sum(r.busy_s for r in reports) / (wall * len(reports)) if wall else 1.0,
            peak_sync_bytes=max(lr.link.up.peak_message_bytes for lr in self.learners),
            rounds=self.syncer.rounds_closed if self.syncer else self.learners[0].replica.steps,
            parameters=self.parameters, per_learner=reports, eval_curve=self.eval_curve,
            config=self.config.to_dict())


def simulate(config: Config, factory: ModelFactory | None = None, progress: Progress | None = None) -> RunResult:
    """Run one configuration in the simulator and return what it measured."""
    return Simulation(config, factory, progress).run()
