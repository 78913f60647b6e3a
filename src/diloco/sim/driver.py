"""The simulated driver: every learner really trains, in virtual-time order, over simulated links.

One process runs all learners. Each inner step takes a virtual duration from its learner's step
timer; the real forward and backward pass runs when the step's end event is processed, so events
interleave exactly as they would in time. Messages take `latency + bytes / bandwidth` on their
learner's link (with regions: over each link of its route, some shared), queued behind each other, held
up by outages. Learners crash and come back as the
failure plan says. The same seed gives the same run, event for event.

The driver decides nothing about rounds, liveness or the end of the run: it delivers the syncer core's
events (`core/events.py`) when they arrive and carries out the actions it answers with, as the real
runtime does over gRPC.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch
from torch import nn

from diloco.config import Config, Topology
from diloco.core.learner_core import LearnerCore
from diloco.core.events import (HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived, PushArrived,
                                TimerFired, sender)
from diloco.core.liveness import HEARTBEAT_S
from diloco.core.messages import MESSAGE_HEADER_BYTES, Push, tensors_wire_bytes
from diloco.core.recovery import restore_plan
from diloco.core.regional import RegionalSyncer, Upstream
from diloco.core.syncer_core import Action, ProtocolError, Publish, SendState, Stop, SyncerCore, Timer
from diloco.data import ShardSampler
from diloco.fragments import Fragment, embedding_names, partition
from diloco.materials import prepare
from diloco.metrics.log import MetricsLog
from diloco.metrics.records import LearnerMeter, RoundMeter
from diloco.models.factory import ModelFactory
from diloco.results import RunResult
from diloco.sim.event_queue import EventQueue
from diloco.sim.data_parallel import all_reduce
from diloco.sim.sim_events import (AllReduceDone, Beat, Crash, Recover, RegionBack, RegionBeat, RegionDown, SimEvent,
                               StateArrives, StepEnds, StopArrives, ToRegion, ToSyncer, UpdateArrives)
from diloco.sim.failures import CrashPlan, outage_windows
from diloco.sim.learners import Checkpoint, SimLearner
from diloco.network.links import Network, Routes
from diloco.sim.ordering import InOrder
from diloco.sim.summary import global_model, record_eval, run_result
from diloco.sim.tier import SimRegion, upstream_bytes
from diloco.sim.timing import StepTimer
from diloco.strategies import StrategySpec, build_strategy
from diloco.training import Replica, make_optimizer

ProgressCallback = Callable[[int, int], None]
"""Called with (tokens trained so far, token budget) as the run goes."""


class Simulation:
    def __init__(self, config: Config, factory: ModelFactory | None = None,
                 progress: ProgressCallback | None = None, metrics: MetricsLog | None = None) -> None:
        self.config = config
        self.metrics = metrics or MetricsLog([])
        self.meters = [LearnerMeter(self.metrics, m, config.metrics.every_steps) for m in range(config.learners.count)]
        self.round_meter = RoundMeter(self.metrics)
        self.spec: StrategySpec = build_strategy(config)
        self.progress = progress
        t = config.train
        materials = prepare(config, factory)
        corpus, self.eval_batches, base = materials.corpus, materials.eval_batches, materials.model
        self.eval_model = copy.deepcopy(base)
        speeds = config.speeds()
        count = len(speeds)
        tokens_per_step = t.batch_size * t.seq_len
        self.budget = config.token_budget()
        equal_steps = self.budget // (count * tokens_per_step)
        self.crash_plan = CrashPlan(config)
        self.network = Network(config)
        self.queue = EventQueue()
        self.learners: list[SimLearner] = []
        plans = self.spec.planned_steps(speeds, self.budget, tokens_per_step)
        self.home_of = Topology(config).fragment_homes(self.spec.fragments) if self.spec.exchange == "outer" else []
        """Per fragment, the region of its home shard (`placement`): its pushes and answers go there."""
        for m, (speed, planned) in enumerate(zip(speeds, plans)):
            sampler = ShardSampler(corpus.train, learner=m, learners=count, seq_len=t.seq_len,
                                   batch_size=t.batch_size, seed=config.seed)
            link = self.network.learner_link(m, outage_windows(config.failures, m), self.home_of)
            self.learners.append(SimLearner(
                index=m, speed=speed, replica=Replica(copy.deepcopy(base), t, sampler, max(1, planned)),
                timer=StepTimer(config.learners.step_time_s, speed, config.learners.jitter, config.seed, m,
                                config.learners.drift, config.learners.drift_steps),
                link=link, planned_steps=equal_steps))
        self.parameters = sum(p.numel() for p in base.parameters() if p.requires_grad)
        self.syncer: SyncerCore | None = None
        """The global syncer's core."""
        self.regions: list[SimRegion] = []
        """With the regional tier, the regions with learners: their syncers are the global syncer's learners."""
        self.fragments: list[Fragment] = []
        if self.spec.exchange == "outer":
            self._build_cores(base)
        self.tokens_trained = 0
        self.eval_curve: list[dict[str, float]] = []
        self._eval_marks = [self.budget * k // t.eval_points for k in range(1, t.eval_points)]
        self.last_event_s = 0.0
        self._gradients_in: dict[int, float] = {}
        self._in_order = InOrder()
        """The global core takes each sender's pushes in the order they were numbered (see `InOrder`)."""

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

    def _build_regions(self, params: dict[str, torch.Tensor], embeddings: set[str], tokens_per_step: int) -> None:
        """The regional tier: the global syncer's learners are the regions' syncers, each of which starts
        from Θ's first version and is the syncer of its region's learners."""
        for r in Topology(self.config).tier_regions():
            self.regions.append(SimRegion(len(self.regions), r.name, list(Topology(self.config).learners_of(r.name)),
                                          self.network.region_link(r.name, self.home_of),
                                          Topology(self.config).region_period(r.name)))
        self.syncer = self.spec.syncer_core(params, self.fragments, range(len(self.regions)), embeddings=embeddings)
        self._embeddings = embeddings
        for region in self.regions:
            self.syncer.declare(region.index, tokens_per_step, RegionalSyncer.burst_steps(
                len(region.members), self.spec.H, self.config.regional.push_every))
            values, versions = self.syncer.rejoin_state(region.index, after_seq=0)
            self._start_region(region, values, versions, region.members)


    def _start_region(self, region: SimRegion, values: dict[str, torch.Tensor], versions: dict[int, int],
                      members: list[int]) -> None:
        """A regional syncer's life begins from Θ as the global syncer sent it; `members` start with it
        (the others rejoin it when they are back)."""
        region.syncer = self.spec.regional_syncer(
            region.index, values, [versions[p] for p in range(len(self.fragments))], self.fragments, members,
            embeddings=self._embeddings, settings=self.config.regional, period=region.period,
            first_seq=region.last_seq)
        tokens_per_step = self.config.train.batch_size * self.config.train.seq_len
        for m in region.members:
            region.syncer.down.declare(m, tokens_per_step)
        for m in members:
            region.syncer.down.rejoin_state(m, after_seq=self.learners[m].last_seq)
        region.alive = True

    def _home(self, learner: SimLearner) -> SimRegion | None:
        """The region whose syncer is the learner's (None: the global syncer is)."""
        return next((r for r in self.regions if learner.index in r.members), None)

    def _to_syncer(self, learner: SimLearner, event) -> ToSyncer:
        home = self._home(learner)
        return ToSyncer(event) if home is None else ToSyncer(event, home.index, home.incarnation)

    def _learner_core(self, learner: SimLearner, versions: list[int] | None, step: int) -> LearnerCore:
        return self.spec.learner_core(learner.index, learner.replica.named_params(), self.fragments,
                                      versions=versions, step=step, first_seq=learner.last_seq)

    # ------------------------------------------------------------ the event loop

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

    @property
    def now(self) -> float:
        return self.queue.now

    def _start_step(self, learner: SimLearner) -> None:
        duration = learner.timer.next()
        learner.busy_s += duration
        learner.step_ends_at = self.now + duration
        self.queue.schedule(learner.step_ends_at, StepEnds(learner.index, learner.incarnation))

    def _schedule_beat(self, learner: SimLearner) -> None:
        if self.syncer is not None:
            self.queue.schedule(self.now + HEARTBEAT_S, Beat(learner.index, learner.incarnation))

    def _on_beat(self, event: Beat) -> None:
        """A learner alive says so every HEARTBEAT_S, training or waiting, until it has left."""
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished or not learner.alive:
            return
        report = learner.core.progress()
        beat = HeartbeatArrived(learner.index, step=report.step, tokens=report.tokens)
        self.queue.schedule(learner.link.up.signal(self.now), self._to_syncer(learner, beat))
        self._schedule_beat(learner)

    def _on_step_end(self, event: StepEnds) -> None:
        m = event.learner
        learner = self.learners[m]
        if event.incarnation != learner.incarnation:
            return  # the step was cut short by a crash or by the end of the run
        learner.step_ends_at = None
        self.last_event_s = max(self.last_event_s, self.now)
        if self.spec.exchange == "gradients":
            learner.tokens += learner.replica.compute_gradients()
            self._gradients_in[m] = self.now
            learner.wait(self.now)
            if len(self._gradients_in) == len(self.learners):
                duration = all_reduce(self.learners)
                self.queue.schedule(max(self._gradients_in.values()) + duration, AllReduceDone())
            return
        tokens = learner.replica.train_step()
        learner.tokens += tokens
        pushes = learner.core.on_step(tokens, step_time_s=learner.timer.last_s, now=self.now)
        self._meter(learner)
        for push in pushes:
            self._send_push(learner, push)
        if self.crash_plan.any and learner.replica.steps % self.config.failures.checkpoint_every == 0:
            self._save_checkpoint(learner)
        self._count_tokens(tokens)
        if learner.stop_requested or (not self.spec.shared_budget and learner.replica.steps >= learner.planned_steps):
            self._send_progress(learner)
            self._finish(learner)
            return
        self._advance(learner)
        # As a real learner does: after merging what arrived and pushing what fell due meanwhile, so that the
        # report's predictions count those pushes (`client/learner_client.py`, `Learner.step`).
        self._send_progress(learner)

    def _send_progress(self, learner: SimLearner) -> None:
        """Every step, as the paper's learners do: where it stands, for the syncer's predictions and budget."""
        report = learner.core.progress()
        arrival = learner.link.up.send(self.now, report.wire_bytes())
        self.queue.schedule(arrival, self._to_syncer(learner, ProgressArrived(report)))

    def _on_arrival(self, arrival: ToSyncer) -> None:
        """One of a syncer core's events arrives (the global one's, or with the regional tier a region's):
        the core decides, the driver carries out its actions."""
        event = arrival.event
        region = self.regions[arrival.region] if arrival.region is not None else None
        if region is not None and (region.syncer is None or arrival.incarnation != region.incarnation):
            return  # its syncer died with what was on its way to it
        origin = sender(event)
        if isinstance(event, (ProgressArrived, HeartbeatArrived)) and origin is not None and not (
                self.regions[origin].alive if self.regions and region is None else self.learners[origin].alive):
            return  # sent by a process that has crashed since: its life's counters are gone with it
        core = self.syncer if region is None else region.syncer
        events = [event]
        if region is None and isinstance(event, PushArrived):
            events = self._in_order.arrived(event.push.learner, event.push.seq, event)
        for event in events:
            try:
                self._handle(core.handle(event, self.now), region)
            except ProtocolError:  # a refused push (an outlier): its sender sends that progress again later
                if isinstance(event, PushArrived):
                    self._refused(event.push, region)

    def _refused(self, push: Push, region: SimRegion | None) -> None:
        if self.regions and region is None:
            pusher = self.regions[push.learner]
            if pusher.syncer is not None:
                self._handle(pusher.syncer.on_refused(push), pusher)
            return
        learner = self.learners[push.learner]
        if learner.core is not None and learner.alive:
            learner.core.on_refused(push)

    def _on_stop(self, event: StopArrives) -> None:
        """The syncer's word that the budget is spent reached a learner: it stops after this step."""
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished or not learner.alive:
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
            self.queue.schedule(arrival, self._to_syncer(learner, LearnerLeft(learner.index, finished=True)))

    def _send_push(self, learner: SimLearner, push: Push) -> None:
        learner.last_seq = push.seq
        if self._home(learner) is None:
            self._in_order.sent(learner.index, push.seq)
        arrival = learner.link.up.send(self.now, push.wire_bytes(), push.fragment)
        self.queue.schedule(arrival, self._to_syncer(learner, PushArrived(push)))

    def _handle(self, actions: list[Action | Upstream], region: SimRegion | None = None) -> None:
        """Carry out a syncer core's actions: the global one's (`region` None) or a region's. The global
        syncer's recipients are the learners, or with the regional tier the regions' syncers."""
        for action in actions:
            if isinstance(action, Upstream):
                self._send_up(region, action.event)
            elif isinstance(action, Timer):
                self.queue.schedule(action.at, ToSyncer(TimerFired()) if region is None
                                    else ToSyncer(TimerFired(), region.index, region.incarnation))
            elif region is None and self.regions:
                self._to_regions(action)
            elif isinstance(action, Stop):
                for learner in self.learners:
                    if not learner.finished and learner.alive and (region is None or learner.index in region.members):
                        arrival = learner.link.down.send(self.now, MESSAGE_HEADER_BYTES)
                        self.queue.schedule(arrival, StopArrives(learner.index, learner.incarnation))
            elif isinstance(action, Publish):
                self.last_event_s = max(self.last_event_s, self.now)
                for m, update in action.updates.items():
                    learner = self.learners[m]
                    if learner.finished or not learner.alive:
                        continue
                    arrival = learner.link.down.send(self.now, update.wire_bytes(), update.fragment)
                    self.queue.schedule(arrival, UpdateArrives(m, learner.incarnation, update))
            elif isinstance(action, SendState):
                learner = self.learners[action.learner]
                versions = [action.versions[p] for p in range(len(self.fragments))]
                arrival = self._send_state(learner.link, action.values)
                self.queue.schedule(arrival, StateArrives(learner.index, learner.incarnation,
                                                          (action.values, versions)))
        if self.syncer is not None and region is None:
            self.round_meter.emit(self.syncer.rounds)

    def _send_state(self, link: Routes, values: dict[str, torch.Tensor]) -> float:
        """Θ for a joining sender: every home shard sends its own fragments' values."""
        if len(link.down.ways) == 1:
            return link.down.send(self.now, tensors_wire_bytes(values))
        return link.down.send_split(self.now, {
            f.index: tensors_wire_bytes({n: values[n] for n in f.names if n in values}) for f in self.fragments})

    # ------------------------------------------------------------ the regional tier

    def _to_regions(self, action: Action) -> None:
        """The global syncer's action, for the regions' syncers: over each region's WAN route."""
        if isinstance(action, Stop):
            for region in self.regions:
                if region.alive:
                    arrival = region.link.down.send(self.now, MESSAGE_HEADER_BYTES)
                    self.queue.schedule(arrival, ToRegion(region.index, region.incarnation, stop=True))
        elif isinstance(action, Publish):
            self.last_event_s = max(self.last_event_s, self.now)
            for r, update in action.updates.items():
                region = self.regions[r]
                if region.alive and not (region.syncer is not None and region.syncer.left):
                    arrival = region.link.down.send(self.now, update.wire_bytes(), update.fragment)
                    self.queue.schedule(arrival, ToRegion(r, region.incarnation, update=update))
        elif isinstance(action, SendState):
            region = self.regions[action.learner]
            arrival = self._send_state(region.link, action.values)
            self.queue.schedule(arrival, ToRegion(region.index, region.incarnation,
                                                  state=(action.values, dict(action.versions))))

    def _send_up(self, region: SimRegion, event) -> None:
        nbytes = upstream_bytes(event)
        fragment = None
        if isinstance(event, PushArrived):
            fragment = event.push.fragment
            self._in_order.sent(region.index, event.push.seq)
        arrival = (region.link.up.signal(self.now) if nbytes is None
                   else region.link.up.send(self.now, nbytes, fragment))
        self.queue.schedule(arrival, ToSyncer(event))

    def _on_to_region(self, event: ToRegion) -> None:
        region = self.regions[event.region]
        if event.incarnation != region.incarnation or not region.alive:
            return
        if event.state is not None:  # back from an outage: a new life from Θ; its learners rejoin it
            self._start_region(region, *event.state, members=[])
            waiting, region.waiting = region.waiting, []
            if self.syncer.stopped:
                self._handle(region.syncer.on_stop(), region)
            for m in waiting:
                self._rejoin(self.learners[m])
            self._schedule_region_beat(region)
        elif region.syncer is None:
            return
        elif event.stop:
            self._handle(region.syncer.on_stop(), region)
        else:
            self._handle(region.syncer.on_upstream(event.update, self.now), region)

    def _schedule_region_beat(self, region: SimRegion) -> None:
        self.queue.schedule(self.now + HEARTBEAT_S, RegionBeat(region.index, region.incarnation))

    def _on_region_beat(self, event: RegionBeat) -> None:
        region = self.regions[event.region]
        if event.incarnation != region.incarnation or region.syncer is None or region.syncer.left:
            return
        self._handle(region.syncer.beat(self.now), region)
        self._schedule_region_beat(region)

    def _on_region_down(self, event: RegionDown) -> None:
        """A regional outage: the region's syncer dies with what it merged and had not sent up yet (its
        learners crash by their own events)."""
        region = self.regions[event.region]
        if region.syncer is not None and region.syncer.left:
            return  # its part of the run is over
        for m, tokens in region.die(len(self.fragments)).items():
            for p, t in enumerate(tokens):
                self.learners[m].lost_tokens[p] += t
        region.alive = False
        region.incarnation += 1
        self.queue.schedule(event.until, RegionBack(region.index, region.incarnation))

    def _on_region_back(self, event: RegionBack) -> None:
        """The region's syncer is back: it takes Θ from the global syncer, which takes a full download."""
        region = self.regions[event.region]
        if event.incarnation != region.incarnation:
            return
        region.alive = True
        self._handle(self.syncer.handle(LearnerRejoined(region.index, after_seq=region.last_seq), self.now))

    def _on_update(self, event: UpdateArrives) -> None:
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished or not learner.alive:
            return  # meant for a learner that crashed or stopped since
        learner.core.on_update(event.update)
        if learner.waiting_since is not None:
            self._advance(learner)

    # ------------------------------------------------------------ failures

    def _schedule_random_crash(self, learner: SimLearner) -> None:
        at = self.crash_plan.next_random(learner.index, self.now)
        if at is not None:
            self.queue.schedule(at, Crash(learner.index))

    def _save_checkpoint(self, learner: SimLearner) -> None:
        r = learner.replica
        learner.checkpoint = Checkpoint(copy.deepcopy(r.optimizer.state_dict()), r.sampler.state_dict(), r.steps)

    def _on_crash(self, event: Crash) -> None:
        """The process dies: its step in progress and its unpushed progress are gone. The syncer finds
        out from its silence (`core/liveness.py`), as it would for real. One already down when its region
        goes down is back no earlier than the region."""
        learner = self.learners[event.learner]
        if learner.finished:
            return
        back_at = self.now + self.config.failures.recovery_s if event.until is None else event.until
        if not learner.alive:
            if event.until is not None and back_at > learner.back_at:
                learner.incarnation += 1  # its recovery under way is void
                self._recover_at(learner, back_at)
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
        self._gradients_in.pop(learner.index, None)
        self._recover_at(learner, back_at)

    def _recover_at(self, learner: SimLearner, at: float) -> None:
        learner.back_at = at
        self.queue.schedule(at, Recover(learner.index, learner.incarnation))

    def _on_recover(self, event: Recover) -> None:
        """The learner's process is back: it asks for the current Θ, which takes a full download."""
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished:
            return
        if self.syncer is None:  # data-parallel: take the parameters of a live peer
            arrival = learner.link.down.send(self.now, self.parameters * 4)
            self.queue.schedule(arrival, StateArrives(learner.index, learner.incarnation, None))
            return
        self._rejoin(learner)

    def _rejoin(self, learner: SimLearner) -> None:
        """It asks its syncer for the current Θ (its region's, with the regional tier: once that is back)."""
        home = self._home(learner)
        event = LearnerRejoined(learner.index, after_seq=learner.last_seq)
        if home is None:
            self._handle(self.syncer.handle(event, self.now))
        elif home.syncer is None:
            home.waiting.append(learner.index)
        else:
            self._handle(home.syncer.handle(event, self.now), home)

    def _on_state(self, event: StateArrives) -> None:
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished:
            return
        if event.state is None:
            self._take_peer_state(learner)
        else:
            self._restart_from(learner, *event.state)
        self._mark_down_until_now(learner)
        learner.alive = True
        home = self._home(learner)
        syncer = self.syncer if home is None else home.syncer.down if home.syncer is not None else None
        if syncer is not None and syncer.stopped:  # the run ended while it was down
            self._finish(learner)
            return
        self._schedule_random_crash(learner)
        self._start_step(learner)
        self._schedule_beat(learner)

    def _take_peer_state(self, learner: SimLearner) -> None:
        """Data-parallel: the job's state is that of the replica furthest along (a live one if any): all
        took the same steps, so it is what a checkpoint taken at its last step would hold."""
        r = learner.replica
        peer = max(self.learners, key=lambda lr: (lr.replica.steps, lr.alive))
        if peer is not learner:
            r.model.load_state_dict(peer.replica.model.state_dict())
            r.optimizer.load_state_dict(copy.deepcopy(peer.replica.optimizer.state_dict()))
            r.steps = peer.replica.steps
        r.model.zero_grad(set_to_none=True)

    def _restart_from(self, learner: SimLearner, theta: dict[str, torch.Tensor], versions: list[int]) -> None:
        """Θ as the syncer sent it; what else comes from its own checkpoint is `core/recovery.py`'s call."""
        r = learner.replica
        with torch.no_grad():
            for name, p in r.named_params().items():
                p.copy_(theta[name])
        r.optimizer = make_optimizer(r.model, r.cfg)
        ckpt = learner.checkpoint
        plan = restore_plan(self.config.failures.restore, ckpt is not None)
        if plan.optimizer:
            r.optimizer.load_state_dict(copy.deepcopy(ckpt.optimizer))
        if plan.data:
            r.sampler.load_state_dict(ckpt.data)
        if plan.steps:
            r.steps = ckpt.steps
        learner.core = self._learner_core(learner, versions=versions, step=r.steps)

    def _mark_down_until_now(self, learner: SimLearner) -> None:
        if learner.down_since is not None:
            learner.down_s += self.now - learner.down_since
            learner.down_since = None

    # ------------------------------------------------------------ data-parallel

    def _on_allreduce_done(self, _: AllReduceDone) -> None:
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

    def _meter(self, learner: SimLearner, final: bool = False) -> None:
        r = learner.replica
        self.meters[learner.index].step(
            self.now, steps=r.steps, tokens=learner.tokens, busy_fraction=learner.busy_s / self.now if self.now else 1.0,
            step_time_s=learner.timer.last_s, bytes_up=learner.link.up.bytes_sent,
            bytes_down=learner.link.down.bytes_sent, loss=lambda: r.last_loss, core=learner.core, final=final)

    def _record_eval(self) -> None:
        record_eval(self)

    def global_model(self) -> nn.Module:
        return global_model(self)

    def ledger_of(self, learner: int) -> tuple[dict[int, int], dict[int, int]]:
        """Per fragment, a learner's tokens merged on time and merged stale: by the global syncer, or with the
        regional tier by its region's syncer over every life, less what died there before going up."""
        home = self._home(self.learners[learner])
        if home is not None:
            merged, stale = home.ledger(learner, len(self.fragments))
            return dict(enumerate(merged)), dict(enumerate(stale))
        entry = self.syncer.ledger[learner]
        return ({p: entry.merged[p] for p in range(len(self.fragments))},
                {p: entry.stale[p] for p in range(len(self.fragments))})

    def rounds_of(self, learner: int) -> list:
        """The rounds a learner could take part in: its syncer's."""
        home = self._home(self.learners[learner])
        return self.syncer.rounds if home is None else home.rounds()

    def token_ledger(self, learner: int) -> dict[str, list[int]]:
        """Per fragment: tokens merged on time, merged stale, and lost, for one learner."""
        merged, stale = self.ledger_of(learner)
        fragments = range(len(self.fragments))
        return {"merged": [merged[p] for p in fragments], "stale": [stale[p] for p in fragments],
                "lost": list(self.learners[learner].lost_tokens)}

    def _result(self) -> RunResult:
        for learner in self.learners:
            self._meter(learner, final=True)
        return run_result(self)


def simulate(config: Config, factory: ModelFactory | None = None, progress: ProgressCallback | None = None,
             metrics: MetricsLog | None = None) -> RunResult:
    """Run one configuration in the simulator and return what it measured."""
    return Simulation(config, factory, progress, metrics).run()
