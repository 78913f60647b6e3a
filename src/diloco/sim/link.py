"""A learner's network link: per direction, a bandwidth shared in order by messages, and a latency."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Direction:
    bandwidth_bps: float
    latency_s: float
    busy_until: float = 0.0
    bytes_sent: int = 0
    messages: int = 0
    peak_message_bytes: int = 0

    def send(self, now: float, nbytes: int) -> float:
        """Queue a message behind those already on the wire; return when it has fully arrived."""
        start = max(now, self.busy_until)
        self.busy_until = start + nbytes * 8 / self.bandwidth_bps
        self.record(nbytes)
        return self.busy_until + self.latency_s

    def record(self, nbytes: int) -> None:
        """Count bytes that crossed this direction (also those a collective timed as a whole)."""
        self.bytes_sent += nbytes
        self.messages += 1
        self.peak_message_bytes = max(self.peak_message_bytes, nbytes)


class Link:
    def __init__(self, bandwidth_mbit: float, latency_ms: float) -> None:
        self.up = Direction(bandwidth_mbit * 1e6, latency_ms / 1e3)
        self.down = Direction(bandwidth_mbit * 1e6, latency_ms / 1e3)
