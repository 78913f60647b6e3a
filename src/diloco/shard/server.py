"""A syncer shard: the sans-I/O syncer core for some fragments, served over gRPC on the real clock.

Shard i of N owns the fragments p with p mod N = i, or with `placement = "links"` those homed in the
config's i-th home region (`ShardPlan`). It does not need the model: the first
learner to join seeds Θ of the shard's fragments (`Init`), and every learner after it must bring the same
layout. Each RPC turns into one of the core's typed events (`core/events.py`), handed to the core under
the shard's lock by `apply`, which journals it first (`shard_store.py`) and carries out the core's
actions: answers into per-learner outboxes (drained by each learner's `Updates` stream), wake-ups to the
waker thread (`shard_waker.py`). Encoding and decoding happen outside the lock.

Every decision (rounds, liveness, the end of the run) is the core's; this module only moves bytes. The
configured learners count from the start, as in the simulator; once every learner has left, the core
merges what is still open and the shard is finished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from diloco.config import Config
from diloco.core.checks import theta_problem
from diloco.core.events import (AnswerTaken, HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived,
                                PushArrived, StreamOpened, SyncerEvent, TimerFired)
from diloco.core.messages import Progress, Update
from diloco.core.messages import Push as PushMessage
from diloco.errors import DilocoError
from diloco.core.syncer_core import (Action, LearnerDead, ProtocolError, Publish, RunOver, SendState, SendUpdate,
                                SyncerCore, Timer)
from diloco.fragments import Fragment
from diloco.metrics import MetricsLog
from diloco.metrics.records import RoundMeter, resident_memory_bytes
from diloco.clock import SYSTEM_CLOCK, Clock
from diloco.core.regional import RegionalSyncer, Upstream
from diloco.shard.journal import JournalError, JournalHalted, push_of, push_payload
from diloco.shard import resume as shard_resume, serving
from diloco.shard.answer_slots import AnswerSlots, Slot
from diloco.shard.serving import serve
from diloco.transport.run_settings import check_shards, settings_of
from diloco.shard.regional_shard import RegionTier
from diloco.shard.ownership import ShardPlan, fragments_of, parse_shard
from diloco.shard.snapshot import shard_report, snapshot
from diloco.shard.store import ShardStore, plain_update
from diloco.shard.waker import Waker
from diloco.strategies import build_strategy
from diloco.transport.frames import FrameError, decode, encode_fp32, message_frames, read_message, tensor_header
from diloco.transport.security import current_caller
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

__all__ = ["SyncerShard", "ShardPlan", "parse_shard", "serve"]

log = logging.getLogger("diloco.syncer")

OUTBOX_POLL_S = 0.5
"""How often an idle update stream checks that its learner is still connected."""
MESSAGE_SLACK_BYTES = 1 << 16
MAX_LEARNER_ID = 2**32 - 1
"""Learner ids travel as uint32."""
MAX_TOKENS = 2**64 - 1
SAVE_EVERY_S = 10.0
"""How often a shard with a state folder saves its whole state (and empties its journal)."""
DECODING_PUSHES = 2
"""Pushes decoded to fp32 at once (one merging, one decoding next): a shard's memory for pushes in
flight is then two fragments in fp32 plus the others as they came, whatever the number of learners."""

class SyncerShard(pb_grpc.SyncerServicer):
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
        self.decoding = threading.BoundedSemaphore(DECODING_PUSHES)
        """Pushes decoded at once: the others wait in their compressed form."""
        self.answer_slots = AnswerSlots()
        self.finished = False
        self.started = clock.now()
        self.metrics = metrics or MetricsLog([])
        self.round_meter = RoundMeter(self.metrics, plan.index, origin=self.metrics.origin)
        self.last_updates: dict[int, dict[int, Update]] = {}
        """Per learner and fragment, the notice of an answer not yet taken by the learner's stream (no
        values: the answer is made when taken, `core.events.AnswerTaken`); queued again after a restart."""
        self._replaying = False
        self._stopping = False
        self.waker = Waker(threading.Condition(self.lock), self._wake, self._save_if_seeded, SAVE_EVERY_S, clock)
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

    def start(self) -> SyncerShard:
        self.waker.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
        self.waker.stop()

    # ------------------------------------------------------------ the core

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
                log.warning("learner %d %s for %.1f s: rounds stop counting on it", action.learner,
                            "silent" if action.joined else "never joined,", action.silent_s)
            elif isinstance(action, RunOver):
                self.finished = True
                if not self._replaying:
                    log.info("every learner left; last rounds merged (%d rounds in all)", self.core.rounds_closed)

    def _take(self, event: SyncerEvent, context: grpc.ServicerContext, push_frames: bytes = b"") -> list[Action]:
        """`apply` for a caller: a refusal (the event itself, or the round it would close) is answered
        INVALID_ARGUMENT with its one line, and logged; the shard is as it was."""
        try:
            return self.apply(event, self.clock.now(), push_frames)  # a refused event is taken off the journal
        except ProtocolError as exc:
            if isinstance(event, PushArrived):
                self.push_errors += 1
            log.warning("refused %s from %s: %s", type(event).__name__, context.peer(), exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except JournalError as exc:  # not on disk, so not taken: the caller tries the same again later
            context.abort(grpc.StatusCode.UNAVAILABLE, f"shard {self.plan.index} cannot journal: {exc}")

    def _wake(self, now: float) -> None:
        if self.core is not None and not self._stopping:
            self.apply(TimerFired(), now)

    def _require_core(self, context: grpc.ServicerContext) -> SyncerCore:
        if self.core is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Θ is not seeded yet: a learner must Init first")
        return self.core

    def record_metrics(self) -> None:
        """The shard's own record: outbox lengths, age of the saved state, memory."""
        with self.lock:
            queued = sum(q.qsize() for q in self.outboxes.values())
            rounds = self.core.rounds_closed if self.core else 0
            age = self.store.age_s() if self.store is not None else None
        self.metrics.record("syncer", shard=self.plan.index, queue_length=queued, checkpoint_age_s=age,
                            memory_bytes=resident_memory_bytes(), rounds=rounds)

    # ------------------------------------------------------------ RPCs

    def _speaks_for(self, learner: int, what: str, context: grpc.ServicerContext) -> None:
        """Refuse a call that speaks for a learner its caller is not (PERMISSION_DENIED, one line, logged);
        with no credentials configured, identity is not enforced."""
        caller = current_caller()
        if not caller.may_speak_for(learner):
            log.warning("refused %s for learner %d from %s: the caller is %s", what, learner, context.peer(), caller)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{caller} may not {what} as learner {learner}")

    def members(self) -> int:
        """The learners the core counts from the start: the configured ones, or with the regional tier (on
        the global syncer) the regions' syncers."""
        return len(self.config.tier_regions()) if self.config.tiered and self.tier is None else self.settings.learners

    def _declare(self, learner: int, tokens_per_step: int) -> None:
        """Hand a learner's declared tokens per step to the core (raises ProtocolError if it refuses). With the
        regional tier the global syncer's learners are regions, whose rounds merge many steps at once."""
        declare = getattr(self.core, "declare", None)  # a core without declarations takes none
        if declare is None:
            return
        regions = self.config.tier_regions() if self.tier is None else []
        burst = RegionalSyncer.burst_steps(len(self.config.learners_of(regions[learner].name)), self.spec.H,
                                           self.config.regional.push_every) if learner < len(regions) else 0
        declare(learner, tokens_per_step, burst)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        if request.learner > MAX_LEARNER_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"learner id {request.learner} is above {MAX_LEARNER_ID}")
        caller = current_caller()
        if caller.kind == "learner":  # a learner's own credential joins as that learner only
            if request.learner >= 0:
                self._speaks_for(request.learner, "join", context)
            request.learner = caller.learner
        with self.lock:
            if request.learner >= 0:
                learner = request.learner
            else:  # the lowest configured id that is not taken, else a new one
                taken = self.joined - self.left
                learner = next(m for m in range(len(taken) + self.members() + 1) if m not in taken)
            if request.tokens_per_step:
                try:  # checked before anything changes: a refused join changes nothing
                    if self.core is not None:
                        self._declare(learner, request.tokens_per_step)
                except ProtocolError as exc:
                    log.warning("refused join of learner %d from %s: %s", learner, context.peer(), exc)
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                self.declared[learner] = request.tokens_per_step
            self.joined.add(learner)
            self.left.discard(learner)
            self.hosts[learner] = request.host or context.peer()
            last_seq = self.core.ledger[learner].last_seq if self.core and learner in self.core.ledger else 0
            log.info("learner %d joined from %s", learner, request.host or context.peer())
            shards = [pb.ShardInfo(index=i, address=a, fragments=self.plan.owned_by(i, self.spec.fragments))
                      for i, a in enumerate(self.plan.addresses)]
            return pb.JoinReply(learner=learner, settings=self.settings, shard=self.plan.index, shards=shards,
                                layout=self.layout, last_seq=last_seq)

    def Init(self, request_iterator, context: grpc.ServicerContext) -> pb.InitReply:
        if self.core is not None:
            return pb.InitReply(accepted=False)  # seeded already: not worth reading
        if self.operator_seeds and current_caller().kind != "operator":
            log.warning("refused Init from %s: %s, and only the operator seeds", context.peer(), current_caller())
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "only the run secret's holder may seed Θ here "
                                                             "(the syncer runs with --operator-seeds)")
        try:
            message = read_message(iter(request_iterator), "state", limit=serving.init_limit_bytes())
            if not context.is_active():
                raise FrameError("the stream broke")
            if message is None:
                raise FrameError("empty Init stream")
            header, tensors = message
            fragments, embeddings = fragments_of(self.plan, self.owned, header.layout, tensors)
            values = {name: decode(e) for name, e in tensors.items()}
            if (problem := theta_problem(values)) is not None:  # Θ's first values are a claim too
                raise FrameError(f"Θ {problem}")
        except FrameError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Init: {exc}")
        with self.lock:
            if self.core is not None:
                return pb.InitReply(accepted=False)
            self.core = self._make_core(values, fragments, embeddings) if self.tier is None else \
                self.tier.seed(self, values, fragments, embeddings)
            self.layout = list(header.layout)
            for learner, tokens_per_step in self.declared.items():  # those who joined before the seeding
                try:
                    self._declare(learner, tokens_per_step)
                except ProtocolError as exc:
                    log.warning("learner %d's declared %d tokens per step refused: %s", learner, tokens_per_step,
                                exc)
            if self.store is not None:
                self.store.open(last_seq=0)
                self.save_state()  # the seeded Θ is the base every journaled event applies to
            log.info("Θ seeded: fragments %s, %d tensors, %d parameters", self.owned, len(values),
                     sum(v.numel() for v in values.values()))
            return pb.InitReply(accepted=True)

    def _make_core(self, values: dict[str, torch.Tensor], fragments: list[Fragment], embeddings: set[str]
                   ) -> SyncerCore:
        core = self.spec.syncer_core(values, fragments, range(self.members()), embeddings=embeddings)
        core.liveness.start(self.clock.now())  # a learner never heard from is counted on from the seeding
        core.answers_when_taken = True  # answers wait on streams as notices, made when sent
        return core

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext):
        with self.lock:
            core = self._require_core(context)
            fragments = list(request.fragments) or list(core.fragments)
            unknown = [p for p in fragments if p not in core.fragments]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fragments {unknown} are not held by shard "
                                                                f"{self.plan.index}")
            if request.observer:
                names = [n for p in fragments for n in core.fragments[p].fragment.names]
                theta = {n: core.theta[n].clone() for n in names}
                versions = {p: core.fragments[p].version for p in fragments}
            else:
                self._speaks_for(request.learner, "pull", context)
                event = LearnerRejoined(request.learner, request.after_seq, tuple(fragments))
                sent = next(a for a in self._take(event, context) if isinstance(a, SendState))
                theta, versions = sent.values, sent.versions
        encoded = encode_fp32(theta)
        header = pb.StateHeader(versions=[pb.FragmentVersion(fragment=p, version=v) for p, v in versions.items()],
                                tensors=[tensor_header(n, e) for n, e in encoded.items()], layout=self.layout)
        yield from message_frames(pb.Frame(state=header), encoded)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushReply:
        core = self._require_core(context)
        frames = iter(request_iterator)
        try:
            message = read_message(frames, "push", limit=self._push_limit())
            if message is None:
                raise FrameError("empty push stream")
            header, tensors = message
            if next(frames, None) is not None:
                raise FrameError("a push stream carries one message")
            if not context.is_active():  # gRPC ends the requests quietly when one fails to parse
                raise FrameError("the stream broke")
            if header.fragment not in core.fragments:
                raise FrameError(f"fragment {header.fragment} is not held by shard {self.plan.index}")
        except FrameError as exc:
            self.push_errors += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {exc}")
        self._speaks_for(header.learner, "push", context)
        with self.decoding:  # pushes wait here encoded, not decoded: memory does not grow with learners
            try:
                deltas = {name: decode(e) for name, e in tensors.items()}
            except FrameError as exc:
                self.push_errors += 1
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {exc}")
            return self._take_push(push_of(header, tensors, deltas), header, tensors, context)

    def _take_push(self, push: PushMessage, header: pb.PushHeader, tensors: dict, context: grpc.ServicerContext
                   ) -> pb.PushReply:
        core = self.core
        with self.lock:
            entry = core.ledger.get(push.learner)
            duplicates = entry.duplicates if entry else 0
            clipped = entry.clipped if entry else 0
            self._take(PushArrived(push), context, push_payload(header, tensors) if self.store else b"")
            entry = core.ledger[push.learner]
            if entry.clipped > clipped:
                log.warning("push %d of fragment %d from learner %d clipped to the outlier bound", push.seq,
                            push.fragment, push.learner)
            return pb.PushReply(duplicate=entry.duplicates > duplicates, clipped=entry.clipped > clipped)

    def _push_limit(self) -> int:
        """The most data one push of any fragment here may carry: fp32, the widest encoding."""
        core = self.core
        return 4 * max(s.fragment.numel for s in core.fragments.values()) + MESSAGE_SLACK_BYTES

    def Updates(self, request: pb.UpdatesRequest, context: grpc.ServicerContext):
        """A newer stream of the same learner retires this one (the learner reconnected); only the learner
        itself may open one, so nobody else can end its stream."""
        learner = request.learner
        self._speaks_for(learner, "open the update stream", context)
        with self.lock:
            stream_id = self.streams.get(learner, 0) + 1
            self.streams[learner] = stream_id
            outbox = self.outboxes.setdefault(learner, queue.Queue())
            if request.holds:
                self._stream_opened(learner, tuple((h.fragment, h.version) for h in request.holds), context)

        def open_() -> bool:
            return context.is_active() and not self._stopping and self.streams.get(learner) == stream_id
        taken: list[Slot] = []
        context.add_callback(lambda: taken and taken[-1].release())  # the RPC ended mid-answer
        while open_():
            try:
                notice = outbox.get(timeout=OUTBOX_POLL_S)
            except queue.Empty:
                continue
            slot = self.answer_slots.take(open_)
            if slot is None:  # the stream ended while it waited: a reopened one claims what it holds
                break
            taken[:] = [slot]
            try:
                update = self._answer(learner, notice)
                if update is None or update.relative:
                    slot.release()  # its differences are shared: no new memory to bound
                if update is None:
                    continue
                if not update.relative:
                    slot.hold_until_sent(update.wire_bytes(), context.cancel)
                yield from update_frames(update)
            finally:
                slot.release()
                update = None  # a stream waiting for its next notice keeps nothing of the last answer alive

    def _stream_opened(self, learner: int, holds: tuple[tuple[int, int], ...], context: grpc.ServicerContext
                       ) -> None:
        """What the learner says it holds: answers it lost are made again. A claim the core refuses
        changes nothing and the stream opens all the same (the learner loses only what it lied about)."""
        if self.core is None or learner not in self.joined or learner in self.left:
            return
        try:
            self.apply(StreamOpened(learner, holds), self.clock.now())
        except ProtocolError as exc:
            log.warning("learner %d reopened its update stream: %s (nothing changed)", learner, exc)
        except JournalError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"shard {self.plan.index} cannot journal: {exc}")

    def _answer(self, learner: int, notice: Update) -> Update | None:
        """The answer a notice stands for, made now (journaled: what the learner holds changes); None
        for a notice another one superseded, or when the answer cannot be made (logged)."""
        with self.lock:
            if self.last_updates.get(learner, {}).get(notice.fragment) is not notice:
                return None
            event = AnswerTaken(learner, notice.fragment, notice.ack_seq, notice.next_push_at)
            try:
                actions = self.apply(event, self.clock.now())
            except (ProtocolError, JournalError) as exc:  # kept: a restart sends it from its notice
                log.warning("answer of fragment %d to learner %d not sent: %s", notice.fragment, learner, exc)
                return None
        return next(a.update for a in actions if isinstance(a, SendUpdate))

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        """A learner is alive (a heartbeat, on its timer) or says where it stands (a progress report, after
        a step: `due_in_s` is set). Only heartbeats measure the interval that liveness is judged by."""
        learner = request.learner
        self._speaks_for(learner, "send a heartbeat", context)
        with self.lock:
            core = self.core
            if learner in self.joined and learner not in self.left:  # strangers count for nothing
                if core is not None:
                    report = Progress(learner, request.steps, request.tokens, request.step_time_s,
                                      tuple(request.due_in_s))
                    event = ProgressArrived(report) if request.due_in_s else \
                        HeartbeatArrived(learner, step=request.steps, tokens=request.tokens)
                    self._take(event, context)
                self.steps[learner] = request.steps
            total = core.tokens_reported() if core is not None else 0
            stop = core is not None and (core.budget_spent or core.stopped)
            return pb.HeartbeatReply(stop=stop, tokens_reported=min(total, MAX_TOKENS))

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self._speaks_for(request.learner, "leave", context)
        with self.lock:
            if request.learner not in self.joined:
                return pb.LeaveReply()  # never took part: nothing to change
            log.info("learner %d left", request.learner)
            if self.core is not None:
                self._take(LearnerLeft(request.learner, finished=request.finished), context)
            else:
                self.left.add(request.learner)
        return pb.LeaveReply()

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self.lock:
            core = self.core
            versions = [pb.FragmentVersion(fragment=p, version=s.version) for p, s in core.fragments.items()] \
                if core else []
            return pb.StatusReply(shard=self.plan.index, initialised=core is not None, finished=self.finished,
                                  versions=versions, rounds=core.rounds_closed if core else 0,
                                  tokens_reported=min(core.tokens_reported() if core else 0, MAX_TOKENS),
                                  alive=sorted(core.alive) if core else [],
                                  report_json=json.dumps(self.report()), run=self.run_id)

    # ------------------------------------------------------------ reports and state

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


def update_frames(update: Update) -> Iterator[pb.Frame]:
    """An answer on the stream: one message per encoded difference (or one whole), in order. Its own
    generator, so that what it references is let go as soon as the last frame is sent."""
    for index, message in enumerate(update.wire):
        header = pb.UpdateHeader(
            fragment=update.fragment, version=update.version, ack_seq=update.ack_seq,
            tensors=[tensor_header(n, e, update.relative) for n, e in message.items()],
            next_push_at=update.next_push_at, continued=index < len(update.wire) - 1,
            base_version=update.base_version + index)
        yield from message_frames(pb.Frame(update=header), message)
