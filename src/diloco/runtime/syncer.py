"""A syncer shard: the sans-I/O syncer core for some fragments, served over gRPC on the real clock.

Shard i of N owns the fragments p with p mod N = i. It does not need the model: the first learner to
join seeds Θ of the shard's fragments (`Init`), and every learner after it must bring the same layout.
Each call takes the shard's lock only to hand an event to the core; encoding and decoding happen
outside it. The core's actions become messages in per-learner outboxes (drained by each learner's
`Updates` stream) and a timer thread that wakes the core when a grace window ends.

Membership: the configured learners count from the start, as in the simulator; a learner that leaves
stops counting. Once every learner has left, the shard merges what is still open, and is finished.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from diloco.codecs import Encoded, get_codec
from diloco.config import Config
from diloco.core.messages import Progress, Push, Update
from diloco.core.syncer import Action, ProtocolError, Publish, RoundRecord, SyncerCore, Timer
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.metrics import MetricsLog
from diloco.metrics.records import RoundMeter, resident_memory_bytes
from diloco.runtime.journal import Journal, payload_frames, push_payload
from diloco.runtime.settings import check_shards, settings_of
from diloco.strategies import build_strategy
from diloco.transport.client import HEARTBEAT_S
from diloco.transport.security import PLAINTEXT, TransportSecurity, secure_server_port, server_interceptors
from diloco.transport.frames import FrameError, decode, encode_fp32, message_frames, read_message, tensor_header
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

log = logging.getLogger("diloco.syncer")

OUTBOX_POLL_S = 0.5
"""How often an idle update stream checks that its learner is still connected."""
MESSAGE_SLACK_BYTES = 1 << 16
SILENT_AFTER_S = 5.0
"""A learner not heard from (heartbeats, pushes) for this long shows as silent on the status page."""
DEAD_AFTER_HEARTBEATS = 5
"""A learner that missed this many of its heartbeats (at the interval measured from its own) is dead:
rounds stop counting on it. It counts again as soon as it rejoins."""
JOIN_BOUND_S = 60.0
"""A configured learner that has not joined this long after Θ was seeded stops being counted on."""
MAX_LEARNER_ID = 2**32 - 1
"""Learner ids travel as uint32."""
MAX_TOKENS = 2**64 - 1
SAVE_EVERY_S = 10.0
"""How often a shard with a state folder saves its whole state (and empties its journal)."""
INIT_LIMIT_BYTES = 1 << 38
"""The largest Θ a shard accepts to be seeded with (256 GiB of fp32)."""


@dataclass(frozen=True)
class ShardPlan:
    index: int
    count: int
    addresses: tuple[str, ...]
    """Every shard's address, by index: the map learners get when they join."""

    def owns(self, fragment: int) -> bool:
        return fragment % self.count == self.index

    def fragments(self, total: int) -> list[int]:
        return [p for p in range(total) if self.owns(p)]


def parse_shard(text: str) -> tuple[int, int]:
    """`i/N` → (i, N), with a one-line error for anything else."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise DilocoError(f"--shard expects i/N such as 0/2, got {text!r}") from None
    if not (count >= 1 and 0 <= index < count):
        raise DilocoError(f"--shard {text}: need 0 <= i < N")
    return index, count


class SyncerShard(pb_grpc.SyncerServicer):
    def __init__(self, config: Config, plan: ShardPlan, metrics: MetricsLog | None = None,
                 state_dir: Path | None = None, resume: bool = False) -> None:
        """With a `state_dir`, the shard journals every event and saves its state there now and then;
        `resume` continues from what a previous process of this shard left there."""
        check_shards(config, plan.count)
        self.config = config
        self.plan = plan
        self.spec = build_strategy(config)
        self.settings = settings_of(config)
        self.owned = plan.fragments(self.spec.fragments)
        self.lock = threading.RLock()
        self.core: SyncerCore | None = None
        self.layout: list[pb.FragmentLayout] = []
        self.outboxes: dict[int, queue.Queue[Update]] = {}
        self.streams: dict[int, int] = {}
        """Per learner, the id of its current update stream: a newer stream retires an older one."""
        self.joined: set[int] = set()
        self.left: set[int] = set()
        self.steps: dict[int, int] = {}
        self.last_seen: dict[int, float] = {}
        self.push_errors = 0
        self.finished = False
        self.started = time.time()
        self.metrics = metrics or MetricsLog([])
        self.round_meter = RoundMeter(self.metrics, plan.index, origin=self.metrics.origin)
        self.saved_at: float | None = None
        self.hosts: dict[int, str] = {}
        self._deadline: float | None = None
        self._timer_cond = threading.Condition(self.lock)
        self._stopping = False
        self.heartbeat_gap: dict[int, float] = {}
        self._heartbeat_seen: dict[int, float] = {}
        self.lost: set[int] = set()
        """Learners found dead by missed heartbeats (not announced)."""
        self.seeded_at: float | None = None
        self.last_updates: dict[int, dict[int, Update]] = {}
        """Per learner and fragment, the latest answer sent: sent again after a restart (a learner drops
        an answer it already has)."""
        self.journal: Journal | None = None
        self._replaying = False
        if state_dir is not None:
            self.state_path = state_dir / f"shard-{plan.index}.state.pt"
            journal_path = state_dir / f"shard-{plan.index}.journal"
            saved = self.state_path.is_file()  # none yet: killed before Θ was seeded, nothing to resume
            if saved and not resume:
                raise DilocoError(f"{state_dir} holds the saved state of shard {plan.index}: pass --resume to "
                                  f"continue that run, or give another --out")
            with self.lock:
                last_seq = self._restore(journal_path) if saved else 0
            self.journal = Journal(journal_path, last_seq)
            if saved:
                self.save_state()
        self._timer = threading.Thread(target=self._timer_loop, name="syncer-timer", daemon=True)
        self._timer.start()
        self._liveness = threading.Thread(target=self._liveness_loop, name="syncer-liveness", daemon=True)
        self._liveness.start()

    # ------------------------------------------------------------ core plumbing

    def _handle(self, actions: list[Action]) -> None:
        """Publishes go to the recipients' outboxes; timers to the timer thread. Called under the lock."""
        for action in actions:
            if isinstance(action, Publish):
                for learner, update in action.updates.items():
                    self.last_updates.setdefault(learner, {})[update.fragment] = update
                    if learner not in self.left:
                        self.outboxes.setdefault(learner, queue.Queue()).put(update)
            elif isinstance(action, Timer):
                if self._deadline is None or action.at < self._deadline:
                    self._deadline = action.at
                    self._timer_cond.notify_all()
        if self.core is not None and not self._replaying:
            self.round_meter.emit(self.core.rounds)

    def _event(self, kind: str, now: float, push: Push | None = None, raw: bytes = b"", **fields):
        """Journal one event, then hand it to the core (under the lock). Replay takes the same path."""
        if self.journal is not None and not self._replaying:
            payload = struct.pack("<d", now) + raw if kind == "push" else json.dumps({"now": now, **fields}).encode()
            # A progress report need not be on disk before it is answered: the next event that is (every
            # event that decides something) makes it durable too, being later in the same file.
            self.journal.append(kind, payload, durable=kind != "progress")
        core = self.core
        if kind == "push":
            self._handle(core.on_push(push, now))
        elif kind == "progress":
            self._handle(core.on_progress(Progress(**{**fields, "due_in_s": tuple(fields["due_in_s"])}), now))
        elif kind == "timer":
            self._handle(core.on_timer(now))
        elif kind in ("leave", "lost"):
            learner = fields["learner"]
            if kind == "leave":
                self.left.add(learner)
                self.streams.pop(learner, None)
            else:
                self.lost.add(learner)
            self._handle(core.leave(learner, now, finished=fields.get("finished", False)))
            self._finish_if_everyone_left(now)
        elif kind == "revive":
            core.join(fields["learner"], now)
            self.lost.discard(fields["learner"])
        elif kind == "rejoin":
            learner = fields["learner"]
            values = core.rejoin_state(learner, fields["after_seq"], fields["fragments"])
            core.join(learner, now)
            self.joined.add(learner)
            self.left.discard(learner)
            self.lost.discard(learner)
            self.finished = False
            return values
        else:
            raise ValueError(f"unknown journal event {kind!r}")
        return None

    def record_metrics(self) -> None:
        """The shard's own record: outbox lengths, age of the saved state, memory."""
        with self.lock:
            queued = sum(q.qsize() for q in self.outboxes.values())
            rounds = self.core.rounds_closed if self.core else 0
            age = time.time() - self.saved_at if self.saved_at is not None else None
        self.metrics.record("syncer", shard=self.plan.index, queue_length=queued, checkpoint_age_s=age,
                            memory_bytes=resident_memory_bytes(), rounds=rounds)

    def _timer_loop(self) -> None:
        with self.lock:
            while not self._stopping:
                if self._deadline is None:
                    self._timer_cond.wait()
                    continue
                wait = self._deadline - time.time()
                if wait > 0:
                    self._timer_cond.wait(min(wait, threading.TIMEOUT_MAX))
                    continue
                self._deadline = None
                if self.core is not None:
                    now = time.time()
                    self._event("timer", now)
                    # Other rounds may still be in their grace windows: wake for the earliest of them. A
                    # deadline already past (a final round waiting for last pushes) needs no timer.
                    pending = [s.deadline for s in self.core.fragments.values()
                               if s.pending and s.deadline and s.deadline > now]
                    if pending and (self._deadline is None or min(pending) < self._deadline):
                        self._deadline = min(pending)

    def _liveness_loop(self) -> None:
        while not self._stopping:
            time.sleep(HEARTBEAT_S / 2)
            with self.lock:
                if self._stopping:
                    return
                self._check_liveness(time.time())
                if self.journal is not None and self.core is not None and \
                        time.time() - (self.saved_at or 0.0) > SAVE_EVERY_S:
                    self.save_state()

    def _check_liveness(self, now: float) -> None:
        """Stop counting on learners that went silent: no learner waits for a dead peer. Called under the lock."""
        core = self.core
        if core is None:
            return
        for m in sorted(core.alive):
            seen = self.last_seen.get(m)
            if seen is None or m not in self.joined:
                if now - (self.seeded_at or now) > JOIN_BOUND_S:
                    log.warning("learner %d never joined; rounds stop counting on it", m)
                    self._event("lost", now, learner=m)
                continue
            limit = DEAD_AFTER_HEARTBEATS * self.heartbeat_gap.get(m, HEARTBEAT_S)
            if now - seen > limit:
                log.warning("learner %d silent for %.1f s (%d heartbeats): counted as dead", m, now - seen,
                            DEAD_AFTER_HEARTBEATS)
                self._event("lost", now, learner=m)

    def _seen(self, learner: int, now: float, heartbeat: bool = False) -> None:
        """A learner was heard from. One counted dead by missed heartbeats (a partition, a stall) that
        speaks again counts again: its anchors are as the syncer recorded them."""
        if learner in self.lost and self.core is not None and learner in self.core.held:
            log.info("learner %d is back after %.1f s of silence", learner, now - self.last_seen.get(learner, now))
            self._event("revive", now, learner=learner)
        last = self.last_seen.get(learner)
        if heartbeat and last is not None and learner in self._heartbeat_seen:
            gap = now - self._heartbeat_seen[learner]
            old = self.heartbeat_gap.get(learner, gap)
            self.heartbeat_gap[learner] = old + 0.3 * (gap - old)
        if heartbeat:
            self._heartbeat_seen[learner] = now
        self.last_seen[learner] = now

    def _require_core(self, context: grpc.ServicerContext) -> SyncerCore:
        if self.core is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Θ is not seeded yet: a learner must Init first")
        return self.core

    def _finish_if_everyone_left(self, now: float) -> None:
        core = self.core
        if core is None or self.finished or core.alive:
            return
        self._handle(core.flush(now))
        self.finished = True
        log.info("every learner left; last rounds merged (%d rounds in all)", core.rounds_closed)

    # ------------------------------------------------------------ RPCs

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        if request.learner > MAX_LEARNER_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"learner id {request.learner} is above {MAX_LEARNER_ID}")
        with self.lock:
            if request.learner >= 0:
                learner = request.learner
            else:  # the lowest configured id that is not taken, else a new one
                taken = self.joined - self.left
                learner = next(m for m in range(len(taken) + self.settings.learners + 1) if m not in taken)
            self.joined.add(learner)
            self.left.discard(learner)
            self._seen(learner, time.time())
            self.hosts[learner] = request.host or context.peer()
            last_seq = self.core.ledger[learner].last_seq if self.core and learner in self.core.ledger else 0
            log.info("learner %d joined from %s", learner, request.host or context.peer())
            shards = [pb.ShardInfo(index=i, address=a, fragments=ShardPlan(i, self.plan.count, ()).fragments(
                self.spec.fragments)) for i, a in enumerate(self.plan.addresses)]
            return pb.JoinReply(learner=learner, settings=self.settings, shard=self.plan.index, shards=shards,
                                layout=self.layout, last_seq=last_seq)

    def Init(self, request_iterator, context: grpc.ServicerContext) -> pb.InitReply:
        if self.core is not None:
            return pb.InitReply(accepted=False)  # seeded already: not worth reading
        try:
            message = read_message(iter(request_iterator), "state", limit=INIT_LIMIT_BYTES)
            if not context.is_active():
                raise FrameError("the stream broke")
            if message is None:
                raise FrameError("empty Init stream")
            header, tensors = message
            fragments, embeddings = self._fragments_of(header.layout, tensors)
            values = {name: decode(e) for name, e in tensors.items()}
        except FrameError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Init: {exc}")
        with self.lock:
            if self.core is not None:
                return pb.InitReply(accepted=False)
            self.core = self._make_core(values, fragments, embeddings)
            self.layout = list(header.layout)
            self.seeded_at = time.time()
            if self.journal is not None:
                self.save_state()  # the seeded Θ is the base every journaled event applies to
            log.info("Θ seeded: fragments %s, %d tensors, %d parameters", self.owned, len(values),
                     sum(v.numel() for v in values.values()))
            return pb.InitReply(accepted=True)

    def _make_core(self, values: dict[str, torch.Tensor], fragments: list[Fragment], embeddings: set[str]
                   ) -> SyncerCore:
        c = self.config
        return self.spec.syncer_core(values, fragments, range(self.settings.learners), embeddings=embeddings,
                                     down_codec=get_codec(c.codec.down, c.codec.block), outlier=c.outer.outlier,
                                     outlier_factor=c.outer.outlier_factor, budget=self.settings.token_budget)

    def _fragments_of(self, layout, tensors: dict | None = None) -> tuple[list[Fragment], set[str]]:
        """The fragments a layout describes, checked against this shard (and against the values, at Init)."""
        indices = sorted(f.index for f in layout)
        if indices != self.owned:
            raise FrameError(f"layout has fragments {indices}; shard {self.plan.index}/{self.plan.count} owns "
                             f"{self.owned}")
        fragments, embeddings, names = [], set(), set()
        for f in sorted(layout, key=lambda f: f.index):
            specs = list(f.tensors)
            for t in specs:
                if t.name in names:
                    raise FrameError(f"tensor {t.name!r} is in two fragments")
                names.add(t.name)
                got = tensors.get(t.name) if tensors is not None else None
                if tensors is not None and (got is None or got.codec != "fp32" or list(got.shape) != list(t.shape)):
                    raise FrameError(f"tensor {t.name!r}: values missing or not fp32 of shape {list(t.shape)}")
                if t.embedding:
                    embeddings.add(t.name)
            numel = sum(int(torch.Size(t.shape).numel()) for t in specs)
            fragments.append(Fragment(f.index, tuple(t.name for t in specs), numel,
                                      bool(specs) and all(t.embedding for t in specs)))
        if tensors is not None and names != set(tensors):
            raise FrameError(f"values for tensors outside the layout: {sorted(set(tensors) - names)[:3]}")
        return fragments, embeddings

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
                theta, versions = self._event("rejoin", time.time(), learner=request.learner,
                                              after_seq=request.after_seq, fragments=fragments)
                self._seen(request.learner, time.time())
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
            deltas = {name: decode(e) for name, e in tensors.items()}
        except FrameError as exc:
            self.push_errors += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {exc}")
        push = self._push_of(header, tensors, deltas)
        with self.lock:
            entry = core.ledger.get(push.learner)
            duplicates = entry.duplicates if entry else 0
            try:
                core.check(push)  # refused before it is journaled: a refused push changes nothing
            except ProtocolError as exc:
                self.push_errors += 1
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self._event("push", time.time(), push, push_payload(header, tensors) if self.journal else b"")
            self._seen(push.learner, time.time())
            return pb.PushReply(duplicate=core.ledger[push.learner].duplicates > duplicates)

    @staticmethod
    def _push_of(header: pb.PushHeader, tensors: dict[str, Encoded], deltas: dict | None = None) -> Push:
        if deltas is None:
            deltas = {name: decode(e) for name, e in tensors.items()}
        return Push(learner=header.learner, fragment=header.fragment, base_version=header.base_version,
                    seq=header.seq, deltas=deltas, tokens=header.tokens, steps=header.steps,
                    step_time_s=header.step_time_s, sent_at=header.sent_at or None,
                    payload_bytes=sum(e.wire_bytes() for e in tensors.values()), step=header.step, final=header.final)

    def _push_limit(self) -> int:
        """The most data one push of any fragment here may carry: fp32, the widest encoding."""
        core = self.core
        return 4 * max(s.fragment.numel for s in core.fragments.values()) + MESSAGE_SLACK_BYTES

    def Updates(self, request: pb.UpdatesRequest, context: grpc.ServicerContext):
        learner = request.learner
        with self.lock:
            stream_id = self.streams.get(learner, 0) + 1
            self.streams[learner] = stream_id
            outbox = self.outboxes.setdefault(learner, queue.Queue())
        while context.is_active() and not self._stopping and self.streams.get(learner) == stream_id:
            try:
                update = outbox.get(timeout=OUTBOX_POLL_S)
            except queue.Empty:
                continue
            header = pb.UpdateHeader(fragment=update.fragment, version=update.version, ack_seq=update.ack_seq,
                                     tensors=[tensor_header(n, e, update.relative) for n, e in update.wire.items()],
                                     next_push_at=update.next_push_at)
            yield from message_frames(pb.Frame(update=header), update.wire)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        """A learner is alive (a heartbeat, on its timer) or says where it stands (a progress report, after
        a step: `due_in_s` is set). Only heartbeats measure the interval that liveness is judged by."""
        learner = request.learner
        with self.lock:
            core = self.core
            if learner in self.joined and learner not in self.left:  # strangers count for nothing
                now = time.time()
                self.steps[learner] = request.steps
                self._seen(learner, now, heartbeat=not request.due_in_s)
                if core is not None:
                    report = Progress(learner, request.steps, request.tokens, request.step_time_s,
                                      tuple(request.due_in_s))
                    try:
                        core.check_progress(report)  # refused before it is journaled: nothing changes
                    except ProtocolError as exc:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    self._event("progress", now, **dataclasses.asdict(report))
            total = core.tokens_reported() if core is not None else 0
            stop = core is not None and core.budget_spent
            return pb.HeartbeatReply(stop=stop, tokens_reported=min(total, MAX_TOKENS))

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        with self.lock:
            if request.learner not in self.joined:
                return pb.LeaveReply()  # never took part: nothing to change
            log.info("learner %d left", request.learner)
            if self.core is not None:
                self._event("leave", time.time(), learner=request.learner, finished=request.finished)
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
                                  report_json=json.dumps(self.report()))

    # ------------------------------------------------------------ reports and state

    def report(self) -> dict:
        """What this shard counted, for run summaries and reports (call under the lock)."""
        core = self.core
        out = {"shard": self.plan.index, "shards": self.plan.count, "fragments": self.owned,
               "finished": self.finished, "push_errors": self.push_errors, "tokens_reported": {}}
        if core is None:
            return out
        out["tokens_reported"] = {m: core.tokens_reported(m) for m in core.tokens.keys() | core.tokens_banked.keys()}
        out["fragment_numel"] = {p: s.fragment.numel for p, s in core.fragments.items()}
        out["versions"] = {p: s.version for p, s in core.fragments.items()}
        out["ledger"] = {m: {"pushes": e.pushes, "duplicates": e.duplicates, "last_seq": e.last_seq,
                             "steps_merged": e.steps_merged, "merged": dict(e.merged), "stale": dict(e.stale)}
                         for m, e in core.ledger.items()}
        out["rounds"] = [self._round(r) for r in core.rounds]
        return out

    def _round(self, r: RoundRecord) -> dict:
        """One round for reports and the status page, on the shard's own time axis."""
        return {"fragment": r.fragment, "version": r.version, "opened_at": r.opened_at - self.started,
                "closed_at": r.closed_at - self.started, "participants": list(r.participants),
                "stale": r.stale, "staleness": list(r.staleness), "held_s": r.held_s, "final": r.final}

    def snapshot(self) -> dict:
        """Membership, each learner's state and the recent rounds, for the status page."""
        with self.lock:
            core, now = self.core, time.time()
            learners = {}
            for m in sorted(set(range(self.settings.learners)) | self.joined):
                entry = core.ledger.get(m) if core else None
                seen = self.last_seen.get(m)
                if m in self.left:
                    state = "left"
                elif m in self.lost:
                    state = "lost"
                elif m not in self.joined:
                    state = "not joined"
                elif seen is not None and now - seen > SILENT_AFTER_S:
                    state = "silent"
                else:
                    state = "training"
                learners[str(m)] = {
                    "name": f"learner {m}", "host": self.hosts.get(m, ""), "state": state,
                    "tokens": core.tokens_reported(m) if core else 0, "steps": self.steps.get(m, 0),
                    "pushes": entry.pushes if entry else 0, "duplicates": entry.duplicates if entry else 0,
                    "tokens_merged": sum(entry.merged.values()) if entry else 0,
                    "tokens_stale": sum(entry.stale.values()) if entry else 0,
                    "last_seen_s": now - seen if seen is not None else None,
                    "held_versions": {str(p): v for p, v in core.held_versions.get(m, {}).items()} if core else {}}
            rounds = [self._round(r) for r in (core.rounds[-200:] if core else [])]
            return {"shard": self.plan.index, "shards": self.plan.count, "strategy": self.spec.name,
                    "uptime_s": now - self.started, "finished": self.finished, "fragments": self.owned,
                    "versions": {str(p): s.version for p, s in core.fragments.items()} if core else {},
                    "learners": learners, "rounds": rounds}

    def save_state(self) -> None:
        """Everything the shard decides from, written atomically, then the journal emptied: what it
        held is in the state now. Loaded with torch.load(weights_only=True): no code is unpickled."""
        with self.lock:
            core = self.core
            if core is None or self.journal is None:
                return
            state = {"core": core.state_dict(), "journal_seq": self.journal.seq,
                     "layout": [torch.frombuffer(bytearray(f.SerializeToString()), dtype=torch.uint8)
                                for f in self.layout],
                     "joined": sorted(self.joined), "left": sorted(self.left), "lost": sorted(self.lost),
                     "finished": self.finished,
                     "last_updates": {m: {p: _plain_update(u) for p, u in by_fragment.items()}
                                      for m, by_fragment in self.last_updates.items()},
                     "report": self.report()}
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, self.state_path)
            self.journal.truncate()
            self.saved_at = time.time()

    def _restore(self, journal_path: Path) -> int:
        """Load the saved state, replay the journal after it; return the last journaled number."""
        state = torch.load(self.state_path, weights_only=True)
        self.layout = [pb.FragmentLayout.FromString(bytes(t.numpy())) for t in state["layout"]]
        fragments, embeddings = self._fragments_of(self.layout)
        self.core = self._make_core(state["core"]["theta"], fragments, embeddings)
        self.core.load_state_dict(state["core"])
        self.joined, self.left, self.lost = set(state["joined"]), set(state["left"]), set(state["lost"])
        self.finished = state["finished"]
        self.last_updates = {m: {p: _update_of(plain) for p, plain in by_fragment.items()}
                             for m, by_fragment in state["last_updates"].items()}
        last_seq, replayed = state["journal_seq"], 0
        self._replaying = True
        try:
            for seq, kind, payload in Journal.read(journal_path):
                if seq <= last_seq:
                    continue
                self._replay(kind, payload)
                last_seq, replayed = seq, replayed + 1
        finally:
            self._replaying = False
        self.outboxes = {}  # only the latest answer per fragment goes out again, not every replayed one
        for m, by_fragment in self.last_updates.items():
            if m not in self.left:
                outbox = self.outboxes[m] = queue.Queue()
                for update in by_fragment.values():
                    outbox.put(update)
        self.seeded_at = now = time.time()
        for m in self.joined - self.left:
            self.last_seen[m] = now  # they get the usual missed heartbeats to show they are alive
        log.info("shard %d resumed: %d rounds, versions %s, %d journaled events replayed", self.plan.index,
                 self.core.rounds_closed, {p: s.version for p, s in self.core.fragments.items()}, replayed)
        return last_seq

    def _replay(self, kind: str, payload: bytes) -> None:
        if kind == "push":
            (now,) = struct.unpack_from("<d", payload)
            header, tensors = read_message(payload_frames(payload[8:]), "push", limit=1 << 40)
            self._event("push", now, self._push_of(header, tensors))
            return
        fields = json.loads(payload)
        self._event(kind, fields.pop("now"), **fields)

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self._timer_cond.notify_all()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _plain_update(update: Update) -> dict:
    """An answer as tensors and plain data, to save."""
    return {"fragment": update.fragment, "version": update.version, "ack_seq": update.ack_seq,
            "payload_bytes": update.payload_bytes, "relative": update.relative, "next_push_at": update.next_push_at,
            "values": dict(update.values),
            "wire": {n: {"codec": e.codec, "shape": list(e.shape), "block": e.block,
                         "payload": _bytes_tensor(e.payload), "scales": _bytes_tensor(e.scales)}
                     for n, e in update.wire.items()}}


def _update_of(plain: dict) -> Update:
    wire = {n: Encoded(w["codec"], tuple(w["shape"]), w["block"], bytes(w["payload"].numpy()),
                       bytes(w["scales"].numpy())) for n, w in plain["wire"].items()}
    return Update(plain["fragment"], plain["version"], dict(plain["values"]), ack_seq=plain["ack_seq"],
                  payload_bytes=plain["payload_bytes"], wire=wire, relative=plain["relative"],
                  next_push_at=plain["next_push_at"])


def serve(shard: SyncerShard, bind: str, workers: int = 32,
          security: TransportSecurity | None = None) -> tuple[grpc.Server, int]:
    """Start serving `shard` on `bind` (HOST:PORT; port 0 picks a free one); return the server and its
    port. A one-line error if the port is taken."""
    security = security or PLAINTEXT
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="syncer-rpc"),
                         interceptors=server_interceptors(security), options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_SyncerServicer_to_server(shard, server)
    check_bindable(bind)
    try:
        port = secure_server_port(server, bind, security)
    except RuntimeError:
        port = 0
    if port == 0:
        raise DilocoError(f"cannot listen on {bind}: the port is in use or the address is not this host's")
    server.start()
    return server, port


def check_bindable(bind: str) -> None:
    """A one-line error for an address this host cannot listen on, before gRPC logs its own."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise DilocoError(f"--bind expects HOST:PORT, got {bind!r}")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise DilocoError(f"cannot listen on {bind}: {reason}") from None
