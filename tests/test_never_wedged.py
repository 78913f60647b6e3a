"""A learner is never wedged by a syncer that cannot make its answers: the shard refuses each such
answer in one line and keeps the update stream open, and the learner, without its answer past a bound
derived from its measured times, trains on (a synchronous one stops waiting)."""

from __future__ import annotations

import time

import pytest
import torch

import diloco.shard.server as server_module
from test_faults import live_shard, tiny_model, train
from diloco.client.learner_client import Learner
from diloco.core.learner_core import ANSWER_PATIENCE

pytestmark = pytest.mark.integration  # a live shard over gRPC and learner threads


def _broken_answers(update, bulk=None, done=None):
    raise RuntimeError("cannot encode this answer")


@pytest.mark.parametrize("strategy", ["decoupled", "diloco"])
def test_a_shard_that_cannot_make_answers_does_not_wedge_the_learner(monkeypatch, caplog, strategy):
    monkeypatch.setattr(server_module, "update_frames", _broken_answers)
    shard, server, address = live_shard(f"strategy={strategy}", "learners.count=1", "outer.H=3",
                                        "outer.fragments=1", "outer.tau=1")
    try:
        learner = Learner(tiny_model(), syncer=address, learner=0)
        optimizer = torch.optim.SGD(learner.model.parameters(), lr=0.1)
        core = learner.core
        core.answer_floor_s = 0.0  # the measured bound alone: a few sync periods, not the floor's minute
        for _ in range(300):  # each step returns: a synchronous learner stops waiting once it gives up
            train(learner, optimizer, 1)
            time.sleep(0.02)
            if core.answers_given_up >= 2:
                break
        assert core.answers_given_up >= 1 and learner.merges == 0  # no answer was ever made
        assert shard.core.ledger[0].pushes >= 2  # after giving up it went on, and pushed again
        assert shard.streams[0] == 1  # the stream was never ended and reopened over the failure
        refusals = [r.getMessage() for r in caplog.records if "refused: RuntimeError" in r.getMessage()]
        assert refusals and all("\n" not in line for line in refusals)
        assert ANSWER_PATIENCE > 1
        learner.close()
    finally:
        shard.stop()
        server.stop(0)


def test_a_fast_learner_whose_answers_come_after_its_patience_learns_to_wait_for_them():
    """Steps of 4 ms against answers that take 0.5 s: the first pushes are given up before their answers come,
    a late answer's delay grows the patience, and the learner then merges the answers that follow."""
    from diloco.core.learner_core import GIVEN_UP_KEPT, LearnerCore
    from diloco.core.messages import Update
    from diloco.fragments import Fragment, Schedule

    core = LearnerCore(0, {"w": torch.zeros(4)}, [Fragment(0, ("w",), 4, False)], Schedule(2, 1), tau=1, alpha=0.0,
                       wait_for_updates=False)
    step_s, delay_s, now, version = 0.004, 0.5, 0.0, 0
    answers: list[tuple[float, Update]] = []

    def answer_later(pushes: list) -> None:
        nonlocal version
        for push in pushes:
            version += 1
            answers.append((now + delay_s, Update(0, version, {"w": torch.zeros(4)}, ack_seq=push.seq)))

    for _ in range(1500):
        now += step_s
        answer_later(core.on_step(10, step_time_s=step_s, now=now))
        while answers and answers[0][0] <= now:
            core.on_update(answers.pop(0)[1], now)
        answer_later(core.poll(now).pushes)
    assert core.answers_given_up >= 1 and core.stale_updates >= 1  # the first answers came too late
    assert core.answer_delay_s >= delay_s
    assert len(core.merge_lags) >= 5  # and later ones were merged
    assert core.answers_given_up <= 2 * GIVEN_UP_KEPT  # not every push, as before the late ones were measured
