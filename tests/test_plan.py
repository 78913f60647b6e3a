"""`diloco plan`: its bytes equal the simulator's, its "keeps up" agrees with whether simulated learners
wait, its memory does not grow with learners, and bad input is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import TINY, tiny_config
from diloco.cli import main
from diloco.codecs import get_codec
from diloco.core.messages import MESSAGE_HEADER_BYTES
from diloco.errors import DilocoError
from diloco.plan import units
from diloco.plan.build import deployment, parse_regions
from diloco.plan.layout import assumed_layout
from diloco.plan.memory import waiting_bytes
from diloco.plan.plan_model import plan
from diloco.plan.replay import predicted_wire_bytes, replay, replay_problem
from diloco.plan.search import keeps_up, smallest_H, smallest_tau
from diloco.plan.deployment import traffic
from diloco.plan.wire import push_bytes, update_bytes
from diloco.transport.receive_buffers import KEPT, KEPT_BYTES, UPLOADS_AT_ONCE

SMALL = ["learners.count=2", "train.tokens=2560"]
"""Two learners, 20 steps each: a whole simulated run in a few seconds."""

SEED_RUN = ["plan", "--params", "12B", "--learners", "8", "--regions", "us=5@20ms,eu=4@45ms,ap=2@90ms,sa=3@70ms",
            "--step-time", "1.5s", "--H", "100", "--fragments", "16", "--tau", "5", "--codec", "int4",
            "--down-codec", "int4", "--shard-memory", "64GiB", "--tokens", "250B", "--step-tokens", "512K"]
"""The seed run as docs/plan.md plans it."""


# ---------------------------------------------------------------- exact against the simulator

EXACT_CONFIGS = {
    "diloco fp32, one fragment": ("strategy=diloco", "outer.H=5", "link.bandwidth_mbit=10", "link.latency_ms=100"),
    "diloco int4 up, bf16 down": ("strategy=diloco", "outer.H=7", "codec.up=int4", "codec.down=bf16",
                                  "link.bandwidth_mbit=50", "link.latency_ms=5"),
    "streaming int4 up, int8 down, 3 fragments": ("strategy=streaming", "outer.fragments=3", "outer.tau=2",
                                                  "outer.H=7", "codec.up=int4", "codec.down=int8",
                                                  "link.bandwidth_mbit=3", "link.latency_ms=30"),
    "streaming fp32, 2 fragments, late answers": ("strategy=streaming", "outer.fragments=2", "outer.tau=1",
                                                  "outer.H=4", "link.bandwidth_mbit=1", "link.latency_ms=50"),
    "streaming fp4 both ways, mixed speeds, jitter": ("strategy=streaming", "outer.fragments=2", "outer.tau=1",
                                                      "outer.H=4", "codec.up=fp4", "codec.down=fp4",
                                                      "learners.speeds=[1, 0.5]", "learners.jitter=0.2",
                                                      "learners.drift=0.1"),
    "data-parallel": ("strategy=ddp", "learners.count=3", "train.tokens=3072", "link.latency_ms=10"),
}


@pytest.mark.integration  # whole simulated runs
@pytest.mark.parametrize("name", list(EXACT_CONFIGS))
def test_predicted_bytes_equal_the_simulators_exactly(name):
    from diloco.sim import simulate

    config = tiny_config(*SMALL, *EXACT_CONFIGS[name])
    result = simulate(config)
    replayed = replay(config)
    assert predicted_wire_bytes(config) == (result.wire_bytes_up, result.wire_bytes_down)
    assert replayed.bytes_up == [r.bytes_up for r in result.per_learner]
    assert replayed.bytes_down == [r.bytes_down for r in result.per_learner]
    assert replayed.peak_sync_bytes == result.peak_sync_bytes
    assert replayed.waiting_s == pytest.approx([r.waiting_s for r in result.per_learner], abs=1e-9)
    assert replayed.training_time_s == pytest.approx(result.training_time_s, rel=1e-12)


@pytest.mark.integration  # two simulated runs
@pytest.mark.parametrize("bandwidth_mbit, fits", [(100, True), (1, False)])
def test_keeps_up_agrees_with_whether_simulated_learners_wait(bandwidth_mbit, fits):
    """τ = 2 steps of 0.25 s: a 3-fragment fp32 push of the tiny model takes ~1 ms at 100 Mbit/s and
    ~0.1 s at 1 Mbit/s, plus 150 ms of latency each way."""
    from diloco.sim import simulate

    config = tiny_config(*SMALL, "strategy=streaming", "outer.fragments=3", "outer.tau=2", "outer.H=6",
                         f"link.bandwidth_mbit={bandwidth_mbit}", "link.latency_ms=150")
    planned = plan(deployment(config))
    result = simulate(config)
    assert planned.keeps_up is fits
    assert all(r.waiting_s == 0 for r in result.per_learner) is fits


SWEEP = [(bandwidth, latency, tau, fragments)
         for bandwidth in (0.3, 3, 100) for latency in (0, 100, 300) for tau in (1, 3) for fragments in (1, 3)]


def test_keeps_up_agrees_with_the_replayed_run_over_a_sweep():
    """The replay is the simulator's timeline (the test above checks it run by run): a learner waits in
    it exactly when the planner says the link does not keep up. SMALL's 20 steps each (three rounds of
    H = 6) give every point the verdict that 40 steps give: the nearest case (3 Mbit/s, 300 ms, τ = 3, three
    fragments) still waits (0.02 s)."""
    for bandwidth, latency, tau, fragments in SWEEP:
        config = tiny_config(*SMALL, "strategy=streaming", f"outer.fragments={fragments}", f"outer.tau={tau}",
                             "outer.H=6", f"link.bandwidth_mbit={bandwidth}", f"link.latency_ms={latency}",
                             "codec.up=int4")
        d = deployment(config)
        waited = max(replay(config, d.layout).waiting_s) > 0
        assert plan(d).keeps_up is not waited, (bandwidth, latency, tau, fragments)


def test_the_plans_totals_are_the_replayed_ones_for_a_synchronous_config(tmp_path):
    overrides = [*TINY, *SMALL, *EXACT_CONFIGS["streaming int4 up, int8 down, 3 fragments"]]
    out = tmp_path / "plan.json"
    assert main(["plan", *(x for item in overrides for x in ("--set", item)), "--json", str(out), "-q"]) == 0
    data = json.loads(out.read_text())
    assert data["totals"]["exact"] is True
    assert (data["totals"]["bytes_up"], data["totals"]["bytes_down"]) == predicted_wire_bytes(tiny_config(*overrides))


def test_without_a_replay_synchronous_uplink_totals_are_still_exact_and_downlink_a_lower_bound():
    from diloco.plan.totals import estimate_totals

    for name in ("streaming int4 up, int8 down, 3 fragments", "diloco fp32, one fragment"):
        config = tiny_config(*SMALL, *EXACT_CONFIGS[name])
        d = deployment(config)
        estimate = estimate_totals(d, list(plan(d).sites))
        up, down = predicted_wire_bytes(config, d.layout)
        assert estimate.bytes_up == up and estimate.bytes_down <= down


def test_asynchronous_runs_are_not_replayed():
    assert "asynchronous" in replay_problem(tiny_config("strategy=decoupled"))
    assert "failures" in replay_problem(tiny_config("strategy=diloco", "failures.mtbf_s=100"))
    with pytest.raises(DilocoError, match="cannot replay"):
        replay(tiny_config("strategy=async"))


# ---------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "fp4"])
def test_message_bytes_are_what_encoding_puts_on_the_wire(codec):
    tensors = [1, 63, 64, 65, 1001]  # odd counts and partial blocks
    encoded = [get_codec(codec, 64).encode(torch.randn(n)) for n in tensors]
    assert push_bytes(tensors, codec, 64) == MESSAGE_HEADER_BYTES + sum(e.wire_bytes() for e in encoded)
    assert update_bytes(tensors, codec, 64) == push_bytes(tensors, codec, 64)


def test_an_assumed_layout_holds_every_parameter():
    layout = assumed_layout(12_000_000_007, 16)
    assert layout.parameters == 12_000_000_007
    assert max(f.numel for f in layout.fragments) - min(f.numel for f in layout.fragments) == 1
    assert not layout.exact and "estimate" in layout.source


def _seed(**changes) -> object:
    from dataclasses import replace

    config = tiny_config("learners.count=8", "learners.step_time_s=1.5", "outer.H=100", "outer.fragments=16",
                         "outer.tau=5", "codec.up=int4", "codec.down=int4", "strategy=decoupled")
    d = deployment(config, assumed_layout(12_000_000_000, 16),
                   regions=parse_regions("us=5@20ms,eu=4@45ms,ap=2@90ms,sa=3@70ms", 0.05),
                   shard_memory_bytes=64 * 2**30, tokens_per_step=512_000, with_totals=False)
    return replace(d, **changes)


def test_shard_memory_does_not_grow_with_learners():
    """The state is per fragment; the pushes being received grow with learners only up to what the bulk port
    takes at once."""
    shards = len(plan(_seed()).shards)  # as many as 8 learners need: more would need more for their CPU
    few, many = _seed(shards=shards), _seed(shards=shards, speeds=(1.0,) * 64)
    port = _seed(shards=shards, speeds=(1.0,) * UPLOADS_AT_ONCE)
    more = _seed(shards=shards, speeds=(1.0,) * 4 * UPLOADS_AT_ONCE)
    state = [(m.resident_bytes, m.transient_bytes) for m in (s.memory for s in plan(few).shards)]
    assert state == [(m.resident_bytes, m.transient_bytes) for m in (s.memory for s in plan(many).shards)]
    assert [s.memory for s in plan(port).shards] == [s.memory for s in plan(more).shards]
    assert plan(many).shards[0].in_per_s == pytest.approx(8 * plan(few).shards[0].in_per_s)


def test_a_shards_peak_counts_the_pushes_it_reads_in_place():
    """Pushes are received into buffers the core reads in place: as many as the port takes at once of the
    largest, a fragment's first push kept whole (every learner's in a reproducible run), coded pushes whose
    adds wait for their round's close, the free buffers."""
    from dataclasses import replace

    d = replace(_seed(), layout=assumed_layout(1_000_000_000, 4), shards=1, regions=(), speeds=(1.0,) * 8)
    push = traffic(d).push
    memory = plan(d).shards[0].memory
    waiting = 3 * sum(push)  # three 4-bit pushes of a fragment fit in half its fp32 bytes: their adds wait
    assert [waiting_bytes(f.numel, b) for f, b in zip(d.layout.fragments, push)] == [3 * b for b in push]
    assert memory.receiving_bytes == 8 * max(push) + sum(push) + waiting + min(KEPT * max(push), KEPT_BYTES)
    assert memory.peak_bytes == memory.resident_bytes + memory.transient_bytes + memory.receiving_bytes
    reproducible = plan(replace(d, reproducible=True)).shards[0].memory
    assert reproducible.receiving_bytes == memory.receiving_bytes + 7 * sum(push)
    fp32, wide = plan(replace(d, codec_up="fp32")).shards[0].memory, traffic(replace(d, codec_up="fp32")).push
    assert max(wide) > 7 * max(push)  # 32 bits a parameter, against 4 and a scale per 64
    assert fp32.receiving_bytes == 8 * max(wide) + sum(wide) + KEPT_BYTES  # none waits; 8 pushes' free buffers pass 1 GiB


def test_shard_memory_counts_the_optimizer_and_downlink_copies():
    from dataclasses import replace

    d = replace(_seed(), layout=assumed_layout(1_000_000, 1), shards=1)
    base = plan(replace(d, optimizer="nesterov", merge_rule="mean", consolidate=False,
                        codec_down="fp32")).shards[0].memory
    assert base.resident_bytes == 4 * 1_000_000 * 3  # Θ, momentum, Σ Δ
    lossy = plan(replace(d, optimizer="delayed-nesterov", merge_rule="rda")).shards[0].memory
    assert lossy.resident_bytes == 4 * 1_000_000 * (1 + 2 + 2 + 1.5)


def test_the_seed_run_keeps_up_and_needs_eight_shards():
    """A plan docs/plan.md lists (16 fragments, int4 both ways): if it changes, the doc must too. Its pushes
    (eight of 422 MB arriving at once) need two more shards than its state alone."""
    p = plan(_seed())
    assert p.keeps_up and p.shards_needed == 8
    assert max(s.round_trip_s for s in p.sites) < 5 * 1.5
    assert not plan(_seed(codec_up="int8", codec_down="int8")).keeps_up


def test_smallest_h_and_tau_are_the_edges_of_what_keeps_up():
    from dataclasses import replace

    d = _seed(H=20)
    h = smallest_H(d)
    assert h is not None and keeps_up(replace(d, H=h)) and not keeps_up(replace(d, H=h - 1))
    d = _seed(tau=1)
    tau = smallest_tau(d)
    assert tau is not None and keeps_up(replace(d, tau=tau)) and not keeps_up(replace(d, tau=tau - 1))


def test_a_saturated_link_never_keeps_up():
    p = plan(_seed(H=10))  # 6.75 GB per learner every 15 s through a 1 Gbit/s share
    ap = next(s for s in p.sites if s.name == "ap")
    assert ap.up_utilisation > 1 and not ap.keeps_up and "of the link" in ap.why


# ---------------------------------------------------------------- the command line


def test_the_seed_run_prints_and_writes_its_plan(tmp_path, capsys):
    out = tmp_path / "seed.json"
    assert main([*SEED_RUN, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "keeps up" in printed and "shards needed: 8" in printed
    data = json.loads(out.read_text())
    assert data["keeps_up"] is True and data["shards_needed"] == 8
    assert data["totals"]["exact"] is False
    assert data["advice"]["smallest_H"] and data["advice"]["least_codec"] == "int4"


def test_a_plan_that_does_not_fit_says_so(capsys):
    assert main(["plan", "--params", "12B", "--learners", "8", "--bandwidth", "1Gbit", "--step-time", "1.5",
                 "--H", "100", "--fragments", "4", "--tau", "1", "--codec", "fp32", "--down-codec", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "does not keep up" in printed and "nothing fits" in printed


@pytest.mark.parametrize("argv, message", [
    (["--params", "-5"], "--params: expected a positive number"),
    (["--params", "0"], "--params: must be positive"),
    (["--params", "nan"], "--params: expected a positive number"),
    (["--params", "12X"], "unknown unit"),
    (["--bandwidth", "0"], "--bandwidth: must be positive"),
    (["--bandwidth", "1e400"], "--bandwidth: must be"),
    (["--step-time", "inf"], "--step-time: expected a positive number"),
    (["--latency=-1ms"], "--latency: expected a positive number"),
    (["--tau", "-1"], "--tau: must be at least 0"),
    (["--H", "1.5"], "--H: expected a whole number"),
    (["--learners", "0"], "--learners: must be at least 1"),
    (["--regions", "us"], "--regions: expected NAME=RATE"),
    (["--regions", "us=1,us=2"], "named twice"),
    (["--learners", "2", "--regions", "a=1,b=1,c=1"], "every region needs"),
    (["--shard-memory", "0GiB"], "--shard-memory: must be positive"),
    (["--codec", "int3"], "codec.up"),
    (["--tau", "60"], "outer.tau"),
])
def test_bad_input_is_refused_in_one_line(argv, message, capsys):
    assert main(["plan", "--params", "1B", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and message in err and "\n" not in err


def test_units_read_friendly_sizes():
    assert units.count("--params", "12B") == 12_000_000_000
    assert units.count("--params", "1.5e9") == 1_500_000_000
    assert units.bandwidth_bps("--bandwidth", "5Gbit") == 5e9
    assert units.bandwidth_bps("--bandwidth", "2.5") == 2.5e9
    assert units.bandwidth_bps("--bandwidth", "500 Mbit/s") == 5e8
    assert units.memory_bytes("--shard-memory", "80GiB") == 80 * 2**30
    assert units.seconds("--latency", "40", "ms") == pytest.approx(0.04)
    assert units.seconds("--step-time", "1500ms") == pytest.approx(1.5)
    assert math.isclose(units.seconds("--latency", "0", "ms", allow_zero=True), 0.0)


# ---------------------------------------------------------------- a config's regions: every link, shared

REGIONS = """
strategy = "streaming"
[outer]
fragments = 3
tau = 2
H = 4
[[regions]]
name = "a"
syncer = true
speeds = [1, 1]
lan = { bandwidth_mbit = 1000, latency_ms = 1 }
wan = { bandwidth_mbit = 20, latency_ms = 30 }
[[regions]]
name = "b"
speeds = [1, 1]
lan = { bandwidth_mbit = 1000, latency_ms = 1 }
wan = { bandwidth_mbit = {b_wan}, latency_ms = 40 }
wan_to = [{ region = "c", latency_ms = 60 }]
[[regions]]
name = "c"
speeds = [1, 0.5]
lan = { bandwidth_mbit = 1000, latency_ms = 1 }
wan = { bandwidth_mbit = 20, latency_ms = 50 }
"""
"""Three regions of two learners (0-1 in a, the syncer's, 2-3 in b, 4-5 in c, 5 at half speed), each
region's learners sharing its WAN links; placement = links homes one of the three fragments in each."""


def regions_config(tmp_path, *overrides: str, b_wan: float = 20):
    from diloco.config import load_config

    path = tmp_path / "regions.toml"
    path.write_text(REGIONS.replace("{b_wan}", repr(b_wan)))
    return load_config(path, [*(x for x in TINY if "speeds" not in x), "train.tokens=3072", *overrides])


def names_and_bytes(links) -> list[tuple[str, int, int]]:
    return [(e["name"], e["bytes_up"], e["bytes_down"]) if isinstance(e, dict) else (e.name, e.bytes_up, e.bytes_down)
            for e in links]


@pytest.mark.integration  # two simulated runs
@pytest.mark.parametrize("placement", ["syncer", "links"])
def test_each_links_bytes_equal_the_simulators_exactly(tmp_path, placement):
    """A synchronous run is replayed over the simulator's own network (each learner's LAN, then its
    region's WAN link to each home), so every link's bytes each way are the simulator's, answers near the
    end included or not as its timing decides."""
    from diloco.sim import simulate

    config = regions_config(tmp_path, f"placement={placement}", "learners.jitter=0.1")
    replayed = replay(config)
    planned = plan(deployment(config), replayed)
    simulated = simulate(config)
    assert names_and_bytes(planned.links) == names_and_bytes(simulated.links) == names_and_bytes(replayed.links)
    assert all(lk.exact for lk in planned.links)
    assert len({e["name"] for e in simulated.links if e["kind"] == "wan"}) == (2 if placement == "syncer" else 3)


def test_without_a_replay_each_links_bytes_are_its_steady_state_over_the_run(tmp_path):
    """Without the replay (an asynchronous run, a hypothetical model) a link's bytes are its steady-state
    rates over the run's time, plus each sender's last push: about the replayed ones, not exactly, for
    the run's ends are not steady. Its first fragments fall due only part way into the first period, the
    run ends part way into a period, and the answers to the last τ steps' pushes are never sent, which
    only the replay's timing tells: here, within a fifth."""
    config = regions_config(tmp_path, "placement=links", "train.tokens=12288")
    d = deployment(config)
    exact, estimate = plan(d, replay(config)), plan(d)
    assert [lk.name for lk in exact.links] == [lk.name for lk in estimate.links]
    for e, s in zip(exact.links, estimate.links):
        assert not s.exact and s.bytes_up == pytest.approx(e.bytes_up, rel=0.2), e.name
        assert s.bytes_down == pytest.approx(e.bytes_down, rel=0.2), e.name


def test_a_regions_wan_link_carries_all_its_learners_traffic(tmp_path):
    """With every fragment homed at the syncer, b's WAN link carries both its learners' traffic each way,
    what each one's LAN carries; with placement = links a WAN link joins two regions that are not the
    syncer's, and carries one's pushes and the other's answers the same way."""
    syncer = {lk.name: lk for lk in plan(deployment(regions_config(tmp_path))).links}
    wan = syncer["b→a (WAN)"]
    assert wan.senders == ("learner 2", "learner 3")
    assert wan.up_per_s == pytest.approx(syncer["learner 2 LAN"].up_per_s + syncer["learner 3 LAN"].up_per_s)
    assert wan.down_per_s == pytest.approx(syncer["learner 2 LAN"].down_per_s + syncer["learner 3 LAN"].down_per_s)
    spread = plan(deployment(regions_config(tmp_path, "placement=links")))
    assert len(set(spread.homes)) == 3
    assert {lk.name for lk in spread.links if lk.kind == "wan"} == {"a→b (WAN)", "a→c (WAN)", "b→c (WAN)"}
    bc = next(lk for lk in spread.links if lk.name == "b→c (WAN)")
    assert set(bc.senders) == {"learner 2", "learner 3", "learner 4", "learner 5"}


def test_with_spread_homes_the_shards_are_one_per_home_region_as_diloco_run_starts_them(tmp_path):
    from diloco.shard.ownership import fragment_owners

    config = regions_config(tmp_path, "placement=links", "outer.fragments=3")
    owners = fragment_owners(config)
    for shards in (None, 3):
        assert [s.memory.fragments for s in plan(deployment(config, shards=shards)).shards] == \
            [tuple(p for p, o in enumerate(owners) if o == i) for i in range(3)]
    with pytest.raises(DilocoError, match=r'placement = "links" runs one syncer shard per home region \(3\), not 5'):
        plan(deployment(config, shards=5))


def test_a_shared_link_that_one_learner_alone_would_fit_does_not_keep_up(tmp_path):
    """b's two learners share its WAN link: sized so that each alone would need 80% of it, together they
    need 160%, and the link (and the plan) does not keep up."""
    one = next(lk for lk in plan(deployment(regions_config(tmp_path))).links if lk.name == "learner 2 LAN")
    b_wan = one.up_per_s * 8 / 0.8 / 1e6
    squeezed = plan(deployment(regions_config(tmp_path, b_wan=b_wan)))
    wan = next(lk for lk in squeezed.links if lk.name == "b→a (WAN)")
    assert wan.up_utilisation == pytest.approx(1.6)
    assert not wan.keeps_up and "160% of the link" in wan.why and not squeezed.keeps_up


def test_a_config_with_regions_prints_and_writes_every_link(tmp_path, capsys):
    example = Path(__file__).resolve().parents[1] / "examples" / "regions.toml"
    out = tmp_path / "plan.json"
    assert main(["plan", str(example), "--set", "placement=links", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per link, all traffic sharing it" in printed and "placement: links" in printed
    data = json.loads(out.read_text())
    wan = [lk for lk in data["links"] if lk["kind"] == "wan"]
    assert data["placement"] == "links" and len(set(data["fragment_homes"])) > 1
    assert len(wan) > 3 and all(lk["bytes_up"] and lk["bandwidth_up_bps"] == 1e9 for lk in wan)
    assert [lk["kind"] for lk in data["links"]] == sorted(lk["kind"] for lk in data["links"])  # LAN first
    assert main(["plan", str(example), "--regions", "us=1"]) == 2
    assert "has [[regions]] already" in capsys.readouterr().err
