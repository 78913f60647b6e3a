"""Checkpoints keep the period their cost allows, whatever the pushes do: a push no longer waits for a
checkpoint recording it (a restart checks each fragment's own newest counted push instead,
`core/own_progress.py`), so no push makes a checkpoint due, on an unsharded learner or on any rank of a
sharded one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diloco.client import sharded_checkpoints
from diloco.client.checkpoints import BASELINE_STEPS, CheckpointPacer, CheckpointWriter
from diloco.client.sharded_checkpoints import ShardedWriter


def _sharded_writer(seq: int) -> ShardedWriter:
    writer = object.__new__(ShardedWriter)  # no process group: its collective is stood in for below
    writer.learner = SimpleNamespace(core=SimpleNamespace(seq=seq))
    writer.pacer = CheckpointPacer(most_every=25)
    writer.pacer.saved_step, writer.pacer.period = 5, 10
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
    # the first once a plain step's time is known, then every `most_every` steps (steps cost ~nothing)
    assert saved == [BASELINE_STEPS, BASELINE_STEPS + 4, BASELINE_STEPS + 8]


def _paced(step_s_while_writing: float, copy_s: float) -> CheckpointPacer:
    """A pacer through its first checkpoint: plain steps of 1 s, a copy of `copy_s`, then two steps written
    beside (each taking `step_s_while_writing`), the write done at the end of the second."""
    pacer = CheckpointPacer(most_every=1000)
    for step in range(1, BASELINE_STEPS + 1):
        pacer.step(1.0, writing=False)
    assert pacer.may_be_due(BASELINE_STEPS) and pacer.due(BASELINE_STEPS, *pacer.figures())
    pacer.saved(BASELINE_STEPS, copy_s)
    pacer.step(step_s_while_writing, writing=True)
    pacer.step(step_s_while_writing, writing=False)
    return pacer


def test_a_checkpoint_measures_the_time_steps_lose_while_it_is_written_and_its_copy_sets_the_period():
    pacer = _paced(step_s_while_writing=1.5, copy_s=0.05)  # a write on the cores training uses: 1 s lost
    copy_s, step_s = pacer.figures()
    assert pacer.cost_s == pytest.approx(1.05) and pacer.cost_total_s == pytest.approx(1.05)  # reported
    assert copy_s == 0.05 and step_s == 1.0  # the plain steps' median: steps beside a write are not in it
    assert not pacer.due(BASELINE_STEPS + 2, copy_s, step_s)
    assert pacer.period == 5  # the copy within 1% of 1 s steps
    assert not pacer.may_be_due(BASELINE_STEPS + 4) and pacer.may_be_due(BASELINE_STEPS + 5)


def test_a_write_that_slows_no_step_costs_its_copy_only():
    pacer = _paced(step_s_while_writing=0.9, copy_s=0.05)  # beside a GPU's steps: none slower (one faster)
    assert pacer.cost_s == pytest.approx(0.05)  # a step faster than usual is no credit


@pytest.mark.parametrize("counts_write, period", [(False, 1), (True, 21)], ids=["beside a GPU", "on the CPUs"])
def test_a_writer_on_the_cpus_training_uses_counts_its_writes_cpu_in_the_period(tmp_path, counts_write, period):
    """Training on the CPU loses the write's CPU time to it, so the period keeps copy and write within 1%
    of the steps; a GPU's step loses only the copy."""
    writer = CheckpointWriter(tmp_path / "learner.pt", most_every=1000, counts_write=counts_write)
    for step in range(1, BASELINE_STEPS + 1):
        writer.maybe_save(step, 0.1, lambda: {"steps": step})
    writer.wait()
    assert writer.written == 1
    writer.copy_s, writer.write_cpu_s = 0.001, 0.020  # 1 ms of copy, 20 ms of the write's CPU; 100 ms steps
    saved = [step for step in range(BASELINE_STEPS + 1, BASELINE_STEPS + 30)
             if writer.maybe_save(step, 0.1, lambda: {"steps": 0}) or writer.wait()]
    assert writer.pacer.period == period and saved[0] == BASELINE_STEPS + period
