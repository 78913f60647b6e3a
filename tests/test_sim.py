"""The simulated driver: virtual time, links, accounting and determinism."""

import pytest

from conftest import computed, tiny_config
from diloco.core.messages import MESSAGE_HEADER_BYTES
from diloco.sim import simulate
from diloco.sim.driver import Simulation
from diloco.training import evaluate

pytestmark = pytest.mark.integration  # every test is a whole training run in the simulator

FAST_LINK = ["link.bandwidth_mbit=1e9", "link.latency_ms=0"]


def test_same_seed_same_run_and_another_seed_differs():
    overrides = ["strategy=streaming", "outer.fragments=3", "outer.tau=1", "outer.alpha=0.5",
                 "learners.speeds=[1, 0.7, 0.5]", "learners.jitter=0.2"]
    first = simulate(tiny_config(*overrides)).summary()
    second = simulate(tiny_config(*overrides)).summary()
    assert computed(first) == computed(second)
    other = simulate(tiny_config(*overrides, "seed=1")).summary()
    assert other["final_eval_loss"] != first["final_eval_loss"]
    assert other["training_time_s"] != first["training_time_s"]


def test_synchronous_learners_wait_for_the_slowest():
    result = simulate(tiny_config("strategy=diloco", "learners.speeds=[1, 0.5]", *FAST_LINK))
    steps = result.per_learner[0].steps
    assert result.training_time_s == pytest.approx(steps * 0.25 / 0.5, rel=1e-6)
    assert result.per_learner[1].busy_fraction == pytest.approx(1.0, rel=1e-6)
    assert result.per_learner[0].busy_fraction == pytest.approx(0.5, rel=1e-6)
    assert result.goodput == pytest.approx(0.75, rel=1e-6)


def test_diloco_moves_the_model_once_per_round_and_counts_each_byte():
    sim = Simulation(tiny_config("strategy=diloco", "outer.H=5", "link.bandwidth_mbit=10", "link.latency_ms=100"))
    result = sim.run()
    steps = result.per_learner[0].steps
    rounds = -(-steps // 5)
    model_bytes = sim.learners[0].link.up.peak_message_bytes
    assert model_bytes > 4 * result.parameters  # fp32 payload plus headers
    assert result.rounds == rounds
    for report in result.per_learner:
        # Up: every round, a progress report after every step (header and one schedule entry), then the
        # announcement that it leaves. Down: every answer but the last, which nobody needs any more.
        progress_bytes = MESSAGE_HEADER_BYTES + 8
        assert report.bytes_up == rounds * model_bytes + steps * progress_bytes + MESSAGE_HEADER_BYTES
        assert report.bytes_down == (rounds - 1) * model_bytes
    # Each round costs an upload and a download on a 10 Mbit/s link with 100 ms each way; the run is
    # over when the last round is merged into Θ, before its answer travels back.
    one_way = 0.1 + model_bytes * 8 / 10e6
    assert result.training_time_s == pytest.approx(steps * 0.25 + (2 * rounds - 1) * one_way, rel=1e-6)


def test_data_parallel_pays_a_ring_all_reduce_every_step():
    sim = Simulation(tiny_config("strategy=ddp", "learners.count=4", "link.bandwidth_mbit=100", "link.latency_ms=10"))
    result = sim.run()
    steps = result.per_learner[0].steps
    grad_bytes = 4 * result.parameters
    share = 2 * 3 * grad_bytes // 4
    assert result.per_learner[0].bytes_up == steps * share
    step_comm = 2 * 3 * (0.01 + grad_bytes / 4 * 8 / 100e6)
    assert result.training_time_s == pytest.approx(steps * (0.25 + step_comm), rel=1e-6)
    assert result.goodput == pytest.approx(0.25 / (0.25 + step_comm), rel=1e-6)


def test_streaming_peak_bytes_are_about_a_fragment():
    common = ["outer.H=6", *FAST_LINK]
    diloco = simulate(tiny_config("strategy=diloco", *common))
    streaming = simulate(tiny_config("strategy=streaming", "outer.fragments=3", *common))
    assert streaming.peak_sync_bytes < 0.6 * diloco.peak_sync_bytes


def test_every_token_is_trained_and_merged_once():
    sim = Simulation(tiny_config("strategy=streaming", "outer.fragments=3", "outer.tau=2", "outer.alpha=0.5",
                                 "learners.speeds=[1, 0.5, 0.8]", "learners.jitter=0.3"))
    result = sim.run()
    budget = sim.config.train.tokens
    assert result.tokens <= budget and result.tokens > budget - 3 * 4 * 16
    for m, report in enumerate(result.per_learner):
        assert sim.syncer.ledger[m].tokens_merged == 3 * report.tokens  # every fragment covers every token
        assert sim.syncer.ledger[m].duplicates == 0
    assert result.eval_curve[-1]["tokens"] == result.tokens
    assert [p["tokens"] for p in result.eval_curve] == sorted(p["tokens"] for p in result.eval_curve)


def test_training_lowers_the_eval_loss():
    result = simulate(tiny_config("strategy=streaming", "outer.fragments=2", "train.tokens=40960"))
    assert result.final_eval_loss < 0.8 * 5.545  # ln 256: the loss of a uniform guess


def test_any_module_returning_a_loss_trains():
    sim = Simulation(tiny_config("strategy=streaming", "outer.fragments=2", "model.factory=toy_models:tiny_lm",
                                 "train.lr=0.02"))
    untrained = evaluate(sim.global_model(), sim.eval_batches)
    assert sim.run().final_eval_loss < untrained - 0.5
