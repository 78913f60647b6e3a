"""Link-aware placement (`placement = "links"`): where fragments' home shards run, and the simulator's
routing of each fragment's pushes and answers to its home."""

from __future__ import annotations

import itertools

import pytest

from conftest import tiny_config
from diloco.config import Topology, config_from_dict, load_config
from diloco.errors import ConfigError
from diloco.network.homes import Site, loads, place
from diloco.sim import simulate
from diloco.network.links import Direction, Fanout, Network, Route
from diloco.virtual_run.push_order import InOrder

TWO_BY_TWO = ('regions=[{name = "home", speeds = [1, 1], syncer = true, '
              'lan = {bandwidth_mbit = 1000, latency_ms = 1}, wan = {bandwidth_mbit = 20, latency_ms = 30}}, '
              '{name = "away", speeds = [1, 1], lan = {bandwidth_mbit = 1000, latency_ms = 1}, '
              'wan = {bandwidth_mbit = 20, latency_ms = 30}}]')


def site(name: str, rate: float, others: dict[str, tuple[float, float]]) -> Site:
    """A region sending at `rate`, with (bandwidth, latency) towards each other region."""
    return Site(name, rate, {o: bw for o, (bw, _) in others.items()}, {o: ms for o, (_, ms) in others.items()})


def triangle() -> list[Site]:
    """Three regions: a big one, a small one, and one behind a slow link."""
    return [site("big", 4, {"small": (1000, 30), "far": (1000, 80)}),
            site("small", 1, {"big": (1000, 30), "far": (1000, 60)}),
            site("far", 2, {"big": (250, 80), "small": (250, 60)})]


# ---------------------------------------------------------------- the placement


def test_one_region_homes_everything_and_a_tie_goes_to_the_syncers_region():
    assert place([site("solo", 2, {})], 3) == ["solo"] * 3
    twins = [site("a", 1, {"b": (100, 10)}), site("b", 1, {"a": (100, 10)})]
    assert place(twins, 1, preferred="b") == ["b"]
    assert place(twins, 1, preferred="a") == ["a"]
    # Answers as large as pushes: each direction carries as much with the homes in one region as split,
    # so the tie keeps them together. Answers 4x larger load the direction out of the homes' region most:
    # splitting them evens out the two directions.
    assert place(twins, 4, preferred="a") == ["a"] * 4
    assert place(twins, 4, preferred="a", answer_ratio=4.0) == ["a", "b", "a", "b"]


@pytest.mark.parametrize("answer_ratio", [1.0, 4.0])
def test_the_links_are_as_light_as_any_placement_of_four_fragments_allows(answer_ratio):
    """Against every one of the 81 placements: none leaves the busiest WAN direction less busy, nor (of
    those as light) the next busiest, and so on."""
    sites = triangle()
    names = [s.name for s in sites]

    def busiest_first(homes) -> list[float]:
        return sorted(loads(sites, {n: list(homes).count(n) for n in names}, answer_ratio).values(), reverse=True)

    chosen = place(sites, 4, preferred="big", answer_ratio=answer_ratio)
    assert busiest_first(chosen) == min(busiest_first(h) for h in itertools.product(names, repeat=4))
    # Better than homing all in any one region, the default's shape.
    assert all(busiest_first(chosen)[0] < busiest_first([n] * 4)[0] for n in names)


def test_equal_regions_home_equal_shares_interleaved():
    config = load_config("examples/regions.toml", ["placement=links", "topology=regional"])
    assert Topology(config).fragment_homes(8) == ["us-east", "us-west", "eu-west", "ap-south"] * 2


def test_a_placement_is_the_same_everywhere_it_is_computed():
    """Every shard and learner derives it from the config alone: the same result each time."""
    config = load_config("examples/regions.toml", ["placement=links", "outer.fragments=8"])
    homes = Topology(config).fragment_homes(8)
    again = load_config("examples/regions.toml", ["placement=links", "outer.fragments=8"])
    assert homes == Topology(again).fragment_homes(8)
    assert set(homes) == {"us-east", "us-west", "eu-west", "ap-south"} and Topology(config).homes(8) == \
        ["us-east", "us-west", "eu-west", "ap-south"]
    default = Topology(load_config("examples/regions.toml"))
    assert default.fragment_homes(8) == ["us-east"] * 8  # the default: the syncer's


@pytest.mark.parametrize("overrides, message", [
    (["placement=links"], "placement' may be 'links' only with [[regions]]"),
    (["placement=links", "strategy=ddp", TWO_BY_TWO], "must be 'syncer' for ddp"),
    (["placement=nearest", TWO_BY_TWO], "must be one of syncer, links"),
])
def test_a_bad_placement_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        tiny_config(*overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


# ---------------------------------------------------------------- a sender's ways to its homes


def two_ways() -> tuple[Fanout, Direction, Direction]:
    near, far = Direction(8e9, 0.001), Direction(8e6, 0.050)  # 1 GB/s, 1 MB/s
    return Fanout({"near": Route([near]), "far": Route([far])}, ["near", "far", "near"]), near, far


def test_a_fragments_message_takes_the_way_to_its_home_and_one_for_all_takes_every_way():
    fanout, near, far = two_ways()
    assert fanout.send(0.0, 1_000_000, fragment=2) == pytest.approx(0.001 + 0.001)
    assert (near.bytes_sent, far.bytes_sent) == (1_000_000, 0)
    assert fanout.send(0.0, 1_000_000, fragment=1) == pytest.approx(1.0 + 0.050)
    assert far.bytes_sent == 1_000_000
    # A progress report goes to both homes; it has arrived when the far one has it (behind the 1 MB there).
    assert fanout.send(0.0, 100) == pytest.approx(1.0 + 100 / 1e6 + 0.050)
    assert (near.bytes_sent, far.bytes_sent, fanout.bytes_sent) == (1_000_100, 1_000_100, 2_000_200)


def test_theta_for_a_joining_sender_comes_from_each_home_its_own_fragments():
    fanout, near, far = two_ways()
    fanout.send_split(0.0, {0: 300, 1: 500, 2: 200})
    assert (near.bytes_sent, near.messages, far.bytes_sent, far.messages) == (500, 1, 500, 1)
    assert fanout.bytes_sent == 1000


# ---------------------------------------------------------------- the simulator


@pytest.mark.integration
@pytest.mark.parametrize("topology", ["flat", "regional"])
def test_spreading_the_homes_lightens_the_busiest_wan_direction_and_accounts_every_token(topology):
    """Two equal regions, two fragments, int8 pushes and fp32 answers: with the syncer's region homing both,
    the direction out of it carries all of the other region's (large) answers; with one fragment homed in
    each, each direction carries half of the answers and half of the pushes."""
    common = [TWO_BY_TWO, "outer.fragments=2", f"topology={topology}", "train.tokens=20480", "codec.up=int8"]
    runs = {p: simulate(tiny_config(*common, f"placement={p}")) for p in ("syncer", "links")}
    config = tiny_config(*common, "placement=links")
    assert Topology(config).fragment_homes(2) == ["home", "away"]
    for result in runs.values():
        assert result.tokens_merged + result.tokens_stale + result.tokens_lost == pytest.approx(result.tokens)
        # No crash: nothing lost, and no push that overtook an earlier one on another route taken for a retry.
        assert (result.tokens_lost, result.duplicates) == (0, 0)
        assert [e["name"] for e in result.links if e["kind"] == "wan"] in (["away→home (WAN)"], ["home→away (WAN)"])

    def busiest(result) -> float:
        wan = next(e for e in result.links if e["kind"] == "wan")
        return max(wan["utilisation_up"], wan["utilisation_down"])

    spread, together = runs["links"], runs["syncer"]
    wan = next(e for e in spread.links if e["kind"] == "wan")
    assert wan["bytes_up"] > 0 and wan["bytes_down"] > 0
    assert busiest(spread) < 0.75 * busiest(together)
    if topology == "flat":  # a learner's LAN carries all of its traffic, wherever its fragments' homes are
        assert spread.lan_bytes == sum(r.bytes_up + r.bytes_down for r in spread.per_learner)


def test_the_default_placement_leaves_a_run_as_it_was():
    """`placement = "syncer"` is the layout runs had before placement existed: one way per sender."""
    config = config_from_dict({"placement": "syncer"})
    assert Topology(config).fragment_homes(4) == [] and Topology(config).homes(4) == []


def test_homes_all_in_one_region_that_is_not_the_syncers_are_routed_there():
    network = Network(tiny_config(TWO_BY_TWO))
    ways = network.learner_link(0, [], home_of=["away", "away"]).up.ways
    assert list(ways) == ["away"] and [h.hop.name for h in network.hops.values()] == \
        ["learner 0 LAN", "home→away (WAN)"]


def test_with_the_regional_tier_a_learner_has_one_way_to_its_regions_syncer_whatever_the_homes():
    network = Network(tiny_config(TWO_BY_TWO, "topology=regional", "placement=links"))
    assert list(network.learner_link(2, [], home_of=["home", "away"]).up.ways) == [""]
    assert sorted(network.region_link("away", home_of=["home", "away"]).up.ways) == ["away", "home"]


def test_a_push_that_overtakes_an_earlier_one_waits_for_it():
    order: InOrder[str] = InOrder()
    for seq in (1, 2, 3):
        order.sent(7, seq)
    assert order.arrived(7, 2, "second") == [] and order.holding == 1  # 1 is still on its way
    assert order.arrived(7, 1, "first") == ["first", "second"]
    assert order.arrived(7, 3, "third") == ["third"] and order.holding == 0
    assert order.arrived(8, 5, "unannounced") == ["unannounced"]  # another sender's, not tracked: at once
