"""`[[regions]]`, `[link]` and `[regional]`: where learners and the syncer are, the links between them, and
the regional tier's settings; what regions imply for the rest of the config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from diloco.config.learners_section import LearnersConfig
from diloco.config.rules import known, require
from diloco.errors import ConfigError


@dataclass
class LinkConfig:
    bandwidth_mbit: float = 100.0
    """Each learner's link, per direction (with `regions`: what a region's `lan` and `wan` leave out)."""
    latency_ms: float = 50.0


@dataclass
class RegionLinkConfig(LinkConfig):
    """The WAN link from a region to one named other region, in that direction; the keys it leaves out
    are the region's `wan`."""

    region: str = ""


@dataclass
class RegionConfig:
    """A group of learners behind one WAN link: `[[regions]]` tables, learners numbered in region order."""

    name: str = ""
    speeds: list[float] = field(default_factory=list)
    """Its learners' relative speeds: one entry per learner."""
    lan: LinkConfig = field(default_factory=LinkConfig)
    """Each of its learners' own link inside the region."""
    wan: LinkConfig = field(default_factory=LinkConfig)
    """Its link to any other region (from here to there), unless `wan_to` names that region."""
    wan_to: list[RegionLinkConfig] = field(default_factory=list)
    """Links to named regions that differ from `wan`, e.g. [{region = "ap", latency_ms = 80}]."""
    syncer: bool = False
    """The syncer runs here (exactly one region): its learners reach it over their LAN alone."""


@dataclass
class RegionalConfig:
    """The regional tier (`topology = "regional"`): one syncer per region between its learners and the
    global syncer (`core/regional.py`)."""

    push_every: int = 1
    """Regional rounds of a fragment per push of it to the global syncer."""
    lr: float = 1.0
    """The regional rounds' outer step: lr 1 without momentum moves the region's Θ by its learners' mean
    progress, and leaves the outer optimizer to the global syncer."""
    momentum: float = 0.0
    codec: Literal["", "fp32", "bf16", "int8", "int4", "fp4"] = ""
    """How the regional syncer's pushes travel to the global syncer; empty: `codec.up`."""


def check_link(ln: LinkConfig, key: str) -> None:
    """A simulated (or emulated) link: some bandwidth, no negative latency."""
    require(ln.bandwidth_mbit > 0, f"{key}.bandwidth_mbit", "must be positive", ln.bandwidth_mbit)
    require(ln.latency_ms >= 0, f"{key}.latency_ms", "must be zero or positive", ln.latency_ms)


def check_regions(regions: list[RegionConfig]) -> None:
    """Checked before the counts, which regions set: names unique, links that carry something, WAN
    overrides towards other existing regions, one syncer, and some learner somewhere."""
    names = [r.name for r in regions]
    for i, region in enumerate(regions):
        key = f"regions[{i}]"
        require(bool(region.name.strip()), f"{key}.name", "must not be empty", region.name)
        require(region.name not in names[:i], f"{key}.name",
                f"must be unique (regions[{names.index(region.name)}] has it too)", region.name)
        for j, speed in enumerate(region.speeds):
            require(speed > 0, f"{key}.speeds[{j}]", "must be positive", speed)
        check_link(region.lan, f"{key}.lan")
        check_link(region.wan, f"{key}.wan")
        targets = [w.region for w in region.wan_to]
        for j, wan in enumerate(region.wan_to):
            require(wan.region in names and wan.region != region.name, f"{key}.wan_to[{j}].region",
                    f"must name another region than {region.name!r} ({known(names)})", wan.region)
            require(wan.region not in targets[:j], f"{key}.wan_to[{j}].region", "must not repeat an earlier entry",
                    wan.region)
            check_link(wan, f"{key}.wan_to[{j}]")
    if regions:
        syncers = [i for i, r in enumerate(regions) if r.syncer]
        require(len(syncers) == 1, "regions", "must have exactly one region with syncer = true",
                [names[i] for i in syncers])
        require(any(r.speeds for r in regions), "regions", "must give at least one learner (a region's speeds)",
                {r.name: r.speeds for r in regions})


def check_regional(r: RegionalConfig) -> None:
    require(r.push_every >= 1, "regional.push_every", "must be at least 1", r.push_every)
    require(r.lr > 0, "regional.lr", "must be positive", r.lr)
    require(0 <= r.momentum < 1, "regional.momentum", "must be in [0, 1)", r.momentum)


def load_regions(regions: list[RegionConfig], link: LinkConfig, learners: LearnersConfig, raw: dict[str, Any]) -> None:
    """What regions imply (the raw tables are well-formed by now, the typed loader took them): link keys a
    region leaves out (from `link`), and the learners, which `learners.speeds` or `learners.count` may repeat
    but not contradict."""
    link_keys = [f.name for f in dataclasses.fields(LinkConfig)]
    for region, region_raw in zip(regions, raw["regions"]):
        for side in ("lan", "wan"):
            _fill_missing(getattr(region, side), region_raw.get(side, {}), link, link_keys)
        for entry, entry_raw in zip(region.wan_to, region_raw.get("wan_to", [])):
            _fill_missing(entry, entry_raw, region.wan, link_keys)
    speeds = [s for r in regions for s in r.speeds]
    given = raw.get("learners", {})
    if "speeds" in given and learners.speeds != speeds and (learners.speeds or set(speeds) - {1.0}):
        raise ConfigError(f"config key 'learners.speeds' must be the regions' speeds {speeds} or be left out "
                          f"(regions set it); got {learners.speeds!r}")
    if "count" in given and learners.count != len(speeds):
        raise ConfigError(f"config key 'learners.count' must be {len(speeds)}, the regions' learners, or be left "
                          f"out (regions set it); got {learners.count!r}")
    learners.speeds, learners.count = speeds, len(speeds)


def _fill_missing(target: Any, given: dict[str, Any], source: Any, keys: list[str]) -> None:
    for key in keys:
        if key not in given:
            setattr(target, key, getattr(source, key))
