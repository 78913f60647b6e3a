"""benchmarks/churn_sim.py stays runnable and says what it claims: the chaos command's kills become the
simulator's crashes and outages (the same victims at the same times), and a tiny run compares a faulty
simulation with its fault-free twin."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import churn_sim  # noqa: E402  (the benchmark itself)
from conftest import TINY  # noqa: E402
from diloco.config import load_config  # noqa: E402
from diloco.launch.chaos import Kill, plan_kills  # noqa: E402


def test_learner_kills_become_crashes_and_a_syncer_kill_every_link_down():
    kills = [Kill(1.5, "learner-2"), Kill(3.0, "syncer-0"), Kill(4.25, "learner-0")]
    config = load_config(None, [*TINY, "learners.count=3", *churn_sim.failures_of(kills, 3, 0.5)])
    assert [(c.learner, c.at_s) for c in config.failures.crashes] == [(2, 1.5), (0, 4.25)]
    assert [(o.learner, o.at_s, o.duration_s) for o in config.failures.outages] == [(m, 3.0, 0.5) for m in range(3)]
    assert config.failures.recovery_s == 0.5


def test_the_schedule_is_the_chaos_commands_for_the_same_seed():
    ours = plan_kills(random.Random(1), 4, 1, 10, 2, 20.0)
    again = plan_kills(random.Random(1), 4, 1, 10, 2, 20.0)
    assert [(k.victim, k.at_s) for k in ours] == [(k.victim, k.at_s) for k in again]
    assert sum(k.victim.startswith("syncer-") for k in ours) == 2


@pytest.mark.integration  # two whole simulated training runs: the clean one and its faulty twin
def test_a_tiny_run_writes_its_comparison(tmp_path, monkeypatch):
    out = tmp_path / "churn.json"
    args = ["churn_sim.py", "--kill-learners", "2", "--kill-syncer", "1", "--json", str(out),
            *[x for item in [*TINY, "learners.count=2", "train.tokens=4096"] for x in ("--set", item)]]
    monkeypatch.setattr(sys, "argv", args)
    assert churn_sim.main() == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert len(run["kills"]) == 3 and run["recovery_s"] > 0
    assert run["faulty"]["tokens"] >= run["clean"]["tokens"] > 0
    assert run["loss_vs_clean"] == run["faulty"]["final_eval_loss"] / run["clean"]["final_eval_loss"] - 1
