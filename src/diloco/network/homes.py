"""Where each fragment's home shard runs, given the regions and their links (`placement = "links"`).

Every sender (a learner, or with the regional tier a region's syncer) pushes every fragment and gets its
answers back; what it exchanges with a fragment homed in its own region stays on its LAN, what it
exchanges with one homed elsewhere crosses the WAN link between the two regions: pushes one way, answers
the other. So homing fragments decides which WAN links carry what. With all of them in one region, each
other region's link to it carries all of that region's pushes one way and all of its answers the other;
spread over the regions, every direction between two regions carries a share of both regions' traffic,
and part of every region's traffic stays at home. That roughly halves the busiest link of equal regions,
for a few percent more WAN bytes in all (the syncer's own region no longer keeps all of its traffic).

The placement chooses how many fragments each region homes, keeping, in this order:

1. the busiest WAN direction least busy (its traffic over its bandwidth: the link that decides whether
   rounds keep up);
2. the WAN bytes fewest (they cost money);
3. the round trips shortest (per fragment, the worst from a sending region to its home: an answer must
   come back within τ steps);
4. on a tie, the syncer's region first, then the order of `[[regions]]` (so that it is deterministic).

It starts greedy, one fragment at a time, then moves single fragments while a move does better.

Fragments count as equal in size, so that every shard and learner computes the same placement from the
config and the fragment count alone, before any tensor exists. They are only roughly equal (on the
default model the smallest holds 0.56× the parameters of the largest), so the loads are approximate.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    """A region as the placement sees it: what its senders push per unit of time (their summed speeds)
    and, per other region, the WAN link's bandwidth (Mbit/s) and latency (ms) each way."""

    name: str
    rate: float
    bandwidth_to: dict[str, float]
    latency_to: dict[str, float]


def place(sites: Sequence[Site], fragments: int, preferred: str | None = None, answer_ratio: float = 1.0
          ) -> list[str]:
    """The region homing each of `fragments` fragments (see the module's docstring). `answer_ratio`: an
    answer's bytes over a push's (their codecs differ)."""
    if not sites:
        raise ValueError("placement needs at least one region")
    names = [s.name for s in sites]
    order = {name: (name != preferred, i) for i, name in enumerate(names)}

    def score(homed: dict[str, int]) -> tuple[list[float], float, float]:
        # Every direction's load, busiest first: a move that unloads one of several equally busy links
        # counts as better, so that the search does not stop on a plateau of the busiest one.
        return (sorted(loads(sites, homed, answer_ratio).values(), reverse=True),
                wan_traffic(sites, homed, answer_ratio),
                sum(n * worst_round_trip(sites, home) for home, n in homed.items()))

    # Greedy, one fragment at a time, then single moves while one makes the score strictly better: the
    # greedy start alone can stop short (its first homes leave later fragments only worse choices).
    homed = {name: 0 for name in names}
    for _ in range(fragments):
        best = min(names, key=lambda h: (score({**homed, h: homed[h] + 1}), order[h]))
        homed[best] += 1
    improved = True
    while improved:
        improved = False
        current = score(homed)
        for source, target in itertools.product(names, names):
            if source == target or not homed[source]:
                continue
            trial = {**homed, source: homed[source] - 1, target: homed[target] + 1}
            if score(trial) < current:
                homed, improved = trial, True
                break
    # Interleaved, so that neighbouring fragments (neighbouring layers) have different homes.
    given = {name: 0 for name in names}
    homes = []
    for f in range(fragments):
        home = max(names, key=lambda h: (homed[h] * (f + 1) / fragments - given[h], -order[h][0], -order[h][1]))
        given[home] += 1
        homes.append(home)
    return homes


def loads(sites: Sequence[Site], homed: dict[str, int], answer_ratio: float = 1.0) -> dict[tuple[str, str], float]:
    """Each WAN direction's traffic over its bandwidth, in relative units (one push of a fragment per unit
    of sender rate). The direction from `s` to `t` carries the pushes of s's senders to the fragments
    homed in t, and the answers of the fragments homed in s to t's senders."""
    return {(s.name, t.name): (s.rate * homed[t.name] + t.rate * homed[s.name] * answer_ratio)
            / s.bandwidth_to[t.name] for s in sites for t in sites if t.name != s.name}


def busiest_load(sites: Sequence[Site], homed: dict[str, int], answer_ratio: float = 1.0) -> float:
    """The busiest WAN direction's load (`loads`)."""
    return max(loads(sites, homed, answer_ratio).values(), default=0.0)


def wan_traffic(sites: Sequence[Site], homed: dict[str, int], answer_ratio: float = 1.0) -> float:
    """Everything that crosses a WAN link, pushes and answers, in the same relative units."""
    return sum(s.rate * n * (1 + answer_ratio) for s in sites for home, n in homed.items() if home != s.name)


def worst_round_trip(sites: Sequence[Site], home: str) -> float:
    """The longest round trip (ms) from a sending region to `home`."""
    target = next(s for s in sites if s.name == home)
    return max((s.latency_to[home] + target.latency_to[s.name] for s in sites if s.name != home and s.rate),
               default=0.0)
