"""Where each fragment's home shard runs, given the regions and their links (`placement = "links"`).

Every sender (a learner, or with the regional tier a region's syncer) pushes every fragment and gets its
answers back; what it sends to a fragment homed in its own region stays on its LAN, what it sends to one
homed elsewhere crosses the WAN link between the two regions, both ways. So homing fragments decides
which WAN links carry what. Placing them all in one region makes every other region's link to it carry
all of its traffic; spreading them over the regions in proportion to what each region sends (its
senders' speeds) keeps part of every region's traffic at home and splits the rest over several links.

The placement is greedy, one fragment at a time, each to the region that keeps, in this order:

1. the busiest WAN direction least busy (its traffic over its bandwidth: the link that decides whether
   rounds keep up);
2. the WAN bytes fewest (they cost money);
3. the worst round trip to the fragment's home shortest (a fragment's answer must come back within τ);
4. the syncer's region first, then the order of `[[regions]]` (so that the result is deterministic).

Fragments count as equal in size: the partition makes them near equal, and every shard can compute the
same placement from the config and the fragment count alone, before any tensor exists.
"""

from __future__ import annotations

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


def place(sites: Sequence[Site], fragments: int, preferred: str | None = None) -> list[str]:
    """The region homing each of `fragments` fragments (see the module's docstring)."""
    if not sites:
        raise ValueError("placement needs at least one region")
    homed = {s.name: 0 for s in sites}
    order = {s.name: (s.name != preferred, i) for i, s in enumerate(sites)}
    homes: list[str] = []
    for _ in range(fragments):
        def cost(candidate: str) -> tuple[float, float, float, tuple[bool, int]]:
            trial = {**homed, candidate: homed[candidate] + 1}
            return (busiest_load(sites, trial), wan_traffic(sites, trial),
                    worst_round_trip(sites, candidate), order[candidate])

        best = min(homed, key=cost)
        homed[best] += 1
        homes.append(best)
    return homes


def busiest_load(sites: Sequence[Site], homed: dict[str, int]) -> float:
    """The busiest WAN direction's traffic over its bandwidth (relative units: one fragment's exchange
    per unit of sender rate). Pushes go from a sender's region to the home, answers back: the same bytes,
    so each direction of a pair carries the sending region's rate times the fragments homed across."""
    load = 0.0
    for source in sites:
        for target in sites:
            if target.name == source.name or not homed[target.name] or not source.rate:
                continue
            traffic = source.rate * homed[target.name]
            load = max(load, traffic / source.bandwidth_to[target.name],
                       traffic / target.bandwidth_to[source.name])
    return load


def wan_traffic(sites: Sequence[Site], homed: dict[str, int]) -> float:
    """Everything that crosses a WAN link, in the same relative units."""
    return sum(s.rate * n for s in sites for home, n in homed.items() if home != s.name)


def worst_round_trip(sites: Sequence[Site], home: str) -> float:
    """The longest round trip (ms) from a sending region to `home`."""
    target = next(s for s in sites if s.name == home)
    return max((s.latency_to[home] + target.latency_to[s.name] for s in sites if s.name != home and s.rate),
               default=0.0)
