"""A sharded learner (FSDP2, HSDP; each rank a process, Gloo on CPU) resumes its own unpushed progress
after a crash, as an unsharded one does (`core/own_progress.py`): its DCP checkpoint holds each rank's
rows of that progress, a restart puts them back on top of Θ through the same decision, with the same
world size or another, and a damaged checkpoint is refused in one line by every rank with nothing changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import rank_procs
from conftest import TINY, freeze_when, serving_shard, wait_for
from diloco.client.sharded_checkpoints import _current, sidecar
from diloco.metrics.records import learner_lives, records_of
from diloco.state_files import load_checked
from test_crash_resume import FALLBACK_STEPS, counted_seqs, counted_seqs_now, newest_push_step, pushed_after

PROGRESS = Path(__file__).parent / "workers" / "sharded_progress.py"
TIMEOUT_S = 120
TOKENS_PER_RANK_STEP = 4 * 16  # TINY's batch × sequence

pytestmark = [pytest.mark.integration,  # one process per rank
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with Gloo is not available")]


def _progress(world: int, out: Path, *args: str, name: str = "rank") -> tuple[list[int], list[str]]:
    codes, logs, _ = rank_procs.launch(world, [sys.executable, str(PROGRESS), *args, "--out", str(out)], out,
                                       TIMEOUT_S, name)
    return codes, logs


@pytest.mark.parametrize("sharding,saved_by,loaded_by", [("fsdp", 2, 2), ("hsdp", 4, 4), ("fsdp", 2, 4),
                                                          ("hsdp", 4, 2)])
def test_resumed_rows_equal_an_unsharded_learners_resume(sharding, saved_by, loaded_by, tmp_path):
    """From the same trained state (a fragment unpushed, two pushes in flight, one of which its shard never
    took), the sharded learner's resumed parameters are Θ − unpushed (− the lost push) on every rank's rows,
    bit for bit what an unsharded learner's resume gives, with the same counters and the same first pushes;
    another world size reshards the progress (DCP's global offsets). The `theta` policy leaves Θ alone."""
    codes, logs = _progress(saved_by, tmp_path, "--phase", "save", "--sharding", sharding, name="save")
    assert codes == [0] * saved_by, logs[0][-3000:]
    codes, logs = _progress(loaded_by, tmp_path, "--phase", "load", "--sharding", sharding, name="load")
    assert codes == [0] * loaded_by, logs[0][-3000:]
    result = json.loads((tmp_path / f"progress-{loaded_by}.json").read_text())
    assert result["theta_kept"] and all(why == "the policy takes Θ" for why in result["theta_policy"]), result
    assert result["outcome"] == [None, None, None] and result["same_outcome"], result
    assert result["params_equal"] and result["unpushed_on_theta"] and result["pushes_equal"], result
    assert result["tokens_since"] == result["plain_tokens_since"] == [200, 100, 200], result


@pytest.mark.parametrize("damage,words", [("distcp", "damaged"), ("latest", "latest")])
def test_a_damaged_progress_checkpoint_is_refused_by_every_rank_with_nothing_changed(damage, words, tmp_path):
    """A flipped byte in rank 1's DCP file (its rows of the progress with the rest), or in the sealed file
    naming the complete slot: every rank refuses in one line; its parameters, optimizer and core are as
    they were."""
    codes, logs = _progress(2, tmp_path, "--phase", "save", name="save")
    assert codes == [0, 0], logs[0][-3000:]
    codes, logs = _progress(2, tmp_path, "--phase", "load", "--damage", damage, name="load")
    assert codes == [0, 0], logs[0][-3000:]
    for rank, log in enumerate(logs):
        lines = [line for line in log.splitlines() if line.startswith("REFUSED: ")]
        assert len(lines) == 1 and words in lines[0], log[-2000:]
        assert json.loads((tmp_path / f"refused-{rank}.json").read_text()) == {"unchanged": True}


SETTINGS = ("learners.count=1", "strategy=decoupled", "outer.H=8", "outer.fragments=2", "metrics.every_steps=1")
KILL_AT_STEP = 20
"""Of the 48 steps the run's budget gives the learner (`_budget`)."""


def _budget(world: int) -> str:
    return f"train.tokens={48 * world * TOKENS_PER_RANK_STEP}"


def _saved_seq(folder: Path) -> int:
    """The newest push the sharded checkpoint on disk records (rank 0's sidecar; none yet: above every push)."""
    if not (folder / "latest").is_file():
        return 1 << 62
    return load_checked(sidecar(_current(folder, None), 0), "checkpoint", "")["progress"]["seq"]


def _steps(out: Path) -> int:
    path = out / "metrics" / "learner-0.jsonl"
    records = records_of(path, "learner") if path.is_file() else []
    return records[-1]["steps"] if records else 0


@pytest.mark.parametrize("sharding,world,resume", [("fsdp", 2, "own"), ("hsdp", 4, "own"), ("fsdp", 2, "theta")])
def test_a_sharded_learner_killed_at_a_known_step_loses_at_most_the_steps_since_its_checkpoint(
        sharding, world, resume, tmp_path):
    """Every rank of the built-in learner SIGKILLed at once, mid-run: its restart resumes its DCP checkpoint and,
    with `own`, the unpushed progress of every fragment not pushed after that checkpoint on top of Θ, which
    its first pushes carry (it is killed after such a push: that fragment takes Θ). The shard's accounting
    holds per fragment (merged + stale + lost = trained, none twice), and with `own` what is lost is at most
    what was trained since that checkpoint."""
    settings = (*SETTINGS, _budget(world))
    sets = [x for item in [*TINY, *settings, f"train.sharding={sharding}", f"failures.resume={resume}"]
            for x in ("--set", item)]
    argv = [sys.executable, "-m", "diloco.learner", "--syncer", "", "--id", "0", "--out", str(tmp_path), "-q", *sets]
    with serving_shard(*settings, workers=8) as (shard, address):
        argv[argv.index("--syncer") + 1] = address
        first = rank_procs.start_ranks(world, argv, tmp_path, "first")
        try:
            folder = tmp_path / "checkpoints" / "learner-0.dcp"
            ended = lambda: any(p.poll() is not None for p in first)  # noqa: E731
            freeze_when([p.pid for p in first], lambda: _steps(tmp_path) >= KILL_AT_STEP or ended(),
                        lambda: ended() or _steps(tmp_path) >= KILL_AT_STEP + FALLBACK_STEPS
                        or pushed_after(counted_seqs_now(shard), _saved_seq(folder)), 180,
                        lambda: (tmp_path / "first-0.log").read_text()[-2000:])
        finally:
            rank_procs.kill_ranks(first)
        checkpointed = load_checked(folder / "latest", "checkpoint", "")["steps"]
        after = pushed_after(counted_seqs(shard), _saved_seq(folder))
        recorded = _steps(tmp_path)
        killed_at = max(recorded, newest_push_step(shard))  # the freeze may fall between a push and its record
        assert KILL_AT_STEP <= killed_at < 48, (tmp_path / "first-0.log").read_text()[-2000:]
        codes, logs, _ = rank_procs.launch(world, argv, tmp_path, TIMEOUT_S * 2, "second")
        assert codes == [0] * world, logs[0][-3000:]
        wait_for(lambda: shard.finished, 30, "the run to end")
        entry = shard.report()["ledger"][0]
    lives = learner_lives(tmp_path / "metrics")[0]
    assert len(lives) == 2 and lives[0]["steps"] == recorded and killed_at - recorded <= 1
    trained = killed_at * world * TOKENS_PER_RANK_STEP + lives[1]["tokens"]
    (start,) = [r for r in records_of(tmp_path / "metrics" / "learner-0.jsonl", "start") if r["steps"] > 0]
    assert start["steps"] == checkpointed <= killed_at
    assert start["resumed_fragments"] == (2 - len(after) if resume == "own" else 0)  # the others resumed
    assert entry["duplicates"] == 0
    since_checkpoint = (killed_at - checkpointed) * world * TOKENS_PER_RANK_STEP
    for p in range(2):
        lost = trained - entry["merged"].get(p, 0) - entry["stale"].get(p, 0)
        assert lost >= 0, (p, lost, entry)  # never more merged than trained
        if resume == "own":
            assert lost <= since_checkpoint, (p, lost, since_checkpoint, entry)
