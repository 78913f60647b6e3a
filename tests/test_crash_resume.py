"""A learner SIGKILLed at a known step loses at most what it trained since its last checkpoint: its
restart puts its own unpushed progress back on top of Θ and pushes it, and nothing is counted twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import TINY, child_env, tiny_config, wait_for
from diloco.metrics.records import learner_lives, records_of
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.state_files import load_checked

pytestmark = pytest.mark.integration  # a live shard over gRPC and learner processes

SETTINGS = ("learners.count=1", "outer.H=8", "outer.fragments=2", "train.tokens=6400",
            "metrics.every_steps=1")
TOKENS_PER_STEP = 4 * 16  # TINY's batch × sequence
KILL_AT_STEP = 30


def _learner(address: str, out, *extra: str) -> subprocess.Popen:
    sets = [x for o in (*TINY, *SETTINGS, *extra) for x in ("--set", o)]
    return subprocess.Popen([sys.executable, "-m", "diloco", "learner", "--syncer", address, "--id", "0",
                             "--out", str(out), *sets], env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=open(out / "learner.log", "ab"), start_new_session=True)


def out_tail(out) -> str:
    return "the kill step; the learner's log ends: " + (out / "learner.log").read_text()[-2000:]


def _steps(out) -> int:
    path = out / "metrics" / "learner-0.jsonl"
    records = records_of(path, "learner") if path.is_file() else []
    return records[-1]["steps"] if records else 0


@pytest.mark.parametrize("resume", ["own", "theta"])
def test_a_learner_killed_at_a_known_step_loses_at_most_the_steps_since_its_checkpoint(tmp_path, resume):
    shard = SyncerShard(tiny_config(*SETTINGS), ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    try:
        first = _learner(address, tmp_path, f"failures.resume={resume}")
        wait_for(lambda: _steps(tmp_path) >= KILL_AT_STEP, 120, lambda: (out_tail(tmp_path)))
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        killed_at = _steps(tmp_path)
        checkpointed = load_checked(tmp_path / "checkpoints" / "learner-0.pt", "checkpoint", "")["steps"]
        second = _learner(address, tmp_path, f"failures.resume={resume}")
        assert second.wait(timeout=600) == 0
        wait_for(lambda: shard.finished, 30, "the run to end")
    finally:
        shard.stop()
        server.stop(0)
    lives = learner_lives(tmp_path / "metrics")[0]
    assert len(lives) == 2 and lives[0]["steps"] == killed_at
    trained = sum(life["tokens"] for life in lives)
    entry = shard.core.ledger[0]
    assert entry.duplicates == 0
    (start,) = [r for r in records_of(tmp_path / "metrics" / "learner-0.jsonl", "start") if r["steps"] > 0]
    assert start["steps"] == checkpointed
    since_checkpoint = (killed_at - checkpointed) * TOKENS_PER_STEP
    for p in range(2):
        lost = trained - entry.merged[p] - entry.stale[p]
        assert lost >= -1e-6  # never more merged than trained
        if resume == "own":
            assert start["resumed_fragments"] == 2
            assert lost <= since_checkpoint + 1e-6, (p, lost, since_checkpoint)
