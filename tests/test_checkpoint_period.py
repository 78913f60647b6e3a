"""Checkpoints keep the period their cost allows, whatever the pushes do: a push no longer waits for a
checkpoint recording it (a restart checks each fragment's own newest counted push instead,
`core/own_progress.py`), so no push makes a checkpoint due, on an unsharded learner or on any rank of a
sharded one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diloco.client import sharded_checkpoints
from diloco.client.checkpoints import CheckpointWriter
from diloco.client.sharded_checkpoints import ShardedWriter


def _sharded_writer(seq: int) -> ShardedWriter:
    writer = object.__new__(ShardedWriter)  # no process group: its collective is stood in for below
    writer.learner = SimpleNamespace(core=SimpleNamespace(seq=seq))
    writer.saved_step, writer.period = 5, 10
    writer.copy_s, writer.skipped, writer._thread = 0.0, 0, None
    return writer


def test_a_sharded_writer_takes_no_checkpoint_for_a_new_push_before_its_period(monkeypatch: pytest.MonkeyPatch) -> None:
    agreed = []

    def all_reduce(shared: torch.Tensor, op: object = None) -> None:
        agreed.append(True)
        shared[0] = 1.0  # a write is on its way somewhere: the due checkpoint is skipped

    monkeypatch.setattr(sharded_checkpoints.dist, "all_reduce", all_reduce)
    writer = _sharded_writer(seq=40)  # many pushes since the last checkpoint, 1 step of a 10-step period
    assert not writer.maybe_save(None, SimpleNamespace(steps=6), 0.1) and not agreed
    assert not writer.maybe_save(None, SimpleNamespace(steps=15), 0.1) and agreed == [True]  # due: its period


def test_an_unsharded_writer_saves_at_its_period_only(tmp_path) -> None:
    writer = CheckpointWriter(tmp_path / "learner.pt", most_every=4)
    saved = []
    for step in range(1, 13):
        if writer.maybe_save(step, 1e-9, lambda: {"steps": step}):
            saved.append(step)
        writer.wait()  # each write done before the next step: none is skipped
    assert saved == [1, 5, 9]  # the first at once, then every `most_every` steps (steps cost ~nothing)
