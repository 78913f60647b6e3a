"""A learner SIGKILLed at a known step loses at most what it trained since its last checkpoint: its
restart puts its own unpushed progress back on top of Θ and pushes it, and nothing is counted twice.
Pushes do not wait for a checkpoint: the learner is killed after a push that followed its last one where
the period leaves such a moment, and only the fragments pushed after it take Θ (their shard counted that
progress); the others resume."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import TINY, child_env, freeze_when, tiny_config, wait_for
from diloco.client.packed_state import unpacked
from diloco.launch.processes import Children
from diloco.launch.spare import Spares
from diloco.metrics.records import learner_lives, records_of
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.state_files import load_checked

pytestmark = pytest.mark.integration  # a live shard over gRPC and learner processes

SETTINGS = ("learners.count=1", "outer.H=8", "outer.fragments=2", "train.tokens=6400",
            "metrics.every_steps=1")
TOKENS_PER_STEP = 4 * 16  # TINY's batch × sequence
KILL_AT_STEP = 30
FALLBACK_STEPS = 10
"""Steps past KILL_AT_STEP after which the learner is killed even if no push has followed its last checkpoint
(a checkpoint period of one step leaves almost no such moment): then every fragment resumes."""


def _learner_argv(address: str, out, *extra: str) -> list[str]:
    sets = [x for o in (*TINY, *SETTINGS, *extra) for x in ("--set", o)]
    return [sys.executable, "-m", "diloco", "learner", "--syncer", address, "--id", "0", "--out", str(out), *sets]


def out_tail(out) -> str:
    return "the kill step; the learner's log ends: " + (out / "logs" / "learner-0.log").read_text()[-2000:]


def counted_seqs_now(shard) -> dict[int, int]:
    """Per fragment, the newest push of learner 0 the shard has counted (`JoinReply.fragment_last_seq`)."""
    with shard.lock:
        entry = shard.core.ledger.get(0) if shard.core is not None else None
        return {p: entry.pushed(p) for p in shard.owned} if entry is not None else {}


def newest_push_step(shard) -> int:
    """The inner step learner 0's newest counted push of this life covered: it trained at least that far,
    even where its metrics had not yet recorded that step (a push goes before the step's record)."""
    with shard.lock:
        counters = shard.core.claims.counters.get(0)
        return max(counters.covered.values(), default=0) if counters is not None else 0


def counted_seqs(shard) -> dict[int, int]:
    """`counted_seqs_now` once no push of a killed process is still being taken (two reads alike, a
    moment apart)."""
    seen = [counted_seqs_now(shard)]

    def settled() -> bool:
        time.sleep(0.2)
        seen.append(counted_seqs_now(shard))
        return seen[-1] == seen[-2]

    wait_for(settled, 30, "the shard to take the killed learner's last pushes")
    return seen[-1]


def saved_seq(path) -> int:
    """The newest push a checkpoint on disk records (`sync.seq`; no checkpoint yet: above every push)."""
    return unpacked(load_checked(path, "checkpoint", ""))["sync"]["seq"] if path.is_file() else 1 << 62


def pushed_after(seqs: dict[int, int], checkpoint_seq: int) -> set[int]:
    """The fragments whose shard counted a push made after the checkpoint: they take Θ at the restart."""
    return {p for p, seq in seqs.items() if seq > checkpoint_seq}


def _steps(out) -> int:
    path = out / "metrics" / "learner-0.jsonl"
    records = records_of(path, "learner") if path.is_file() else []
    return records[-1]["steps"] if records else 0


@pytest.mark.parametrize("resume,spare", [("own", False), ("theta", False), ("own", True)])
def test_a_learner_killed_at_a_known_step_loses_at_most_the_steps_since_its_checkpoint(tmp_path, resume, spare):
    """`spare`: the second life is a pre-started spare that takes the killed learner's place (`diloco chaos`'s
    restarts): the same resume, in a process that had imported everything before the kill."""
    shard = SyncerShard(tiny_config(*SETTINGS), ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    children, env = Children(tmp_path / "logs"), child_env()
    spares = Spares(children, env, 1 if spare else 0)
    try:
        spares.fill()
        children.start("learner-0", _learner_argv(address, tmp_path, f"failures.resume={resume}"), env)
        first = children.children["learner-0"].process
        freeze_when([first.pid], lambda: _steps(tmp_path) >= KILL_AT_STEP or first.poll() is not None,
                    lambda: first.poll() is not None or _steps(tmp_path) >= KILL_AT_STEP + FALLBACK_STEPS or pushed_after(
                        counted_seqs_now(shard), saved_seq(tmp_path / "checkpoints" / "learner-0.pt")),
                    120, lambda: out_tail(tmp_path))
        children.kill("learner-0")  # frozen after a push that followed the last checkpoint
        saved = unpacked(load_checked(tmp_path / "checkpoints" / "learner-0.pt", "checkpoint", ""))
        checkpointed, after = saved["steps"], pushed_after(counted_seqs(shard), saved["sync"]["seq"])
        recorded = _steps(tmp_path)
        killed_at = max(recorded, newest_push_step(shard))  # the freeze may fall between a push and its record
        assert "model" not in saved  # Θ and the saved unpushed progress make the parameters again
        waiting = [c.process.pid for c in spares.waiting()]
        second = spares.restart("learner-0")
        assert (second.process.pid in waiting) == spare  # the spare became the learner, in the same process
        assert second.process.wait(timeout=600) == 0, out_tail(tmp_path)
        wait_for(lambda: shard.finished, 30, "the run to end")
    finally:
        children.close()
        shard.stop()
        server.stop(0)
    lives = learner_lives(tmp_path / "metrics")[0]
    assert len(lives) == 2 and lives[0]["steps"] == recorded and killed_at - recorded <= 1
    trained = killed_at * TOKENS_PER_STEP + lives[1]["tokens"]
    entry = shard.core.ledger[0]
    assert entry.duplicates == 0
    (start,) = [r for r in records_of(tmp_path / "metrics" / "learner-0.jsonl", "start") if r["steps"] > 0]
    assert start["steps"] == checkpointed and start["spare"] == spare
    since_checkpoint = (killed_at - checkpointed) * TOKENS_PER_STEP
    for p in range(2):
        lost = trained - entry.merged[p] - entry.stale[p]
        assert lost >= -1e-6  # never more merged than trained
        if resume == "own":
            assert lost <= since_checkpoint + 1e-6, (p, lost, since_checkpoint)
    assert start["resumed_fragments"] == (2 - len(after) if resume == "own" else 0)  # the others resumed
