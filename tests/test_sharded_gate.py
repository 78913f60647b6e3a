"""Which pushes a sharded learner's checkpoints are forced by (`builtin_loop.hold_pushes`,
`ShardedWriter.gated`): where rank 0 holds each push until a checkpoint records it (a strategy that does
not wait for answers), a new push makes a checkpoint due at once on every rank; where pushes go at once
(synchronous strategies), checkpoints keep their period."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diloco.client import sharded_checkpoints
from diloco.client.builtin_loop import hold_pushes
from diloco.client.learner_client import Learner
from diloco.client.push_gate import PushGate
from diloco.client.sharded_checkpoints import ShardedWriter


def _writer(seq: int) -> ShardedWriter:
    writer = object.__new__(ShardedWriter)  # no process group: its collective is stood in for below
    writer.learner = SimpleNamespace(core=SimpleNamespace(seq=seq))
    writer.saved_step, writer.saved_seq, writer.period, writer.gated = 5, 3, 10, False
    writer.copy_s, writer.skipped, writer._thread = 0.0, 0, None
    return writer


def _learner(waits: bool) -> Learner:
    learner = object.__new__(Learner)
    learner.core, learner.push_gate = SimpleNamespace(wait_for_updates=waits), PushGate()
    return learner


@pytest.mark.parametrize("waits,gated", [(False, True), (True, False)])
@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_knows_whether_pushes_are_held_and_rank_0_holds_them(waits: bool, gated: bool, rank: int) -> None:
    writer, learner = _writer(4), _learner(waits)
    hold_pushes(writer, learner, rank)
    assert writer.gated == gated
    assert learner.push_gate.pending(1) == (gated and rank == 0)


def test_a_new_push_forces_a_checkpoint_only_where_pushes_are_held(monkeypatch: pytest.MonkeyPatch) -> None:
    agreed = []

    def all_reduce(shared: torch.Tensor, op: object = None) -> None:
        agreed.append(True)
        shared[0] = 1.0  # a write is on its way somewhere: the due checkpoint is skipped

    monkeypatch.setattr(sharded_checkpoints.dist, "all_reduce", all_reduce)
    writer = _writer(4)  # a push (4) after the last checkpoint's (3), 1 step of a 10-step period since
    assert not writer.maybe_save(None, SimpleNamespace(steps=6), 0.1) and not agreed  # not due
    writer.gated = True
    assert not writer.maybe_save(None, SimpleNamespace(steps=6), 0.1) and agreed == [True] and writer.skipped == 1
