"""Learners of several ranks in `diloco run`: `learners.ranks` and `learners.sharding` are checked with one
line each, a rank group starts its ranks with torchrun's environment and ends with its first failure,
and a run with a 2-rank FSDP learner, a 2-rank DDP learner and a 1-process learner accounts every token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import TINY, tiny_config
from diloco.errors import ConfigError
from diloco.launch import rank_group

MIXED = ["learners.speeds=[1, 1, 0.5]", "learners.ranks=[2, 2, 1]", 'learners.sharding=["fsdp", "ddp", "ddp"]']


@pytest.mark.parametrize("sets,words", [
    (["learners.count=3", "learners.ranks=[2, 2]"], "learners.ranks' must have one entry per learner"),
    (["learners.count=2", "learners.ranks=[0, 1]"], "learners.ranks[0]' must be a whole number"),
    (["learners.count=2", "learners.ranks=[5000, 1]"], "learners.ranks[0]' must be in [1, 1,024]"),
    (["learners.count=2", 'learners.sharding=["fsdp", "ddp"]'], "give this learner at least 2 in learners.ranks"),
    (["learners.count=2", "learners.ranks=[2, 2]", 'learners.sharding=["tp", "ddp"]'], "must be one of ddp"),
    (["learners.count=2", "learners.ranks=[2, 1]", 'learners.frameworks=["jax", "torch"]'],
     "must be 1 for a JAX learner"),
    (["learners.count=2", "learners.ranks=[2, 1]", "cluster.learner_processes=4"], "set one of the two"),
])
def test_bad_rank_groups_are_refused_in_one_line(sets, words):
    with pytest.raises(ConfigError) as refused:
        tiny_config(*sets)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_learner_sharding_entry_overrides_train_sharding():
    config = tiny_config(*MIXED, "train.sharding=hsdp")
    assert [config.learners.sharding_of(m, config.train.sharding) for m in (0, 1, 2, None)] == \
        ["fsdp", "ddp", "ddp", "hsdp"]
    assert [config.learners.ranks_of(m) for m in range(4)] == [2, 2, 1, 1]  # 3: an elastic newcomer


def test_a_rank_group_gives_torchruns_environment_and_ends_with_its_first_failure(tmp_path, monkeypatch):
    """Every rank sees the same world and rendezvous port; rank 1 fails, rank 0 hangs: the group kills
    rank 0 after the grace and exits with rank 1's code."""
    monkeypatch.setattr(rank_group, "PEERS_GRACE_S", 0.5)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    script = (f"import os, sys, time, json; r = int(os.environ['RANK']); open(r'{tmp_path}/' + str(r), 'w')"
              f".write(json.dumps({{k: os.environ[k] for k in {keys!r}}})); "
              "sys.exit(3) if r == 1 else time.sleep(60)")
    started = time.monotonic()
    code = rank_group.run_group(2, [sys.executable, "-c", script])
    assert code == 3 and time.monotonic() - started < 30
    envs = [json.loads((tmp_path / str(r)).read_text()) for r in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["MASTER_ADDR"] == "127.0.0.1"
    assert rank_group.group_command(1, ["x"]) == ["x"]  # one process: no group around it


def diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=400)


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


@pytest.mark.integration  # diloco run: a syncer and three learners of 2, 2 and 1 processes
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed (Gloo)")
def test_a_run_with_fsdp_ddp_and_single_process_learners_accounts_every_token(tmp_path: Path):
    done = diloco("run", *sets(*TINY, "train.tokens=20480", *MIXED), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    reports = [json.loads((tmp_path / "learners" / f"learner-{m}.json").read_text()) for m in range(3)]
    assert [r["world"] for r in reports] == [2, 2, 1]
    assert all(r["tokens"] > 0 and r["pushes"] > 0 and not r["interrupted"] for r in reports)
    assert reports[0]["bytes_between_ranks"] > 0  # the FSDP learner's pushes were gathered over its group
    assert summary["tokens"] == sum(r["tokens"] for r in reports)
    assert summary["tokens_merged"] + summary["tokens_stale"] + summary["tokens_lost"] == summary["tokens"]
    assert summary["tokens_lost"] == 0 and summary["duplicates"] == 0
    assert all(p["tokens_lost"] == 0 and p["crashes"] == 0 for p in summary["per_learner"])
    folder = tmp_path / "checkpoints" / "learner-0.dcp"  # the FSDP learner: every rank wrote its rows
    assert (folder / "latest").is_file()  # it names the complete one of the two slots
    assert any(sorted(f.name for f in slot.glob("rank-*.state")) == ["rank-0.state", "rank-1.state"]
               for slot in folder.iterdir() if slot.is_dir())
    assert (tmp_path / "checkpoints" / "learner-1.pt").is_file()


@pytest.mark.integration  # `diloco sim` as a process: a whole simulated training run
def test_the_simulator_ignores_rank_groups_in_one_warning_line(tmp_path):
    done = diloco("sim", *sets(*TINY, *MIXED, "train.tokens=1920"), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "learners.ranks" in line]
    assert len(warnings) == 1 and "ignored by `diloco sim`" in warnings[0]
