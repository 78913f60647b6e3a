"""A syncer shard's state and how events apply to it: the sans-I/O syncer core, its journal and saved
state, and the core's actions carried out (answers into per-learner outboxes, wake-ups, the regional
tier's events up). No gRPC here: `server.py` turns calls into these events.

Shard i of N owns the fragments p with p mod N = i, or with `placement = "links"` those homed in the
config's i-th home region (`ShardPlan`). It does not need the model: the first learner to join seeds Θ
of the shard's fragments, and every learner after it must bring the same layout. Every decision
(rounds, liveness, the end of the run) is the core's; the configured learners count from the start, as
in the simulator; once every learner has left, the core merges what is still open and the shard is
finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import threading
from pathlib import Path

import torch

from diloco.clock import SYSTEM_CLOCK, Clock
from diloco.codecs import Encoded
from diloco.config import Config, Topology
from diloco.core.events import AnswerTaken, LearnerLeft, LearnerRejoined, SyncerEvent, TimerFired
from diloco.core.messages import Update
from diloco.core.regional import RegionalSyncer, Upstream
from diloco.core.syncer_core import Action, LearnerDead, ProtocolError, Publish, RunOver, Stop, SyncerCore, Timer
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.metrics import MetricsLog
from diloco.metrics.records import RoundMeter, resident_memory_bytes
from diloco.outer import compiled_step
from diloco.shard import resume as shard_resume
from diloco.shard.answer_slots import AnswerSlots
from diloco.shard.group_commit import GROUP_PUSHES, PushQueue
from diloco.shard.journal import JournalHalted
from diloco.shard.ownership import ShardPlan
from diloco.shard.regional_shard import RegionTier
from diloco.shard.snapshot import shard_report, snapshot
from diloco.shard.store import ShardStore, plain_update
from diloco.shard.waker import Waker
from diloco.strategies import build_strategy
from diloco.transport.bulk import BulkServer
from diloco.transport.run_settings import check_shards
from diloco.transport.wire_messages import settings_of
from diloco.v1 import diloco_pb2 as pb

log = logging.getLogger("diloco.syncer")

SAVE_EVERY_S = 10.0
"""The longest a shard with a state folder goes without saving its whole state (and emptying its journal)."""
SAVE_MIN_S = 2.0
"""The shortest: between the two, as often as a save's own cost allows (`waker.SAVE_SHARE`), so that a
restart has little journal to replay (each journaled push is decoded and merged again)."""
SINK_ENV = "DILOCO_SHARD_SINK"
"""Set to 1, a shard takes pushes off the wire and answers them without merging (`benchmarks/scale.py
--sink`: the transport alone). Never for a run: nothing is learned."""
DECODING_PUSHES = 2
"""Pushes decoded to fp32 at once (one merging, one decoding next): a shard's memory for pushes in
flight is then two fragments in fp32 plus the others as they came, whatever the number of learners."""


class ShardState:
    def __init__(self, config: Config, plan: ShardPlan, metrics: MetricsLog | None = None,
                 state_dir: Path | None = None, resume: bool = False, clock: Clock = SYSTEM_CLOCK,
                 tier: RegionTier | None = None, operator_seeds: bool = False, state_key: bytes | None = None
                 ) -> None:
        """With a `state_dir`, the shard journals every event and saves its state there now and then;
        `resume` continues from what a previous process of this shard left there. With a `tier`, it is a
        region's syncer (`regional_shard.py`): it journals nothing, and its own Θ starts from the global
        syncer's when its first learner seeds it. `operator_seeds`: only the run secret's holder may seed Θ
        (a learner's own credential may not). `state_key` seals the state file (`state_files.file_key` of
        the run's secret). No thread runs until `start()`."""
        check_shards(config, plan.count)
        self.config, self.plan, self.clock = config, plan, clock
        self.spec = build_strategy(config)
        self.settings = settings_of(config)
        self.owned = plan.fragments(self.spec.fragments)
        self.lock = threading.RLock()
        self.core: SyncerCore | None = None
        self.tier, self.operator_seeds = tier, operator_seeds
        self.layout: list[pb.FragmentLayout] = []
        self.outboxes: dict[int, queue.Queue[Update]] = {}
        self.streams: dict[int, int] = {}
        """Per learner, the id of its current update stream: a newer stream retires an older one."""
        self.joined: set[int] = set()
        self.left: set[int] = set()
        self.steps: dict[int, int] = {}
        self.hosts: dict[int, str] = {}
        self.declared: dict[int, int] = {}
        """Per learner, the tokens one of its inner steps trains, as it declared when it joined."""
        self.push_errors = 0
        self.answers_sent = self.answer_bytes_sent = 0
        """Answers made for the learners' streams, and their bytes on the wire: what this shard sends out."""
        self.bulk: BulkServer | None = None
        """Its bulk port (`--bulk-port`, `transport/bulk.py`): pulls that ask get their values there, and pushes
        whose header asks send their data there."""
        self.decoding = threading.BoundedSemaphore(DECODING_PUSHES)
        """Pushes decoded at once: the others wait in their compressed form."""
        self.sink = os.environ.get(SINK_ENV) == "1"
        if self.sink:  # a benchmark's switch: a run started with it by mistake learns nothing, so say so
            log.warning("%s=1: this shard takes pushes without merging them (a transport benchmark); nothing is "
                        "learned", SINK_ENV)
        self.sink_answers: dict[int, dict[str, Encoded]] = {}
        """Sink mode: per fragment, the encoded difference every answer carries (`PushIntake._sink_push`)."""
        self.push_queue = PushQueue(GROUP_PUSHES if tier is None else 1)
        """Pushes waiting for the lock, taken as one group by whoever gets it (`group_commit.py`)."""
        self.answer_slots = AnswerSlots()
        self.finished = False
        self.stop_said = False
        """The core said Stop (the shared budget is spent): every heartbeat reply tells the learner so."""
        self.started = clock.now()
        self.metrics = metrics or MetricsLog([])
        self.round_meter = RoundMeter(self.metrics, plan.index, origin=self.metrics.origin)
        self.last_updates: dict[int, dict[int, Update]] = {}
        """Per learner and fragment, the notice of an answer not yet taken by the learner's stream (no
        values: the answer is made when taken, `core.events.AnswerTaken`); queued again after a restart."""
        self._replaying = False
        self._stopping = False
        self.waker = Waker(threading.Condition(self.lock), self._wake, self._save_if_seeded, SAVE_EVERY_S, clock,
                            save_min_s=SAVE_MIN_S)
        self.store = ShardStore(state_dir, plan.index, resume, clock, state_key) if state_dir is not None else None
        self.run_id = self.store.run_id if self.store is not None else secrets.token_hex(16)
        """This run's identity: callers' credentials are bound to it (`security.call_token`)."""
        if self.store is not None:
            with self.lock:
                shard_resume.resume(self)

    @property
    def lost(self) -> set[int]:
        """Learners the core found dead by silence (they count again when they speak)."""
        return set(self.core.lost) if self.core is not None else set()

    def start(self) -> ShardState:
        self.waker.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
        self.waker.stop()
        if self.bulk is not None:
            self.bulk.close()

    def apply(self, event: SyncerEvent, now: float, push_frames: bytes = b"") -> list[Action]:
        """Journal one event, hand it to the core, carry out its actions (under the lock). Replay takes
        the same path. Nothing is taken that is not on disk, and nothing stays on disk that was not
        taken: a record that cannot be written raises JournalWriteFailed before the core sees the event,
        and one the core refuses (ProtocolError) is taken back off the journal before it is re-raised."""
        journaled = self.store is not None and not self._replaying
        if journaled:
            self.store.record(event, now, push_frames)
        try:
            actions = (self.tier.region if self.tier is not None else self.core).handle(event, now)
        except ProtocolError:
            if journaled:
                self.store.rollback()  # JournalHalted if it cannot be: the shard takes nothing more
            raise
        except Exception as exc:
            if journaled:  # the core may be half-changed: journal nothing more, resume from disk instead
                self._halt_journal(f"the core failed on {type(event).__name__} ({type(exc).__name__}: {exc})")
            raise
        self.carry_out(actions)
        if isinstance(event, AnswerTaken):
            waiting = self.last_updates.get(event.learner, {})
            if event.fragment in waiting and waiting[event.fragment].ack_seq <= event.ack_seq:
                del waiting[event.fragment]
        elif isinstance(event, LearnerLeft):
            self.left.add(event.learner)
            self.streams.pop(event.learner, None)
        elif isinstance(event, LearnerRejoined):
            self.joined.add(event.learner)
            self.left.discard(event.learner)
            self.finished = self.core.over
        if not self._replaying:
            self.round_meter.emit(self.core.rounds)
        return actions

    def carry_out(self, actions: list[Action]) -> None:
        """The core's actions (under the lock): notices into outboxes, wake-ups, logs, and a regional
        syncer's events for the global syncer."""
        for action in actions:
            if isinstance(action, Upstream):
                self.tier.sent(action)
            elif isinstance(action, Publish):  # notices: each answer is made when its stream can send it
                for learner, notice in action.updates.items():
                    waiting = self.last_updates.setdefault(learner, {}).get(notice.fragment)
                    if waiting is not None:  # one answer covers both (the stream skips the older notice)
                        notice = dataclasses.replace(notice, ack_seq=max(notice.ack_seq, waiting.ack_seq))
                    self.last_updates[learner][notice.fragment] = notice
                    if learner not in self.left:
                        self.outboxes.setdefault(learner, queue.Queue()).put(notice)
            elif isinstance(action, Timer):
                self.waker.wake_at(action.at)
            elif isinstance(action, LearnerDead) and not self._replaying:
                if action.connection_lost:
                    log.warning("learner %d's connection ended without a goodbye: rounds stop counting on it",
                                action.learner)
                else:
                    log.warning("learner %d %s for %.1f s: rounds stop counting on it", action.learner,
                                "silent" if action.joined else "never joined,", action.silent_s)
            elif isinstance(action, Stop):
                self.stop_said = True
                if not self._replaying:
                    log.info("the shared token budget is spent: every learner is told to stop")
            elif isinstance(action, RunOver):
                self.finished = True
                if not self._replaying:
                    log.info("every learner left; last rounds merged (%d rounds in all)", self.core.rounds_closed)

    def _wake(self, now: float) -> None:
        if self.core is not None and not self._stopping:
            self.apply(TimerFired(), now)

    def record_metrics(self) -> None:
        """The shard's own record: outbox lengths, age of the saved state, memory."""
        with self.lock:
            queued = sum(q.qsize() for q in self.outboxes.values())
            rounds = self.core.rounds_closed if self.core else 0
            age = self.store.age_s() if self.store is not None else None
        self.metrics.record("syncer", shard=self.plan.index, queue_length=queued, checkpoint_age_s=age,
                            memory_bytes=resident_memory_bytes(), rounds=rounds)

    def members(self) -> int:
        """The learners the core counts from the start: the configured ones, or with the regional tier (on
        the global syncer) the regions' syncers."""
        return len(Topology(self.config).tier_regions()) if Topology(self.config).tiered and self.tier is None else self.settings.learners

    def _declare(self, learner: int, tokens_per_step: int) -> None:
        """Hand a learner's declared tokens per step to the core (raises ProtocolError if it refuses). With the
        regional tier the global syncer's learners are regions, whose rounds merge many steps at once."""
        declare = getattr(self.core, "declare", None)  # a core without declarations takes none
        if declare is None:
            return
        regions = Topology(self.config).tier_regions() if self.tier is None else []
        burst = RegionalSyncer.burst_steps(len(Topology(self.config).learners_of(regions[learner].name)), self.spec.H,
                                           self.config.regional.push_every) if learner < len(regions) else 0
        declare(learner, tokens_per_step, burst)

    def _make_core(self, values: dict[str, torch.Tensor], fragments: list[Fragment], embeddings: set[str]
                   ) -> SyncerCore:
        core = self.spec.syncer_core(values, fragments, range(self.members()), embeddings=embeddings)
        compiled_step.load_for(values.values(), steps=self.spec.optimizer == "delayed-nesterov")
        core.liveness.start(self.clock.now())  # a learner never heard from is counted on from the seeding
        core.answers_when_taken = True  # answers wait on streams as notices, made when sent
        return core

    def report(self) -> dict:
        """What this shard counted, for run summaries and reports (call under the lock)."""
        return shard_report(self)

    def snapshot(self) -> dict:
        """Membership, each learner's state and the recent rounds, for the status page."""
        with self.lock:
            return snapshot(self)

    def _save_if_seeded(self, now: float) -> None:
        if self.store is not None and self.core is not None and self.store.journal is not None:
            self.save_state()

    def save_state(self) -> None:
        """Everything the shard decides from, with who saved it, written atomically with its digest,
        then the journal emptied: what it held is in the state now. Not once the journal has halted
        (the journal and the last good state are what a restart resumes from)."""
        with self.lock:
            if self.core is None or self.store is None or self.store.halted is not None:
                return
            try:
                self.store.save({
                    "identity": shard_resume.shard_identity(self.plan, self.owned, self.settings),
                    "core": self.core.state_dict(),
                    "layout": [torch.frombuffer(bytearray(f.SerializeToString()), dtype=torch.uint8)
                               for f in self.layout],
                    "joined": sorted(self.joined), "left": sorted(self.left), "finished": self.finished,
                    "last_updates": {m: {p: plain_update(u) for p, u in by_fragment.items()}
                                     for m, by_fragment in self.last_updates.items()},
                    "report": self.report()})
            except OSError as exc:
                raise DilocoError(f"could not save the state of shard {self.plan.index} to {self.store.state_path} "
                                  f"({exc.strerror or exc}); the journal still holds every event since the last "
                                  f"save") from None

    def _halt_journal(self, why: str) -> None:
        """Journal nothing more (the event just recorded is taken back first): fail-stop, one line."""
        try:
            self.store.rollback()
        except JournalHalted:
            return  # halted already, and said so
        self.store.halt(why)
