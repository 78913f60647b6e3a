"""The emulated links between one client and the syncer's shards: per direction, one shaped way that all
shards share (they run in one place), or one per shard (`placement = "links"` homes them in different
regions). What each way carried is what the run reports per home."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco.network.shaping import ShapedDirection

if TYPE_CHECKING:
    from diloco.config import LinkConfig


@dataclass(frozen=True)
class LinkShape:
    """An emulated link: per direction, a bandwidth and a one-way latency."""

    bandwidth_mbit: float
    latency_ms: float


class ShardWays:
    """One direction of a sender's traffic with the syncer's shards. A message about one fragment takes its
    shard's way; one meant for every shard crosses each way once. The counters are the totals over the ways."""

    def __init__(self, links: Sequence[LinkShape | LinkConfig | None], per_shard: bool) -> None:
        self.ways = [ShapedDirection(link.bandwidth_mbit if link else None, link.latency_ms if link else 0.0)
                     for link in links]
        self.per_shard = per_shard

    def to(self, shard: int) -> ShapedDirection:
        return self.ways[shard] if self.per_shard else self.ways[0]

    def send_to_each(self, nbytes: int, shards: Sequence[int]) -> dict[int, float]:
        """A message for every shard, delivered to each on its own: when it has arrived over each one's way
        (over the one way they share, the same time for all)."""
        if not self.per_shard:
            return dict.fromkeys(shards, self.ways[0].send(nbytes))
        return {shard: self.ways[shard].send(nbytes) for shard in shards}

    @property
    def bytes_sent(self) -> int:
        return sum(way.bytes_sent for way in self.ways)

    @property
    def messages(self) -> int:
        return sum(way.messages for way in self.ways)

    @property
    def peak_message_bytes(self) -> int:
        return max(way.peak_message_bytes for way in self.ways)


def bytes_by_home(up: ShardWays, down: ShardWays, homes: Sequence[str] | None) -> dict[str, Any]:
    """With shards in several regions (`homes`, per shard), the bytes to and from each: what each way carried."""
    if homes is None:
        return {}
    return {"bytes_by_home": {home: {"bytes_up": up.to(i).bytes_sent, "bytes_down": down.to(i).bytes_sent}
                              for i, home in enumerate(homes)}}
