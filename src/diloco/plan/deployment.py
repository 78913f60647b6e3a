"""The deployment a plan is for: the strategy's schedule, the learners and their links, the codecs, the
syncer's shards; and what crosses one learner's link per sync period (`traffic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco.fragments import Schedule
from diloco.plan.layout import Layout
from diloco.plan.steady_links import Site, Traffic
from diloco.plan.memory import Pushes, SyncerState
from diloco.plan.wire import progress_bytes, push_bytes, update_bytes

if TYPE_CHECKING:
    from diloco.config import Config


@dataclass(frozen=True)
class Region:
    """A region's WAN link to the syncer, per direction, shared by the learners in it."""

    name: str
    bandwidth_bps: float
    latency_s: float


@dataclass(frozen=True)
class Deployment:
    """Everything a plan depends on: the strategy's schedule, the fleet, its links, codecs and syncer."""

    strategy: str
    exchange: str
    """`outer` (through the syncer) or `gradients` (data-parallel all-reduce)."""
    synchronous: bool
    """Every learner in every round: the fleet moves at its slowest learner's pace."""
    waits: bool
    """A learner stops after step t + τ until the answer to its push of step t is in."""
    staggered: bool
    """Fragments on staggered offsets (streaming, decoupled): at most H of them."""
    layout: Layout
    H: int
    tau: int
    step_time_s: float
    """One inner step of a learner at speed 1."""
    speeds: tuple[float, ...]
    bandwidth_bps: float
    """Each learner's own link, per direction (when no regions are given)."""
    latency_s: float
    codec_up: str
    codec_down: str
    block: int
    optimizer: str
    """The outer optimizer: `nesterov` or `delayed-nesterov`."""
    merge_rule: str = "mean"
    consolidate: bool = False
    regions: tuple[Region, ...] = ()
    shards: int | None = None
    shard_memory_bytes: float | None = None
    tokens_per_step: int = 1
    """Tokens one learner trains per inner step."""
    tokens: int | None = None
    """The run's token budget, over all learners: totals are given when it is."""
    step_time_source: str = ""
    """How the step time was found when it was not given (`--params`: from the model's FLOPs)."""
    shard_cores: float | None = None
    """Cores of one shard's machine: how many shards the syncer's CPU needs (`syncer_cost.py`)."""
    reproducible: bool = False
    """`outer.reproducible`: a round keeps every push whole until it closes (`plan/memory.py`)."""
    network: Config | None = field(default=None, compare=False, repr=False)
    """A config with `[[regions]]`: its regions, learners, links, topology and placement, which the
    plan's per-link loads follow (`network.py`); None otherwise."""

    @property
    def learners(self) -> int:
        return len(self.speeds)

    @property
    def grid_step_s(self) -> float:
        """One step of the sync grid: the slowest learner's (synchronous) or the fastest's."""
        return self.step_time_s / (min(self.speeds) if self.synchronous else max(self.speeds))

    @property
    def period_s(self) -> float:
        return (1 if self.exchange == "gradients" else self.H) * self.grid_step_s

    def region_of(self, learner: int) -> Region | None:
        return self.regions[learner % len(self.regions)] if self.regions else None

    def sites(self) -> list[Site]:
        """Learners grouped by region and speed; learners of a region share its link equally."""
        groups: dict[tuple[str | None, float], int] = {}
        for m, v in enumerate(self.speeds):
            region = self.region_of(m)
            key = (region.name if region else None, v)
            groups[key] = groups.get(key, 0) + 1
        per_region = {r.name: sum(1 for m in range(self.learners) if self.region_of(m) == r) for r in self.regions}
        by_name = {r.name: r for r in self.regions}
        mixed = len(set(self.speeds)) > 1
        sites = []
        for (name, v), n in groups.items():
            label = " ".join(filter(None, [name, f"speed {v:g}" if mixed else None])) or "each"
            if name is None:
                sites.append(Site(label, n, v, self.bandwidth_bps, self.latency_s))
            else:
                r = by_name[name]
                sites.append(Site(label, n, v, r.bandwidth_bps / per_region[name], r.latency_s, name))
        return sites

    def own_step_s(self, site: Site) -> float:
        return self.grid_step_s if self.synchronous else self.step_time_s / site.speed

    def syncer_state(self) -> SyncerState:
        return SyncerState(self.optimizer, self.merge_rule, self.consolidate, self.codec_down != "fp32")

    def pushes(self) -> Pushes:
        """What the shards' pushes hold while they arrive (`plan/memory.py`)."""
        return Pushes(traffic(self).push, self.learners, self.learners if self.reproducible else 1)


def traffic(d: Deployment) -> Traffic:
    """Per sync period: each fragment's push and answer, a report per step, the schedule's offsets."""
    fragments = d.layout.fragments
    schedule = Schedule(d.H, len(fragments))
    return Traffic(tuple(push_bytes(f.tensors, d.codec_up, d.block) for f in fragments),
                   tuple(update_bytes(f.tensors, d.codec_down, d.block) for f in fragments),
                   progress_bytes(len(fragments)), tuple(schedule.next_due(p, 0) for p in range(len(fragments))), d.H)
