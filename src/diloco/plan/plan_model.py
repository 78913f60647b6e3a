"""The plan: what each learner, link and shard carries, and whether every link keeps up.

Rates are the steady state of a sync period (H steps of the sync grid, the slowest learner's steps for
synchronous strategies, the fastest's otherwise). Per learner and period, up: one push per fragment and
one progress report per own step; down: one answer per fragment. Message sizes come from `wire.py`, the
links' timing from `links.py`, the shards' memory from `memory.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from diloco.config import Topology
from diloco.plan.deployment import Deployment, traffic
from diloco.plan.steady_links import LinkState, Site, Traffic, steady_state, verdict
from diloco.plan.memory import shard_memory, shards_needed
from diloco.plan.network import network_report
from diloco.plan.reports import Plan, RegionReport, ShardReport, SiteReport
from diloco.plan.syncer_cost import cores, join_s, shards_for_cores
from diloco.plan.totals import estimate_totals, replayed_totals
from diloco.shard.ownership import placed_shard_count
from diloco.plan.wire import all_reduce_share

if TYPE_CHECKING:
    from diloco.plan.replay import ReplayResult


def site_reports(d: Deployment) -> list[SiteReport]:
    """Per site: bytes per period and per second, and the link's steady state against the τ budget."""
    if d.exchange == "gradients":
        return _all_reduce_reports(d)
    t = traffic(d)
    sites = d.sites()
    states = steady_state(sites, t, d.grid_step_s, [d.own_step_s(s) for s in sites])
    return [_site_report(d, t, site, state) for site, state in zip(sites, states)]


def _site_report(d: Deployment, t: Traffic, site: Site, state: LinkState) -> SiteReport:
    period, own_step = d.period_s, d.own_step_s(site)
    up = sum(t.push) + round(t.progress * period / own_step)
    down = sum(t.update)
    budget = d.tau * own_step
    keeps_up, why, worst, rt = verdict(state, d.tau, budget)
    stall = sum(max(0.0, r - budget) for r in state.round_trip_s) if d.waits and not keeps_up else 0.0
    return SiteReport(site.name, site.learners, site.speed, site.bandwidth_bps, site.latency_s, up, down,
                      up / period, down / period, max(t.push), max(t.update), rt, worst, budget,
                      state.up_utilisation, state.down_utilisation, keeps_up, why, stall, site.region)


def _all_reduce_reports(d: Deployment) -> list[SiteReport]:
    """Data-parallel: every step, a ring all-reduce over the slowest link; nothing overlaps it."""
    sites = d.sites()
    grad_bytes = 4 * d.layout.parameters
    share = all_reduce_share(grad_bytes, d.learners)
    bandwidth = min(s.bandwidth_bps for s in sites)
    latency = max(s.latency_s for s in sites)
    comm = 2 * (d.learners - 1) * (latency + grad_bytes / d.learners * 8 / bandwidth) if d.learners >= 2 else 0.0
    step = d.grid_step_s
    reports = []
    for s in sites:
        keeps_up = comm == 0
        why = "" if keeps_up else "data-parallel: every step waits for its all-reduce"
        utilisation = share * 8 / s.bandwidth_bps / (step + comm)
        reports.append(SiteReport(s.name, s.learners, s.speed, s.bandwidth_bps, s.latency_s, share, share,
                                  share / (step + comm), share / (step + comm), share, share, comm, 0, 0.0,
                                  utilisation, utilisation, keeps_up, why, comm, s.region))
    return reports


def region_reports(d: Deployment, sites: list[SiteReport]) -> list[RegionReport]:
    reports = []
    for r in d.regions:
        mine = [s for s in sites if s.region == r.name]
        if not mine:
            continue
        up = sum(s.learners * s.up_per_s * 8 for s in mine)
        down = sum(s.learners * s.down_per_s * 8 for s in mine)
        reports.append(RegionReport(r.name, sum(s.learners for s in mine), r.bandwidth_bps, up, down,
                                    all(s.keeps_up for s in mine)))
    return reports


def shard_reports(d: Deployment, sites: list[SiteReport], shards: int, owners: Sequence[int] | None = None
                  ) -> list[ShardReport]:
    """Each shard's memory, and the bytes per second its fragments bring in and send out."""
    t = traffic(d)
    learners = sum(s.learners for s in sites)
    fragments = d.layout.fragments
    reports = []
    for mem in shard_memory([f.numel for f in fragments], [f.embedding for f in fragments], shards,
                            d.syncer_state(), owners, d.pushes()):
        pushes = sum(t.push[p] for p in mem.fragments) * learners
        answers = sum(t.update[p] for p in mem.fragments) * learners
        pushed = mem.parameters * learners / d.period_s
        reports.append(ShardReport(mem, pushes / d.period_s, answers / d.period_s, pushed, cores(pushed)))
    return reports


def pushed_params_per_s(d: Deployment) -> float:
    """Parameters the whole syncer is pushed per second: every learner pushes every fragment per period."""
    return d.layout.parameters * d.learners / d.period_s


def plan(d: Deployment, replayed: ReplayResult | None = None) -> Plan:
    """The plan; its totals and links' bytes are the `replayed` run's where given (exact)."""
    sites = site_reports(d)
    numels = tuple(f.numel for f in d.layout.fragments)
    needed, shards, for_cores = None, [], None
    homes = Topology(d.network).fragment_homes(len(numels)) if d.network and d.exchange == "outer" else []
    if d.exchange == "outer" and d.network is not None and d.network.placement == "links":
        # One shard per home region, owning the fragments homed there, as `diloco run` starts them.
        regions = Topology(d.network).homes(len(numels))
        placed_shard_count(d.network, d.shards or 1)  # another count is refused, as `diloco run` refuses it
        shards = shard_reports(d, sites, len(regions), [regions.index(h) for h in homes])
        if d.shard_memory_bytes is not None and all(s.memory.peak_bytes <= d.shard_memory_bytes for s in shards):
            needed = len(regions)
    elif d.exchange == "outer":
        if d.shard_memory_bytes is not None:
            needed = shards_needed(list(numels), [f.embedding for f in d.layout.fragments], d.syncer_state(),
                                   d.shard_memory_bytes, d.pushes())
        # without --shard-cores, one core a shard: what one thread is measured to get through
        for_cores = shards_for_cores(pushed_params_per_s(d), numels, d.shard_cores or 1.0)
        count = d.shards or max(needed or 1, for_cores or 1)
        shards = shard_reports(d, sites, min(count, len(numels)))
    totals = replayed_totals(replayed) if replayed else estimate_totals(d, sites) if d.tokens else None
    network = network_report(d, replayed.links if replayed else None, totals.time_s if totals else None)
    return Plan(d, d.period_s, numels, tuple(sites), tuple(region_reports(d, sites)), tuple(shards), needed, totals,
                network.links, tuple(homes), network.slow_routes,
                join_s([s.memory.parameters for s in shards], min(s.bandwidth_bps for s in sites))
                if shards else None, for_cores)
