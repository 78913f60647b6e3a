"""`placement = "links"` in the real runtime: one global syncer shard per home region, each owning the
fragments the config homes there; a learner's traffic with each shard shaped and counted on its route to
that region, and the summary's links named, ordered and merged as the simulator lists them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import TINY, tiny_config
from diloco.config import Topology, load_config
from diloco.core.accounting import learner_tokens, ledger_of
from diloco.errors import DilocoError
from diloco.results import LearnerReport, links_from_learners, traffic_fields
from diloco.client.learner_client import Learner, LinkShape
from diloco.client.link import ShardWays
from diloco.shard.ownership import ShardPlan, fragment_owners, global_shard_plan, placed_shard_count
from diloco.shard.server import SyncerShard, serve
from diloco.strategies import build_strategy

EXAMPLE = "examples/regions.toml"
SMALL = [*(o for o in TINY if not o.startswith("learners.speeds")),  # the regions give the speeds
         "train.tokens=4096", "learners.step_time_s=0.05", "placement=links"]
"""examples/regions.toml (four regions, eight learners, four fragments) at a size two cores run quickly."""
TWO_BY_TWO = ('regions=[{name = "home", speeds = [1, 1], syncer = true, '
              'lan = {bandwidth_mbit = 1000, latency_ms = 1}, wan = {bandwidth_mbit = 20, latency_ms = 30}}, '
              '{name = "away", speeds = [1, 1], lan = {bandwidth_mbit = 1000, latency_ms = 1}, '
              'wan = {bandwidth_mbit = 20, latency_ms = 30}}]')


def example(*overrides: str):
    return load_config(EXAMPLE, [*SMALL, *overrides])


# ---------------------------------------------------------------- who owns what


def test_each_home_region_gets_one_shard_owning_exactly_its_fragments():
    config = example()
    count = build_strategy(config).fragments
    homes, fragment_homes = Topology(config).homes(count), Topology(config).fragment_homes(count)
    owners = fragment_owners(config)
    assert placed_shard_count(config, 1) == len(homes) == max(owners) + 1
    for i, home in enumerate(homes):
        plan = global_shard_plan(config, i, len(homes), ("",) * len(homes))
        assert plan.fragments(count) == [p for p in range(count) if fragment_homes[p] == home]
    # The default placement: the modulo rule, any number of shards, as before.
    default = example("placement=syncer")
    assert fragment_owners(default) is None and placed_shard_count(default, 3) == 3
    assert global_shard_plan(default, 1, 3, ("",) * 3) == ShardPlan(1, 3, ("",) * 3)


def test_a_shard_count_other_than_one_per_home_region_is_refused_in_one_line():
    config = example()
    for refused in (lambda: placed_shard_count(config, 2), lambda: global_shard_plan(config, 0, 2, ("", ""))):
        with pytest.raises(DilocoError) as error:
            refused()
        assert "placement" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.integration
def test_a_learner_refuses_a_shard_map_that_disagrees_with_its_config():
    """The shard owns both fragments (one shard, the modulo rule); a learner whose config homes them in
    two shards is refused with one line, and leaves the shard it joined."""
    shard = SyncerShard(tiny_config("outer.fragments=2", "learners.count=2"), ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        with pytest.raises(DilocoError) as error:
            Learner(model, syncer=address, learner=0, owners=[0, 1])
        message = str(error.value)
        assert "disagrees" in message and "\n" not in message
        assert "shard 0: fragments [0, 1]" in message and "shard 1: fragments [1]" in message
        assert shard.left == {0}  # refused: not counted as alive
        agreeing = Learner(model, syncer=address, learner=1, owners=[0, 0])
        assert [s.fragments for s in agreeing.shards] == [[0, 1]]
        agreeing.close()
    finally:
        shard.stop()
        server.stop(0)


# ---------------------------------------------------------------- shaping and counting per home


def test_each_shard_has_its_own_way_and_a_progress_report_crosses_each_once():
    ways = ShardWays([LinkShape(1000, 1), None, LinkShape(10, 50)], per_shard=True)
    ways.to(0).send(100)
    ways.to(2).send(300)
    arrive = ways.send_to_each(10, [0, 1, 2])
    assert [w.bytes_sent for w in ways.ways] == [110, 10, 310]
    assert arrive[2] > arrive[0]  # each shard's copy arrives over its own way
    assert (ways.bytes_sent, ways.messages, ways.peak_message_bytes) == (430, 5, 300)
    shared = ShardWays([None], per_shard=False)  # every shard in one place: one way, as before
    shared.to(3).send(100)
    arrive = shared.send_to_each(10, [0, 3])
    assert (shared.bytes_sent, shared.messages) == (110, 2) and arrive[0] == arrive[3]


def report(m: int, up: int, down: int) -> LearnerReport:
    return LearnerReport(learner=m, speed=1.0, tokens=0, steps=0, busy_s=0.0, waiting_s=0.0, down_s=0.0,
                         busy_fraction=1.0, crashes=0, tokens_lost=0.0, bytes_up=up, bytes_down=down)


def test_a_wan_link_used_both_ways_is_listed_once_named_as_first_used():
    """Learner 0 (home) sends to away's shard over home→away; learner 2 (away) to home's over away→home:
    the same link, its other direction."""
    config = tiny_config(TWO_BY_TWO)  # per-home bytes name their homes: the routes alone matter here
    by_home = {0: {"home": (10, 1), "away": (20, 2)}, 2: {"home": (300, 30), "away": (400, 40)}}
    links = traffic_fields(links_from_learners(config, [report(0, 30, 3), report(2, 700, 70)], by_home))
    assert [(e["name"], e["bytes_up"], e["bytes_down"]) for e in links["links"]] == [
        ("learner 0 LAN", 30, 3), ("learner 2 LAN", 700, 70), ("home→away (WAN)", 20 + 30, 2 + 300)]
    assert (links["lan_bytes"], links["wan_bytes"]) == (803, 352)
    # Without per-home bytes, everything goes to the syncer's region, as before.
    plain = links_from_learners(config, [report(2, 700, 70)])
    assert [(e["name"], e["bytes_up"], e["bytes_down"]) for e in plain] == [
        ("learner 2 LAN", 700, 70), ("away→home (WAN)", 700, 70)]


# ---------------------------------------------------------------- diloco run against diloco sim


@pytest.mark.integration
def test_diloco_run_homes_fragments_per_region_and_lists_the_simulators_links(tmp_path):
    overrides = [x for o in SMALL for x in ("--set", o)]
    outs = {kind: tmp_path / kind for kind in ("run", "sim")}
    for kind, out in outs.items():
        done = subprocess.run([sys.executable, "-m", "diloco", kind, EXAMPLE, *overrides, "--out", str(out), "-q"],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    run, sim = (json.loads((out / "summary.json").read_text()) for out in outs.values())
    config = example()
    count = build_strategy(config).fragments
    homes, fragment_homes = Topology(config).homes(count), Topology(config).fragment_homes(count)
    assert len(homes) > 1  # the example spreads its fragments
    # One shard per home region, each owning the fragments homed there.
    shards = json.loads((outs["run"] / "syncer" / "shards.json").read_text())
    assert run["shards"] == len(shards) == len(homes)
    assert {s["shard"]: s["fragments"] for s in shards} == \
        {i: [p for p in range(count) if fragment_homes[p] == home] for i, home in enumerate(homes)}
    # Every token accounted: trained = merged + stale + lost, none counted twice.
    numel = {int(p): n for s in shards for p, n in s["fragment_numel"].items()}
    for r in run["per_learner"]:
        tokens = learner_tokens(r["tokens"], *ledger_of(shards, r["learner"]), numel)
        assert tokens["counted_twice"] == 0, r["learner"]
    assert run["tokens_merged"] + run["tokens_stale"] + run["tokens_lost"] == pytest.approx(run["tokens"])
    # The same links as the simulator's, in its order; every WAN link it uses carries bytes here too.
    assert [(e["name"], e["kind"]) for e in run["links"]] == [(e["name"], e["kind"]) for e in sim["links"]]
    used = {e["name"] for e in sim["links"] if e["kind"] == "wan" and e["bytes_up"] + e["bytes_down"] > 0}
    assert used and all(e["bytes_up"] > 0 and e["bytes_down"] > 0 for e in run["links"] if e["name"] in used)
    assert run["wan_bytes"] == sum(e["bytes_up"] + e["bytes_down"] for e in run["links"] if e["kind"] == "wan") > 0
    # A learner's LAN carries all of its traffic; what it sent to each home adds up to its totals.
    lan = {e["name"]: (e["bytes_up"], e["bytes_down"]) for e in run["links"] if e["kind"] == "lan"}
    for r in run["per_learner"]:
        assert lan[f"learner {r['learner']} LAN"] == (r["bytes_up"], r["bytes_down"])
        own = json.loads((outs["run"] / "learners" / f"learner-{r['learner']}.json").read_text())
        assert set(own["bytes_by_home"]) == set(homes)
        assert sum(h["bytes_up"] for h in own["bytes_by_home"].values()) == own["bytes_up"]
        assert sum(h["bytes_down"] for h in own["bytes_by_home"].values()) == own["bytes_down"]
    assert run["lan_bytes"] == sum(r["bytes_up"] + r["bytes_down"] for r in run["per_learner"])


def sim_link_names(config) -> list[str]:
    """The links the simulator lists for `config`, in its order: its network, built as its driver does."""
    from diloco.network.links import Network

    network = Network(config)
    homes = Topology(config).fragment_homes(build_strategy(config).fragments)
    for m in range(config.learners.count):
        network.learner_link(m, [], homes)
    for region in Topology(config).tier_regions():
        network.region_link(region.name, homes)
    return sorted((e["name"] for e in network.link_entries(run_s=1.0)), key=lambda name: "LAN" not in name)


@pytest.mark.integration
def test_regional_syncers_send_each_fragment_up_to_its_home_region(tmp_path):
    """With the regional tier, each region's syncer has a way to every home region: its pushes of a
    fragment go to that fragment's home, its progress to every home, each counted on its own WAN link."""
    config = example("topology=regional")
    count = build_strategy(config).fragments
    homes, fragment_homes = Topology(config).homes(count), Topology(config).fragment_homes(count)
    overrides = [x for o in [*SMALL, "topology=regional"] for x in ("--set", o)]
    done = subprocess.run([sys.executable, "-m", "diloco", "run", EXAMPLE, *overrides, "--out", str(tmp_path), "-q"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    shards = json.loads((tmp_path / "syncer" / "shards.json").read_text())
    regions = json.loads((tmp_path / "syncer" / "regions.json").read_text())
    assert {s["shard"]: s["fragments"] for s in shards} == \
        {i: [p for p in range(count) if fragment_homes[p] == home] for i, home in enumerate(homes)}
    # Every token: merged by its region's syncer (and sent up) or lost, none twice.
    numel = {int(p): n for s in shards for p, n in s["fragment_numel"].items()}
    for r in summary["per_learner"]:
        assert learner_tokens(r["tokens"], *ledger_of(regions, r["learner"]), numel)["counted_twice"] == 0
    assert summary["tokens_merged"] + summary["tokens_stale"] + summary["tokens_lost"] == \
        pytest.approx(summary["tokens"])
    # The simulator's links; the WAN ones carry what the uplinks sent to homes in other regions.
    assert [e["name"] for e in summary["links"]] == sim_link_names(config)
    away = 0
    for region in regions:
        by_home = region["uplink"]["bytes_by_home"]
        assert set(by_home) == set(homes)
        assert sum(h["bytes_up"] for h in by_home.values()) == region["uplink"]["bytes_up"]
        away += sum(h["bytes_up"] + h["bytes_down"] for home, h in by_home.items() if home != region["region"])
    assert summary["wan_bytes"] == away > 0
    lan = {e["name"]: e["bytes_up"] + e["bytes_down"] for e in summary["links"] if e["kind"] == "lan"}
    assert lan == {f"learner {r['learner']} LAN": r["bytes_up"] + r["bytes_down"] for r in summary["per_learner"]}
