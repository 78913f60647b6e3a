"""A sharded learner's checkpoint copy (`client/checkpoint_staging.py`): the staged state is what the live
state was at the copy, training changes after it do not reach it, the buffers are kept from one checkpoint
to the next, and the own progress (a copy already) is passed as it is."""

from __future__ import annotations

import torch

from diloco.client.checkpoint_staging import KeptStaging


def _state(weight: torch.Tensor, step: float) -> dict:
    return {"model": {"w": weight}, "optimizer": {"state": {0: {"step": torch.tensor(step), "exp_avg": weight * 2}},
                                                  "param_groups": [{"lr": 0.1, "params": [0]}]},
            "progress": {"0": {"unpushed": {"w": torch.ones(3)}}}}


def test_the_staged_copy_is_the_state_at_the_copy_and_its_buffers_are_kept() -> None:
    stager, weight = KeptStaging(), torch.arange(6.0).reshape(2, 3)
    live = _state(weight, 1.0)
    first = stager.stage(live)
    assert torch.equal(first["model"]["w"], weight) and first["model"]["w"] is not weight
    assert first["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert first["progress"] is live["progress"]  # not copied again
    weight.add_(100.0)  # training goes on: the copy does not move
    assert torch.equal(first["model"]["w"], torch.arange(6.0).reshape(2, 3))
    second = stager.stage(_state(weight, 2.0))
    assert second["model"]["w"] is first["model"]["w"]  # the same buffer, rewritten (the write before is done)
    assert torch.equal(second["model"]["w"], weight) and float(second["optimizer"]["state"][0]["step"]) == 2.0
    bigger = stager.stage(_state(torch.zeros(4, 3), 3.0))  # another shape at that place: a buffer of its own
    assert bigger["model"]["w"].shape == (4, 3)
