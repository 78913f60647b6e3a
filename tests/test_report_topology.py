"""`diloco report` of a run with regions: the topology picture and the links table; nothing new without regions."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from test_report import assert_png, parse, summary, write_run

from diloco.config import Topology, load_config
from diloco.report.report_cli import run
from diloco.report.link_figures import links_table, summary_links, total_bytes
from diloco.report.plots import write_run_plots
from diloco.report.run_records import load_run
from diloco.report.topology_picture import (clearance, homes, region_label, regions_config, ring_positions,
                                    topology_figure, wan_edges, wan_labels)
from diloco.results import LearnerReport, human_bytes, link_entry, links_from_learners, traffic_fields
from diloco.strategies import build_strategy

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "regions.toml"
"""Four regions of two learners; the syncer in us-east; ap-south's learners (6 and 7) at half speed."""
TINY_EXAMPLE = ["train.tokens=49152", "model.layers=1", "model.width=32"]


def regions_summary(*overrides: str) -> dict[str, Any]:
    """A summary of the example's regions whose links are counted as the real runtime counts them (each
    learner's bytes on every hop of its route, no busy shares): learner m sent (m + 1) MB and got 0.5 MB."""
    config = load_config(EXAMPLE, list(overrides))
    reports = [LearnerReport(learner=m, speed=speed, tokens=1024, steps=10, busy_s=9.0, waiting_s=0.0, down_s=0.0,
                             busy_fraction=0.9, crashes=0, tokens_lost=0.0, bytes_up=1_000_000 * (m + 1),
                             bytes_down=500_000)
               for m, speed in enumerate(config.speeds())]
    return summary(learners=len(reports), per_learner=[asdict(r) for r in reports], config=config.to_dict(),
                   **traffic_fields(links_from_learners(config, reports)))


def mesh_summary(*overrides: str) -> dict[str, Any]:
    """A summary of the example with `placement = "links"`, its links as the simulator lists them: each
    learner's LAN, and a WAN link between every region with learners and every other region homing
    fragments, named the way it is first used, carrying (k + 1) MB the way its name points and k MB back,
    busy for a few percent of the run each way."""
    config = load_config(EXAMPLE, ["placement=links", *overrides])
    homes = Topology(config).homes(build_strategy(config).fragments)
    topology = Topology(config)
    hops = [hop for r in config.regions if r.speeds for home in homes for hop in topology.region_route(r.name, home)]
    wan = [hop for i, hop in enumerate(hops) if all({hop.near, hop.far} != {h.near, h.far} for h in hops[:i])]
    lan = [hop for m in range(config.learners.count) for hop in Topology(config).route(m) if hop.kind == "lan"]
    links = [link_entry(hop, 1_000_000 * (k + 1), 1_000_000 * k, 0.01 * (k + 1), 0.001 * k)
             for k, hop in enumerate(lan + wan)]
    return summary(learners=config.learners.count, config=config.to_dict(), **traffic_fields(links))


def kind_tables(markdown: str) -> dict[str, list[list[str]]]:
    """The links tables by their first header (`WAN link`, `LAN link`), each as its body rows' cells."""
    tables = {}
    for block in markdown.split("\n\n"):
        lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in block.splitlines()]
        tables[lines[0][0]] = lines[2:]
    return tables


@pytest.mark.parametrize("topology", ["flat", "regional"])
def test_a_run_with_regions_gets_a_topology_figure(tmp_path: Path, topology: str) -> None:
    folder = write_run(tmp_path / "run", regions_summary(f"topology={topology}"))
    written = write_run_plots(folder)
    assert folder / "plots" / "topology.png" in written
    assert_png(folder / "plots" / "topology.png")


def test_a_run_without_regions_gets_no_topology_figure_and_no_links_table(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", summary())
    assert "topology.png" not in [p.name for p in write_run_plots(folder)]
    assert topology_figure(load_run(folder)) is None
    assert links_table(summary()) is None
    assert links_table(summary(links=[], lan_bytes=0, wan_bytes=0)) is None


def test_a_config_this_version_cannot_read_leaves_the_figure_out(tmp_path: Path) -> None:
    future = regions_summary()
    future["config"]["a_section_from_the_future"] = {"x": 1}
    assert regions_config(future) is None
    assert topology_figure(load_run(write_run(tmp_path / "run", future))) is None


def test_the_links_tables_totals_are_the_summarys_wan_and_lan_bytes() -> None:
    data = regions_summary()
    tables = kind_tables(links_table(data) or "")
    assert list(tables) == ["WAN link", "LAN link"]
    for kind, title, total in (("wan", "WAN link", data["wan_bytes"]), ("lan", "LAN link", data["lan_bytes"])):
        links, rows = summary_links(data, kind), tables[title]
        assert sum(total_bytes(links)) == total > 0
        assert [row[0] for row in rows] == [e["name"] for e in links] + ["total"]
        assert rows[-1][3] == human_bytes(total)  # bytes up+down
        assert rows[-1][1:3] == [human_bytes(n) for n in total_bytes(links)]
    # Outside the syncer's region, a learner's bytes cross its region's WAN link: 3+4, 5+6, 7+8 MB up.
    assert [row[:2] for row in tables["WAN link"][:-1]] == [
        ["us-west→us-east (WAN)", "7.00 MB"], ["eu-west→us-east (WAN)", "11.00 MB"],
        ["ap-south→us-east (WAN)", "15.00 MB"]]
    assert all(row[4:] == ["n/a", "n/a"] for row in tables["WAN link"][:-1])  # a real run measures no busy share


def test_each_region_shows_its_syncers_learners_and_lan_bytes() -> None:
    data = regions_summary()
    config = regions_config(data)
    assert config is not None
    links = {e["name"]: e for e in data["links"]}
    assert region_label(config, "us-east", links).splitlines() == [
        "us-east", "[syncer]", "learners 0–1, speed 1", "LAN: 4.00 MB"]  # (1 + 2) MB up, 2 x 0.5 MB down
    assert region_label(config, "ap-south", links).splitlines() == [
        "ap-south", "learners 6–7, speed 0.5", "LAN: 16.00 MB"]
    hop = next(hop for hop, _ in wan_edges(config, links, {}) if hop.near == "ap-south")
    assert wan_labels(hop, links["ap-south→us-east (WAN)"]) == ("→ us-east 15.00 MB", "→ ap-south 1.00 MB")

    tiered = regions_config(regions_summary("topology=regional"))
    assert tiered is not None and Topology(tiered).tiered
    assert region_label(tiered, "us-east", links).splitlines()[:3] == ["us-east", "[global syncer]",
                                                                        "[regional syncer]"]
    assert region_label(tiered, "eu-west", links).splitlines()[:2] == ["eu-west", "[regional syncer]"]


def test_the_command_prints_the_links_tables_after_the_runs_row(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_run(tmp_path / "run", regions_summary())
    assert run(parse(str(folder))) == 0
    printed = capsys.readouterr().out
    assert printed.index("| run | strategy |") < printed.index("| WAN link |") < printed.index("| LAN link |")
    assert f"wrote {folder / 'plots' / 'topology.png'}" in printed


@pytest.mark.integration  # a whole (tiny) training run in the simulator
def test_report_of_a_simulated_regions_run(tmp_path: Path) -> None:
    from diloco.sim import simulate

    data = json.loads(json.dumps(simulate(load_config(EXAMPLE, TINY_EXAMPLE)).summary()))
    folder = write_run(tmp_path / "sim-regions", data)
    assert folder / "plots" / "topology.png" in write_run_plots(folder)
    assert_png(folder / "plots" / "topology.png")
    tables = kind_tables(links_table(data) or "")
    assert tables["WAN link"][-1][3] == human_bytes(data["wan_bytes"])
    assert tables["LAN link"][-1][3] == human_bytes(data["lan_bytes"])
    assert all(re.fullmatch(r"<0\.1%|\d+\.\d%", cell) for row in tables["WAN link"][:-1] for cell in row[4:])


def test_with_placement_links_every_wan_link_is_an_edge_not_only_those_to_the_syncer() -> None:
    data = mesh_summary()
    config = regions_config(data)
    assert config is not None
    links = {e["name"]: e for e in data["links"]}
    edges = wan_edges(config, links, homes(config))
    assert sorted(hop.name for hop, _ in edges) == sorted(e["name"] for e in data["links"] if e["kind"] == "wan")
    assert any(Topology(config).syncer_region() not in (hop.near, hop.far) for hop, _ in edges)
    for hop, entry in edges:  # each way's label names where its bytes go, from the link's own name
        there, back = wan_labels(hop, entry)
        assert there.startswith(f"→ {hop.far} ") and back.startswith(f"→ {hop.near} ")
        assert entry is not None and human_bytes(entry["bytes_up"]) in there


def test_with_placement_links_each_box_says_how_many_fragments_its_region_homes() -> None:
    data = mesh_summary()
    config = regions_config(data)
    assert config is not None
    fragments = build_strategy(config).fragments
    homed = {r: Topology(config).fragment_homes(fragments).count(r) for r in Topology(config).homes(fragments)}
    assert homes(config) == homed and sum(homed.values()) == fragments
    for region in (r.name for r in config.regions):
        label = region_label(config, region, {}, homes(config))
        assert f"homes {homed.get(region, 0)} of {fragments} fragments" in label.splitlines()
    syncer_only = regions_config(regions_summary())
    assert syncer_only is not None
    assert not any("homes" in line for line in region_label(syncer_only, "us-east", {}, homes(syncer_only)).splitlines())


@pytest.mark.parametrize("overrides", [(), ("topology=regional",)])
def test_the_mesh_picture_keeps_every_label_clear_of_the_others_and_of_the_boxes(
        tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """Four regions on a ring, six WAN links (two of them crossing in the middle), two labels each: no
    two texts drawn overlap."""
    folder = write_run(tmp_path / "run", mesh_summary(*overrides))
    figure = topology_figure(load_run(folder))
    assert figure is not None
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [t.get_bbox_patch().get_window_extent(renderer) for t in figure.axes[0].texts]
    assert len(boxes) == 4 + 2 * 6
    overlapping = [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
    assert overlapping == []
    assert folder / "plots" / "topology.png" in write_run_plots(folder)


def test_a_region_on_the_ring_takes_the_top_and_clearance_measures_in_sizes() -> None:
    positions = ring_positions(["a", "b", "c", "d"], "c")  # then clockwise in their order
    assert [positions[name] for name in "cabd"] == [pytest.approx(p, abs=1e-9)
                                                    for p in ((0, 1), (1, 0), (0, -1), (-1, 0))]
    assert clearance((0, 0, 1, 1), [(3, 0, 1, 1)]) == pytest.approx(1.5)  # apart by half their sizes again
    assert clearance((0, 0, 1, 1), [(1, 0.5, 1, 1)]) < 1  # overlapping
