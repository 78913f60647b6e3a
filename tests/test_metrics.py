"""Metrics hold the right values: tokens add up to what learners trained, bytes to what the links
counted, rounds to what the syncer merged; and every sink gets them under the catalog's names."""

from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import tiny_config
from diloco.errors import DilocoError
from diloco.metrics import CATALOG, MetricsLog, open_metrics
from diloco.metrics.sinks import PrometheusSink
from diloco.sim.driver import Simulation


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def last_by_learner(records):
    last = {}
    for r in records:
        if r["kind"] == "learner":
            last[r["learner"]] = r
    return last


@pytest.mark.integration  # a whole training run in the simulator
def test_simulated_metrics_add_up_to_what_was_trained_sent_and_merged(tmp_path):
    config = tiny_config("learners.speeds=[1, 0.5]", "outer.fragments=2", "metrics.every_steps=3")
    log = open_metrics(tmp_path, origin=0.0)
    result = Simulation(config, metrics=log).run()
    log.close()
    records = read_records(tmp_path / "metrics.jsonl")
    assert {r["kind"] for r in records} == {"learner", "round", "eval", "syncer"}
    for r in records:  # only the catalog's names, besides kind, time and labels
        assert set(r) - {"kind", "time_s"} <= set(CATALOG[r["kind"]]) | {"learner", "shard", "fragment"}
    last = last_by_learner(records)
    for report in result.per_learner:
        final = last[report.learner]
        assert (final["tokens"], final["steps"]) == (report.tokens, report.steps)
        assert (final["bytes_up"], final["bytes_down"]) == (report.bytes_up, report.bytes_down)
        assert final["outer_grad_norm"] > 0 and final["loss"] > 0
    rounds = [r for r in records if r["kind"] == "round"]
    assert len(rounds) == result.rounds
    # Every token is merged once per fragment, on time or stale.
    assert sum(r["tokens"] for r in rounds) == 2 * result.tokens
    assert all(r["update_norm"] > 0 for r in rounds)
    assert all((r["cosine"] is None) == (len(r["participants"]) == 1) for r in rounds)
    assert all(-1 <= r["cosine"] <= 1 for r in rounds if r["cosine"] is not None)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[-1]["loss"] == pytest.approx(result.final_eval_loss)


def test_round_cosine_is_one_for_identical_learners_and_the_norm_is_the_step():
    from diloco.core.syncer_core import mean_cosine

    import torch
    same = torch.tensor([1.0, 2.0])
    assert mean_cosine([same, same, same]) == pytest.approx(1.0)
    assert mean_cosine([same, torch.tensor([-1.0, -2.0])]) == pytest.approx(-1.0)
    assert mean_cosine([same]) is None


@pytest.mark.integration  # a live HTTP server
def test_prometheus_serves_the_latest_value_of_each_metric_with_labels():
    sink = PrometheusSink(0, host="127.0.0.1")
    log = MetricsLog([sink])
    log.record("learner", 1.0, learner=2, tokens=100, steps=3, bytes_up=7)
    log.record("learner", 2.0, learner=2, tokens=160, steps=4, bytes_up=9)
    log.record("round", 2.0, shard=0, fragment=1, participants=[0, 2], update_norm=0.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10).read().decode()
    log.close()
    assert 'diloco_learner_tokens{learner="2"} 160.0' in text
    assert 'diloco_learner_bytes_up{learner="2"} 9.0' in text
    assert 'diloco_round_participants{fragment="1",shard="0"} 2.0' in text


def test_tensorboard_gets_every_numeric_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = open_metrics(tmp_path, tensorboard=True, origin=0.0)
    log.record("learner", 0.5, learner=0, tokens=64, loss=3.5, outer_grad_norm=None)
    log.record("eval", 1.0, tokens=64, loss=3.25)
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "metrics"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "learner/learner0/tokens" in tags and "eval/run/loss" in tags
    assert "learner/learner0/outer_grad_norm" not in tags  # none yet: not a zero
    assert events.Scalars("eval/run/loss")[0].value == pytest.approx(3.25)


def test_asking_for_a_sink_that_is_not_installed_fails_clearly(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(DilocoError, match="Weights & Biases is not installed"):
        open_metrics(tmp_path, wandb="my-project")


def test_a_metric_kind_outside_the_catalog_is_refused():
    with pytest.raises(ValueError, match="unknown metric kind"):
        MetricsLog([]).record("learnr", 0.0, tokens=1)


def test_learner_lives_split_at_each_start_even_a_life_of_one_step(tmp_path):
    """A resumed life counts tokens from zero but steps on from its checkpoint: a life that trained one
    step before it was killed shows no fall in either counter, and only its `start` record ends the life
    before it (a torn last line is skipped, as a kill leaves it)."""
    from diloco.metrics.records import learner_lives

    def learner(tokens: int, steps: int) -> dict:
        return {"kind": "learner", "learner": 3, "tokens": tokens, "steps": steps}

    lines = [{"kind": "start", "learner": 3, "steps": 0}, learner(1024, 1), learner(2048, 2),
             {"kind": "start", "learner": 3, "steps": 2}, learner(1024, 3),
             {"kind": "start", "learner": 3, "steps": 3}, learner(1024, 4), learner(2048, 5)]
    path = tmp_path / "learner-3.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "learn')
    lives = learner_lives(tmp_path)
    assert [(life["tokens"], life["steps"]) for life in lives[3]] == [(2048, 2), (1024, 3), (2048, 5)]
    # Without start records (an older file), a fall in the counters still ends a life.
    path.write_text("".join(json.dumps(line) + "\n" for line in lines if line["kind"] == "learner"))
    assert [(life["tokens"], life["steps"]) for life in learner_lives(tmp_path)[3]] == [(2048, 2), (2048, 5)]


def test_a_real_learners_meter_records_every_step_that_pushed_as_well_as_its_period(tmp_path):
    """A life killed between periodic records must not show more tokens merged than recorded trained: with
    `at_pushes` a step whose core made a push (its sequence number moved) is recorded at once."""
    from types import SimpleNamespace

    from diloco.metrics.records import LearnerMeter, records_of

    def run(at_pushes: bool) -> list[int]:
        path = tmp_path / f"at-{at_pushes}.jsonl"
        log = open_metrics(tmp_path, name=path.stem)
        meter, core = LearnerMeter(log, 0, every_steps=10, at_pushes=at_pushes), SimpleNamespace(
            seq=0, last_push_norm=None, last_staleness=None, anchor_versions=[0])
        for step in range(1, 25):
            if step in (3, 4, 17):  # pushes made at these steps
                core.seq += 1
            meter.step(step * 0.1, steps=step, tokens=step * 1024, busy_fraction=1.0, step_time_s=0.1,
                       bytes_up=0, bytes_down=0, loss=lambda: None, core=core)
        log.close()
        return [r["steps"] for r in records_of(path, "learner")]

    assert run(at_pushes=False) == [10, 20]
    assert run(at_pushes=True) == [1, 3, 4, 10, 17, 20]  # and a life's first step (a push may come with it)
