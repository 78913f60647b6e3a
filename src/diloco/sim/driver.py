"""The simulated driver: every learner really trains, in virtual-time order, over simulated links.

One process runs all learners. Each inner step takes a virtual duration from its learner's step
timer; the real forward and backward pass runs when the step's end event is processed, so events
interleave exactly as they would in time. Messages take `latency + bytes / bandwidth` on their
learner's link, queued behind each other, held up by outages. Learners crash and come back as the
failure plan says. The same seed gives the same run, event for event.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from diloco.codecs import get_codec
from diloco.config import Config
from diloco.core.accounting import by_parameters, learner_round_stats, round_stats, tokens_of
from diloco.core.learner import LearnerCore
from diloco.core.messages import MESSAGE_HEADER_BYTES, Progress, Push, Update, tensors_wire_bytes
from diloco.core.syncer import Action, ProtocolError, Publish, Stop, SyncerCore, Timer
from diloco.data import EvalBatches, ShardSampler, load_corpus
from diloco.fragments import Fragment, embedding_names, partition
from diloco.models.factory import ModelFactory, build_model
from diloco.metrics.log import MetricsLog
from diloco.metrics.records import LearnerMeter, RoundMeter, resident_memory_bytes
from diloco.results import LearnerReport, RunResult
from diloco.sim.clock import EventQueue
from diloco.sim.failures import CrashPlan, outage_windows
from diloco.sim.link import Link
from diloco.sim.timing import StepTimer
from diloco.strategies import StrategySpec, build_strategy
from diloco.training import Replica, evaluate, make_optimizer

Progress = Callable[[int, int], None]
"""Called with (tokens trained so far, token budget) as the run goes."""


@dataclass
class Checkpoint:
    """What a learner saves of its own: inner-optimizer state, data position, step count."""

    optimizer: dict[str, Any]
    data: dict[str, Any]
    steps: int


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
    down_s: float = 0.0
    waiting_since: float | None = None
    step_ends_at: float | None = None
    incarnation: int = 0
    """Bumped at every crash: events meant for an earlier life are dropped."""
    alive: bool = True
    down_since: float | None = None
    finished: bool = False
    stop_requested: bool = False
    """The syncer said the shared budget is spent: the learner finishes at the end of this step."""
    crashes: int = 0
    last_seq: int = 0
    lost_tokens: list[int] = field(default_factory=list)
    checkpoint: Checkpoint | None = None

    def wait(self, now: float) -> None:
        if self.waiting_since is None:
            self.waiting_since = now

    def resume(self, now: float) -> None:
        if self.waiting_since is not None:
            self.waiting_s += now - self.waiting_since
            self.waiting_since = None

    def abort_step(self, now: float) -> None:
        """A step in progress is cut short: the time it would still have taken was never spent."""
        if self.step_ends_at is not None:
            self.busy_s -= self.step_ends_at - now
            self.step_ends_at = None
        self.incarnation += 1


class Simulation:
    def __init__(self, config: Config, factory: ModelFactory | None = None,
                 progress: Progress | None = None, metrics: MetricsLog | None = None) -> None:
        self.config = config
        self.metrics = metrics or MetricsLog([])
        self.meters = [LearnerMeter(self.metrics, m, config.metrics.every_steps) for m in range(config.learners.count)]
        self.round_meter = RoundMeter(self.metrics)
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
        tokens_per_step = t.batch_size * t.seq_len
        self.budget = config.token_budget()
        equal_steps = self.budget // (count * tokens_per_step)
        self.crash_plan = CrashPlan(config.failures, count, config.seed)
        self.queue = EventQueue()
        self.learners: list[SimLearner] = []
        plans = self.spec.planned_steps(speeds, self.budget, tokens_per_step)
        for m, (speed, planned) in enumerate(zip(speeds, plans)):
            sampler = ShardSampler(corpus.train, learner=m, learners=count, seq_len=t.seq_len,
                                   batch_size=t.batch_size, seed=config.seed)
            link = Link(config.link.bandwidth_mbit, config.link.latency_ms, outage_windows(config.failures, m))
            self.learners.append(SimLearner(
                index=m, speed=speed, replica=Replica(copy.deepcopy(base), t, sampler, max(1, planned)),
                timer=StepTimer(config.learners.step_time_s, speed, config.learners.jitter, config.seed, m,
                                config.learners.drift, config.learners.drift_steps),
                link=link, planned_steps=equal_steps))
        self.parameters = sum(p.numel() for p in base.parameters() if p.requires_grad)
        self.syncer: SyncerCore | None = None
        self.fragments: list[Fragment] = []
        if self.spec.exchange == "outer":
            self._build_cores(base)
        self.tokens_trained = 0
        self.eval_curve: list[dict[str, float]] = []
        self._eval_marks = [self.budget * k // t.eval_points for k in range(1, t.eval_points)]
        self.last_event_s = 0.0
        self._gradients_in: dict[int, float] = {}

    def _build_cores(self, base: nn.Module) -> None:
        spec = self.spec
        embeddings = embedding_names(base)
        self.fragments = partition(base, spec.fragments, embeddings)
        for learner in self.learners:
            learner.core = self._learner_core(learner, versions=None, step=0)
            learner.lost_tokens = [0] * len(self.fragments)
        params = {n: p for n, p in base.named_parameters() if p.requires_grad}
        c = self.config
        self.syncer = spec.syncer_core(params, self.fragments, range(len(self.learners)), embeddings=embeddings,
                                       down_codec=get_codec(c.codec.down, c.codec.block), outlier=c.outer.outlier,
                                       outlier_factor=c.outer.outlier_factor, budget=self.budget)

    def _learner_core(self, learner: SimLearner, versions: list[int] | None, step: int) -> LearnerCore:
        codec = self.config.codec
        return self.spec.learner_core(learner.index, learner.replica.named_params(), self.fragments,
                                      codec=get_codec(codec.up, codec.block), error_feedback=codec.error_feedback,
                                      versions=versions, step=step, first_seq=learner.last_seq)

    # ------------------------------------------------------------ the event loop

    def run(self) -> RunResult:
        torch.manual_seed(self.config.seed)
        for at, m in self.crash_plan.fixed:
            self.queue.schedule(at, ("crash", m))
        for learner in self.learners:
            self._schedule_random_crash(learner)
            if self.crash_plan.any:
                self._save_checkpoint(learner)
            self._start_step(learner)
        handlers = {"step_end": self._on_step_end, "push": self._on_push, "update": self._on_update,
                    "timer": self._on_timer, "allreduce_done": self._on_allreduce_done, "crash": self._on_crash,
                    "detect": self._on_detect, "leave": self._on_leave, "recover": self._on_recover,
                    "rejoin": self._on_rejoin, "progress": self._on_progress, "stop": self._on_stop}
        while True:
            while self.queue:
                kind, payload = self.queue.pop()
                handlers[kind](payload)
            # Everyone has stopped and every message has landed: close what is still open.
            if self.syncer is None or not self._handle(self.syncer.flush(self.now)):
                break
        return self._result()

    @property
    def now(self) -> float:
        return self.queue.now

    def _start_step(self, learner: SimLearner) -> None:
        duration = learner.timer.next()
        learner.busy_s += duration
        learner.step_ends_at = self.now + duration
        self.queue.schedule(learner.step_ends_at, ("step_end", (learner.index, learner.incarnation)))

    def _on_step_end(self, payload: tuple[int, int]) -> None:
        m, incarnation = payload
        learner = self.learners[m]
        if incarnation != learner.incarnation:
            return  # the step was cut short by a crash or by the end of the run
        learner.step_ends_at = None
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
        pushes = learner.core.on_step(tokens, step_time_s=learner.timer.last_s, now=self.now)
        self._meter(learner)
        for push in pushes:
            self._send_push(learner, push)
        self._send_progress(learner)
        if self.crash_plan.any and learner.replica.steps % self.config.failures.checkpoint_every == 0:
            self._save_checkpoint(learner)
        self._count_tokens(tokens)
        if learner.stop_requested or (not self.spec.shared_budget and learner.replica.steps >= learner.planned_steps):
            self._finish(learner)
            return
        self._advance(learner)

    def _send_progress(self, learner: SimLearner) -> None:
        """Every step, as the paper's learners do: where it stands, for the syncer's predictions and budget."""
        report = learner.core.progress()
        arrival = learner.link.up.send(self.now, report.wire_bytes())
        self.queue.schedule(arrival, ("progress", report))

    def _on_progress(self, report: Progress) -> None:
        if self.learners[report.learner].alive:
            self._handle(self.syncer.on_progress(report, self.now))

    def _on_stop(self, payload: tuple[int, int]) -> None:
        """The syncer's word that the budget is spent reached a learner: it stops after this step."""
        m, incarnation = payload
        learner = self.learners[m]
        if incarnation != learner.incarnation or learner.finished or not learner.alive:
            return
        learner.stop_requested = True
        if learner.waiting_since is not None:  # waiting for an answer: no step to finish first
            self._finish(learner)

    def _advance(self, learner: SimLearner) -> None:
        poll = learner.core.poll(self.now)
        for push in poll.pushes:
            self._send_push(learner, push)
        if poll.waiting_for:
            learner.wait(self.now)
        else:
            learner.resume(self.now)
            self._start_step(learner)

    def _finish(self, learner: SimLearner) -> None:
        """The learner trains no more: push what it has not pushed yet, then leave the syncer."""
        learner.finished = True
        learner.resume(self.now)
        if learner.core is not None and learner.alive:
            for push in learner.core.finish(self.now):
                self._send_push(learner, push)
        if self.syncer is not None:
            # Announced on the same link, so it lands after the last pushes.
            arrival = learner.link.up.send(self.now, MESSAGE_HEADER_BYTES)
            self.queue.schedule(arrival, ("leave", learner.index))

    def _send_push(self, learner: SimLearner, push: Push) -> None:
        learner.last_seq = push.seq
        arrival = learner.link.up.send(self.now, push.wire_bytes())
        self.queue.schedule(arrival, ("push", push))

    def _on_push(self, push: Push) -> None:
        try:
            self._handle(self.syncer.on_push(push, self.now))
        except ProtocolError:  # refused (an outlier): the learner sends that progress again later
            learner = self.learners[push.learner]
            if learner.core is not None and learner.alive:
                learner.core.on_refused(push)

    def _on_leave(self, m: int) -> None:
        self._handle(self.syncer.leave(m, self.now, finished=self.learners[m].finished))

    def _on_timer(self, _: None) -> None:
        self._handle(self.syncer.on_timer(self.now))

    def _handle(self, actions: list[Action]) -> bool:
        for action in actions:
            if isinstance(action, Timer):
                self.queue.schedule(action.at, ("timer", None))
            elif isinstance(action, Stop):
                for learner in self.learners:
                    if not learner.finished and learner.alive:
                        arrival = learner.link.down.send(self.now, MESSAGE_HEADER_BYTES)
                        self.queue.schedule(arrival, ("stop", (learner.index, learner.incarnation)))
            elif isinstance(action, Publish):
                self.last_event_s = max(self.last_event_s, self.now)
                for m, update in action.updates.items():
                    learner = self.learners[m]
                    if learner.finished or not learner.alive:
                        continue
                    arrival = learner.link.down.send(self.now, update.wire_bytes())
                    self.queue.schedule(arrival, ("update", (m, learner.incarnation, update)))
        if self.syncer is not None:
            self.round_meter.emit(self.syncer.rounds)
        return bool(actions)

    def _on_update(self, payload: tuple[int, int, Update]) -> None:
        m, incarnation, update = payload
        learner = self.learners[m]
        if incarnation != learner.incarnation or learner.finished or not learner.alive:
            return  # meant for a learner that crashed or stopped since
        learner.core.on_update(update)
        if learner.waiting_since is not None:
            self._advance(learner)

    # ------------------------------------------------------------ failures

    def _schedule_random_crash(self, learner: SimLearner) -> None:
        at = self.crash_plan.next_random(learner.index, self.now)
        if at is not None:
            self.queue.schedule(at, ("crash", learner.index))

    def _save_checkpoint(self, learner: SimLearner) -> None:
        r = learner.replica
        learner.checkpoint = Checkpoint(copy.deepcopy(r.optimizer.state_dict()), r.sampler.state_dict(), r.steps)

    def _on_crash(self, m: int) -> None:
        learner = self.learners[m]
        if learner.finished or not learner.alive:
            return
        learner.abort_step(self.now)
        learner.resume(self.now)
        learner.alive = False
        learner.down_since = self.now
        learner.crashes += 1
        if learner.core is not None:
            for p, tokens in enumerate(learner.core.unpushed_tokens()):
                learner.lost_tokens[p] += tokens
            learner.core = None
        self._gradients_in.pop(m, None)
        self.queue.schedule(self.now + self.config.failures.detect_s, ("detect", (m, learner.incarnation)))
        self.queue.schedule(self.now + self.config.failures.recovery_s, ("recover", (m, learner.incarnation)))

    def _on_detect(self, payload: tuple[int, int]) -> None:
        m, incarnation = payload
        learner = self.learners[m]
        if self.syncer is not None and incarnation == learner.incarnation and not learner.alive:
            self._handle(self.syncer.leave(m, self.now))

    def _on_recover(self, payload: tuple[int, int]) -> None:
        """The learner's process is back: it asks for the current Θ, which takes a full download."""
        m, incarnation = payload
        learner = self.learners[m]
        if incarnation != learner.incarnation or learner.finished:
            return
        if self.syncer is None:  # data-parallel: take the parameters of a live peer
            nbytes = self.parameters * 4
            state = None
        else:
            theta, by_fragment = self.syncer.rejoin_state(m, after_seq=learner.last_seq)
            versions = [by_fragment[p] for p in range(len(self.fragments))]
            nbytes = tensors_wire_bytes(theta)
            state = (theta, versions)
        arrival = learner.link.down.send(self.now, nbytes)
        self.queue.schedule(arrival, ("rejoin", (m, incarnation, state)))

    def _on_rejoin(self, payload: tuple[int, int, Any]) -> None:
        m, incarnation, state = payload
        learner = self.learners[m]
        if incarnation != learner.incarnation or learner.finished:
            return
        r = learner.replica
        if state is None:
            # The job's state is that of the replica furthest along (a live one if any): all took the
            # same steps, so it is what a checkpoint taken at its last step would hold.
            peer = max(self.learners, key=lambda lr: (lr.replica.steps, lr.alive))
            if peer is not learner:
                r.model.load_state_dict(peer.replica.model.state_dict())
                r.optimizer.load_state_dict(copy.deepcopy(peer.replica.optimizer.state_dict()))
                r.steps = peer.replica.steps
            r.model.zero_grad(set_to_none=True)
        else:
            theta, versions = state
            with torch.no_grad():
                for name, p in r.named_params().items():
                    p.copy_(theta[name])
            r.optimizer = make_optimizer(r.model, r.cfg)
            ckpt = learner.checkpoint
            if ckpt is not None:
                if self.config.failures.restore == "checkpoint":
                    r.optimizer.load_state_dict(copy.deepcopy(ckpt.optimizer))
                r.sampler.load_state_dict(ckpt.data)
                r.steps = ckpt.steps
            learner.core = self._learner_core(learner, versions=versions, step=r.steps)
            self.syncer.join(m, self.now)
        self._mark_down_until_now(learner)
        learner.alive = True
        if self.syncer is not None and self.syncer.stopped:  # the run ended while it was down
            self._finish(learner)
            return
        self._schedule_random_crash(learner)
        self._start_step(learner)

    def _mark_down_until_now(self, learner: SimLearner) -> None:
        if learner.down_since is not None:
            learner.down_s += self.now - learner.down_since
            learner.down_since = None

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
        duration = 0.0
        if count > 1:
            share = 2 * (count - 1) * grad_bytes // count
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
        for learner in self.learners:
            if not learner.alive:
                continue  # it crashed after handing in its gradients; it takes a peer's state when back
            learner.resume(self.now)
            learner.replica.apply_gradients()
            self._meter(learner)
            if learner.replica.steps < learner.planned_steps:
                self._start_step(learner)
            else:
                learner.finished = True
        self._count_tokens(sum(lr.replica.sampler.batch_size * lr.replica.sampler.seq_len for lr in self.learners))

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

    def _meter(self, learner: SimLearner, final: bool = False) -> None:
        r = learner.replica
        self.meters[learner.index].step(
            self.now, steps=r.steps, tokens=learner.tokens, busy_fraction=learner.busy_s / self.now if self.now else 1.0,
            step_time_s=learner.timer.last_s, bytes_up=learner.link.up.bytes_sent,
            bytes_down=learner.link.down.bytes_sent, loss=lambda: r.last_loss, core=learner.core, final=final)

    def _record_eval(self) -> None:
        loss = evaluate(self.global_model(), self.eval_batches)
        self.eval_curve.append({"time_s": self.now, "tokens": self.tokens_trained, "loss": loss})
        self.metrics.record("eval", self.now, tokens=self.tokens_trained, loss=loss)
        if self.syncer is not None:
            pending = sum(len(s.pending) for s in self.syncer.fragments.values())
            self.metrics.record("syncer", self.now, shard=0, queue_length=pending, checkpoint_age_s=None,
                                memory_bytes=resident_memory_bytes(), rounds=self.syncer.rounds_closed)

    def token_ledger(self, learner: int) -> dict[str, list[int]]:
        """Per fragment: tokens merged on time, merged stale, and lost, for one learner."""
        entry = self.syncer.ledger[learner]
        fragments = range(len(self.fragments))
        return {"merged": [entry.merged[p] for p in fragments], "stale": [entry.stale[p] for p in fragments],
                "lost": list(self.learners[learner].lost_tokens)}

    def _result(self) -> RunResult:
        unfinished = [lr.index for lr in self.learners if not lr.finished]
        if unfinished:
            raise RuntimeError(f"simulation ended with learners {unfinished} still waiting: a round never closed")
        wall = self.last_event_s
        for learner in self.learners:
            self._meter(learner, final=True)
        self._record_eval()
        self.eval_curve[-1]["time_s"] = wall
        numel = {f.index: f.numel for f in self.fragments}
        totals = {"merged": 0.0, "stale": 0.0, "lost": 0.0}
        reports = []
        for lr in self.learners:
            if self.syncer is not None:
                entry = self.syncer.ledger[lr.index]
                tokens = tokens_of(lr.tokens, by_parameters(entry.merged, numel, self.parameters),
                                   by_parameters(entry.stale, numel, self.parameters))
            else:
                tokens = tokens_of(lr.tokens, lr.tokens, 0.0)
            for key in totals:
                totals[key] += tokens[key]
            reports.append(LearnerReport(
                learner=lr.index, speed=lr.speed, tokens=lr.tokens, steps=lr.replica.steps, busy_s=lr.busy_s,
                waiting_s=lr.waiting_s, down_s=lr.down_s, busy_fraction=lr.busy_s / wall if wall else 1.0,
                crashes=lr.crashes, tokens_lost=tokens["lost"], bytes_up=lr.link.up.bytes_sent,
                bytes_down=lr.link.down.bytes_sent, eval_loss=evaluate(lr.replica.model, self.eval_batches),
                rounds=learner_round_stats(self.syncer.rounds, lr.index) if self.syncer else {}))
        learner_losses = [r.eval_loss for r in reports]
        return RunResult(
            strategy=self.spec.name, learners=len(self.learners), tokens=sum(r.tokens for r in reports),
            final_eval_loss=self.eval_curve[-1]["loss"], virtual_wall_clock_s=wall,
            wire_bytes_up=sum(r.bytes_up for r in reports), wire_bytes_down=sum(r.bytes_down for r in reports),
            goodput=sum(r.busy_s for r in reports) / (wall * len(reports)) if wall else 1.0,
            peak_sync_bytes=max(lr.link.up.peak_message_bytes for lr in self.learners),
            rounds=self.syncer.rounds_closed if self.syncer else self.learners[0].replica.steps,
            parameters=self.parameters, tokens_merged=totals["merged"], tokens_stale=totals["stale"],
            tokens_lost=totals["lost"], per_learner=reports, eval_curve=self.eval_curve,
            config=self.config.to_dict(), round_stats=round_stats(self.syncer.rounds) if self.syncer else {},
            learners_eval_loss_mean=sum(learner_losses) / len(learner_losses))


def simulate(config: Config, factory: ModelFactory | None = None, progress: Progress | None = None,
             metrics: MetricsLog | None = None) -> RunResult:
    """Run one configuration in the simulator and return what it measured."""
    return Simulation(config, factory, progress, metrics).run()
