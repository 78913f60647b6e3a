"""A syncer shard served over gRPC on the real clock: each RPC turns into one of the core's typed events
(`core/events.py`), applied under the shard's lock by `ShardState.apply` (`shard_state.py`), which
journals it first and carries out the core's actions. Encoding and decoding happen here, outside the
lock; every conversion to and from the wire is `transport/wire_messages.py`'s. This module only moves bytes.
"""

from __future__ import annotations

import json
import logging
import queue
import threading

import grpc

from diloco.core.checks import theta_problem
from diloco.core.events import (AnswerTaken, HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived,
                                PushArrived, StreamLost, StreamOpened, SyncerEvent)
from diloco.core.messages import Update
from diloco.core.syncer_core import Action, ProtocolError, SendState, SendUpdate, SyncerCore
from diloco.shard import serving
from diloco.shard.answer_slots import Slot
from diloco.shard.journal import JournalError
from diloco.shard.ownership import ShardPlan, fragments_of, parse_shard
from diloco.shard.push_intake import PushIntake, Refusal
from diloco.shard.serving import serve
from diloco.transport.bulk import BulkServer
from diloco.transport.frames import FrameError, buffered, decode, read_message
from diloco.transport.security import current_caller
from diloco.transport.wire_messages import bulk_state_frame, fragment_versions, progress_of, state_frames, update_frames
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

__all__ = ["SyncerShard", "ShardPlan", "parse_shard", "serve"]

log = logging.getLogger("diloco.syncer")

OUTBOX_POLL_S = 0.5
"""How often an idle update stream checks that its learner is still connected."""
MAX_LEARNER_ID = 2**32 - 1
"""Learner ids travel as uint32."""
MAX_TOKENS = 2**64 - 1


class SyncerShard(PushIntake, pb_grpc.SyncerServicer):
    """The gRPC servicer: who may speak for whom, framing, and the calls as events."""

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

    def _require_core(self, context: grpc.ServicerContext) -> SyncerCore:
        if self.core is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Θ is not seeded yet: a learner must Init first")
        return self.core

    def _speaks_for(self, learner: int, what: str, context: grpc.ServicerContext) -> None:
        """Refuse a call that speaks for a learner its caller is not (PERMISSION_DENIED, one line, logged);
        with no credentials configured, identity is not enforced."""
        caller = current_caller()
        if not caller.may_speak_for(learner):
            log.warning("refused %s for learner %d from %s: the caller is %s", what, learner, context.peer(), caller)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{caller} may not {what} as learner {learner}")

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
            entry = self.core.ledger.get(learner) if self.core is not None else None
            last_seq = entry.last_seq if entry is not None else 0
            pushed = {p: entry.pushed(p) if entry is not None else 0 for p in self.owned}
            log.info("learner %d joined from %s", learner, request.host or context.peer())
            shards = [pb.ShardInfo(index=i, address=a, fragments=self.plan.owned_by(i, self.spec.fragments))
                      for i, a in enumerate(self.plan.addresses)]
            return pb.JoinReply(learner=learner, settings=self.settings, shard=self.plan.index, shards=shards,
                                layout=self.layout, last_seq=last_seq, fragment_last_seq=pushed,
                                bulk_pushes=self.bulk is not None)

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
                theta = {n: core.theta[n] for n in names}  # a commit replaces Θ's tensors, never writes them
                versions = {p: core.fragments[p].version for p in fragments}
                push_in_s: dict[int, float] = {}
            else:
                self._speaks_for(request.learner, "pull", context)
                event = LearnerRejoined(request.learner, request.after_seq, tuple(fragments))
                sent = next(a for a in self._take(event, context) if isinstance(a, SendState))
                theta, versions, push_in_s = sent.values, sent.versions, sent.push_in_s
        if request.bulk and self.bulk is not None:
            yield bulk_state_frame(theta, self.layout, versions, self.bulk, push_in_s)
        else:
            yield from state_frames(theta, self.layout, versions, snapshot=True, push_in_s=push_in_s)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushReply:
        """A push's header and its data in frames, or (`PushHeader.bulk`) its header alone, answered with a
        ticket to send the data on the bulk port (`push_intake.py`)."""
        self._require_core(context)
        frames = iter(request_iterator)
        try:
            header, nbytes = self.checked_push_header(frames)
            tensors = None if header.bulk else buffered(frames, header, nbytes)
            if next(frames, None) is not None:
                raise FrameError("a push stream carries one message" if tensors is not None else
                                 "a bulk push's data goes to the bulk port, not in frames")
            if not context.is_active():  # gRPC ends the requests quietly when one fails to parse
                raise FrameError("the stream broke")
        except FrameError as exc:
            self.push_errors += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {exc}")
        self._speaks_for(header.learner, "push", context)
        if tensors is None:
            return self.bulk_ticket(header, nbytes, context.peer())
        try:
            return self.take_push(header, tensors, context.peer())
        except Refusal as exc:
            context.abort(exc.code, str(exc))

    def Updates(self, request: pb.UpdatesRequest, context: grpc.ServicerContext):
        """A newer stream of the same learner retires this one (the learner reconnected); only the learner
        itself may open one, so nobody else can end its stream. Answers' data go over the bulk port where
        the learner asks and the shard has one."""
        learner = request.learner
        bulk = self.bulk if request.bulk else None
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

        def ended() -> None:
            if taken:
                taken[-1].release()  # the RPC ended mid-answer
            self._stream_ended(learner, stream_id)
        context.add_callback(ended)
        while open_():
            try:
                notice = outbox.get(timeout=OUTBOX_POLL_S)
            except queue.Empty:
                continue
            slot = self.answer_slots.take(open_)
            if slot is None:  # the stream ended while it waited: a reopened one claims what it holds
                break
            taken[:] = [slot]
            fetched = None
            try:
                frames, fetched = self._whole_answer(learner, notice, slot, context, bulk)
                yield from frames
            finally:
                slot.release()
                frames = []  # a stream waiting for its next notice keeps nothing of the last answer alive
            while fetched is not None and not fetched.wait(OUTBOX_POLL_S) and open_():
                pass  # the learner has not yet used (nor let expire) the tickets of this answer's data

    def _stream_ended(self, learner: int, stream_id: int) -> None:
        """The learner's newest update stream ended and it has not said goodbye: its process died or its
        connection broke (`StreamLost`). A stream a newer one retired, or one ended by this shard stopping,
        says nothing of the learner."""
        with self.lock:
            if self._stopping or self.streams.get(learner) != stream_id or self.core is None \
                    or learner not in self.joined or learner in self.left:
                return
            try:
                self.apply(StreamLost(learner), self.clock.now())
            except (ProtocolError, JournalError) as exc:
                log.warning("learner %d's update stream ended: %s", learner, exc)

    def _whole_answer(self, learner: int, notice: Update, slot: Slot, context: grpc.ServicerContext,
                      bulk: BulkServer | None) -> tuple[list[pb.Frame], threading.Event | None]:
        """Every frame of the answer a notice stands for, made before the first is sent: a whole fragment,
        or nothing and one line in the log. An answer that cannot be made never ends the stream (the
        learner would reopen it and meet the same failure again); the learner trains on without it.
        With them, for a relative answer whose data waits at the bulk port, an event set once the learner
        used (or let expire) its tickets: the stream makes its next answer only then, so that its tickets
        never pile up past the port's MAX_TICKETS (where the oldest, a learner's answer, would be dropped).
        A whole answer is bounded by its slot instead."""
        try:
            update = self._answer(learner, notice)
            if update is None or update.relative:
                slot.release()  # its differences are shared: no new memory to bound
            if update is None:
                return [], None
            if not update.relative:
                slot.hold_until_sent(update.wire_bytes(), context.cancel)
            fetched = threading.Event() if bulk is not None and update.relative else None
            done = fetched.set if fetched is not None else slot.pass_on() if bulk is not None else None
            return list(update_frames(update, bulk, done)), fetched  # with bulk, its bytes wait there
        except OSError:  # the stream itself broke (not the answer): it ends, and the learner's reopening asks again
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to make it: refused in one line
            log.error("answer of fragment %d to learner %d refused: %s: %s", notice.fragment, learner,
                      type(exc).__name__, exc)
            return [], None

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
            if self.sink:  # a benchmark's answer carries its bytes already (`PushIntake._sink_push`)
                self.answers_sent += 1
                self.answer_bytes_sent += notice.wire_bytes()
                return notice
            event = AnswerTaken(learner, notice.fragment, notice.ack_seq, notice.next_push_at)
            try:
                actions = self.apply(event, self.clock.now())
            except (ProtocolError, JournalError) as exc:  # kept: a restart sends it from its notice
                log.warning("answer of fragment %d to learner %d not sent: %s", notice.fragment, learner, exc)
                return None
            update = next(a.update for a in actions if isinstance(a, SendUpdate))
            self.answers_sent += 1
            self.answer_bytes_sent += update.wire_bytes()
        return update

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        """A learner is alive (a heartbeat, on its timer) or says where it stands (a progress report, after
        a step: `due_in_s` is set). Only heartbeats measure the interval that liveness is judged by."""
        learner = request.learner
        self._speaks_for(learner, "send a heartbeat", context)
        with self.lock:
            core = self.core
            if learner in self.joined and learner not in self.left:  # strangers count for nothing
                if core is not None:
                    event = ProgressArrived(progress_of(request)) if request.due_in_s else \
                        HeartbeatArrived(learner, step=request.steps, tokens=request.tokens)
                    self._take(event, context)
                self.steps[learner] = request.steps
            total = core.tokens_reported() if core is not None else 0
            return pb.HeartbeatReply(stop=self.stop_said, tokens_reported=min(total, MAX_TOKENS))

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
            versions = fragment_versions({p: s.version for p, s in core.fragments.items()}) if core else []
            return pb.StatusReply(shard=self.plan.index, initialised=core is not None, finished=self.finished,
                                  versions=versions, rounds=core.rounds_closed if core else 0,
                                  tokens_reported=min(core.tokens_reported() if core else 0, MAX_TOKENS),
                                  alive=sorted(core.alive) if core else [],
                                  report_json=json.dumps(self.report()), run=self.run_id)
