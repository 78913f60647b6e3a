"""A learner's link in the steady state: when each fragment's answer comes back, and how busy it is.

The τ-overlap budget: a learner pushes fragment p after step t and merges its answer after step t + τ;
the link keeps up when the answer is in by then, i.e. when the fragment's round trip (its push queued
and sent up, latency, the round closing on the last learner's push, its answer queued and sent down,
latency) takes at most τ inner steps. Queueing matters: every step's progress report travels the same
uplink, and with many fragments one push may still be on the wire when the next is sent.

So rather than a formula, a few sync periods are played out on the simulator's own link model
(`network/links.py`: messages in order, each taking bytes / bandwidth, then the latency), with every push on
the schedule's grid (fragment p at steps o_p, o_p + H, ...) and nobody waiting: the timeline of a run in
which every link keeps up. If every answer is in within τ steps there, it is also the run's timeline, and
no learner ever waits; if one is not, the run's learners wait (synchronous) or merge late (decoupled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PERIODS = 4
"""Sync periods played out. From empty links the queues reach their steady state within one or two."""


@dataclass(frozen=True)
class Site:
    """Learners alike: the same speed and the same link (their share of it), per direction."""

    name: str
    learners: int
    speed: float
    bandwidth_bps: float
    latency_s: float
    region: str | None = None
    down_bandwidth_bps: float | None = None
    """Towards the learner, where it differs from `bandwidth_bps` (a WAN link rated per direction)."""
    down_latency_s: float | None = None

    @property
    def down(self) -> tuple[float, float]:
        """Bandwidth and latency towards the learner."""
        return (self.bandwidth_bps if self.down_bandwidth_bps is None else self.down_bandwidth_bps,
                self.latency_s if self.down_latency_s is None else self.down_latency_s)


@dataclass(frozen=True)
class Traffic:
    """What one learner's link carries in one sync period of H grid steps."""

    push: tuple[int, ...]
    """Bytes of each fragment's push."""
    update: tuple[int, ...]
    """Bytes of each fragment's answer."""
    progress: int
    """Bytes of the report sent after every inner step."""
    first_due: tuple[int, ...]
    """Grid step (1..H) of each fragment's first push."""
    H: int


@dataclass(frozen=True)
class LinkState:
    round_trip_s: tuple[float, ...]
    """Per fragment, the longest round trip seen: push sent to answer in."""
    up_utilisation: float
    down_utilisation: float

    @property
    def saturated(self) -> bool:
        """More to send than the link carries: queues, and round trips, grow without bound."""
        return self.up_utilisation >= 1 or self.down_utilisation >= 1


def steady_state(sites: list[Site], traffic: Traffic, grid_step_s: float, step_s: list[float]
                 ) -> list[LinkState]:
    """Each site's link over PERIODS sync periods without waiting. `grid_step_s`: the time of one step of
    the sync grid (H of them make a period); `step_s`: each site's own step time (its progress reports)."""
    from diloco.network.links import Direction

    period = traffic.H * grid_step_s
    loads = [_utilisation(site, traffic, period, own_step) for site, own_step in zip(sites, step_s)]
    if any(max(load) >= 1 for load in loads):  # rounds close on the last push: nobody's answer is ever in
        return [LinkState((math.inf,) * len(traffic.push), *load) for load in loads]
    horizon = PERIODS * period
    pushes = sorted(((k * traffic.H + due) * grid_step_s, p, k)
                    for k in range(PERIODS) for p, due in enumerate(traffic.first_due))
    arrivals = []
    for site, own_step in zip(sites, step_s):
        up = Direction(site.bandwidth_bps, site.latency_s)
        arrivals.append(_send_up(up, pushes, traffic, own_step, horizon))
    closes = sorted((max(a[(k, p)] for a in arrivals), t, p, k) for t, p, k in pushes)
    states = []
    for site, load in zip(sites, loads):
        down = Direction(*site.down)
        worst = [0.0] * len(traffic.push)
        for closed, sent, p, _ in closes:
            worst[p] = max(worst[p], down.send(closed, traffic.update[p]) - sent)
        states.append(LinkState(tuple(worst), *load))
    return states


def verdict(state: LinkState, tau: int, budget_s: float) -> tuple[bool, str, int, float]:
    """Whether a link keeps up (the τ-overlap budget: every fragment's round trip within τ steps), why
    not, and its worst fragment and that one's round trip."""
    worst = max(range(len(state.round_trip_s)), key=lambda p: state.round_trip_s[p])
    rt = state.round_trip_s[worst]
    if state.saturated:
        return False, f"needs {max(state.up_utilisation, state.down_utilisation):.0%} of the link", worst, rt
    if math.isinf(rt):
        return False, "another learner's link is saturated", worst, rt
    if tau == 0:
        return False, "τ = 0: every sync waits for its round trip", worst, rt
    if rt > budget_s:
        return False, f"fragment {worst}'s round trip > τ steps", worst, rt
    return True, "", worst, rt


def _utilisation(site: Site, traffic: Traffic, period: float, own_step: float) -> tuple[float, float]:
    """Share of the link's time each direction is busy, on average."""
    up_bits = (sum(traffic.push) + traffic.progress * period / own_step) * 8
    return up_bits / site.bandwidth_bps / period, sum(traffic.update) * 8 / site.down[0] / period


def _send_up(up, pushes: list[tuple[float, int, int]], traffic: Traffic, step_s: float, horizon: float
             ) -> dict[tuple[int, int], float]:
    """Send every push and every step's report in time order (a step's pushes before its report); return
    when each push arrives. Reports sent on an idle link are taken in one go up to the next push."""
    report_s = traffic.progress * 8 / up.bandwidth_bps
    last = int(horizon / step_s)
    arrived: dict[tuple[int, int], float] = {}
    j = 1
    for at, p, k in [*pushes, (math.inf, -1, -1)]:
        while j <= last and j * step_s < at:
            now = j * step_s
            if up.busy_until <= now and report_s <= step_s:
                j_end = min(last, _last_before(at, step_s))
                up.busy_until = j_end * step_s + report_s  # each report done before the next is sent
                j = j_end + 1
            else:
                up.send(now, traffic.progress)
                j += 1
        if p >= 0:
            arrived[(k, p)] = up.send(at, traffic.push[p])
    return arrived


def _last_before(at: float, step_s: float) -> int:
    """The last step j with j·step_s < at."""
    if math.isinf(at):
        return 2**62
    j = int(at / step_s)
    while j * step_s >= at:
        j -= 1
    while (j + 1) * step_s < at:
        j += 1
    return j
