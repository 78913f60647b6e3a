"""Where learners and the syncer are and which links join them: the one place to ask, built from a config.

`Topology(config)` answers from the config's `[[regions]]`, `topology`, `placement` and links; it keeps no
copy, so it always answers for the config as it is now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.regions_section import LinkConfig, RegionConfig
from diloco.config.run_config import Config


@dataclass(frozen=True, eq=False)
class Hop:
    """One link on a learner's way to the syncer: `up` carries traffic from `near` to `far` (towards the
    syncer), `down` back. A learner's LAN hop is its own; a WAN hop is its region's, shared by the
    region's learners (and named by its two ends, so that whoever else sends between them shares it)."""

    kind: Literal["lan", "wan"]
    near: str
    """`learner M` for a LAN hop, the learner's region for a WAN hop."""
    far: str
    """The region towards the syncer."""
    up: LinkConfig
    down: LinkConfig

    @property
    def name(self) -> str:
        return f"{self.near} LAN" if self.kind == "lan" else f"{self.near}→{self.far} (WAN)"


@dataclass(frozen=True)
class Topology:
    """The queries about regions, routes and fragment homes of one config."""

    config: Config

    def learners_of(self, region: str) -> range:
        """The ids of a region's learners (empty for a name that is not a region)."""
        first = 0
        for r in self.config.regions:
            if r.name == region:
                return range(first, first + len(r.speeds))
            first += len(r.speeds)
        return range(0)

    def region_of(self, learner: int) -> str | None:
        """The region of a learner; None without regions, or for an id beyond them (an elastic run's extra
        learners)."""
        return next((r.name for r in self.config.regions if learner in self.learners_of(r.name)), None)

    def syncer_region(self) -> str | None:
        return next((r.name for r in self.config.regions if r.syncer), None)

    def wan_link(self, source: str, target: str) -> LinkConfig:
        """The WAN link from region `source` to region `target`: its `wan_to` entry, else its `wan`."""
        region = next(r for r in self.config.regions if r.name == source)
        return next((w for w in region.wan_to if w.region == target), region.wan)

    @property
    def tiered(self) -> bool:
        """The regional tier is on (`topology = "regional"` with regions)."""
        return self.config.topology == "regional" and bool(self.config.regions)

    def route(self, learner: int, home: str | None = None) -> list[Hop]:
        """The links a learner's messages cross to the shard in region `home` (default: the syncer's), in
        order (back: in reverse): its LAN, then, flat and outside that region, its region's WAN link there
        (`region_route`); with the regional tier its syncer is its region's, over the LAN alone. Empty
        without regions: `link`."""
        region, syncer = self.region_of(learner), self.syncer_region()
        if region is None or syncer is None:
            return []
        lan = next(r.lan for r in self.config.regions if r.name == region)
        hops = [Hop("lan", f"learner {learner}", region, lan, lan)]
        return hops if self.tiered else hops + self.region_route(region, home)

    def homes(self, fragments: int) -> list[str]:
        """The regions that home some of `fragments` fragments, in `[[regions]]` order (by default the
        syncer's alone)."""
        homes = set(self.fragment_homes(fragments))
        return [r.name for r in self.config.regions if r.name in homes]

    def fragment_homes(self, fragments: int) -> list[str]:
        """The region of each fragment's home shard (empty without regions)."""
        syncer = self.syncer_region()
        if syncer is None:
            return []
        if self.config.placement == "syncer":
            return [syncer] * fragments
        from diloco.network.homes import Site, place

        senders = {r.name for r in self.tier_regions()}
        speeds, regions = self.config.speeds(), self.config.regions
        sites = [Site(r.name, (1.0 if r.name in senders else 0.0) if self.tiered
                      else sum(speeds[m] for m in self.learners_of(r.name)),
                      {o.name: self.wan_link(r.name, o.name).bandwidth_mbit for o in regions if o is not r},
                      {o.name: self.wan_link(r.name, o.name).latency_ms for o in regions if o is not r})
                 for r in regions]
        return place(sites, fragments, preferred=syncer, answer_ratio=self._answer_ratio())

    def _answer_ratio(self) -> float:
        """An answer's wire bytes over a push's, for the global syncer's senders (their codecs differ)."""
        from diloco.codecs.registry import get_codec

        codec = self.config.codec
        up = self.config.regional.codec or codec.up if self.tiered else codec.up
        numel, block = 1 << 20, codec.block
        return get_codec(codec.down, block).wire_bytes(numel, block) / get_codec(up, block).wire_bytes(numel, block)

    def tier_regions(self) -> list[RegionConfig]:
        """With the regional tier, the regions that have learners, in order: their syncers are the global
        syncer's learners, numbered from 0. Empty without the tier."""
        return [r for r in self.config.regions if r.speeds] if self.tiered else []

    def region_period(self, region: str) -> float:
        """A region's pacing period in its fastest learner's steps: H steps of the fastest learner of all,
        in time, so that every region syncs on the same grid (not rounded: a half-speed region with H = 5
        syncs every 2.5 of its steps, as the others every 5 of theirs)."""
        speeds, members = self.config.speeds(), self.learners_of(region)
        return self.config.outer.H * max(speeds[m] for m in members) / max(speeds)

    def region_route(self, region: str, home: str | None = None) -> list[Hop]:
        """The WAN hop from a region to region `home` (default: the syncer's; none from that region)."""
        home = home or self.syncer_region()
        if home is None or region == home:
            return []
        return [Hop("wan", region, home, self.wan_link(region, home), self.wan_link(home, region))]

    def emulated_link(self, learner: int | None, home: str | None = None) -> LinkConfig:
        """One link standing for a learner's route towards the shards in region `home` (default: the
        syncer's), as the real runtime shapes it: the slowest hop's bandwidth and the sum of the latencies
        (`link` without regions, or without an id)."""
        hops = self.route(learner, home) if learner is not None else []
        if not hops:
            return self.config.link
        return LinkConfig(bandwidth_mbit=min(h.up.bandwidth_mbit for h in hops),
                          latency_ms=sum(h.up.latency_ms for h in hops))
