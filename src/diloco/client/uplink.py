"""A regional syncer's way to the global syncer, over the real network.

It joins the global shards as one learner (its region's id), seeds Θ there with the values its own first
learner brought if nobody has yet (or checks their layout), and takes the global Θ, from which the
regional syncer starts. From then on it carries the regional syncer's `Upstream` events to the global
shards in order, over an emulated WAN link when one is given (pushes encoded here, off the shard's
lock), and hands back the global answers and the word to stop. It is the learners' own client link
(`client/link.py`), driven by a syncer instead of a training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diloco.codecs import Encoded
from diloco.config import LinkConfig
from diloco.core.events import HeartbeatArrived, LearnerLeft, ProgressArrived, PushArrived, SyncerEvent
from diloco.core.messages import Push, Update
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.client.joining import Joined, join_run
from diloco.client.link import (ClientLink, HeartbeatOut, LeaveOut, LinkHandlers, ProgressOut, PushOut,
                                ShardWays, UpEvent, bytes_by_home)
from diloco.transport.security import TransportSecurity

log = logging.getLogger("diloco.uplink")


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


def up_event(event: SyncerEvent) -> UpEvent:
    """One of the regional syncer's events for the global syncer, as the link carries it."""
    if isinstance(event, PushArrived):
        return PushOut(event.push)
    if isinstance(event, ProgressArrived):
        return ProgressOut(event.report)
    if isinstance(event, LearnerLeft):
        return LeaveOut(event.finished)
    if isinstance(event, HeartbeatArrived):
        return HeartbeatOut(event.tokens, event.step)
    raise TypeError(f"a region does not send {type(event).__name__} up")


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
        self.link: ClientLink | None = None

    def join(self, values: dict[str, torch.Tensor], fragments: list[Fragment], tokens_per_step: int) -> Joined:
        """Join every global shard as the region, seed or check Θ with `values`, take the global Θ."""
        joined = join_run(self.address, self.region, self.connect_timeout_s, self.host, values,
                          lambda count: self._fragments(fragments, count), self.security, tokens_per_step,
                          self.owners)
        self.link = ClientLink(self.region, f"region {self.region}", joined.shards, joined.versions, self.up,
                               self.down)
        log.info("region %d joined %d global shard(s) at %s", self.region, len(joined.shards), self.address)
        return joined

    @staticmethod
    def _fragments(fragments: list[Fragment], count: int) -> list[Fragment]:
        if count != len(fragments):
            raise DilocoError(f"the global syncer has {count} fragments, this region {len(fragments)}: both must "
                              f"run the same config")
        return fragments

    def start(self, handlers: UplinkHandlers) -> None:
        """The region trains on if the link fails; the global syncer finds it silent."""
        self.link.start(LinkHandlers(encode=handlers.encode, anchors=handlers.anchors, refused=handlers.refused,
                                     stop=handlers.stop, beat=lambda: [up_event(e) for e in handlers.beat()],
                                     answer=lambda arrival: handlers.answer(arrival.update), ordered_beats=True),
                        name="uplink")

    def send(self, event: SyncerEvent) -> None:
        """Carry one of the regional syncer's events up, after those sent before it."""
        self.link.send(up_event(event))

    def close(self) -> None:
        """Deliver what is queued (bounded), then stop every thread."""
        if self.link is not None:
            self.link.close()

    def report(self) -> dict[str, Any]:
        return {"bytes_up": self.up.bytes_sent, "bytes_down": self.down.bytes_sent, "messages_up": self.up.messages,
                "messages_down": self.down.messages,
                **bytes_by_home(self.up, self.down, [h.home for h in self.homes] if self.homes is not None else None)}
