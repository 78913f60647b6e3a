"""How a shard takes a push in, whichever way its data came: in gRPC frames behind its header, or over the
shard's bulk port once the header alone was checked and answered with a ticket (`transport/bulk.py`).

Both ways end in `take_push`: the push queued for its group (`group_commit.py`), and its outcome as a
PushReply or a `Refusal` that the way it came turns into its own answer (a gRPC status, or a bulk
reply). Every check of the header (size, fragment, who may speak for the learner) is made before a byte
of its data is read, by the gRPC call that carries the header; a bulk ticket is issued only after them,
and only for the bytes that header declares. A push taken off the bulk port is answered with a ticket for
its learner's next push, whose header then comes on the port with its data and is checked there, the same
checks, for that learner only; but not while other pushes wait for the shard, so that a shard that is
behind paces its learners by the two-step way's gRPC call.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError

from diloco.codecs import Encoded
from diloco.core.messages import Push, Update
from diloco.core.syncer_core import Publish
from diloco.shard.group_commit import QueuedPush, take_group
from diloco.shard.shard_state import ShardState
from diloco.transport.bulk import REFUSED, TAKEN, UNAVAILABLE, PushAhead, Upload
from diloco.transport.frames import FrameError, decode, open_message, tensors_of
from diloco.transport.wire_messages import push_of, push_payload
from diloco.v1 import diloco_pb2 as pb

log = logging.getLogger("diloco.syncer")

MESSAGE_SLACK_BYTES = 1 << 16


class Refusal(Exception):
    """A push not taken: `code` says whether to send it again (UNAVAILABLE) or not (INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, why: str) -> None:
        super().__init__(why)
        self.code = code


class PushIntake(ShardState):
    def push_limit(self) -> int:
        """The most data one push of any fragment here may carry: fp32, the widest encoding."""
        return 4 * max(s.fragment.numel for s in self.core.fragments.values()) + MESSAGE_SLACK_BYTES

    def take_push(self, header: pb.PushHeader, tensors: dict, peer: str) -> pb.PushReply:
        """Queue the push; whoever holds the lock next takes every queued push as one group (`group_commit`).
        A Refusal if it is not taken."""
        if self.tier is not None:  # a region's syncer takes its pushes one at a time, decoded here
            with self.decoding:  # pushes wait here encoded, not decoded: memory does not grow with learners
                try:
                    deltas = {name: decode(e) for name, e in tensors.items()}
                except FrameError as exc:
                    self.push_errors += 1
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad push: {exc}") from None
                push = push_of(header, tensors, deltas)
        else:
            push = push_of(header, tensors)  # decoded on use
        if self.sink:
            return self._sink_push(push, tensors)
        item = QueuedPush(push, push_payload(header, tensors) if self.store else b"")
        self.push_queue.put(item)
        with self.lock:
            while item.outcome is None:
                take_group(self, self.push_queue.take(), self.clock.now())
        if item.outcome == "refused":
            self.push_errors += 1
            log.warning("refused PushArrived from %s: %s", peer, item.why)
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, item.why)
        if item.outcome == "unavailable":
            raise Refusal(grpc.StatusCode.UNAVAILABLE, item.why)
        if item.clipped:
            log.warning("push %d of fragment %d from learner %d clipped to the outlier bound", push.seq,
                        push.fragment, push.learner)
        return pb.PushReply(duplicate=item.duplicate, clipped=item.clipped)

    def _sink_push(self, push: Push, tensors: dict[str, Encoded]) -> pb.PushReply:
        """Sink mode (`SINK_ENV`, benchmarks only): the push was read off the wire and is not merged. Its learner
        is answered as after a round, with one encoded difference of the fragment: the fragment's first push's
        own bytes, copied once and sent again each time (with no round, the current version would otherwise go
        whole, in fp32). So pushes and answers measure the transport alone, at their sizes in a run."""
        with self.lock:
            if push.fragment not in self.sink_answers:
                self.sink_answers[push.fragment] = {n: Encoded(e.codec, e.shape, e.block, bytes(e.payload),
                                                               bytes(e.scales)) for n, e in tensors.items()}
            wire = self.sink_answers[push.fragment]
            version = self.core.version(push.fragment)
            notice = Update(push.fragment, version, {}, ack_seq=push.seq, wire=(wire,), relative=True,
                            payload_bytes=sum(e.wire_bytes() for e in wire.values()), base_version=version)
            self.carry_out([Publish(push.fragment, version, {push.learner: notice})])
        return pb.PushReply()

    def checked_push_header(self, frames) -> tuple[pb.PushHeader, int]:
        """The push header at the front of `frames` and the data bytes it declares, once every tensor header is
        checked and its fragment is one this shard holds (a FrameError otherwise): what both ways of taking a
        push check before a byte of its data is read."""
        opened = open_message(frames, "push", limit=self.push_limit())
        if opened is None:
            raise FrameError("empty push stream")
        header, nbytes = opened
        if header.fragment not in self.core.fragments:
            raise FrameError(f"fragment {header.fragment} is not held by shard {self.plan.index}")
        return header, nbytes

    def bulk_ticket(self, header: pb.PushHeader, nbytes: int, peer: str) -> pb.PushReply:
        """The answer to a checked push header whose data is to follow on the bulk port: that port and a
        ticket for exactly `nbytes`. A shard without a bulk port answers with no ticket, and the learner sends
        the data in frames."""
        if self.bulk is None:
            return pb.PushReply()
        return pb.PushReply(bulk_port=self.bulk.port, bulk_ticket=self.bulk.ticket(self._upload(header, nbytes, peer)))

    def _upload(self, header: pb.PushHeader, nbytes: int, peer: str) -> Upload:
        """A checked header's data, read off the bulk port and taken as `take_push` takes frames. The reply of a
        push taken carries a ticket for its learner's next push (`BulkServer.ticket_ahead`)."""
        header.bulk = False  # as the journal keeps it: a push whose data is in hand
        learner = header.learner

        def take(data: memoryview) -> tuple[int, bytes]:
            try:
                reply = self.take_push(header, tensors_of(header, data), peer)
            except Refusal as exc:
                return (UNAVAILABLE if exc.code == grpc.StatusCode.UNAVAILABLE else REFUSED), str(exc).encode()
            except Exception as exc:  # noqa: BLE001 - the learner gets one line, the shard goes on
                log.error("push %d from learner %d over the bulk port failed: %s: %s", header.seq, header.learner,
                          type(exc).__name__, exc)
                return REFUSED, f"the shard failed to take it: {type(exc).__name__}: {exc}".encode()
            if (bulk := self.bulk) is not None and not self.push_queue.waiting():
                reply.next_ticket = bulk.ticket_ahead(learner, PushAhead(lambda raw: self._push_ahead(learner, raw, peer)))
            return TAKEN, reply.SerializeToString()

        return Upload(nbytes, take)

    def _push_ahead(self, learner: int, raw: bytes, peer: str) -> Upload | str:
        """The Upload of a push whose header came on the bulk port with a ticket issued to `learner` (by the
        reply to its last push, itself authenticated), checked as the gRPC call checks one; else why not."""
        try:
            header = pb.PushHeader.FromString(raw)
        except DecodeError:
            return "the header does not parse"
        if header.learner != learner:
            return f"the ticket is learner {learner}'s, the header speaks for learner {header.learner}"
        try:
            _, nbytes = self.checked_push_header(iter([pb.Frame(push=header)]))
        except FrameError as exc:
            self.push_errors += 1
            return f"bad push: {exc}"
        return self._upload(header, nbytes, peer)
