"""A learner that does not sync has no Θ to take at a restart: it resumes the parameters its own checkpoint
saved (a syncing learner's checkpoint holds none: Θ and its unpushed progress make them again)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import rank_procs
from conftest import TINY, tiny_config
from diloco.client.builtin_loop import run_learner
from diloco.client.checkpoints import read_checkpoint
from diloco.client.packed_state import unpacked
from diloco.errors import DilocoError
from diloco.state_files import load_checked, save_checked


@pytest.mark.integration  # two whole learners, in this process
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_learner_that_does_not_sync_resumes_its_own_parameters(tmp_path, framework):
    if framework == "jax":
        pytest.importorskip("jax")
        from diloco.jax.jax_loop import run_jax_learner as run
    else:
        run = run_learner
    config = tiny_config()
    first = run(config, syncer=None, learner=0, out=tmp_path)
    again = run(config, syncer=None, learner=0, out=tmp_path)  # its plan is done: no step more
    assert again["resumed_from_step"] == first["steps"] == again["steps"] > 0
    assert again["eval_loss"] == first["eval_loss"]  # the trained parameters, not fresh ones


@pytest.mark.integration  # two lives of a 2-rank FSDP learner, each its own processes
def test_a_sharded_learner_that_does_not_sync_resumes_its_own_rows(tmp_path):
    """Its DCP checkpoint keeps its rows of the parameters (a syncing one's keeps none) and a restart
    loads them into every rank."""
    argv = [sys.executable, "-m", "diloco.learner", "--no-sync", "--id", "0", "--out", str(tmp_path), "-q",
            *[x for item in [*TINY, "train.sharding=fsdp"] for x in ("--set", item)]]
    reports = []
    for life in range(2):
        codes, logs, _ = rank_procs.launch(2, argv, tmp_path, 300, log_name=f"life-{life}-rank")
        assert codes == [0, 0], logs[0][-3000:]
        reports.append(json.loads((tmp_path / "learners" / "learner-0.json").read_text()))
    first, again = reports
    assert again["resumed_from_step"] == first["steps"] == again["steps"] > 0
    assert again["eval_loss"] == first["eval_loss"]


def test_saved_parameters_that_do_not_fit_the_model_are_refused_in_one_line(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "learner-0.pt"
    save_checked({"model": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, "optimizer": optimizer.state_dict(),
                  "data": {"learner": 0, "epoch": 0, "index": 0}, "steps": 1}, path)
    assert read_checkpoint(path, 10, optimizer)["steps"] == 1  # a syncing learner does not read them
    with pytest.raises(DilocoError) as refused:
        read_checkpoint(path, 10, optimizer, params=model.state_dict())
    line = str(refused.value)
    assert "\n" not in line and "'weight' of another shape" in line and str(path) in line and "delete it" in line
    saved = unpacked(load_checked(path, "", ""))
    del saved["model"]
    save_checked(saved, path)
    with pytest.raises(DilocoError, match="holds no parameters of this model"):
        read_checkpoint(path, 10, optimizer, params=model.state_dict())
