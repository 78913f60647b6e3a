"""What a run measured, in the same shape from the simulator and the real runtime."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.config import Topology

if TYPE_CHECKING:
    from diloco.config import Config, Hop


@dataclass
class LearnerReport:
    learner: int
    speed: float
    tokens: int
    """Tokens this learner trained on (including any a crash later lost)."""
    steps: int
    busy_s: float
    waiting_s: float
    down_s: float
    busy_fraction: float = 0.0
    """Of the run's training time (`fleet_goodput`): set by `build_run_result`, as are `tokens_lost`
    and `rounds`."""
    crashes: int = 0
    tokens_lost: int = 0
    """Tokens trained but never merged, e.g. lost in a crash (averaged over the model's parameters, in
    whole tokens: `driver_kit/run_summary.py`)."""
    bytes_up: int = 0
    bytes_down: int = 0
    eval_loss: float | None = None
    """Held-out loss of this learner's own model at its end, on the same batches as Θ's."""
    rounds: dict[str, Any] = field(default_factory=dict)
    """The rounds its pushes were merged in: how many, their mean size, its staleness histogram."""


@dataclass
class RunResult:
    strategy: str
    learners: int
    tokens: int
    final_eval_loss: float
    training_time_s: float
    """From the first step to the last merge: virtual seconds in the simulator, measured ones for real
    (`clock` says which)."""
    wire_bytes_up: int
    wire_bytes_down: int
    goodput: float
    """Fraction of all learners' time over the run spent in inner steps (`fleet_goodput`)."""
    peak_sync_bytes: int
    """Largest single sync message one learner sent (for data-parallel: one step's all-reduce share)."""
    rounds: int
    parameters: int
    tokens_merged: int
    tokens_stale: int
    tokens_lost: int
    """Token accounting of the syncer, averaged over the model's parameters, in whole tokens:
    trained = merged + stale + lost (`driver_kit/run_summary.py`)."""
    per_learner: list[LearnerReport]
    eval_curve: list[dict[str, float]]
    config: dict[str, Any] = field(default_factory=dict)
    round_stats: dict[str, Any] = field(default_factory=dict)
    """Participants per round (mean, histogram), staleness of merged pushes (histogram), time held open."""
    learners_eval_loss_mean: float | None = None
    """Mean of the learners' own held-out losses at the end: the final Θ should be no worse."""
    clock: str = "virtual"
    """`virtual`: the simulator's clock; `real`: measured on the machines of a real run."""
    wall_clock_s: float = 0.0
    """The whole command on this host's clock (a real run: start-up and evaluation included; the
    simulator: how long simulating took)."""
    duplicates: int = 0
    """Pushes the syncer received twice (retries) and counted once."""
    shards: int = 1
    endpoints: dict[str, str] = field(default_factory=dict)
    """What a real run's processes served (metrics, status page)."""
    launcher: str = ""
    """Who started a real run's processes: `local` (this machine) or `ray` (a Ray cluster); empty in the
    simulator."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """A Ray run's use of the cluster: node-hours, cost, cost per million merged tokens, every
    placement and what happened to it."""
    lan_bytes: int = 0
    """Bytes over the learners' links inside their regions, both directions (0 without regions)."""
    wan_bytes: int = 0
    """Bytes over the links between regions, both directions (0 without regions)."""
    links: list[dict[str, Any]] = field(default_factory=list)
    """Per link (`regions`): name, kind (`lan` or `wan`), bytes towards the syncer (`bytes_up`) and back
    (`bytes_down`), and each direction's busy share of the run (the simulator; None in a real run)."""

    def summary(self) -> dict[str, Any]:
        return asdict(self)


def link_entry(hop: Hop, bytes_up: int, bytes_down: int, utilisation_up: float | None = None,
               utilisation_down: float | None = None) -> dict[str, Any]:
    """One link of a summary's `links`, in the same shape from both drivers."""
    return {"name": hop.name, "kind": hop.kind, "bytes_up": bytes_up, "bytes_down": bytes_down,
            "utilisation_up": utilisation_up, "utilisation_down": utilisation_down}


def traffic_fields(links: list[dict[str, Any]]) -> dict[str, Any]:
    """A summary's `links` (LAN links first, then WAN links, each in learner order) with their totals."""
    def total(kind: str) -> int:
        return sum(e["bytes_up"] + e["bytes_down"] for e in links if e["kind"] == kind)

    return {"links": sorted(links, key=lambda e: e["kind"] != "lan"), "lan_bytes": total("lan"),
            "wan_bytes": total("wan")}


def links_from_learners(config: Config, reports: list[LearnerReport],
                        by_home: dict[int, dict[str, tuple[int, int]]] | None = None) -> list[dict[str, Any]]:
    """Each link's bytes as the learners' own counters assign them: a learner's traffic with the shards of
    a home region crosses every hop of its route there (its LAN; flat and outside that region, the WAN
    link between the two). `by_home`: per learner, its bytes (up, down) per home region (`sent_by_home`);
    a learner without them sent everything to the syncer's region. A learner outside the regions (an
    elastic run's extra one) is on no listed link."""
    return listed_links(
        (Topology(config).route(report.learner, home), up, down) for report in reports
        for home, (up, down) in ((by_home or {}).get(report.learner)
                                 or {None: (report.bytes_up, report.bytes_down)}).items())


def links_from_regions(config: Config, region_reports: list[dict[str, Any]], order: Sequence[str] = ()
                       ) -> list[dict[str, Any]]:
    """With the regional tier, the WAN links carry the regional syncers' traffic, as their uplinks counted
    it: per home region (`order`, see `sent_by_home`) when the global shards run in several, else all to
    the syncer's region (the learners' own traffic stays on their LANs)."""
    routes = []
    for report in region_reports:
        uplink = report.get("uplink", {})
        homes = (sent_by_home(uplink["bytes_by_home"], order) if "bytes_by_home" in uplink
                 else {None: (uplink.get("bytes_up", 0), uplink.get("bytes_down", 0))})
        routes += [(Topology(config).region_route(report["region"], home), up, down)
                   for home, (up, down) in homes.items()]
    return listed_links(routes)


def sent_by_home(counted: dict[str, dict[str, int]], order: Sequence[str]) -> dict[str, tuple[int, int]]:
    """A sender's per-home counters (its report's `bytes_by_home`) as (up, down), in `order`: the order the
    fragments first name their homes (`dict.fromkeys(Topology(config).fragment_homes(F))`), the simulator's."""
    return {home: (counted[home]["bytes_up"], counted[home]["bytes_down"]) for home in order if home in counted}


def listed_links(routes: Iterable[tuple[list[Hop], int, int]]) -> list[dict[str, Any]]:
    """Each hop's bytes from routes and what crossed them (up, down), in the order first used. A WAN link
    between two regions is listed once, named the way it was first used, as the simulator lists it:
    traffic the other way round is that link's other direction."""
    links: dict[tuple[str, str], tuple[Hop, list[int]]] = {}
    for hops, up, down in routes:
        for hop in hops:
            if (hop.far, hop.near) in links:  # the reverse of a listed link: its directions swapped
                counted = links[(hop.far, hop.near)][1]
                counted[0] += down
                counted[1] += up
                continue
            counted = links.setdefault((hop.near, hop.far), (hop, [0, 0]))[1]
            counted[0] += up
            counted[1] += down
    return [link_entry(hop, up, down) for hop, (up, down) in links.values()]


def human_bytes(n: float) -> str:
    """Decimal units, as links are rated: 12.83 MB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
