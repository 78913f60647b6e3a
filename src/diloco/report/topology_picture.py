"""The picture of a run's regions (topology.png): where its learners and syncers are, which regions home
fragments, and what crossed the links between them. Drawn only for a run with `[[regions]]`; a run without
them gets no figure.

With every fragment homed at the syncer (`placement = "syncer"`), every WAN link joins a region to the
syncer's: the syncer's region is in the middle, the others round it. With `placement = "links"` WAN links
join any two regions: the regions stand on a ring, the syncer's at the top, and each box says how many
fragments it homes. Each WAN link is one edge, labelled with its bytes each way (named by its ends) and,
from the simulator, how busy each way was; labels are placed along their edges away from each other and
from the boxes. Where each learner is, which link is whose and which region homes what come from the run's
own config (`Topology(config)`: `learners_of`, `route`, `region_route`, `fragment_homes`), the bytes and busy
shares from summary.json's `links`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from diloco.config import Config, Hop, Topology, config_from_dict
from diloco.errors import ConfigError
from diloco.report.figures import new_figure
from diloco.report.link_figures import busy_share, link_bytes, total_bytes
from diloco.report.run_records import Run
from diloco.results import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SYNCER_COLOUR = "#d9e8ff"
REGION_COLOUR = "#f6f7f9"
EDGE_COLOUR = "#66717c"
RING_RADIUS = 1.0
"""The regions' distance from the middle (the syncer's region in a star), in data units."""
BOX_MARGIN = (0.5, 0.35)
"""Room around a box's centre for its text, in data units (x, y), so that no box is cut at the edge."""
LABEL_AT = (0.3, 0.24, 0.36, 0.42, 0.18)
"""Where along a WAN edge, from the sending end, the label of one way's bytes may sit (the other way's:
as far from the other end), in order of preference: the first that keeps clear of every box and label
(on the line, else just above it or below it)."""
CHAR_EM = 0.6
"""A character's width in ems, about, for the fonts used: enough to keep labels apart."""
LABEL_FONT = 8
BOX_FONT = 9


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
    """The regions as boxes (name, syncers, learners, fragments homed, LAN total) and each WAN link that
    carried traffic, or should have, as an edge labelled with its bytes and busy share each way."""
    config = regions_config(run.summary)
    syncer = Topology(config).syncer_region() if config is not None else None
    if config is None or syncer is None or run.summary is None:
        return None
    links = {e.get("name"): e for e in run.summary.get("links") or [] if isinstance(e, dict)}
    names = [r.name for r in config.regions]
    homed = homes(config)
    edges = wan_edges(config, links, homed)
    star = all(syncer in (hop.near, hop.far) for hop, _ in edges)
    positions = region_positions(names, syncer) if star else ring_positions(names, syncer)
    heaviest = max([sum(link_bytes(e)) for _, e in edges if e is not None] + [1])
    figure, axes = new_figure(1, 1, 10, 8)
    fit_to_boxes(axes, list(positions.values()))
    boxes = {name: region_label(config, name, links, homed) for name in positions}
    taken = [(*positions[name], *text_half_size(axes, text, BOX_FONT, pad=0.6)) for name, text in boxes.items()]
    for hop, entry in sorted(edges, key=lambda edge: -sum(link_bytes(edge[1])) if edge[1] else 0):
        width = 1 + 4 * (sum(link_bytes(entry)) / heaviest if entry is not None else 0)
        draw_wan_edge(axes, positions[hop.near], positions[hop.far], wan_labels(hop, entry), width, taken)
    for name, (x, y) in positions.items():
        axes.text(x, y, boxes[name], ha="center", va="center", fontsize=BOX_FONT, zorder=4,
                  bbox={"boxstyle": "round,pad=0.6", "linewidth": 1.5 if name == syncer else 1,
                        "facecolor": SYNCER_COLOUR if name == syncer else REGION_COLOUR, "edgecolor": EDGE_COLOUR})
    axes.axis("off")
    tier = "a syncer per region, under the global one" if Topology(config).tiered else "one syncer"
    axes.set_title(f"{run.name}: regions ({config.topology} topology: {tier}; placement {config.placement})")
    figure.text(0.5, 0.02, "WAN links: each way's bytes near where they leave (→ the region they go to); busy: "
                "the share of the run that way spent carrying bytes", ha="center", fontsize="small", color=EDGE_COLOUR)
    return figure


def homes(config: Config) -> dict[str, int]:
    """How many fragments each region homes (`placement`); empty for a data-parallel run, which has none."""
    from diloco.strategies import build_strategy

    spec = build_strategy(config)
    return dict(Counter(Topology(config).fragment_homes(spec.fragments))) if spec.exchange == "outer" else {}


def wan_edges(config: Config, links: dict[Any, dict[str, Any]], homed: dict[str, int]
              ) -> list[tuple[Hop, dict[str, Any] | None]]:
    """Each WAN link once, as the hop that names it, with its summary entry: every link in the summary,
    and every one the config says traffic should take, from each region that sends (its learners, or
    with the regional tier its syncer) to each region homing fragments (`homed`; none: the syncer's),
    None where nothing crossed it."""
    topology = Topology(config)
    senders = {r.name for r in (topology.tier_regions() if topology.tiered else config.regions) if r.speeds}
    targets = set(homed) or {topology.syncer_region()}
    edges: dict[frozenset[str], tuple[Hop, dict[str, Any] | None]] = {}
    for a in config.regions:
        for b in config.regions:
            hops = topology.region_route(a.name, b.name)
            if not hops:
                continue
            pair = frozenset((a.name, b.name))
            if hops[0].name in links:
                edges[pair] = (hops[0], links[hops[0].name])
            elif pair not in edges and a.name in senders and b.name in targets:
                edges[pair] = (hops[0], None)
    return [edges[pair] for pair in sorted(edges, key=sorted)]


def region_positions(names: list[str], syncer: str) -> dict[str, tuple[float, float]]:
    """The syncer's region in the middle, the others evenly round it, the first at the top."""
    others = [name for name in names if name != syncer]
    return {syncer: (0.0, 0.0), **ring_positions(others, None)}


def ring_positions(names: list[str], first: str | None) -> dict[str, tuple[float, float]]:
    """Every region evenly on a ring, `first` (else the first of them) at the top, the others clockwise."""
    ordered = ([first] if first else []) + [name for name in names if name != first]
    positions = {}
    for index, name in enumerate(ordered):
        angle = math.pi / 2 - 2 * math.pi * index / len(ordered)
        positions[name] = (RING_RADIUS * math.cos(angle), RING_RADIUS * math.sin(angle))
    return positions


def lan_entries(config: Config, region: str, links: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary's entries for the LAN links of a region's learners."""
    topology = Topology(config)
    names = [hop.name for m in topology.learners_of(region) for hop in topology.route(m) if hop.kind == "lan"]
    return [links[name] for name in names if name in links]


def region_label(config: Config, region: str, links: dict[Any, dict[str, Any]],
                 homed: dict[str, int] | None = None) -> str:
    """A region's box: its name, the syncers it runs, its learners, the fragments it homes (where
    `placement` spreads them) and its LAN links' bytes."""
    syncers, topology = [], Topology(config)
    if region == topology.syncer_region():
        syncers.append("global syncer" if topology.tiered else "syncer")
    if topology.tiered:
        syncers.append("regional syncer")
    up, down = total_bytes(lan_entries(config, region, links))
    fragments = sum((homed or {}).values())
    home = ([f"homes {homed.get(region, 0)} of {fragments} fragments"]
            if homed and config.placement == "links" else [])
    lines = [region, *(f"[{s}]" for s in syncers), *learner_lines(config, region), *home,
             f"LAN: {human_bytes(up + down)}"]
    return "\n".join(lines)


def learner_lines(config: Config, region: str) -> list[str]:
    """Its learners, runs of consecutive ids at one speed on one line: `learners 0–1, speed 1`."""
    speeds = config.speeds()
    runs: list[list[int]] = []
    for m in Topology(config).learners_of(region):
        if runs and runs[-1][-1] == m - 1 and speeds[runs[-1][-1]] == speeds[m]:
            runs[-1].append(m)
        else:
            runs.append([m])
    if not runs:
        return ["no learners"]
    return [(f"learner {ids[0]}" if len(ids) == 1 else f"learners {ids[0]}–{ids[-1]}") + f", speed {speeds[ids[0]]:g}"
            for ids in runs]


def wan_labels(hop: Hop, entry: dict[str, Any] | None) -> tuple[str, str]:
    """Each way's label, from `hop.near` (the way the link's name points, `bytes_up`) and back: the
    region it goes to, its bytes and, where measured, how busy that way was."""
    if entry is None:
        return f"→ {hop.far}: no traffic", f"→ {hop.near}: no traffic"
    there, back = (f"→ {target} {human_bytes(count)}" + (f" · busy {share}" if share is not None else "")
                   for target, count, share in zip((hop.far, hop.near), link_bytes(entry),
                                                   (busy_share(entry, "up"), busy_share(entry, "down"))))
    return there, back


def draw_wan_edge(axes: Axes, start: tuple[float, float], end: tuple[float, float], labels: tuple[str, str],
                  width: float, taken: list[tuple[float, float, float, float]]) -> None:
    """The line under the boxes, thicker for more bytes, and each way's label on a white patch near the
    end it leaves from, where along the edge it first keeps clear of what is `taken` (boxes and labels as
    centre and half sizes, to which it adds its own)."""
    axes.plot([start[0], end[0]], [start[1], end[1]], color=EDGE_COLOUR, linewidth=width, zorder=1)
    for label, (a, b) in zip(labels, ((start, end), (end, start))):
        half = text_half_size(axes, label, LABEL_FONT, pad=0.3)
        spots = [(a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1]) + shift * 2.2 * half[1])
                 for shift in (0, 1, -1) for t in LABEL_AT]  # on the line, else just above or below it
        x, y = max(spots, key=lambda spot: (min(1.0, clearance((*spot, *half), taken)), -spots.index(spot)))
        taken.append((x, y, *half))
        axes.text(x, y, label, ha="center", va="center", fontsize=LABEL_FONT, zorder=3,
                  bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#d9dee3"})


def clearance(item: tuple[float, float, float, float], taken: list[tuple[float, float, float, float]]) -> float:
    """How clear a rectangle (centre, half sizes) is of the nearest taken one: at least 1 when apart."""
    x, y, w, h = item
    return min([max(abs(x - ox) / (w + ow), abs(y - oy) / (h + oh)) for ox, oy, ow, oh in taken] + [math.inf])


def text_half_size(axes: Axes, text: str, fontsize: float, pad: float) -> tuple[float, float]:
    """Half the width and height, in data units, that a text in a box padded by `pad` ems takes, about
    (the axes' limits set, one unit as long across as up)."""
    figure = axes.get_figure()
    box = axes.get_position()
    width_in, height_in = box.width * figure.get_figwidth(), box.height * figure.get_figheight()
    (x0, x1), (y0, y1) = axes.get_xlim(), axes.get_ylim()
    units_per_inch = max((x1 - x0) / width_in, (y1 - y0) / height_in)  # the equal aspect shrinks one side
    em = fontsize / 72 * units_per_inch
    lines = text.splitlines() or [""]
    return ((max(map(len, lines)) * CHAR_EM + 2 * pad) * em / 2, (len(lines) * 1.2 + 2 * pad) * em / 2)


def fit_to_boxes(axes: Axes, centres: list[tuple[float, float]]) -> None:
    """Limits that hold every box and no more, one unit as long across as up."""
    xs, ys = [x for x, _ in centres], [y for _, y in centres]
    axes.set_xlim(min(xs) - BOX_MARGIN[0], max(xs) + BOX_MARGIN[0])
    axes.set_ylim(min(ys) - BOX_MARGIN[1], max(ys) + BOX_MARGIN[1])
    axes.set_aspect("equal")
