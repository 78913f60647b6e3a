"""What a run measured, in the same shape from the simulator and the real runtime."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

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
    busy_fraction: float
    crashes: int
    tokens_lost: float
    """Tokens trained but never merged, e.g. lost in a crash (averaged over the model's parameters)."""
    bytes_up: int
    bytes_down: int
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
    """Fraction of all learners' time spent in inner steps."""
    peak_sync_bytes: int
    """Largest single sync message one learner sent (for data-parallel: one step's all-reduce share)."""
    rounds: int
    parameters: int
    tokens_merged: float
    tokens_stale: float
    tokens_lost: float
    """Token accounting of the syncer, averaged over the model's parameters: trained = merged + stale + lost."""
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


def links_from_learners(config: Config, reports: list[LearnerReport]) -> list[dict[str, Any]]:
    """Each link's bytes as the learners' own counters assign them: a learner's traffic crosses every hop
    of its route (its LAN; outside the syncer's region, its region's WAN link too). A learner outside the
    regions (an elastic run's extra one) is on no listed link."""
    hops: dict[str, tuple[Hop, list[int]]] = {}
    for report in reports:
        for hop in config.route(report.learner):
            counted = hops.setdefault(hop.name, (hop, [0, 0]))[1]
            counted[0] += report.bytes_up
            counted[1] += report.bytes_down
    return [link_entry(hop, up, down) for hop, (up, down) in hops.values()]


def links_from_regions(config: Config, region_reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With the regional tier, each region's WAN link carries its regional syncer's traffic, as its uplink
    counted it (the learners' own traffic stays on their LANs)."""
    out = []
    for report in region_reports:
        uplink = report.get("uplink", {})
        for hop in config.region_route(report["region"]):
            out.append(link_entry(hop, uplink.get("bytes_up", 0), uplink.get("bytes_down", 0)))
    return out


def human_bytes(n: float) -> str:
    """Decimal units, as links are rated: 12.83 MB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
