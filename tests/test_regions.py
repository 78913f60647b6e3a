"""Regions: the config that places learners and the syncer, the simulator's links (a LAN link per learner,
WAN links shared by a region's learners), regional outages, and the LAN/WAN bytes both drivers report."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys

import pytest

from conftest import TINY, computed, tiny_config
from diloco.config import Topology, config_from_dict
from diloco.errors import ConfigError
from diloco.results import links_from_learners, traffic_fields
from diloco.sim import simulate
from diloco.sim.driver import Simulation
from diloco.network.links import Direction, Network, Route

LAN = {"bandwidth_mbit": 8000, "latency_ms": 1}  # 1e9 bytes/s
WAN = {"bandwidth_mbit": 8, "latency_ms": 10}  # 1e6 bytes/s

REGIONS = [
    {"name": "us", "speeds": [1], "syncer": True, "lan": dict(LAN), "wan": dict(WAN)},
    {"name": "eu", "speeds": [1, 0.5], "lan": dict(LAN), "wan": dict(WAN),
     "wan_to": [{"region": "us", "latency_ms": 40}]},
]


def regions_config(regions=None, **sections):
    return config_from_dict({"regions": copy.deepcopy(REGIONS if regions is None else regions), **sections})


def inline(regions: list[dict]) -> str:
    """`--set regions=[...]`: the regions as one TOML inline array."""
    def value(v):
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)
    return f"regions={value(regions)}"


# ---------------------------------------------------------------- config


def test_regions_set_the_learners_in_region_order_and_their_routes():
    config = regions_config()
    assert (config.learners.count, config.learners.speeds) == (3, [1.0, 1.0, 0.5])
    assert [Topology(config).region_of(m) for m in range(4)] == ["us", "eu", "eu", None]
    assert list(Topology(config).learners_of("eu")) == [1, 2] and Topology(config).syncer_region() == "us"
    assert [h.name for h in Topology(config).route(0)] == ["learner 0 LAN"]  # the syncer's region: its LAN alone
    lan, wan = Topology(config).route(2)
    assert (lan.name, lan.kind, wan.name, wan.kind) == ("learner 2 LAN", "lan", "eu→us (WAN)", "wan")
    # eu→us is eu's override (its bandwidth left out: eu's default WAN); us→eu is us's default WAN.
    assert (wan.up.bandwidth_mbit, wan.up.latency_ms) == (8, 40)
    assert (wan.down.bandwidth_mbit, wan.down.latency_ms) == (8, 10)
    # The real runtime's one emulated link: the slowest hop, the latencies summed.
    assert (Topology(config).emulated_link(2).bandwidth_mbit, Topology(config).emulated_link(2).latency_ms) == (8, 41)
    assert Topology(config).emulated_link(0).latency_ms == 1 and Topology(config).emulated_link(None) is config.link


def test_without_regions_nothing_changes():
    config = config_from_dict({})
    assert config.regions == [] and Topology(config).route(0) == [] and Topology(config).region_of(0) is None
    assert Topology(config).emulated_link(0) is config.link


def test_a_region_that_leaves_out_its_links_takes_link():
    config = regions_config([{"name": "a", "speeds": [1], "syncer": True}, {"name": "b", "speeds": [1],
                                                                           "wan": {"latency_ms": 7}}],
                            link={"bandwidth_mbit": 3, "latency_ms": 5})
    a, b = config.regions
    assert (a.lan.bandwidth_mbit, a.lan.latency_ms, b.wan.bandwidth_mbit, b.wan.latency_ms) == (3, 5, 3, 7)


def test_learners_may_repeat_what_regions_say():
    assert regions_config(learners={"speeds": [1, 1, 0.5], "count": 3}).learners.count == 3
    equal = [{"name": "a", "speeds": [1, 1], "syncer": True}]
    assert regions_config(equal, learners={"speeds": []}).learners.speeds == [1.0, 1.0]  # [] is "all 1"


@pytest.mark.parametrize("learners, message", [
    ({"speeds": [1, 1, 1]}, "config key 'learners.speeds' must be the regions' speeds [1.0, 1.0, 0.5]"),
    ({"speeds": []}, "config key 'learners.speeds' must be the regions' speeds"),
    ({"count": 4}, "config key 'learners.count' must be 3, the regions' learners"),
])
def test_learners_that_contradict_the_regions_are_refused(learners, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        regions_config(learners=learners)


def changed(path: str, value) -> list[dict]:
    """REGIONS with one value changed, e.g. `1.wan_to.0.region`."""
    regions = copy.deepcopy(REGIONS)
    *parents, last = path.split(".")
    node = regions
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return regions


@pytest.mark.parametrize("regions, message", [
    (changed("1.name", ""), "config key 'regions[1].name' must not be empty"),
    (changed("1.name", "us"), "config key 'regions[1].name' must be unique (regions[0] has it too)"),
    (changed("0.speeds", [1, 0]), "config key 'regions[0].speeds[1]' must be positive"),
    (changed("0.lan.bandwidth_mbit", 0), "config key 'regions[0].lan.bandwidth_mbit' must be positive"),
    (changed("1.wan.latency_ms", -1), "config key 'regions[1].wan.latency_ms' must be zero or positive"),
    (changed("1.wan_to.0.bandwidth_mbit", -5), "config key 'regions[1].wan_to[0].bandwidth_mbit' must be positive"),
    (changed("1.wan_to.0.region", "mars"), "config key 'regions[1].wan_to[0].region' must name another region "
                                           "than 'eu' (known: us, eu); got 'mars'"),
    (changed("1.wan_to.0.region", "eu"), "config key 'regions[1].wan_to[0].region' must name another region"),
    (changed("1.wan_to", [{"region": "us"}, {"region": "us"}]),
     "config key 'regions[1].wan_to[1].region' must not repeat an earlier entry"),
    (changed("0.syncer", False), "config key 'regions' must have exactly one region with syncer = true; got []"),
    (changed("1.syncer", True), "config key 'regions' must have exactly one region with syncer = true; "
                                "got ['us', 'eu']"),
    (changed("1.wan.bandwidth_mbit", math.inf), "config key 'regions[1].wan.bandwidth_mbit' must be a finite"),
    ([{"name": "a", "syncer": True}], "config key 'regions' must give at least one learner"),
    (changed("0.speed", [1]), "unknown config key 'regions[0].speed'"),
    (changed("1.wan_to.0.to", "us"), "unknown config key 'regions[1].wan_to[0].to'"),
])
def test_bad_regions_are_refused_naming_the_key(regions, message):
    with pytest.raises(ConfigError) as refused:
        regions_config(regions)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.parametrize("outage, regions, message", [
    ({"region": "mars", "at_s": 1, "duration_s": 1}, REGIONS,
     "config key 'failures.outages[0].region' must name a region (known: us, eu); got 'mars'"),
    ({"region": "eu", "at_s": 1, "duration_s": 1}, [],
     "config key 'failures.outages[0].region' must name a region (no regions are configured)"),
    ({"region": "eu", "learner": 1, "at_s": 1, "duration_s": 1}, REGIONS,
     "config key 'failures.outages[0]' names a learner and a region: give one"),
])
def test_bad_regional_outages_are_refused(outage, regions, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        config_from_dict({"regions": copy.deepcopy(regions), "failures": {"outages": [outage]}})


def test_the_example_config_loads():
    from diloco.config import load_config

    config = load_config("examples/regions.toml")
    assert config.learners.count == 8 and len(config.regions) == 4 and Topology(config).syncer_region() == "us-east"
    assert config.learners.speeds[6:] == [0.5, 0.5]


# ---------------------------------------------------------------- links


def test_a_route_is_store_and_forward():
    first, second = Direction(8e6, 0.25), Direction(16e6, 0.5)  # 1 MB/s, 2 MB/s
    route = Route([first, second])
    # 1 MB: 1 s on the first hop and its latency, then 0.5 s on the second and its latency.
    assert route.send(0.0, 1_000_000) == pytest.approx(1 + 0.25 + 0.5 + 0.5)
    # A heartbeat sent now stays behind that message on every hop, taking no time of its own.
    assert route.signal(0.0) == pytest.approx(1 + 0.25 + 0.5 + 0.5)
    assert (route.bandwidth_bps, route.latency_s) == (8e6, 0.75)
    assert [d.bytes_sent for d in (route, first, second)] == [1_000_000] * 3


def test_learners_of_a_region_queue_behind_each_other_on_its_wan_link():
    network = Network(regions_config())
    one, two = network.learner_link(1, []), network.learner_link(2, [])
    assert one.up.only.hops[1] is two.up.only.hops[1] and one.up.only.hops[0] is not two.up.only.hops[0]  # shared WAN, own LAN
    lan_s = 1e6 / 1e9 + 0.001  # 1 MB over the LAN and its latency
    first = one.up.send(0.0, 1_000_000)
    second = two.up.send(0.0, 1_000_000)
    assert first == pytest.approx(lan_s + 1.0 + 0.040)  # 1 s on the 1 MB/s WAN, eu→us latency 40 ms
    assert second == pytest.approx(lan_s + 2.0 + 0.040)  # waited for the first on the WAN, not on its LAN
    # Back: over us→eu's WAN first (10 ms), then the learner's LAN.
    assert one.down.send(0.0, 1_000_000) == pytest.approx(1.0 + 0.010 + lan_s)
    assert (one.up.bytes_sent, two.up.bytes_sent, one.up.only.hops[1].bytes_sent) == (1_000_000, 1_000_000, 2_000_000)
    entries = {e["name"]: e for e in network.link_entries(run_s=4.0)}
    assert entries["eu→us (WAN)"]["utilisation_up"] == pytest.approx(0.5)  # busy 2 s of 4
    assert entries["eu→us (WAN)"]["bytes_down"] == 1_000_000


def test_a_message_held_up_on_its_lan_does_not_hold_the_shared_wan_and_a_sender_keeps_its_order():
    network = Network(regions_config())
    cut, other = network.learner_link(1, [(0.0, 5.0)]), network.learner_link(2, [])
    assert cut.up.send(0.0, 1_000_000) > 6.0  # its LAN is down until 5 s, then 1 s on the WAN
    # The other learner's message reaches the WAN long before: it goes at once, not behind the first.
    assert other.up.send(0.0, 1000) < 0.1
    # 6 MB do not fit before the booked message: after it. A small message sent next would fit in the
    # gap, but does not overtake its sender's own.
    big = other.up.send(0.1, 6_000_000)
    assert big > 12.0 and other.up.send(0.2, 1000) > big


# ---------------------------------------------------------------- the simulator

TWO_BY_TWO = [{"name": "home", "speeds": [1, 1], "syncer": True, "lan": {"bandwidth_mbit": 1000, "latency_ms": 1},
               "wan": {"bandwidth_mbit": 20, "latency_ms": 30}},
              {"name": "away", "speeds": [1, 1], "lan": {"bandwidth_mbit": 1000, "latency_ms": 1},
               "wan": {"bandwidth_mbit": 20, "latency_ms": 30}}]


@pytest.mark.integration
def test_one_region_holding_the_syncer_runs_exactly_as_no_regions():
    """A single region whose LAN is `link`: the same links, so the same run, number for number."""
    plain = ["learners.speeds=[1, 0.5]", "learners.jitter=0.2", "link.bandwidth_mbit=5", "link.latency_ms=20",
             "failures.outages=[{learner = 1, at_s = 2, duration_s = 3}]"]
    one_region = inline([{"name": "solo", "speeds": [1, 0.5], "syncer": True,
                          "lan": {"bandwidth_mbit": 5, "latency_ms": 20}}])
    without = simulate(tiny_config(*plain)).summary()
    within = simulate(tiny_config(*plain, "learners.speeds=[1, 0.5]", one_region)).summary()
    assert (without["lan_bytes"], without["wan_bytes"], without["links"]) == (0, 0, [])
    assert within["lan_bytes"] == within["wire_bytes_up"] + within["wire_bytes_down"] and within["wan_bytes"] == 0
    differing = {"config", "links", "lan_bytes"}
    assert {k: v for k, v in computed(without).items() if k not in differing} == \
        {k: v for k, v in computed(within).items() if k not in differing}


@pytest.mark.integration
def test_every_links_bytes_are_its_learners_bytes():
    config = tiny_config(inline(TWO_BY_TWO), "learners.jitter=0.2")
    result = Simulation(config).run()
    by_learners = traffic_fields(links_from_learners(config, result.per_learner))  # the runtime's rule
    assert (result.lan_bytes, result.wan_bytes) == (by_learners["lan_bytes"], by_learners["wan_bytes"])
    assert [{k: e[k] for k in ("name", "kind", "bytes_up", "bytes_down")} for e in result.links] == \
        [{k: e[k] for k in ("name", "kind", "bytes_up", "bytes_down")} for e in by_learners["links"]]
    assert [e["name"] for e in result.links] == [f"learner {m} LAN" for m in range(4)] + ["away→home (WAN)"]
    wire = {r.learner: r.bytes_up + r.bytes_down for r in result.per_learner}
    assert result.lan_bytes == sum(wire.values())
    assert result.wan_bytes == wire[2] + wire[3]
    assert all(0 < e["utilisation_up"] < 1 and 0 < e["utilisation_down"] < 1 for e in result.links)
    wan = result.links[-1]
    assert wan["utilisation_up"] > result.links[2]["utilisation_up"]  # carries two learners, 50x slower


@pytest.mark.integration
def test_a_regional_outage_crashes_its_learners_until_it_ends_and_spares_the_others():
    """Taking Θ alone, the away region's learners lose what they had not pushed; resuming their own
    progress (the default), they lose no more than that."""
    lost = {}
    for resume in ("theta", "own"):
        config = tiny_config(inline(TWO_BY_TWO), "failures.outages=[{region = \"away\", at_s = 2, duration_s = 3}]",
                             "failures.recovery_s=30", f"failures.resume={resume}")
        result = simulate(config)
        home, away = result.per_learner[:2], result.per_learner[2:]
        assert [r.crashes for r in home] == [0, 0] and [r.down_s for r in home] == [0, 0]
        for r in away:
            # Down for the outage (not recovery_s), then Θ's download over the WAN; back and finished.
            assert r.crashes == 1 and 3 <= r.down_s < 4
        lost[resume] = [r.tokens_lost for r in away]
        assert result.tokens_merged + result.tokens_stale + result.tokens_lost == pytest.approx(result.tokens)
    assert all(t > 0 for t in lost["theta"])
    assert all(own <= theta for own, theta in zip(lost["own"], lost["theta"])), lost


@pytest.mark.integration
def test_a_learner_already_down_stays_down_until_its_region_is_back():
    config = tiny_config(inline(TWO_BY_TWO), "failures.crashes=[{learner = 3, at_s = 1}]", "failures.recovery_s=2",
                         "failures.outages=[{region = \"away\", at_s = 2, duration_s = 4}]")
    learner = simulate(config).per_learner[3]
    assert learner.crashes == 1 and 5 <= learner.down_s < 6  # from 1 s to the region's return at 6 s


# ---------------------------------------------------------------- the real runtime


@pytest.mark.integration
def test_a_real_run_counts_each_learners_bytes_on_the_links_of_its_route(tmp_path):
    regions = [{"name": "home", "speeds": [1], "syncer": True}, {"name": "away", "speeds": [1]}]
    overrides = [*TINY, inline(regions), "train.tokens=5120"]
    done = subprocess.run([sys.executable, "-m", "diloco", "run", *(x for o in overrides for x in ("--set", o)),
                           "--out", str(tmp_path), "-q"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    wire = {r["learner"]: r["bytes_up"] + r["bytes_down"] for r in summary["per_learner"]}
    assert wire[0] > 0 and wire[1] > 0
    assert summary["lan_bytes"] == wire[0] + wire[1] and summary["wan_bytes"] == wire[1]
    assert [(e["name"], e["kind"], e["bytes_up"] + e["bytes_down"]) for e in summary["links"]] == \
        [("learner 0 LAN", "lan", wire[0]), ("learner 1 LAN", "lan", wire[1]), ("away→home (WAN)", "wan", wire[1])]
