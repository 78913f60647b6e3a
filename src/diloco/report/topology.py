"""The picture of a run's regions (topology.png): where its learners and syncers are, and what crossed the
links between them. Drawn only for a run with `[[regions]]`; a run without them gets no figure.

The syncer's region is in the middle, every other region around it, joined to it by its WAN link (the
one its learners' traffic, or with the regional tier its regional syncer's, crosses). Where each learner
is and which link is whose come from the run's own config (`Config.learners_of`, `Config.route`,
`Config.region_route`), the bytes and busy shares from summary.json's `links`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from diloco.config import Config, config_from_dict
from diloco.errors import ConfigError
from diloco.report.figures import new_figure
from diloco.report.links import busy_share, link_bytes, total_bytes
from diloco.report.records import Run
from diloco.results import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SYNCER_COLOUR = "#d9e8ff"
REGION_COLOUR = "#f6f7f9"
EDGE_COLOUR = "#66717c"
RING_RADIUS = 1.0
"""The other regions' distance from the syncer's, in data units."""
BOX_MARGIN = (0.5, 0.35)
"""Room around a box's centre for its text, in data units (x, y), so that no box is cut at the edge."""
LABEL_AT = 0.5
"""Where along a WAN edge, from the syncer's region, its label sits: half way, between the two boxes."""


def regions_config(summary: dict[str, Any] | None) -> Config | None:
    """The run's config when it has regions; None without them, or for a config this version cannot read
    (a summary from another diloco): the picture is then left out rather than guessed."""
    raw = summary.get("config") if summary is not None else None
    if not isinstance(raw, dict) or not raw.get("regions"):
        return None
    try:
        return config_from_dict(raw)
    except (ConfigError, TypeError, ValueError):
        return None


def topology_figure(run: Run) -> Figure | None:
    """The regions as boxes (name, syncers, learners, LAN total) and each one's WAN link to the syncer's
    region as an edge labelled with its bytes and busy share each way."""
    config = regions_config(run.summary)
    syncer = config.syncer_region() if config is not None else None
    if config is None or syncer is None or run.summary is None:
        return None
    links = {e.get("name"): e for e in run.summary.get("links") or [] if isinstance(e, dict)}
    positions = region_positions([r.name for r in config.regions], syncer)
    wan = {name: wan_entry(config, name, links) for name in positions if name != syncer}
    heaviest = max([sum(link_bytes(e)) for e in wan.values() if e is not None] + [1])
    figure, axes = new_figure(1, 1, 10, 8)
    for name, entry in wan.items():
        width = 1 + 4 * (sum(link_bytes(entry)) / heaviest if entry is not None else 0)
        draw_wan_edge(axes, positions[name], positions[syncer], wan_label(entry), width)
    for name, (x, y) in positions.items():
        axes.text(x, y, region_label(config, name, links), ha="center", va="center", fontsize=9, zorder=4,
                  bbox={"boxstyle": "round,pad=0.6", "linewidth": 1.5 if name == syncer else 1,
                        "facecolor": SYNCER_COLOUR if name == syncer else REGION_COLOUR, "edgecolor": EDGE_COLOUR})
    fit_to_boxes(axes, list(positions.values()))
    axes.axis("off")
    tier = "a syncer per region, under the global one" if config.tiered else "one syncer"
    axes.set_title(f"{run.name}: regions ({config.topology} topology: {tier})")
    figure.text(0.5, 0.02, "WAN links to the syncer's region: ↑ towards the syncer, ↓ back; busy: the share of "
                "the run each direction spent carrying bytes", ha="center", fontsize="small", color=EDGE_COLOUR)
    return figure


def region_positions(names: list[str], syncer: str) -> dict[str, tuple[float, float]]:
    """The syncer's region in the middle, the others evenly round it, the first at the top."""
    others = [name for name in names if name != syncer]
    positions = {syncer: (0.0, 0.0)}
    for index, name in enumerate(others):
        angle = math.pi / 2 - 2 * math.pi * index / len(others)
        positions[name] = (RING_RADIUS * math.cos(angle), RING_RADIUS * math.sin(angle))
    return positions


def wan_entry(config: Config, region: str, links: dict[Any, dict[str, Any]]) -> dict[str, Any] | None:
    """The summary's entry for a region's WAN link to the syncer's region; None when nothing crossed it (a
    region without learners)."""
    return next((links[hop.name] for hop in config.region_route(region) if hop.name in links), None)


def lan_entries(config: Config, region: str, links: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary's entries for the LAN links of a region's learners."""
    names = [hop.name for m in config.learners_of(region) for hop in config.route(m) if hop.kind == "lan"]
    return [links[name] for name in names if name in links]


def region_label(config: Config, region: str, links: dict[Any, dict[str, Any]]) -> str:
    """A region's box: its name, the syncers it runs, its learners and its LAN links' bytes."""
    syncers = []
    if region == config.syncer_region():
        syncers.append("global syncer" if config.tiered else "syncer")
    if config.tiered:
        syncers.append("regional syncer")
    up, down = total_bytes(lan_entries(config, region, links))
    lines = [region, *(f"[{s}]" for s in syncers), *learner_lines(config, region),
             f"LAN: {human_bytes(up + down)}"]
    return "\n".join(lines)


def learner_lines(config: Config, region: str) -> list[str]:
    """Its learners, runs of consecutive ids at one speed on one line: `learners 0–1, speed 1`."""
    speeds = config.speeds()
    runs: list[list[int]] = []
    for m in config.learners_of(region):
        if runs and runs[-1][-1] == m - 1 and speeds[runs[-1][-1]] == speeds[m]:
            runs[-1].append(m)
        else:
            runs.append([m])
    if not runs:
        return ["no learners"]
    return [(f"learner {ids[0]}" if len(ids) == 1 else f"learners {ids[0]}–{ids[-1]}") + f", speed {speeds[ids[0]]:g}"
            for ids in runs]


def wan_label(entry: dict[str, Any] | None) -> str:
    """Bytes each way and, where measured, how busy each direction was."""
    if entry is None:
        return "no traffic"
    lines = []
    for arrow, direction, count in zip("↑↓", ("up", "down"), link_bytes(entry)):
        share = busy_share(entry, direction)
        lines.append(f"{arrow} {human_bytes(count)}" + (f" · busy {share}" if share is not None else ""))
    return "\n".join(lines)


def draw_wan_edge(axes: Axes, start: tuple[float, float], end: tuple[float, float], label: str,
                  width: float) -> None:
    """The line under the boxes, thicker for more bytes, and its label on a white patch."""
    axes.plot([start[0], end[0]], [start[1], end[1]], color=EDGE_COLOUR, linewidth=width, zorder=1)
    x, y = (end[0] + LABEL_AT * (start[0] - end[0]), end[1] + LABEL_AT * (start[1] - end[1]))
    axes.text(x, y, label, ha="center", va="center", fontsize=8, zorder=3,
              bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#d9dee3"})


def fit_to_boxes(axes: Axes, centres: list[tuple[float, float]]) -> None:
    """Limits that hold every box and no more, one unit as long across as up."""
    xs, ys = [x for x, _ in centres], [y for _, y in centres]
    axes.set_xlim(min(xs) - BOX_MARGIN[0], max(xs) + BOX_MARGIN[0])
    axes.set_ylim(min(ys) - BOX_MARGIN[1], max(ys) + BOX_MARGIN[1])
    axes.set_aspect("equal")
