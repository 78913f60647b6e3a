"""The learner's end of the protocol, one shard at a time: plain calls that turn gRPC failures into
one-line errors naming the shard."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import grpc
import torch

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.codecs import Encoded
from diloco.errors import DilocoError
from diloco.transport.bulk import AHEAD_HEADER, TAKEN, UNAVAILABLE, BulkTransferError, BulkUnreachable
from diloco.transport.bulk_client import BulkConnections, bulk_host, receive, send
from diloco.transport.security import BUSY, ClientIdentity, TransportSecurity, default_security, make_channel
from diloco.transport.frames import data_views, message_frames, read_message, read_values
from diloco.transport.stream_calls import syncer_stub
from diloco.transport.wire_messages import (fragment_versions, heartbeat_request, push_in_of, seed_frames,
                                            versions_of)
from diloco.v1 import diloco_pb2 as pb

log = logging.getLogger("diloco.learner")

RECONNECT_MAX_S = 0.5
"""The longest a channel waits between attempts to connect to a shard it lost (gRPC adds up to 20% jitter).
A refused connection costs either end next to nothing, and every second a restarted shard goes unreached
is a second its learners train apart: a learner's calls get through within this (and the jitter) of a
restarted shard's serving (measured in `diloco chaos`'s timeline of each shard kill)."""
RETRY_MAX_S = 5.0
"""The longest `with_retries` waits between tries of a call a shard answered as unavailable (busy, or
unable to journal): its own load is what the wait spares."""
GIVE_UP_POLL_S = 0.2
"""How often a wait for a shard looks whether it was told to give up (a learner stopping while it joins)."""
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_permit_without_calls", 1),
                   # After a partition or a shard restart, try again within RECONNECT_MAX_S (gRPC's own
                   # backoff would grow to minutes): the learner's pushes wait in its queue meanwhile.
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_S * 1000))]
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
BULK_TRIES = 3
"""Times in a row a shard's bulk port may be unreachable for a push or an answer before its learner moves
those bytes over gRPC for good: a shard killed between handing out a ticket and its use is not a
firewall, and once restarted it names its new port on the next call."""
GRPC_BUSY = "Concurrent RPC limit exceeded!"
"""gRPC's own refusal when the syncer's `maximum_concurrent_rpcs` calls are running."""


def retryable(error: grpc.RpcError) -> bool:
    """Unreachable, too slow, or refused for want of capacity (not a message too large: that stays so)."""
    code = error.code()
    details = error.details() or ""
    return code in RETRYABLE or (code == grpc.StatusCode.RESOURCE_EXHAUSTED
                                 and (details.startswith(BUSY) or details == GRPC_BUSY))

class Pulled(NamedTuple):
    """A pull's answer: Θ of the fragments asked for, their versions, the shard's layout, and (a joining
    learner's pull) when, on this machine's wall clock, to push each fragment first (`SendState.push_in_s`)."""

    values: dict[str, torch.Tensor]
    versions: dict[int, int]
    layout: list[pb.FragmentLayout]
    push_at: dict[int, float]


class SyncerUnavailable(DilocoError):
    """The shard could not be reached (yet): callers may retry."""


def describe(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return f"{code.name if code else 'error'}: {details}"


class ShardClient:
    def __init__(self, address: str, security: TransportSecurity | None = None) -> None:
        """`security`: the shared secret (or a learner's own credential) and TLS settings; by default the
        secret in DILOCO_SECRET, else the credential in DILOCO_LEARNER_TOKEN, if any."""
        self.address = address
        security = security if security is not None else default_security()
        self.security = security
        self.bulk_failed = False
        """A bulk pull from this shard failed once, or its bulk port could not be reached for a push: pulls
        and pushes go over gRPC since."""
        self.bulk_pushes = False
        """The shard's Join said it takes a push's data on its bulk port (`transport/bulk.py`)."""
        self.bulk_misses = 0
        """Times in a row its bulk port could not be reached for a push or an answer."""
        self.bulk_connections = BulkConnections(security)
        self.ahead: tuple[int, bytes] | None = None
        """The bulk port and the ticket the last push's reply gave for the next push (`bulk.ticket_ahead`)."""
        self._ahead_lock = threading.Lock()
        self.identity = ClientIdentity(security)
        self.channel = make_channel(address, security, CHANNEL_OPTIONS, self.identity)
        self.stub = syncer_stub(self.channel)
        self._connected = threading.Event()
        """Set while the channel holds a connection to the shard (told by gRPC on every change). The one
        subscription to the channel's state, which also starts connecting: gRPC's own ready future would
        subscribe again, and a channel closed within its poll interval after that fails gRPC's poller."""
        self.channel.subscribe(self._on_connectivity, try_to_connect=True)

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self._connected.set()
        else:
            self._connected.clear()

    @property
    def connected(self) -> bool:
        """Whether the channel holds a connection now: a call that failed without one failed for want of it."""
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the channel holds a connection again (gRPC reconnects every `RECONNECT_MAX_S` at most),
        for at most `timeout_s`; whether it does."""
        return self._connected.wait(timeout_s)

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                self.identity.run = None  # a shard that started a new run: the next call learns it again
            if retryable(exc):
                raise SyncerUnavailable(f"syncer at {self.address} unavailable during {what} ({describe(exc)})") \
                    from None
            raise DilocoError(f"syncer at {self.address} refused {what}: {exc.details()}") from None

    def wait_ready(self, timeout_s: float, give_up: threading.Event | None = None) -> None:
        """Block until the shard answers; a one-line error if it does not within `timeout_s`, or once
        `give_up` is set (a learner told to stop while it joins)."""
        deadline = clock.monotonic() + timeout_s
        while not self.wait_connected(min(GIVE_UP_POLL_S, max(0.0, deadline - clock.monotonic()))):
            if give_up is not None and give_up.is_set():
                raise DilocoError(f"stopped while waiting for the syncer at {self.address}")
            if clock.monotonic() >= deadline:
                raise DilocoError(f"cannot reach the syncer at {self.address} (nothing answered within "
                                  f"{timeout_s:g} s): check the address and that `diloco syncer` runs there")

    @property
    def own_learner(self) -> int | None:
        """The learner this client's credential names, if it holds only one learner's."""
        return self.identity.learner

    def act_as(self, learner: int) -> None:
        """Calls from now on speak for `learner` (the shard binds learner calls to their credential)."""
        self.identity.act_as(learner)

    def join(self, learner: int | None, host: str = "", tokens_per_step: int = 0) -> pb.JoinReply:
        """Join as `learner` (None: the syncer picks, or the one this client's credential names); from the
        reply on, calls carry the joined learner's credential. `tokens_per_step`: what one inner step
        trains (batch × sequence × ranks), 0 when not known."""
        if learner is None:
            learner = self.own_learner
        if learner is not None:
            self.act_as(learner)
        request = pb.JoinRequest(learner=-1 if learner is None else learner, host=host,
                                 tokens_per_step=tokens_per_step)
        reply = self._call("join", self.stub.Join, request, timeout=30)
        self.act_as(reply.learner)
        self.bulk_pushes = reply.bulk_pushes
        return reply

    def init(self, layout: list[pb.FragmentLayout], values: Mapping[str, Any]) -> bool:
        """Seed Θ: each value (anything with `.shape` and `.detach()`) is taken and encoded only as its frames
        are due, on gRPC's request thread (`seed_frames`); a failure there is raised here as it was."""
        failed: list[Exception] = []

        def frames() -> Iterator:
            try:
                yield from seed_frames(values, layout)
            except Exception as exc:
                failed.append(exc)
                raise

        try:
            return self._call("init", self.stub.Init, frames(), timeout=300).accepted
        except DilocoError:
            if failed:
                raise failed[0] from None
            raise

    def pull(self, learner: int, *, observer: bool = False, after_seq: int = 0, fragments: list[int] = ()) -> Pulled:
        """Θ of the shard's `fragments` (default: all), their versions, and the layout: over the shard's bulk
        port where it serves one (`transport/bulk.py`), else (or once that failed) in gRPC frames."""
        header_at: list[float] = []

        def stamped(stream):
            for frame in stream:  # the header comes first: when (wall clock) the first push delays count from
                if not header_at:
                    header_at.append(clock.now())
                yield frame

        def fetch():
            header_at.clear()
            bulk = not self.bulk_failed
            request = pb.PullRequest(learner=learner, observer=observer, after_seq=after_seq, fragments=fragments,
                                     bulk=bulk)
            stream = self.stub.Pull(request, timeout=300)
            try:
                message = read_values(stamped(stream), "state", limit=1 << 40,
                                      bulk=self.receive_bulk if bulk else None)
            except BulkTransferError as exc:
                stream.cancel()
                self.bulk_failed = True
                log.warning("%s; pulling over gRPC from now on", exc)
                return fetch()
            if message is None:
                raise DilocoError(f"syncer at {self.address} sent no state")
            return message

        header, values = self._call("pull", fetch)
        push_at = {p: header_at[0] + d for p, d in push_in_of(header.versions).items()} if header_at else {}
        return Pulled(values, versions_of(header.versions), list(header.layout), push_at)

    def receive_bulk(self, header: pb.StateHeader | pb.UpdateHeader, targets: list[memoryview]) -> None:
        """Fill `targets` with the data a header's bulk ticket names, from the shard's bulk port."""
        receive(self.bulk_connections, bulk_host(self.address), header.bulk_port, header.bulk_ticket, targets,
                self.address)

    def push(self, header: pb.PushHeader, tensors: dict[str, Encoded]) -> pb.PushReply:
        """One push (`header`'s tensor list in `tensors`' order): its data over the shard's bulk port where its
        Join said it takes it, else (or once that port could not be reached) in gRPC frames behind the header.
        Over the port, header and data go together where the last push's reply gave a ticket for this one;
        else the header alone goes over gRPC first, answered with a ticket for the data."""
        if self.bulk_pushes and not self.bulk_failed:
            with self._ahead_lock:
                ahead, self.ahead = self.ahead, None
            if ahead is not None:
                taken = self._push_ahead(ahead, header, tensors)
                if taken is not None:
                    return taken
            bulk_header = pb.PushHeader()
            bulk_header.CopyFrom(header)
            bulk_header.bulk = True
            reply = self._call("push", self.stub.Push, iter([pb.Frame(push=bulk_header)]), timeout=600)
            if reply.bulk_ticket:  # none: the shard has no bulk port now (restarted without one)
                taken = self._push_bulk(reply.bulk_port, reply.bulk_ticket, [], tensors)
                if taken is not None:
                    return taken
        frames = message_frames(pb.Frame(push=header), tensors)
        return self._call("push", self.stub.Push, frames, timeout=600)

    def _push_ahead(self, ahead: tuple[int, bytes], header: pb.PushHeader, tensors: dict[str, Encoded]
                    ) -> pb.PushReply | None:
        """The push's header and data with the ticket the last push's reply gave; None if that did not go
        through (the ticket void, the shard restarted, the connection broke): the caller then sends it the
        two-step way, and a push that went through after all is counted once (its seq)."""
        raw = header.SerializeToString()
        try:
            return self._push_bulk(*ahead, [memoryview(AHEAD_HEADER.pack(len(raw)) + raw)], tensors, ahead=True)
        except (SyncerUnavailable, BulkUnreachable):
            return None

    def _push_bulk(self, port: int, ticket: bytes, head: list[memoryview], tensors: dict[str, Encoded],
                   ahead: bool = False) -> pb.PushReply | None:
        """`head` and the push's data sent with `ticket` and the shard's reply read; None if the port is
        unreachable (then frames; after BULK_TRIES in a row, from now on; `ahead`: BulkUnreachable, not
        counted, as the port may be a restarted shard's old one). A transfer that broke is SyncerUnavailable:
        the push is sent again and counted once (its seq). A reply's ticket for the next push is kept for it."""
        try:
            status, body = send(self.bulk_connections, bulk_host(self.address), port, ticket,
                                head + data_views(tensors.values()), self.address)
        except BulkUnreachable as exc:
            if ahead:
                raise
            self._bulk_missed(exc)
            return None
        except BulkTransferError as exc:
            raise SyncerUnavailable(f"syncer at {self.address} unavailable during push ({exc})") from None
        self.bulk_misses = 0
        if status == TAKEN:
            reply = pb.PushReply.FromString(body)
            if reply.next_ticket:  # the transport's, not the caller's
                with self._ahead_lock:
                    self.ahead = (port, reply.next_ticket)
                reply.ClearField("next_ticket")
            return reply
        why = body.decode(errors="replace")
        if status == UNAVAILABLE:
            raise SyncerUnavailable(f"syncer at {self.address} unavailable during push ({why})")
        raise DilocoError(f"syncer at {self.address} refused push: {why}")

    def updates(self, learner: int, holds: dict[int, int] | None = None
                ) -> Iterator[tuple[pb.UpdateHeader, dict[str, Encoded]]]:
        """New versions for `learner`, as the shard publishes them, until the stream is cancelled or ends.
        `holds`: the version of each fragment it last received whole (answers lost on the way come again)."""
        bulk = not self.bulk_failed  # a shard without a bulk port (or older) sends frames all the same
        call = self.stub.Updates(pb.UpdatesRequest(learner=learner, holds=fragment_versions(holds or {}), bulk=bulk))
        self._updates_call = call
        frames = iter(call)
        try:
            while (message := read_message(frames, "update", limit=1 << 40,
                                           bulk=self.receive_bulk if bulk else None)) is not None:
                yield message
        except BulkUnreachable as exc:  # the stream opens again: what it held comes again
            self._bulk_missed(exc)
            call.cancel()
            raise SyncerUnavailable(f"answer from {self.address} not fetched ({exc})") from None
        except BulkTransferError as exc:
            call.cancel()
            raise SyncerUnavailable(f"answer from {self.address} broke ({exc})") from None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            if exc.code() in REFUSALS:  # asking again would be refused again
                raise DilocoError(f"syncer at {self.address} refused the update stream: {exc.details()}") \
                    from None
            raise SyncerUnavailable(f"update stream from {self.address} broke ({describe(exc)})") from None

    def _bulk_missed(self, exc: BulkUnreachable) -> None:
        self.bulk_misses += 1
        if self.bulk_misses >= BULK_TRIES:
            self.bulk_failed = True
            log.warning("%s; pushing and pulling over gRPC from now on", exc)

    def cancel_updates(self) -> None:
        call = getattr(self, "_updates_call", None)
        if call is not None:
            call.cancel()

    def heartbeat(self, learner: int, tokens: int, steps: int, step_time_s: float = 0.0,
                  due_in_s: tuple[float, ...] = ()) -> pb.HeartbeatReply:
        """Say the learner is alive; with `due_in_s`, also where it stands (a progress report)."""
        request = heartbeat_request(learner, tokens, steps, step_time_s, due_in_s)
        return self._call("heartbeat", self.stub.Heartbeat, request, timeout=10)

    def leave(self, learner: int, finished: bool = False) -> None:
        self._call("leave", self.stub.Leave, pb.LeaveRequest(learner=learner, finished=finished), timeout=30)

    def status(self, timeout_s: float = 10) -> pb.StatusReply:
        return self._call("status", self.stub.Status, pb.StatusRequest(), timeout=timeout_s)

    def close(self) -> None:
        self.cancel_updates()
        self.bulk_connections.close()
        self.channel.unsubscribe(self._on_connectivity)
        _await_poller(self.channel)
        self.channel.close()


POLLER_STOP_S = 1.0
"""The longest `close` waits for gRPC's poller of a channel's state to stop."""


def _await_poller(channel: grpc.Channel) -> None:
    """Once nobody subscribes, gRPC's poller of a channel's state stops at its next look (every 0.2 s); a
    channel closed before that fails it, with a traceback on its thread. Wait for it (at most
    `POLLER_STOP_S`), reading gRPC's own attributes where they are (an intercepted channel wraps the real
    one); where they are not, nothing is awaited."""
    state = getattr(channel, "_connectivity_state", None) or getattr(getattr(channel, "_channel", None),
                                                                     "_connectivity_state", None)
    deadline = clock.monotonic() + POLLER_STOP_S
    while getattr(state, "polling", False) and clock.monotonic() < deadline:
        clock.sleep(0.01)


def with_retries(fn, *, attempts: int | None = 8, first_delay_s: float = 0.1, what: str = "call",
                 give_up: threading.Event | None = None, client: ShardClient | None = None):
    """Run `fn`, retrying with exponential backoff (up to `RETRY_MAX_S` apart) while the syncer is
    unavailable: `attempts` times, or with None until it answers or `give_up` is set. With the `client`
    whose call `fn` makes, a call that failed for want of a connection is tried again as soon as the
    channel has one (a restarted shard is reached at gRPC's next reconnect, not the next backoff step);
    one refused over a standing connection (the shard busy) waits its backoff."""
    delay = first_delay_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except SyncerUnavailable:
            if (attempts is not None and attempt >= attempts) or (give_up is not None and give_up.is_set()):
                raise
            if client is not None and not client.connected:
                client.wait_connected(delay)
            elif give_up is not None:
                give_up.wait(delay)
            else:
                clock.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
