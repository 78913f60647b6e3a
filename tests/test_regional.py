"""The regional tier (`topology = "regional"`): a syncer per region between its learners and the global syncer.

What must hold: one push per region instead of one per learner over the WAN at the same loss; every token
trained is merged exactly once through both tiers, or counted lost (a regional outage loses what its syncer
merged and had not sent up, and nothing of the other regions); a round pushed up holds its learners'
answers until the global answer is merged (bounded by a timer, released by a refusal); the global syncer
checks a region's counters as any learner's, with the region's declared burst; and the config refuses what
the tier cannot run. Here: simulated runs of the example, and the config; the cores by hand are in
test_regional_core.py.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import TINY
from diloco.config import Topology, load_config
from diloco.driver_kit.run_summary import whole_tokens
from diloco.core.accounting import learner_tokens
from diloco.errors import ConfigError
from diloco.sim.driver import Simulation
from diloco.sim.tier import SimRegion


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "regions.toml"

# ---------------------------------------------------------------- simulated runs of the example, shrunk

SMALL = [o for o in TINY if not o.startswith("learners.speeds")] + ["train.tokens=20480", "outer.H=8"]
"""examples/regions.toml (4 regions x 2 learners, ap-south at half speed) with a tiny model and budget (a run
of ~12 virtual seconds), in the lockstep timing model. H = 8: held answers come back before the learners' next
push falls due (the two tests of late answers and of the grid below take smaller H on purpose)."""

JITTERY = ["learners.jitter=0.1", "learners.drift=0.16", "learners.step_time_s=0.05"]
"""The example's own timing model (noisy steps, drifting speeds, 0.05 s steps: a run of ~2.6 s)."""

OUTAGE = 'failures.outages=[{region = "eu-west", at_s = 4, duration_s = 3}]'
"""eu-west (region 2 of the tier, learners 4 and 5) is down for 3 s in the middle of a ~12 s run."""
OUTAGE_JITTERY = 'failures.outages=[{region = "eu-west", at_s = 1, duration_s = 0.6}]'
"""The same in the example's timing model, whose run lasts ~2.6 s."""

EU_WEST = (4, 5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models train fastest on one thread, and the machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recording_die(original):
    """SimRegion.die that keeps, on the region, what each of its syncer's deaths lost (per learner, per fragment)."""
    def die(self, fragments):
        lost = original(self, fragments)
        self.__dict__.setdefault("lost_at_death", []).append(copy.deepcopy(lost))
        return lost
    return die


@functools.lru_cache(maxsize=None)
def run(*overrides: str) -> tuple[Simulation, object]:
    """One simulated run of the shrunk example (cached: several tests read the same run)."""
    sim = Simulation(load_config(str(EXAMPLE), [*SMALL, *overrides]))
    with mock.patch.object(SimRegion, "die", _recording_die(SimRegion.die)):
        result = sim.run()
    return sim, result


def wan_links(result) -> dict[str, int]:
    return {e["name"]: e["bytes_up"] + e["bytes_down"] for e in result.links if e["kind"] == "wan"}


@pytest.mark.integration
def test_regional_moves_half_the_wan_bytes_of_flat_at_the_same_loss_and_tokens():
    """The point of the tier: with 2 learners per region, one push and one answer per region cross the WAN
    instead of one per learner, so about half the WAN bytes, while the model (loss) and the work (tokens)
    stay what the flat topology gives."""
    _, flat = run("topology=flat")
    _, regional = run("topology=regional")
    print(f"\nflat: loss {flat.final_eval_loss:.4f} WAN {flat.wan_bytes} tokens {flat.tokens} "
          f"time {flat.training_time_s:.3f} s | regional: loss {regional.final_eval_loss:.4f} WAN "
          f"{regional.wan_bytes} tokens {regional.tokens} time {regional.training_time_s:.3f} s | "
          f"WAN ratio {flat.wan_bytes / regional.wan_bytes:.3f}")
    assert flat.wan_bytes >= 1.9 * regional.wan_bytes
    flat_links, regional_links = wan_links(flat), wan_links(regional)
    assert flat_links.keys() == regional_links.keys() and len(flat_links) == 3  # every region but the syncer's
    for name in flat_links:  # each region's WAN link, the half-speed one included
        assert flat_links[name] >= 1.85 * regional_links[name], name
    assert regional.final_eval_loss == pytest.approx(flat.final_eval_loss, rel=0.02)
    assert regional.tokens == flat.tokens
    assert regional.training_time_s == pytest.approx(flat.training_time_s, rel=0.05)


@pytest.mark.integration
def test_push_every_two_moves_fewer_wan_bytes():
    """`regional.push_every = 2` pushes a region's progress up every other regional round: fewer WAN bytes
    again, the same tokens trained."""
    _, every = run("topology=regional")
    _, second = run("topology=regional", "regional.push_every=2")
    print(f"\npush_every=1: WAN {every.wan_bytes} loss {every.final_eval_loss:.4f} | push_every=2: WAN "
          f"{second.wan_bytes} loss {second.final_eval_loss:.4f}")
    assert second.wan_bytes < 0.75 * every.wan_bytes
    assert second.tokens == every.tokens
    assert second.final_eval_loss == pytest.approx(every.final_eval_loss, rel=0.05)


CONSERVATION_RUNS = {
    "regional": ("topology=regional",),
    "outage": ("topology=regional", OUTAGE),
    "jittery outage, push_every=2": ("topology=regional", "regional.push_every=2", *JITTERY, OUTAGE_JITTERY),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", CONSERVATION_RUNS)
def test_every_token_is_merged_once_through_both_tiers_or_counted_lost(name):
    """Exactly-once through two tiers. Per learner and fragment: trained = merged (on time or stale, by its
    region's syncer, in any of its lives, less what died there unsent) + lost, nothing counted twice, no
    duplicate. Per region and fragment, the global ledger holds exactly what the region's rounds merged (over
    every life of its syncer) less what its syncer's deaths lost (`SimRegion.die`: the tokens still
    `pending`, merged here and never sent up): a push sent up is never lost, and nothing reaches the global
    syncer twice or without having been merged in the region."""
    sim, result = run(*CONSERVATION_RUNS[name])
    fragments = range(len(sim.fragments))
    numel = {f.index: f.numel for f in sim.fragments}
    assert result.duplicates == 0
    for learner in sim.learners:
        ledger = sim.token_ledger(learner.index)
        for p in fragments:
            assert ledger["merged"][p] + ledger["stale"][p] + ledger["lost"][p] == learner.tokens, (learner.index, p)
        tokens = learner_tokens(learner.tokens, *sim.ledger_of(learner.index), numel)
        assert tokens["counted_twice"] == 0
        assert tokens["merged"] + tokens["stale"] + tokens["lost"] == pytest.approx(learner.tokens)
        # the summary says it in whole tokens, each kind within one token of the exact share
        assert whole_tokens(tokens)["lost"] == result.per_learner[learner.index].tokens_lost
        assert abs(result.per_learner[learner.index].tokens_lost - tokens["lost"]) < 1
    assert result.tokens_merged + result.tokens_stale + result.tokens_lost == result.tokens
    died = 0
    for region in sim.regions:
        assert region.syncer is not None and region.syncer.left  # it pushed its last and left the global syncer
        assert all(not pending for pending in region.syncer.pending.values())  # nothing stayed unsent
        entry = sim.syncer.ledger[region.index]
        assert entry.duplicates == 0
        lost_at_death = getattr(region, "lost_at_death", [])
        for p in fragments:
            merged_here = sum(sum(r.tokens_each) for r in region.rounds() if r.fragment == p)
            lost_here = sum(lost[m][p] for lost in lost_at_death for m in lost)
            died += lost_here
            assert entry.merged[p] + entry.stale[p] == merged_here - lost_here, (region.name, p)
            # End to end: what the region's learners trained reached Θ once, or is counted lost.
            trained = sum(sim.learners[m].tokens for m in region.members)
            lost = sum(sim.learners[m].lost_tokens[p] for m in region.members)
            assert entry.merged[p] + entry.stale[p] == trained - lost, (region.name, p)
            if region.incarnation == 0:  # one life: what it sent up is what the global syncer merged of it
                went_up = sum(sum(region.syncer.sent_total.get(m, {}).get(p, [0, 0])) for m in region.members)
                assert entry.merged[p] + entry.stale[p] == went_up, (region.name, p)
    if "push_every=2" in name:
        # The identity was exercised: the outage killed a syncer holding unsent progress (with push_every = 1
        # a round is pushed up at once, and its learners push that fragment again only once answered).
        assert died > 0
    print(f"\n{name}: tokens {result.tokens}, merged {result.tokens_merged:.1f}, stale {result.tokens_stale:.1f}, "
          f"lost {result.tokens_lost:.1f} (of which unsent by a dying regional syncer, summed over fragments: {died})")


@pytest.mark.integration
def test_a_regional_outage_loses_only_that_regions_tokens_and_the_others_keep_training():
    """A regional outage kills the region's learners and its syncer. The run completes; the region's learners
    lose tokens (their unpushed steps, and any progress their syncer merged and had not sent up), the other regions'
    learners lose none and are not held up: the global rounds go on without the region, and their busy
    fraction is no lower than without the outage (the shared budget makes them train a little more)."""
    _, base = run("topology=regional")
    sim, hit = run("topology=regional", OUTAGE)  # run_result raises if a learner never finished
    others = [m for m in range(len(sim.learners)) if m not in EU_WEST]
    print("\nbusy fraction without / with the outage:",
          {m: (round(base.per_learner[m].busy_fraction, 4), round(hit.per_learner[m].busy_fraction, 4))
           for m in range(len(sim.learners))}, f"tokens lost: {hit.tokens_lost:.1f}")
    eu_west = next(r for r in sim.regions if r.name == "eu-west")
    assert eu_west.incarnation == 1 and len(eu_west.lost_at_death) == 1  # one death, then a new life from Θ
    assert [r.incarnation for r in sim.regions if r is not eu_west] == [0, 0, 0]
    for m in EU_WEST:
        report = hit.per_learner[m]
        assert report.crashes == 1 and report.tokens_lost > 0 and 3 <= report.down_s < 4
    for m in others:
        report = hit.per_learner[m]
        assert report.crashes == 0 and report.tokens_lost == 0
        assert report.busy_fraction >= base.per_learner[m].busy_fraction - 0.02
    assert hit.tokens_lost > 0 and base.tokens_lost == 0
    # The global syncer kept closing rounds of the other regions while eu-west was down.
    during = [r for r in sim.syncer.rounds if 4 < r.closed_at < 7]
    assert len(during) >= len(sim.fragments) and all(eu_west.index not in r.participants for r in during)
    assert hit.tokens >= sim.config.token_budget()


def pairs(region: SimRegion) -> float:
    """The share of a two-learner region's rounds (the last ones aside) that gathered both its learners."""
    rounds = [r for r in region.rounds() if not r.final]
    return sum(len(r.participants) == 2 for r in rounds) / len(rounds)


@pytest.mark.integration
def test_a_regions_rounds_gather_its_learners_when_held_answers_come_late():
    """Held answers come back after a WAN round trip and a global round, often after the learners' next push
    of the fragment fell due: they push it as soon as they merge the answer. The regional rounds must still
    gather both learners of a region, or the region pushes up once per learner and saves no WAN bytes.
    The example's own timing, H = 4: the half-speed region (ap-south) is hit hardest."""
    sim, _ = run("topology=regional", *JITTERY, "outer.H=4", "train.tokens=12288")
    shares = {r.name: round(pairs(r), 2) for r in sim.regions}
    print("\nrounds gathering both learners:", shares)
    assert all(share >= 0.5 for share in shares.values()), shares


@pytest.mark.integration
def test_every_region_syncs_on_the_same_grid():
    """`region_period` promises every region syncs on the global grid (H steps of the fastest learner, in
    time): with H = 5 the half-speed region must hold as many regional rounds as the others, not 25% more
    (each round pushed up is WAN bytes)."""
    sim, _ = run("topology=regional", "outer.H=5")
    counts = {r.name: len(r.rounds()) for r in sim.regions}
    print("\nregional rounds:", counts)
    assert max(counts.values()) <= 1.1 * min(counts.values()), counts


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("with_regions, overrides, key", [
    (False, ["topology=regional"], "topology"),
    (True, ["topology=regional", "strategy=ddp"], "topology"),
    (True, ["topology=regional", "regional.push_every=0"], "regional.push_every"),
    (True, ["topology=regional", "regional.momentum=1"], "regional.momentum"),
    (True, ["topology=regional", "regional.lr=0"], "regional.lr"),
    (True, ["topology=regional", "regional.codec=zip"], "regional.codec"),
    (True, ["topology=mesh"], "topology"),
])
def test_what_the_tier_cannot_run_is_refused_naming_the_key(with_regions, overrides, key):
    """Regional needs regions to put syncers in and a strategy with a syncer (ddp all-reduces); a regional
    round pushes at least every round, steps forward (lr > 0) with momentum below 1, and its pushes travel in
    a codec that exists. Each mistake is one line naming its key, before anything runs."""
    with pytest.raises(ConfigError) as refused:
        load_config(str(EXAMPLE) if with_regions else None, overrides)
    message = str(refused.value)
    assert message.startswith(f"config key '{key}' ") and "\n" not in message, message


def test_the_example_runs_regional_as_configured():
    """examples/regions.toml with `topology = regional`: the tier is on, one regional syncer per region with
    learners, and each region but the syncer's reaches it over its WAN link."""
    config = load_config(str(EXAMPLE), ["topology=regional"])
    assert Topology(config).tiered and not Topology(load_config(str(EXAMPLE), [])).tiered
    assert [r.name for r in Topology(config).tier_regions()] == ["us-east", "us-west", "eu-west", "ap-south"]
    assert Topology(config).region_route("us-east") == []
    assert [h.kind for h in Topology(config).region_route("eu-west")] == ["wan"]
    assert [h.kind for h in Topology(config).route(4)] == ["lan"]  # a learner's syncer is its region's, over its LAN
