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
