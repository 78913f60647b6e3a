"""A regional syncer's way to the global syncer, over the real network.

It joins the global shards as one learner (its region's id), seeds Θ there with the values its own first
learner brought if nobody has yet (or checks their layout), and takes the global Θ, from which the
regional syncer starts. From then on it carries the regional syncer's `Upstream` events to the global
shards in order, over an emulated WAN link when one is given (pushes encoded here, off the shard's
lock), and hands back the global answers and the word to stop. It is the learner runtime's transport
(`joining.py`, `transport/calls.py`, the shaped link), driven by a syncer instead of a training loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.codecs import Encoded
from diloco.config import LinkConfig
from diloco.core.events import HeartbeatArrived, LearnerLeft, ProgressArrived, PushArrived, SyncerEvent
from diloco.core.liveness import HEARTBEAT_S
from diloco.core.messages import MESSAGE_HEADER_BYTES, Push, Update
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.client.answers import update_of
from diloco.client.joining import Joined, ShardLink, join_run
from diloco.client.learner_client import ShardWays
from diloco.transport.calls import SyncerUnavailable, with_retries
from diloco.transport.frames import tensor_header
from diloco.transport.security import TransportSecurity
from diloco.network.shaping import DeliveryQueue
from diloco.v1 import diloco_pb2 as pb

log = logging.getLogger("diloco.uplink")

RECONNECT_S = 0.5
CLOSE_BOUND_S = 60.0
"""How long closing keeps trying to hand the region's last pushes to a global syncer that does not answer."""


@dataclass(frozen=True)
class UplinkHandlers:
    """What the regional shard does with what comes back (each called on an uplink thread)."""

    answer: Callable[[Update], None]
    stop: Callable[[], None]
    refused: Callable[[Push], None]
    encode: Callable[[dict[str, torch.Tensor]], dict[str, Encoded]]
    """The upstream core's encoding (error feedback carries over: called in push order, one thread)."""
    anchors: Callable[[int], dict[str, torch.Tensor]]
    """What the region holds of a fragment as the global syncer sent it: relative answers apply to it."""
    beat: Callable[[], list[SyncerEvent]]


@dataclass(frozen=True)
class HomeRoute:
    """Where one global shard runs (a region's name, for the report's per-home bytes) and the WAN link to
    it each way (None: none to emulate, e.g. from the region's own)."""

    home: str
    up: LinkConfig | None
    down: LinkConfig | None


class Uplink:
    def __init__(self, address: str, region: int, security: TransportSecurity | None, *,
                 up: LinkConfig | None = None, down: LinkConfig | None = None, host: str = "",
                 connect_timeout_s: float = 60.0, homes: Sequence[HomeRoute] | None = None,
                 owners: Sequence[int] | None = None) -> None:
        """`up`/`down`: the WAN link to emulate each way (None: the network as it is). `homes`: per global
        shard, where it runs and the link to it, when the shards run in different regions (`placement =
        "links"`): each shard's traffic shaped and counted on its own, instead of all on `up`/`down`.
        `owners`: per fragment, the global shard the config says owns it (checked at join)."""
        self.address, self.region, self.security = address, region, security
        self.host, self.connect_timeout_s = host, connect_timeout_s
        self.homes, self.owners = (list(homes) if homes is not None else None), owners
        per_shard = self.homes is not None
        self.up = ShardWays([h.up for h in self.homes] if per_shard else [up], per_shard)
        self.down = ShardWays([h.down for h in self.homes] if per_shard else [down], per_shard)
        self.shards: list[ShardLink] = []
        self._outbox: queue.Queue[SyncerEvent | None] = queue.Queue()
        self._wire: DeliveryQueue[tuple[str, object]] = DeliveryQueue()
        self._inbox: DeliveryQueue[Update] = DeliveryQueue()
        self._halt = threading.Event()
        self._give_up = threading.Event()
        self._threads: list[threading.Thread] = []
        self._received: dict[int, int] = {}

    def join(self, values: dict[str, torch.Tensor], fragments: list[Fragment], tokens_per_step: int) -> Joined:
        """Join every global shard as the region, seed or check Θ with `values`, take the global Θ."""
        joined = join_run(self.address, self.region, self.connect_timeout_s, self.host, values,
                          lambda count: self._fragments(fragments, count), self.security, tokens_per_step,
                          self.owners)
        self.shards = joined.shards
        self._shard_of = {p: shard for shard in self.shards for p in shard.fragments}
        self._received = dict(joined.versions)
        log.info("region %d joined %d global shard(s) at %s", self.region, len(self.shards), self.address)
        return joined

    @staticmethod
    def _fragments(fragments: list[Fragment], count: int) -> list[Fragment]:
        if count != len(fragments):
            raise DilocoError(f"the global syncer has {count} fragments, this region {len(fragments)}: both must "
                              f"run the same config")
        return fragments

    def start(self, handlers: UplinkHandlers) -> None:
        self.handlers = handlers
        targets = [("uplink-encode", self._encode_loop), ("uplink-deliver", self._deliver_loop),
                   ("uplink-heartbeat", self._heartbeat_loop), ("uplink-answers", self._answer_loop)]
        targets += [(f"uplink-receive-{s.index}", lambda s=s: self._receive_loop(s)) for s in self.shards]
        for name, target in targets:
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def send(self, event: SyncerEvent) -> None:
        """Carry one of the regional syncer's events up, after those sent before it."""
        self._outbox.put(event)

    def close(self) -> None:
        """Deliver what is queued (bounded), then stop every thread."""
        self._outbox.put(None)
        for thread in self._threads:
            if thread.name in ("uplink-encode", "uplink-deliver"):
                thread.join(timeout=CLOSE_BOUND_S)
                if thread.is_alive():
                    log.warning("region %d: global syncer unreachable for %g s at close; giving up", self.region,
                                CLOSE_BOUND_S)
                    self._give_up.set()
                    thread.join()
        self._halt.set()
        self._inbox.close()
        for shard in self.shards:
            shard.client.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def report(self) -> dict[str, Any]:
        by_home = {} if self.homes is None else {"bytes_by_home": {
            h.home: {"bytes_up": self.up.to(i).bytes_sent, "bytes_down": self.down.to(i).bytes_sent}
            for i, h in enumerate(self.homes)}}
        return {"bytes_up": self.up.bytes_sent, "bytes_down": self.down.bytes_sent, "messages_up": self.up.messages,
                "messages_down": self.down.messages, **by_home}

    # ------------------------------------------------------------ threads

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException:  # the region trains on; the global syncer finds it silent
                if not self._halt.is_set():
                    log.exception("region %d: %s failed", self.region, threading.current_thread().name)
        return run

    def _encode_loop(self) -> None:
        while (event := self._outbox.get()) is not None:
            if isinstance(event, PushArrived):
                push = event.push
                encoded = self.handlers.encode(push.deltas)
                header = pb.PushHeader(learner=self.region, fragment=push.fragment, base_version=push.base_version,
                                       seq=push.seq, tokens=push.tokens, steps=push.steps,
                                       step_time_s=push.step_time_s, sent_at=push.sent_at or clock.now(),
                                       tensors=[tensor_header(n, e) for n, e in encoded.items()], step=push.step,
                                       final=push.final)
                nbytes = MESSAGE_HEADER_BYTES + sum(e.wire_bytes() for e in encoded.values())
                way = self.up.to(self._shard_of[push.fragment].index)
                self._wire.put(way.send(nbytes), ("push", (header, encoded, push)))
            elif isinstance(event, ProgressArrived):  # for every shard: once over each way
                self._wire.put(self.up.send_to_all(event.report.wire_bytes()), ("progress", event.report))
            elif isinstance(event, LearnerLeft):
                self._wire.put(self.up.send_to_all(MESSAGE_HEADER_BYTES), ("leave", event.finished))
            elif isinstance(event, HeartbeatArrived):  # behind the reports sent before it: claims stay in order
                self._wire.put(self.up.send_to_all(0), ("beat", event))
        self._wire.close()

    def _deliver_loop(self) -> None:
        while (item := self._wire.get()) is not None:
            kind, payload = item
            if kind == "push":
                header, encoded, push = payload
                shard = self._shard_of[push.fragment]
                try:
                    with_retries(lambda: shard.client.push(header, encoded), attempts=None, what="push",
                                 give_up=self._give_up)
                except SyncerUnavailable:
                    raise
                except DilocoError as exc:
                    log.warning("region %d: push of fragment %d refused: %s", self.region, push.fragment, exc)
                    self.handlers.refused(push)
            elif kind == "progress":
                self._tell(payload.tokens, payload.step, payload.step_time_s, payload.due_in_s)
            elif kind == "beat":
                self._tell(payload.tokens, payload.step)
            elif kind == "leave":
                for shard in self.shards:
                    try:
                        with_retries(lambda: shard.client.leave(self.region, finished=payload), what="leave")
                    except SyncerUnavailable as exc:
                        log.warning("region %d: could not announce leaving: %s", self.region, exc)

    def _tell(self, tokens: int, step: int, step_time_s: float = 0.0, due_in_s: tuple[float, ...] = ()) -> None:
        """A progress report or heartbeat to every global shard; not retried (the next one says more)."""
        for shard in self.shards:
            try:
                reply = shard.client.heartbeat(self.region, tokens, step, step_time_s, due_in_s)
            except DilocoError as exc:
                log.debug("region %d: report to shard %d failed: %s", self.region, shard.index, exc)
                continue
            if reply.stop:
                self.handlers.stop()

    def _heartbeat_loop(self) -> None:
        while not self._halt.wait(HEARTBEAT_S):
            for event in self.handlers.beat():
                self.send(event)

    def _receive_loop(self, shard: ShardLink) -> None:
        """Answers from one global shard, decoded here and handed over when the emulated link delivers them."""
        while not self._halt.is_set():
            partial: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
            holds = {p: self._received[p] for p in shard.fragments}
            try:
                for header, tensors in shard.client.updates(self.region, holds):
                    base, nbytes = partial.pop(header.fragment, (None, 0))
                    nbytes += MESSAGE_HEADER_BYTES + sum(e.wire_bytes() for e in tensors.values())
                    update = update_of(header, tensors, self.handlers.anchors(header.fragment),
                                       self._received[header.fragment], nbytes, base)
                    if header.continued:
                        partial[header.fragment] = (update.values, nbytes)
                        continue
                    self._received[header.fragment] = header.version
                    self._inbox.put(self.down.to(shard.index).send(nbytes), update)
                reason = "the update stream ended"
            except (SyncerUnavailable, ValueError) as exc:  # ValueError: a lost answer, or a bad frame
                reason = str(exc)
                shard.client.cancel_updates()
            if self._halt.wait(RECONNECT_S):
                return
            log.warning("region %d: %s (global shard %d); reconnecting", self.region, reason, shard.index)

    def _answer_loop(self) -> None:
        while (update := self._inbox.get()) is not None:
            self.handlers.answer(update)
