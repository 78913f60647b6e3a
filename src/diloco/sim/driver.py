"""The simulated driver: every learner really trains, in virtual-time order, over simulated links.

One process runs all learners. Each inner step takes a virtual duration from its learner's step
timer; the real forward and backward pass runs when the step's end event is processed, so events
interleave exactly as they would in time. Messages take `latency + bytes / bandwidth` on their
learner's link (with regions: over each link of its route, some shared), queued behind each other, held
up by outages. Learners crash and come back as the
failure plan says. The same seed gives the same run, event for event.

The driver decides nothing about rounds, liveness or the end of the run: it delivers the syncer core's
events (`core/events.py`) when they arrive and carries out the actions it answers with, as the real
runtime does over gRPC. It is composed of one part per concept: learner steps (`learner_steps.py`), the
syncer shell (`syncer_shell.py`), the regional tier (`regional_wiring.py`), crashes and recovery
(`crash_recovery.py`) and data-parallel (`data_parallel.py`).
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch
from torch import nn

from diloco.config import Config, Topology
from diloco.data import ShardSampler
from diloco.driver_kit.schedule import EvalMarks, learner_plans
from diloco.fragments import embedding_names, partition
from diloco.materials import prepare
from diloco.metrics.log import MetricsLog
from diloco.metrics.records import LearnerMeter, RoundMeter
from diloco.models.factory import ModelFactory
from diloco.network.links import Network
from diloco.results import RunResult
from diloco.sim.crash_recovery import CrashRecovery
from diloco.sim.data_parallel import DataParallelSteps
from diloco.sim.failures import CrashPlan, outage_windows
from diloco.sim.learner_steps import LearnerSteps
from diloco.sim.learners import SimLearner
from diloco.sim.regional_wiring import RegionalWiring
from diloco.sim.sim_events import (AllReduceDone, Beat, Crash, Recover, RegionBack, RegionBeat, RegionDown, SimEvent,
                                   StateArrives, StepEnds, StopArrives, ToRegion, ToSyncer, UpdateArrives)
from diloco.sim.sim_state import ProgressCallback
from diloco.sim.summary import global_model, record_eval, run_result
from diloco.sim.syncer_shell import SyncerShell
from diloco.strategies import build_strategy
from diloco.training import Replica
from diloco.virtual_run.event_queue import EventQueue
from diloco.virtual_run.push_order import InOrder
from diloco.virtual_run.step_timer import StepTimer


class Simulation(LearnerSteps, SyncerShell, RegionalWiring, CrashRecovery, DataParallelSteps):
    def __init__(self, config: Config, factory: ModelFactory | None = None,
                 progress: ProgressCallback | None = None, metrics: MetricsLog | None = None) -> None:
        self.config = config
        self.metrics = metrics or MetricsLog([])
        self.meters = [LearnerMeter(self.metrics, m, config.metrics.every_steps) for m in range(config.learners.count)]
        self.round_meter = RoundMeter(self.metrics)
        self.spec = build_strategy(config)
        self.progress = progress
        t = config.train
        materials = prepare(config, factory)
        corpus, self.eval_batches, base = materials.corpus, materials.eval_batches, materials.model
        self.eval_model = copy.deepcopy(base)
        plans = learner_plans(config, spec=self.spec)
        count = len(plans)
        self.budget = config.token_budget()
        self.crash_plan = CrashPlan(config)
        self.network = Network(config)
        self.queue = EventQueue()
        self.learners = []
        self.home_of = Topology(config).fragment_homes(self.spec.fragments) if self.spec.exchange == "outer" else []
        for m, plan in enumerate(plans):
            sampler = ShardSampler(corpus.train, learner=m, learners=count, seq_len=t.seq_len,
                                   batch_size=t.batch_size, seed=config.seed)
            link = self.network.learner_link(m, outage_windows(config.failures, m), self.home_of)
            self.learners.append(SimLearner(
                index=m, speed=plan.speed, replica=Replica(copy.deepcopy(base), t, sampler, plan.planned_steps),
                timer=StepTimer(config.learners.step_time_s, plan.speed, config.learners.jitter, config.seed, m,
                                config.learners.drift, config.learners.drift_steps),
                link=link, last_step=plan.last_step))
        self.parameters = sum(p.numel() for p in base.parameters() if p.requires_grad)
        self.syncer = None
        self.regions = []
        self.fragments = []
        if self.spec.exchange == "outer":
            self._build_cores(base)
        self.tokens_trained = 0
        self.eval_curve: list[dict[str, float]] = []
        self.eval_marks = EvalMarks(config)
        self.last_event_s = 0.0
        self._gradients_in = {}
        self._in_order = InOrder()

    def _build_cores(self, base: nn.Module) -> None:
        spec = self.spec
        embeddings = embedding_names(base)
        self.fragments = partition(base, spec.fragments, embeddings)
        for learner in self.learners:
            learner.core = self._learner_core(learner, versions=None, step=0)
            learner.lost_tokens = [0] * len(self.fragments)
        params = {n: p for n, p in base.named_parameters() if p.requires_grad}
        tokens_per_step = self.config.train.batch_size * self.config.train.seq_len
        if Topology(self.config).tiered:
            self._build_regions(params, embeddings, tokens_per_step)
            return
        self.syncer = spec.syncer_core(params, self.fragments, range(len(self.learners)), embeddings=embeddings)
        for learner in self.learners:  # each starts from Θ's first version, as a real learner takes it at join
            self.syncer.declare(learner.index, tokens_per_step)
            self.syncer.rejoin_state(learner.index, after_seq=0)

    def run(self) -> RunResult:
        self.host_started = time.perf_counter()
        torch.manual_seed(self.config.seed)
        for at, crash in self.crash_plan.fixed:
            self.queue.schedule(at, crash)
        for region in self.regions:
            self._schedule_region_beat(region)
            for o in self.config.failures.outages:
                if o.region == region.name:
                    self.queue.schedule(o.at_s, RegionDown(region.index, o.at_s + o.duration_s))
        for learner in self.learners:
            self._schedule_random_crash(learner)
            if self.crash_plan.any:
                self._save_checkpoint(learner)
            self._start_step(learner)
            self._schedule_beat(learner)
        handlers: dict[type, Callable[[SimEvent], None]] = {
            StepEnds: self._on_step_end, ToSyncer: self._on_arrival, UpdateArrives: self._on_update,
            StopArrives: self._on_stop, Beat: self._on_beat, Crash: self._on_crash, Recover: self._on_recover,
            StateArrives: self._on_state, AllReduceDone: self._on_allreduce_done, ToRegion: self._on_to_region,
            RegionBeat: self._on_region_beat, RegionDown: self._on_region_down, RegionBack: self._on_region_back}
        while self.queue:
            event = self.queue.pop()
            handlers[type(event)](event)
        return self._result()

    def _count_tokens(self, tokens: int) -> None:
        self.tokens_trained += tokens
        for _ in range(self.eval_marks.passed(self.tokens_trained)):
            self._record_eval()
        if self.progress:
            self.progress(self.tokens_trained, self.budget)

    def _record_eval(self) -> None:
        record_eval(self)

    def global_model(self) -> nn.Module:
        return global_model(self)

    def _result(self) -> RunResult:
        for learner in self.learners:
            self._meter(learner, final=True)
        return run_result(self)


def simulate(config: Config, factory: ModelFactory | None = None, progress: ProgressCallback | None = None,
             metrics: MetricsLog | None = None) -> RunResult:
    """Run one configuration in the simulator and return what it measured."""
    return Simulation(config, factory, progress, metrics).run()
