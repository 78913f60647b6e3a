"""The links of a config's `[[regions]]`, each with all the traffic that shares it.

Every sender (a learner; with the regional tier a region's syncer, its learners then on their LAN alone)
has one flow per region that homes fragments (`placement`): its pushes of those fragments and a progress
report per step go there over its route (`Topology.route`: its LAN, then its region's WAN link there), the
answers come back. A link carries every flow whose route crosses it, in one direction or the other: with
`placement = "links"` a WAN link between two regions carries one region's pushes and the other's answers
the same way.

Whether a link keeps up is today's rule for a learner's link (`links.py`: every fragment's round trip
within τ steps, played out over a few sync periods), applied to each flow over its route: each hop lends
a flow the share of its bandwidth that the flow's bytes are of everything crossing that hop that way (the
equal share of the `--regions` model when the flows are alike), the route is as fast as its slowest
share, and its latency is the sum of its hops'. A link keeps up when every flow across it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from diloco.config import Topology
from diloco.plan.deployment import Deployment, traffic
from diloco.plan.steady_links import Site, Traffic, steady_state, verdict
from diloco.plan.reports import LinkReport
from diloco.plan.wire import LEAVE_BYTES

if TYPE_CHECKING:
    from diloco.config import Config, Hop

NO_BANDWIDTH = 1e-3
"""Bits per second left to a flow on a way the others fill: its link is saturated (and says so)."""


@dataclass(frozen=True)
class Flow:
    """One sender's traffic to the shards of one home region (or, a learner of the regional tier, to its
    region's syncer)."""

    sender: str
    step_s: float
    """The sender's own step: one progress report each."""
    round: str
    """Whose round its pushes join: flows of one round close together."""
    fragments: tuple[int, ...]
    hops: tuple[Hop, ...]
    """Its route, each hop oriented from the sender (`up`: towards the home)."""
    period_steps: int
    """Grid steps between two pushes of a fragment."""

    def traffic(self, t: Traffic) -> Traffic:
        return Traffic(tuple(t.push[p] for p in self.fragments), tuple(t.update[p] for p in self.fragments),
                       t.progress, tuple(t.first_due[p] for p in self.fragments), self.period_steps)

    def last_bytes(self, t: Traffic) -> int:
        """What it sends once at the end: its fragments' last push (of what no push carried) and the word
        that it leaves."""
        return sum(t.push[p] for p in self.fragments) + LEAVE_BYTES

    def rates(self, t: Traffic, grid_step_s: float) -> tuple[float, float]:
        """Bytes per second towards the home and back."""
        period = self.period_steps * grid_step_s
        up = sum(t.push[p] for p in self.fragments) / period + t.progress / self.step_s
        return up, sum(t.update[p] for p in self.fragments) / period


def flows(d: Deployment, config: Config, homes: list[str]) -> list[Flow]:
    """Every sender's flow to every home, in the order the simulator first uses their links (learners in
    order, each one's homes in the order fragments name them), so that links are named as it names them."""
    by_home: dict[str, tuple[int, ...]] = {}
    for p, home in enumerate(homes):
        by_home[home] = (*by_home.get(home, ()), p)
    out, topology = [], Topology(config)
    for m, speed in enumerate(d.speeds):
        step_s = d.grid_step_s if d.synchronous else d.step_time_s / speed
        if topology.tiered:
            out.append(Flow(f"learner {m}", step_s, f"region {topology.region_of(m)}", tuple(range(len(homes))),
                            tuple(topology.route(m)), d.H))
            continue
        out += [Flow(f"learner {m}", step_s, home, fragments, tuple(topology.route(m, home)), d.H)
                for home, fragments in by_home.items()]
    push_every = config.regional.push_every
    for r in topology.tier_regions():
        # it forwards its region's progress once per step of its learners on average (`core/regional.py`)
        step_s = d.step_time_s * len(r.speeds) / sum(r.speeds)
        out += [Flow(f"{r.name} syncer", step_s, home, fragments, tuple(topology.region_route(r.name, home)),
                     d.H * push_every)
                for home, fragments in by_home.items() if home != r.name]
    return out


@dataclass
class _Link:
    """A link while its flows are gathered: the hop that named it, and each flow across it with whether
    the flow's pushes go its `up` way."""

    hop: Hop
    crossings: list[tuple[Flow, bool]]

    def load(self, t: Traffic, grid_step_s: float, counted: Callable[[Flow], bool] = lambda flow: True
             ) -> tuple[float, float]:
        """Bytes per second its `up` and `down` ways carry (of the `counted` flows)."""
        up = down = 0.0
        for flow, forward in self.crossings:
            if counted(flow):
                there, back = flow.rates(t, grid_step_s)
                up, down = (up + there, down + back) if forward else (up + back, down + there)
        return up, down


@dataclass(frozen=True)
class RouteReport:
    """One sender's route to one home, all its hops: latencies add up along it."""

    name: str
    round_trip_s: float
    budget_s: float
    keeps_up: bool
    why: str


@dataclass(frozen=True)
class NetworkReport:
    links: tuple[LinkReport, ...]
    routes: tuple[RouteReport, ...]

    @property
    def slow_routes(self) -> tuple[str, ...]:
        """Routes that miss τ though each of their links alone keeps up."""
        if not all(lk.keeps_up for lk in self.links):
            return ()
        return tuple(f"{r.name}: {r.why}" for r in self.routes if not r.keeps_up)

    @property
    def keeps_up(self) -> bool:
        return all(lk.keeps_up for lk in self.links) and all(r.keeps_up for r in self.routes)


def network_report(d: Deployment, exact_links: list[dict] | None = None, time_s: float | None = None
                   ) -> NetworkReport:
    """Every link of the deployment's regions with its load and whether it keeps up, LAN links first as
    `diloco sim`'s summary lists them; over the run, its bytes each way: `exact_links` (the replayed run's)
    where given, else the steady state over `time_s` and each sender's last push."""
    config = d.network
    if config is None or d.exchange != "outer":
        return NetworkReport((), ())
    t = traffic(d)
    all_flows = flows(d, config, Topology(config).fragment_homes(len(t.push)))
    links = _gather(all_flows)
    exact = {e["name"]: e for e in exact_links or []}
    reports = []
    for name, link in links.items():
        up, down = link.load(t, d.grid_step_s)
        bandwidth_up, bandwidth_down = link.hop.up.bandwidth_mbit * 1e6, link.hop.down.bandwidth_mbit * 1e6
        verdicts = _verdicts(d, [flow for flow, _ in link.crossings], links, t, only=name)
        failing = next((f"{flow.sender}: {v[1]}" for flow, v in verdicts.items() if not v[0]), "")
        use = max(up * 8 / bandwidth_up, down * 8 / bandwidth_down)
        if use >= 1:
            failing = f"needs {use:.0%} of the link"
        tightest = max(verdicts.values(), key=lambda v: v[2] / v[3] if v[3] else float("inf"))
        if name in exact:
            totals: tuple[int | None, int | None] = (exact[name]["bytes_up"], exact[name]["bytes_down"])
        elif time_s is not None:
            last = [sum(flow.last_bytes(t) for flow, forward in link.crossings if forward == way) for way in (True, False)]
            totals = (round(up * time_s) + last[0], round(down * time_s) + last[1])
        else:
            totals = (None, None)
        reports.append(LinkReport(
            name, link.hop.kind, tuple(dict.fromkeys(flow.sender for flow, _ in link.crossings)),
            bandwidth_up, bandwidth_down, up, down, up * 8 / bandwidth_up, down * 8 / bandwidth_down,
            tightest[2], tightest[3], not failing, failing, *totals, name in exact))
    reports.sort(key=lambda r: r.kind != "lan")
    routes = [RouteReport(f"{flow.sender} to {flow.round}", rt, budget, keeps_up, why)
              for flow, (keeps_up, why, rt, budget) in _verdicts(d, all_flows, links, t).items()]
    return NetworkReport(tuple(reports), tuple(routes))


def _gather(all_flows: list[Flow]) -> dict[str, _Link]:
    """Each link once, named by the first flow across it (a WAN link's two ways are one link)."""
    links: dict[str, _Link] = {}
    for flow in all_flows:
        for hop in flow.hops:
            name = _link_name(hop, links)
            links.setdefault(name, _Link(hop, [])).crossings.append((flow, name == hop.name))
    return links


def _link_name(hop: Hop, links: dict[str, _Link]) -> str:
    """The name of the link a hop crosses: its own, or the other way round's when that one came first."""
    backward = f"{hop.far}→{hop.near} (WAN)"
    return backward if hop.kind == "wan" and backward in links and hop.name not in links else hop.name


def _site(flow: Flow, links: dict[str, _Link], t: Traffic, grid_step_s: float, only: str | None) -> Site:
    """A flow's route (or its one hop across link `only`) as one link: the slowest of its shares of its
    hops' ways, the latencies summed. The flows of its round push together and share equally what the
    others (other rounds' pushes, answers the other way, progress reports) leave of a way on average."""
    hops = [h for h in flow.hops if only is None or _link_name(h, links) == only]
    up_shares, down_shares = [], []
    for hop in hops:
        link = links[_link_name(hop, links)]
        forward = link.hop.name == hop.name
        others = link.load(t, grid_step_s, lambda f: f.round != flow.round)
        peers = sum(1 for f, way in link.crossings if f.round == flow.round and way == forward)
        towards, away = others if forward else others[::-1]
        up_shares.append(max(hop.up.bandwidth_mbit * 1e6 - towards * 8, NO_BANDWIDTH) / peers)
        down_shares.append(max(hop.down.bandwidth_mbit * 1e6 - away * 8, NO_BANDWIDTH) / peers)
    return Site(flow.sender, 1, 1.0, min(up_shares), sum(h.up.latency_ms for h in hops) / 1e3,
                down_bandwidth_bps=min(down_shares), down_latency_s=sum(h.down.latency_ms for h in hops) / 1e3)


def _verdicts(d: Deployment, chosen: list[Flow], links: dict[str, _Link], t: Traffic, only: str | None = None
              ) -> dict[Flow, tuple[bool, str, float, float]]:
    """Per flow: keeps up, why not, its worst round trip, its τ budget; over its route, or over link `only`
    alone. Flows of one round are played out together (the round closes on the last of their pushes)."""
    rounds: dict[str, list[Flow]] = {}
    for flow in chosen:
        if flow.hops:
            rounds.setdefault(flow.round, []).append(flow)
    out = {}
    for members in rounds.values():
        states = steady_state([_site(f, links, t, d.grid_step_s, only) for f in members], members[0].traffic(t),
                              d.grid_step_s, [f.step_s for f in members])
        for flow, state in zip(members, states):
            budget = d.tau * flow.step_s
            keeps_up, why, _, rt = verdict(state, d.tau, budget)
            out[flow] = (keeps_up, why, rt, budget)
    return out
