"""The decisions both drivers take from `diloco.driver_kit`: each learner's plan and last step, the eval
marks, and the run's summary (whole tokens, one goodput)."""

from __future__ import annotations

import pytest

from conftest import tiny_config
from diloco.driver_kit.run_summary import LearnerOutcome, build_run_result, fleet_goodput, whole_tokens
from diloco.driver_kit.schedule import STEP_CAP, EvalMarks, learner_plan, learner_plans, planned_tokens
from diloco.results import LearnerReport
from diloco.sim.driver import Simulation


def outcome(learner: int, busy_s: float, split: dict[str, int], tokens: int) -> LearnerOutcome:
    report = LearnerReport(learner=learner, speed=1.0, tokens=tokens, steps=10, busy_s=busy_s, waiting_s=0.0,
                           down_s=0.0, bytes_up=100, bytes_down=50, eval_loss=2.0)
    return LearnerOutcome(report, split, round_records=[])


def test_goodput_is_busy_time_over_every_learners_time_in_the_run():
    # Two learners over a 10 s run: one busy 8 s, one 5 s (it waited or finished early): 13 of 20 s.
    assert fleet_goodput([8.0, 5.0], 10.0) == pytest.approx(0.65)
    result = build_run_result(
        strategy="diloco", outcomes=[outcome(0, 8.0, {"merged": 60, "stale": 0, "lost": 4}, 64),
                                     outcome(1, 5.0, {"merged": 30, "stale": 2, "lost": 0}, 32)],
        training_time_s=10.0, eval_curve=[{"time_s": 9.0, "tokens": 96, "loss": 2.5}], round_records=[],
        peak_sync_bytes=0, rounds=0, parameters=1)
    assert result.goodput == pytest.approx(0.65)
    assert result.goodput == pytest.approx(sum(r.busy_fraction for r in result.per_learner) / 2)
    assert (result.tokens_merged, result.tokens_stale, result.tokens_lost, result.tokens) == (90, 2, 4, 96)
    assert result.eval_curve[-1]["time_s"] == 10.0 and result.final_eval_loss == 2.5


@pytest.mark.parametrize("shares", [
    {"merged": 1000.4, "stale": 23.3, "lost": 0.3},
    {"merged": 0.5, "stale": 0.5, "lost": 0.0},
    {"merged": 99.999, "stale": 0.0, "lost": 0.001},
    {"merged": 12.0, "stale": 0.0, "lost": 0.0},
])
def test_whole_tokens_keep_their_sum_and_move_less_than_one_token(shares):
    whole = whole_tokens(shares)
    assert all(isinstance(v, int) for v in whole.values())
    assert sum(whole.values()) == round(sum(shares.values()))
    assert all(abs(whole[k] - shares[k]) < 1 for k in shares)


def test_a_shared_budget_plans_by_speed_and_waits_for_the_syncers_stop():
    config = tiny_config("strategy=decoupled", "learners.speeds=[1, 0.5]")
    plans = learner_plans(config)
    assert plans[0].planned_steps > plans[1].planned_steps  # the faster learner's share is larger
    assert [p.last_step for p in plans] == [p.planned_steps * STEP_CAP for p in plans]
    alone = learner_plan(config, 0, syncing=False)  # no syncer to say stop: it stops at its plan
    assert alone.last_step == alone.planned_steps


def test_an_own_budget_stops_every_learner_at_its_equal_share():
    config = tiny_config("strategy=diloco", "learners.count=3")
    t = config.train
    plans = learner_plans(config)
    assert {p.last_step for p in plans} == {config.token_budget() // (3 * t.batch_size * t.seq_len)}
    assert learner_plan(config, 7) == plans[-1]  # an elastic run's extra learner plans like the last one
    assert planned_tokens(config) == [p.planned_steps * t.batch_size * t.seq_len for p in plans]


def test_the_simulator_takes_its_plans_and_eval_marks_from_the_kit():
    config = tiny_config("strategy=decoupled", "learners.speeds=[1, 0.5, 0.25]", "train.eval_points=4")
    sim = Simulation(config)
    plans = learner_plans(config)
    assert [lr.replica.planned_steps for lr in sim.learners] == [p.planned_steps for p in plans]
    assert [lr.last_step for lr in sim.learners] == [p.last_step for p in plans]
    assert sim.eval_marks.marks == EvalMarks(config).marks


def test_eval_marks_fall_due_once_each_as_tokens_pass_them():
    config = tiny_config("train.eval_points=4")
    marks = EvalMarks(config)
    first, second, third = list(marks.marks)
    assert (marks.passed(first - 1), marks.passed(first), marks.passed(first)) == (0, 1, 0)
    assert marks.passed(third) == 2 and marks.passed(10 ** 12) == 0
