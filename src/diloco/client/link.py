"""One client's link to the syncer's shards: what every client (the torch, sharded and JAX learners
through `learner_client.py`, a regional syncer's uplink) stands on.

Typed events go up in the order they are sent (`PushOut`, `ProgressOut`, `HeartbeatOut`, `LeaveOut`);
updates come down decoded, each when the emulated link has carried it (`arrivals`), with refused pushes
and the word to stop handed to the client's `LinkHandlers`. Five kinds of threads do the work:

- encode: each push's tensors encoded in push order (error feedback carries over), on the client's
  device side (`Landing`), then queued on the shard's shaped way (`ShardWays`);
- deliver, one per shard: each message handed to its shard once the emulated link has carried it; a push
  is retried while its shard is unavailable (the shard counts a retried push once), until `close` gives
  up. A shard that is down or slow holds up only its own messages, never the other shards';
- receive, one per shard: the update stream, reopened when it ends or breaks (claiming what was received
  whole, so lost answers come again), answers in several messages put back together;
- heartbeat: the client's `beat` on its timer; and, one per shard, beat: a learner's heartbeat told to
  that shard, the newest one only: a shard that does not answer (partitioned: its call hangs
  until its deadline) keeps no other shard from hearing that the client is alive.

The link sees host tensors and an `encode` callable, never a model: device staging is the client's.
A thread that fails makes the link silent (nothing more is sent) and is reported through `failed`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

import torch

from diloco.codecs import Encoded
from diloco.core.liveness import HEARTBEAT_S
from diloco.core.messages import MESSAGE_HEADER_BYTES, Progress, Push, Update
from diloco.errors import DilocoError
from diloco.client.newest import Newest
from diloco.client.reachability import Reachability
from diloco.clock import SYSTEM_CLOCK as clock
from diloco.client.shard_ways import LinkShape, ShardWays, bytes_by_home
from diloco.network.shaping import DeliveryQueue
from diloco.transport.calls import SyncerUnavailable, with_retries
from diloco.transport.wire_messages import message_bytes, push_header, update_of

if TYPE_CHECKING:
    from diloco.client.joining import ShardLink

__all__ = ["LinkShape", "ShardWays", "bytes_by_home"]  # where the clients have always taken them from

log = logging.getLogger("diloco.link")

RECONNECT_S = 0.5
"""How long the link waits before opening a broken or ended update stream again."""
CLOSE_BOUND_S = 60.0
"""How long `close()` keeps trying to hand the last pushes to a syncer that does not answer."""


# ------------------------------------------------------------ events up


@dataclass(frozen=True)
class PushOut:
    push: Push
    ready: Any = None
    """The client's device marker its deltas were made at: encoding waits for it (`Landing.side`)."""


@dataclass(frozen=True)
class ProgressOut:
    progress: Progress


@dataclass(frozen=True)
class HeartbeatOut:
    tokens: int
    step: int


@dataclass(frozen=True)
class LeaveOut:
    finished: bool


UpEvent = Union[PushOut, ProgressOut, HeartbeatOut, LeaveOut]


@dataclass(frozen=True)
class Arrival:
    """An answer the emulated link has carried: merge it once `ready` (the client's device marker) is."""

    update: Update
    ready: Any = None


class Landing(Protocol):
    """Where a client's tensors are worked on (`client/staging.py` for torch devices; `HostLanding`)."""

    def side(self, after: Any = None) -> Any: ...

    def to_device(self, value: torch.Tensor) -> torch.Tensor: ...

    def done(self) -> Any: ...


class HostLanding:
    """Tensors stay on the host where they are."""

    @contextmanager
    def side(self, after: Any = None) -> Iterator[None]:
        yield

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def done(self) -> None:
        return None


@dataclass(frozen=True)
class LinkHandlers:
    """What the client does with what comes back (each called on a link thread)."""

    encode: Callable[[dict[str, torch.Tensor]], dict[str, Encoded]]
    """The client core's encoding of one push (called in push order, from one thread)."""
    anchors: Callable[[int], dict[str, torch.Tensor]]
    """What the client holds of a fragment as the syncer sent it: relative answers apply to it."""
    refused: Callable[[Push], None]
    stop: Callable[[], None]
    beat: Callable[[], list[UpEvent]]
    """What the client says on its heartbeat timer."""
    failed: Callable[[BaseException], None] = lambda exc: None
    answer: Callable[[Arrival], None] | None = None
    """Given: each arrival is handed to it on a link thread; None: the client takes them from `arrivals`."""
    ordered_beats: bool = False
    """A regional syncer's heartbeat carries claims that must stay behind the reports sent before it: it
    goes through the queue. A learner's only says it is alive and must not wait behind a push on a slow
    link: it is told to every shard at once."""


class ClientLink:
    def __init__(self, sender: int, who: str, shards: list[ShardLink], received: dict[int, int], up: ShardWays,
                 down: ShardWays, landing: Landing | None = None) -> None:
        """`sender`: the id the shards know this client by; `who`: how logs name it ("learner 3");
        `received`: per fragment, the version held (what a reopened stream claims)."""
        self.sender, self.who, self.shards = sender, who, shards
        self.up, self.down = up, down
        self.landing: Landing = landing or HostLanding()
        self.received = dict(received)
        """Per fragment, the version of the last answer received whole."""
        self.shard_of = {p: shard for shard in shards for p in shard.fragments}
        self.arrivals: DeliveryQueue[Arrival] = DeliveryQueue()
        self.error: BaseException | None = None
        self._outbox: queue.Queue[UpEvent | None] = queue.Queue()
        self._wires: dict[int, DeliveryQueue[tuple[UpEvent, Any]]] = {s.index: DeliveryQueue() for s in shards}
        """Per shard, what its deliver thread hands over, each when the emulated link has carried it."""
        self._beats: dict[int, Newest[HeartbeatOut]] = {s.index: Newest() for s in shards}
        """Per shard, the heartbeat its beat thread tells next (unordered heartbeats only)."""
        self._halt = threading.Event()
        self._give_up = threading.Event()
        self._answers_wanted, self._answers_lock = threading.Event(), threading.Lock()
        self._answers_wanted.set()
        self._threads: list[threading.Thread] = []
        self._senders: list[threading.Thread] = []
        self._unsent = 0
        """Events sent and not yet delivered (`drain`)."""
        self._delivered = threading.Condition()
        self.reach = Reachability()
        """When each shard stopped answering this client's pushes and heartbeats, and answered again."""

    def start(self, handlers: LinkHandlers, name: str) -> None:
        """Start the threads, named after `name` ("learner", "uplink")."""
        self.handlers = handlers
        targets = [("encode", self._encode_loop), ("heartbeat", self._heartbeat_loop)]
        targets += [(f"deliver-{s.index}", lambda s=s: self._deliver_loop(s)) for s in self.shards]
        targets += [(f"receive-{s.index}", lambda s=s: self._receive_loop(s)) for s in self.shards]
        if not handlers.ordered_beats:
            targets += [(f"beat-{s.index}", lambda s=s: self._beat_loop(s)) for s in self.shards]
        if handlers.answer is not None:
            targets.append(("answers", self._answer_loop))
        for kind, target in targets:
            thread = threading.Thread(target=self._guard(target), name=f"{name}-{kind}", daemon=True)
            thread.start()
            self._threads.append(thread)
            if kind == "encode" or kind.startswith("deliver"):
                self._senders.append(thread)

    def send(self, event: UpEvent) -> None:
        """Carry `event` up, after every event sent before it."""
        with self._delivered:
            self._unsent += 1
        self._outbox.put(event)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every event sent so far is delivered (a push's tensors and bytes let go), for at
        most `timeout_s`; False if it did not happen (the syncer away, or the link broken)."""
        with self._delivered:
            return self._delivered.wait_for(lambda: self._unsent == 0 or self.error is not None, timeout_s)

    def stop_answers(self) -> None:
        """The client will merge no more answers (it has made its last pushes): those that have arrived
        and those still to come are dropped, the latter undecoded. A leaving learner's last pushes are
        answered with whole fragments, which would otherwise be held until it is gone."""
        with self._answers_lock:  # an answer decoded meanwhile is not queued after the clear
            self._answers_wanted.clear()
            self.arrivals.clear()

    def close(self) -> None:
        """Deliver what is queued (for at most `CLOSE_BOUND_S` while the syncer does not answer), then stop."""
        self._outbox.put(None)
        deadline = clock.monotonic() + CLOSE_BOUND_S
        for thread in self._senders:
            thread.join(timeout=max(0.0, deadline - clock.monotonic()))
        if any(thread.is_alive() for thread in self._senders):  # a shard stayed away: what is left unsent is lost
            log.warning("%s: syncer unreachable for %g s at close; giving up", self.who, CLOSE_BOUND_S)
            self._give_up.set()
            for thread in self._senders:
                thread.join()
        self._halt.set()
        for beat in self._beats.values():
            beat.close()
        self.arrivals.close()
        for shard in self.shards:
            shard.client.close()
        for thread in self._threads:
            thread.join(timeout=5)

    # ------------------------------------------------------------ threads

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                if not self._halt.is_set():
                    log.exception("%s: %s failed", self.who, threading.current_thread().name)
                    self.error = exc
                    self._close_wires()  # a broken link goes silent
                    with self._delivered:
                        self._delivered.notify_all()
                    self.handlers.failed(exc)
        return run

    def _encode_loop(self) -> None:
        """Encode pushes in order and put every event on its way (a push on its shard's, others on each)."""
        while (event := self._outbox.get()) is not None:
            items = self._encoded(event)
            del event  # a push's tensors are let go once encoded, before it is queued (see `drain`)
            with self._delivered:  # one delivery per shard it goes to
                self._unsent += len(items) - 1
                self._delivered.notify_all()
            for shard, at, item in items:
                self._wires[shard].put(at, item)
            items = item = None  # and its bytes once delivered, not when the next event comes
        self._close_wires()

    def _encoded(self, event: UpEvent) -> list[tuple[int, float, tuple[UpEvent, Any]]]:
        """Per shard `event` goes to, when it arrives over that shard's way and what is delivered then: a push
        encoded, without its tensors."""
        if isinstance(event, PushOut):
            push = event.push
            with self.landing.side(event.ready):  # encoded on the device, then copied to the host
                encoded = self.handlers.encode(push.deltas)
            header = push_header(self.sender, push, encoded)
            shard = self.shard_of[push.fragment].index
            return [(shard, self.up.to(shard).send(message_bytes(encoded)),
                     (PushOut(replace(push, deltas={})), (header, encoded)))]
        nbytes = event.progress.wire_bytes() if isinstance(event, ProgressOut) else \
            MESSAGE_HEADER_BYTES if isinstance(event, LeaveOut) else 0  # a heartbeat: behind the reports before it
        arrive = self.up.send_to_each(nbytes, list(self._wires))
        return [(shard, at, (event, None)) for shard, at in arrive.items()]

    def _close_wires(self) -> None:
        for wire in self._wires.values():
            wire.close()

    def _deliver_loop(self, shard: ShardLink) -> None:
        while (item := self._wires[shard.index].get()) is not None and self.error is None:
            self._deliver(shard, *item)
            del item  # let go before `drain` hears of it
            with self._delivered:
                self._unsent -= 1
                self._delivered.notify_all()

    def _deliver(self, shard: ShardLink, event: UpEvent, payload: Any) -> None:
        if isinstance(event, PushOut):
            self._deliver_push(shard, event.push, *payload)
        elif isinstance(event, ProgressOut):
            p = event.progress
            self._tell_one(shard, p.tokens, p.step, p.step_time_s, p.due_in_s)
        elif isinstance(event, HeartbeatOut):
            self._tell_one(shard, event.tokens, event.step)
        else:
            try:
                with_retries(lambda: shard.client.leave(self.sender, finished=event.finished), what="leave",
                             client=shard.client)
            except SyncerUnavailable as exc:
                log.warning("%s: could not announce leaving to shard %d: %s", self.who, shard.index, exc)

    def _deliver_push(self, shard: ShardLink, push: Push, header: Any, encoded: dict[str, Encoded]) -> None:
        """A shard that restarts comes back with everything it acknowledged: keep trying (the client goes on
        meanwhile); a push it took before it went down is counted once."""
        try:
            reply = with_retries(lambda: self.reach.call(shard.index, "push", lambda: shard.client.push(
                header, encoded)), attempts=None, what="push", give_up=self._give_up, client=shard.client)
        except SyncerUnavailable:
            raise
        except DilocoError as exc:  # refused with a reason (an outlier, a non-finite value)
            log.warning("%s: push of fragment %d refused: %s", self.who, push.fragment, exc)
            self.handlers.refused(push)
            return
        if reply.clipped:
            log.warning("%s: push of fragment %d was larger than the syncer's outlier bound and merged scaled "
                        "down to it", self.who, push.fragment)

    def _tell_one(self, shard: ShardLink, tokens: int, step: int, step_time_s: float = 0.0,
                  due_in_s: tuple[float, ...] = ()) -> None:
        """A progress report or heartbeat to one shard; not retried (the next one says more)."""
        try:
            reply = self.reach.call(shard.index, "heartbeat", lambda: shard.client.heartbeat(
                self.sender, tokens, step, step_time_s, due_in_s))
        except DilocoError as exc:
            log.debug("%s: report to shard %d failed: %s", self.who, shard.index, exc)
            return
        if reply.stop:
            self.handlers.stop()

    def _heartbeat_loop(self) -> None:
        while not self._halt.wait(HEARTBEAT_S):
            for event in self.handlers.beat():
                if self.handlers.ordered_beats or not isinstance(event, HeartbeatOut):
                    self.send(event)
                else:
                    for beat in self._beats.values():
                        beat.put(event)

    def _beat_loop(self, shard: ShardLink) -> None:
        while (event := self._beats[shard.index].take()) is not None:
            self._tell_one(shard, event.tokens, event.step)

    def _receive_loop(self, shard: ShardLink) -> None:
        """New versions from one shard: decoded here, handed over when the emulated link delivers them.
        A stream that ends or breaks is opened again (a client without updates would go on alone); one
        the shard refuses is this link's failure."""
        while not self._halt.is_set():
            partial: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
            """Per fragment, an answer's differences applied so far (and their bytes), until its last."""
            holds = {p: self.received[p] for p in shard.fragments}
            try:
                for header, tensors in shard.client.updates(self.sender, holds):
                    if not self._answers_wanted.is_set():
                        continue
                    base, nbytes = partial.pop(header.fragment, (None, 0))
                    nbytes += message_bytes(tensors)
                    with self.landing.side():
                        update = update_of(header, tensors, self.handlers.anchors(header.fragment),
                                           self.received[header.fragment], nbytes, base, self.landing.to_device)
                        ready = self.landing.done()
                    if header.continued:
                        partial[header.fragment] = (update.values, nbytes)
                        continue
                    self.received[header.fragment] = header.version
                    with self._answers_lock:
                        if self._answers_wanted.is_set():
                            self.arrivals.put(self.down.to(shard.index).send(nbytes), Arrival(update, ready))
                reason = "the update stream ended"
            except (SyncerUnavailable, ValueError) as exc:  # ValueError: a LostAnswer, or a bad frame
                reason = str(exc)
                shard.client.cancel_updates()
            if shard.client.connected:
                self._halt.wait(RECONNECT_S)
            else:  # the connection is gone: the stream opens again as soon as it is back
                shard.client.wait_connected(RECONNECT_S)
            if self._halt.is_set():
                return
            log.warning("%s: %s (shard %d); reconnecting", self.who, reason, shard.index)

    def _answer_loop(self) -> None:
        while (arrival := self.arrivals.get()) is not None:
            self.handlers.answer(arrival)
