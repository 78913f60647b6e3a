"""A learner's network link: per direction, a bandwidth shared in order by messages, a latency, and
windows of outage during which nothing moves."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Direction:
    bandwidth_bps: float
    latency_s: float
    outages: list[tuple[float, float]] = field(default_factory=list)
    busy_until: float = 0.0
    bytes_sent: int = 0
    messages: int = 0
    peak_message_bytes: int = 0

    def send(self, now: float, nbytes: int) -> float:
        """Queue a message behind those already on the wire; return when it has fully arrived."""
        start = max(now, self.busy_until)
        end = start + nbytes * 8 / self.bandwidth_bps
        for down_from, down_to in sorted(self.outages):
            if down_from <= start < down_to:  # the link is down when the message would start
                end += down_to - start
                start = down_to
            elif start < down_from < end:  # it goes down mid-message: the rest waits
                end += down_to - down_from
        self.busy_until = end
        self.record(nbytes)
        return end + self.latency_s

    def signal(self, now: float) -> float:
        """When a control message of negligible size (a heartbeat) sent now arrives: behind what is
        on the wire and held up by outages, taking no bandwidth and not counted."""
        start = max(now, self.busy_until)
        for down_from, down_to in sorted(self.outages):
            if down_from <= start < down_to:
                start = down_to
        return start + self.latency_s

    def record(self, nbytes: int) -> None:
        """Count bytes that crossed this direction (also those a collective timed as a whole)."""
        self.bytes_sent += nbytes
        self.messages += 1
        self.peak_message_bytes = max(self.peak_message_bytes, nbytes)


class Link:
    def __init__(self, bandwidth_mbit: float, latency_ms: float,
                 outages: list[tuple[float, float]] | None = None) -> None:
        self.up = Direction(bandwidth_mbit * 1e6, latency_ms / 1e3, list(outages or []))
        self.down = Direction(bandwidth_mbit * 1e6, latency_ms / 1e3, list(outages or []))
