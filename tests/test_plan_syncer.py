"""`diloco plan` on the syncer's side: cores from the measured cost per pushed parameter, the join time,
a `--params` plan's step time from the model's FLOPs, and a combination of knobs proposed when no knob
alone keeps up (the README example), as a command line that does keep up."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from conftest import tiny_config
from diloco.cli import main
from diloco.plan.build import deployment
from diloco.plan.layout import assumed_layout
from diloco.plan.plan_model import plan
from diloco.plan.syncer_cost import (LEARNER_FLOPS, PLAN_MAX_THREADS, PLAN_STEP_TOKENS, SHARD_BULK_PULL_BYTES_PER_S,
                                     SHARD_CPU_NS_PER_PARAM, SHARD_PULL_BYTES_PER_S, SHARD_SERIAL_SHARE, join_s,
                                     shard_capacity, shards_for_cores, threads_for)

README_EXAMPLE = ["plan", "--params", "12B", "--learners", "8", "--bandwidth", "1Gbit"]


def _plan_json(tmp_path, argv: list[str], name: str = "plan.json") -> dict:
    out = tmp_path / name
    assert main([*argv, "--json", str(out), "-q"]) == 0
    return json.loads(out.read_text())


def _deployment(**changes):
    config = tiny_config("learners.count=8", "learners.step_time_s=1.5", "outer.H=100", "outer.fragments=6",
                         "codec.up=int4", "codec.down=int4")
    return replace(deployment(config, assumed_layout(1_000_000_007, 6), with_totals=False), **changes)


def test_cores_are_pushed_parameters_per_second_times_the_measured_cost():
    p = plan(_deployment(shards=4))
    d = p.deployment
    period = 100 * 1.5
    for s in p.shards:
        pushed = s.memory.parameters * 8 / period  # every learner pushes each owned fragment once per period
        assert s.pushed_params_per_s == pytest.approx(pushed)
        assert s.cores == pytest.approx(pushed * SHARD_CPU_NS_PER_PARAM * 1e-9)
    assert sum(s.cores for s in p.shards) == pytest.approx(d.layout.parameters * 8 / period * SHARD_CPU_NS_PER_PARAM
                                                           * 1e-9)
    # shards 0 and 1 own two fragments each (p mod 4), 2 and 3 one: the join waits for the largest part, or
    # for all of Θ over the learner's link, whichever is slower (here the 100 Mbit/s link, by far)
    theta = 4 * d.layout.parameters
    assert p.join_s == pytest.approx(theta * 8 / d.bandwidth_bps)
    assert p.shards[0].memory.parameters > p.shards[2].memory.parameters
    fast = plan(_deployment(shards=4, bandwidth_bps=1e12))  # a link faster than any shard serves
    assert fast.join_s == pytest.approx(4 * fast.shards[0].memory.parameters / SHARD_BULK_PULL_BYTES_PER_S)
    assert join_s([1000, 3000], pull_bytes_per_s=SHARD_PULL_BYTES_PER_S) == pytest.approx(
        4 * 3000 / SHARD_PULL_BYTES_PER_S)  # a shard serving over gRPC only: its measured rate


def test_shards_for_cores_is_the_fewest_whose_busiest_fits():
    d = _deployment()
    total = plan(replace(d, shards=1)).shards[0].cores
    limit = total / 2.5
    p = plan(replace(d, shard_cores=limit))
    assert p.shards_for_cores is not None and len(p.shards) == p.shards_for_cores
    assert max(s.cores for s in p.shards) <= limit
    fewer = plan(replace(d, shards=p.shards_for_cores - 1))
    assert max(s.cores for s in fewer.shards) > limit
    numels = [f.numel for f in d.layout.fragments]
    assert shards_for_cores(total / SHARD_CPU_NS_PER_PARAM * 1e9, numels, total / 100) is None  # a fragment > limit


@pytest.mark.parametrize("needed", [0.3, 1.0, 1.01, 1.4, 1.7, 2.0, 2.2])
def test_threads_for_is_the_fewest_whose_capacity_covers_the_shard(needed: float):
    threads = threads_for(needed)
    assert threads is not None and shard_capacity(threads) >= needed - 1e-9
    assert threads == 1 or shard_capacity(threads - 1) < needed
    assert shard_capacity(1) == pytest.approx(1.0)


def test_no_thread_count_covers_more_than_the_serial_share_allows():
    ceiling = 1 / SHARD_SERIAL_SHARE
    assert threads_for(ceiling) is None and threads_for(ceiling * 1.5) is None
    assert threads_for(shard_capacity(PLAN_MAX_THREADS + 1)) is None  # reachable, but not with a sane count


def test_a_shard_on_several_cores_gets_through_only_its_capacity():
    d = _deployment()
    total = plan(replace(d, shards=1)).shards[0].cores
    rate = total / SHARD_CPU_NS_PER_PARAM * 1e9  # pushed parameters/s of the whole model
    numels = [f.numel for f in d.layout.fragments]
    for cores_each in (2, 4, 16):
        shards = shards_for_cores(rate * 2.0 / total, numels, cores_each)  # a model that needs 2 cores in all
        assert shards is not None
        largest = max(sum(numels[p::shards]) for p in range(shards))
        assert 2.0 * largest / sum(numels) <= shard_capacity(cores_each) + 1e-9
        assert shards == 1 or 2.0 * max(sum(numels[p::shards - 1]) for p in range(shards - 1)) / sum(numels) \
            > shard_capacity(cores_each)


def test_a_plan_gives_each_shard_what_its_threads_get_through(tmp_path, capsys):
    """The README example needs 3.9 cores: one core a shard by default (four shards); in 16 fragments on
    shards of 4 cores, as much as a shard on 4 threads gets through (Amdahl: three shards); on one shard, more
    than any thread count gets through."""
    data = _plan_json(tmp_path, README_EXAMPLE)
    assert data["shards_for_cores"] == len(data["shards"]) == 4
    assert max(s["cores"] for s in data["shards"]) <= 1 and data["shard_threads"] == 1
    on_four = [*README_EXAMPLE, "--fragments", "16", "--shard-cores", "4"]
    wide = _plan_json(tmp_path, on_four, "wide.json")
    busiest = max(s["cores"] for s in wide["shards"])
    assert len(wide["shards"]) == 3 and 1 < busiest <= shard_capacity(4)
    assert wide["shard_threads"] == threads_for(busiest) <= 4
    assert main(on_four) == 0
    assert f"start each shard with `diloco syncer --threads {wide['shard_threads']}`" in capsys.readouterr().out
    forced = _plan_json(tmp_path, [*README_EXAMPLE, "--shards", "1"], "one.json")
    assert forced["shard_threads"] is None
    assert main([*README_EXAMPLE, "--shards", "1"]) == 0
    assert "no thread count is enough for the busiest shard" in capsys.readouterr().out


def test_a_params_plan_derives_its_step_time_from_the_models_flops(tmp_path):
    data = _plan_json(tmp_path, README_EXAMPLE)
    expected = 6 * 12e9 * PLAN_STEP_TOKENS / LEARNER_FLOPS
    assert data["deployment"]["step_time_s"] == pytest.approx(expected)
    assert data["deployment"]["tokens_per_step"] == PLAN_STEP_TOKENS
    slower = _plan_json(tmp_path, [*README_EXAMPLE, "--learner-flops", f"{LEARNER_FLOPS / 2e15}P"], "slow.json")
    assert slower["deployment"]["step_time_s"] == pytest.approx(2 * expected)
    given = _plan_json(tmp_path, [*README_EXAMPLE, "--step-time", "3s"], "given.json")
    assert given["deployment"]["step_time_s"] == 3.0 and given["step_time_source"] == ""
    by_key = _plan_json(tmp_path, [*README_EXAMPLE, "--set", "learners.step_time_s=4.0"], "key.json")
    assert by_key["deployment"]["step_time_s"] == 4.0


def test_the_readme_example_is_fixed_by_the_combination_it_proposes(tmp_path, capsys):
    data = _plan_json(tmp_path, README_EXAMPLE)
    advice = data["advice"]
    assert data["keeps_up"] is False
    assert not any(advice[k] for k in ("smallest_H", "least_codec", "smallest_tau", "fewest_fragments"))
    assert advice["combination"] is not None and advice["command"].startswith("diloco plan ")
    words = shlex.split(advice["command"])[1:]
    assert words[:3] == README_EXAMPLE[:3] and "--bandwidth" in words  # the user's own flags kept
    proposed = _plan_json(tmp_path, words, "proposed.json")
    assert proposed["keeps_up"] is True
    assert proposed["deployment"]["H"] == advice["combination"]["H"]
    assert proposed["deployment"]["codec_up"] == advice["combination"]["codec"]
    assert main(README_EXAMPLE) == 0
    assert "- try: diloco plan --params 12B" in capsys.readouterr().out


def test_a_plan_that_keeps_up_proposes_nothing(tmp_path):
    data = _plan_json(tmp_path, [*README_EXAMPLE, "--H", "48", "--fragments", "48", "--codec", "int4",
                                 "--down-codec", "int4"])
    assert data["keeps_up"] is True and data["advice"]["command"] == "" and data["advice"]["combination"] is None


@pytest.mark.parametrize("argv, message", [
    (["--learner-flops", "0"], "--learner-flops: must be positive"),
    (["--learner-flops", "5X"], "--learner-flops: unknown unit"),
    (["--learner-flops", "inf"], "--learner-flops: expected a positive number"),
    (["--step-time", "1s", "--learner-flops=-3P"], "--learner-flops: expected a positive number"),
    (["--shard-cores", "0"], "--shard-cores: must be positive"),
    (["--shard-cores", "many"], "--shard-cores: expected a positive number"),
    (["--step-tokens", "0"], "--step-tokens: must be positive"),
])
def test_bad_syncer_input_is_refused_in_one_line(argv, message, capsys, tmp_path):
    out = tmp_path / "never.json"
    assert main(["plan", "--params", "1B", *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and message in err and "\n" not in err
    assert not out.exists()
