"""What a plan says: per learner site, per region, per shard, over the run. Plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from diloco.plan.deployment import Deployment
from diloco.plan.memory import ShardMemory
from diloco.plan.syncer_cost import threads_for


@dataclass(frozen=True)
class SiteReport:
    """One learner of a site: what it moves, and whether its link keeps up."""

    name: str
    learners: int
    speed: float
    bandwidth_bps: float
    latency_s: float
    up_per_period: int
    down_per_period: int
    up_per_s: float
    down_per_s: float
    peak_up: int
    peak_down: int
    round_trip_s: float
    """The longest round trip of a fragment (data-parallel: one step's all-reduce)."""
    worst_fragment: int
    budget_s: float
    """τ of its steps: the time a fragment's round trip may take without anyone waiting."""
    up_utilisation: float
    down_utilisation: float
    keeps_up: bool
    why: str
    stall_s: float
    """Estimated wait per sync period when it does not keep up and learners wait for answers."""
    region: str | None = None


@dataclass(frozen=True)
class RegionReport:
    name: str
    learners: int
    bandwidth_bps: float
    needed_up_bps: float
    needed_down_bps: float
    keeps_up: bool


@dataclass(frozen=True)
class LinkReport:
    """One link of the config's regions (a learner's LAN, a WAN link between two regions), named as
    `diloco sim`'s summary names it: `up` is the way its name points (towards the syncer, or from the
    first region to the second), with everything that crosses it from every sender."""

    name: str
    kind: str
    """`lan` or `wan`."""
    senders: tuple[str, ...]
    """Whose traffic crosses it: learners, or with the regional tier the regions' syncers."""
    bandwidth_up_bps: float
    bandwidth_down_bps: float
    up_per_s: float
    """Bytes per second, steady state."""
    down_per_s: float
    up_utilisation: float
    down_utilisation: float
    round_trip_s: float
    """The longest round trip of a fragment whose traffic crosses it."""
    budget_s: float
    """τ steps of the sender whose round trip is the tightest against them."""
    keeps_up: bool
    why: str
    bytes_up: int | None = None
    """Over the run (with a token budget)."""
    bytes_down: int | None = None
    exact: bool = False
    """The totals are the simulator's schedule replayed (else the steady state over the run's time)."""


@dataclass(frozen=True)
class ShardReport:
    memory: ShardMemory
    in_per_s: float
    out_per_s: float
    pushed_params_per_s: float = 0.0
    """Parameters pushed to it per second, over all learners."""
    cores: float = 0.0
    """CPU cores its merging keeps busy (`syncer_cost.cores`)."""


@dataclass(frozen=True)
class Totals:
    steps: int
    """Inner steps per learner (of a learner at speed 1 when speeds differ)."""
    time_s: float
    bytes_up: int
    bytes_down: int
    exact: bool
    note: str


@dataclass(frozen=True)
class Plan:
    """What `diloco plan` prints (and writes as JSON)."""

    deployment: Deployment
    period_s: float
    fragment_numels: tuple[int, ...]
    sites: tuple[SiteReport, ...]
    regions: tuple[RegionReport, ...] = ()
    shards: tuple[ShardReport, ...] = ()
    shards_needed: int | None = None
    totals: Totals | None = None
    links: tuple[LinkReport, ...] = ()
    """With the config's `[[regions]]`: every link, all traffic that shares it counted."""
    homes: tuple[str, ...] = ()
    """With the config's `[[regions]]`: the region homing each fragment (`placement`)."""
    slow_routes: tuple[str, ...] = ()
    """Senders' routes that miss τ though each of their links alone keeps up."""
    join_s: float | None = None
    """A joining learner's pull of Θ from every shard at once (`syncer_cost.join_s`)."""
    shards_for_cores: int | None = None
    """With `--shard-cores`: the fewest shards whose CPU keeps up (None: one fragment needs more)."""

    @property
    def shard_threads(self) -> int | None:
        """`diloco syncer --threads` for the busiest shard (`syncer_cost.threads_for`; None: no count is enough)."""
        return threads_for(max((s.cores for s in self.shards), default=0.0))

    @property
    def keeps_up(self) -> bool:
        """Every learner's link keeps up; with the config's regions, every one of their links (a learner's
        own link is then its route, which the links stand for)."""
        if self.links:
            return all(lk.keeps_up for lk in self.links) and not self.slow_routes
        return all(s.keeps_up for s in self.sites) and all(r.keeps_up for r in self.regions)

    def to_dict(self) -> dict:
        d = self.deployment
        return {
            "deployment": {"strategy": d.strategy, "learners": d.learners, "speeds": list(d.speeds),
                           "parameters": d.layout.parameters, "layout": d.layout.source, "exact": d.layout.exact,
                           "fragments": len(d.layout.fragments), "H": d.H, "tau": d.tau, "step_time_s": d.step_time_s,
                           "codec_up": d.codec_up, "codec_down": d.codec_down, "block": d.block,
                           "optimizer": d.optimizer, "merge_rule": d.merge_rule,
                           "consolidate": d.consolidate, "bandwidth_bps": d.bandwidth_bps, "latency_s": d.latency_s,
                           "regions": [asdict(r) for r in d.regions], "tokens_per_step": d.tokens_per_step,
                           "tokens": d.tokens},
            "period_s": self.period_s, "fragment_numels": list(self.fragment_numels), "keeps_up": self.keeps_up,
            "learners": [asdict(s) for s in self.sites], "regions": [asdict(r) for r in self.regions],
            "shards": [{**asdict(s.memory), "peak_bytes": s.memory.peak_bytes, "in_per_s": s.in_per_s,
                        "out_per_s": s.out_per_s, "pushed_params_per_s": s.pushed_params_per_s, "cores": s.cores}
                       for s in self.shards],
            "shards_needed": self.shards_needed, "join_s": self.join_s, "shard_cores": d.shard_cores,
            "shards_for_cores": self.shards_for_cores, "shard_threads": self.shard_threads, "step_time_source": d.step_time_source, "totals": asdict(self.totals) if self.totals else None,
            "placement": d.network.placement if d.network else None, "fragment_homes": list(self.homes),
            "slow_routes": list(self.slow_routes),
            "links": [asdict(lk) for lk in self.links]}
