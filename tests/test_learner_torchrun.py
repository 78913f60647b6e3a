"""One learner made of two torchrun processes (Gloo, CPU): rank 0 talks to the syncer and broadcasts
each merge, token counts are summed over ranks, and the model may be wrapped in DDP.

The syncer runs in this process; tests/workers/ddp_learner.py runs under `torch.distributed.run`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import free_port_for_torchrun, serving_shard

WORKER = Path(__file__).parent / "workers" / "ddp_learner.py"
RANKS, STEPS, BATCH, SEQ = 2, 24, 4, 16
FRAGMENTS = 2
TIMEOUT_S = 120

pytestmark = [pytest.mark.integration,  # torchrun processes against a live shard
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with Gloo is not available")]


def torchrun(syncer: str, out: Path) -> tuple[int, str]:
    """Run the worker under torchrun; return its exit code and output. If it runs past the timeout or the
    test is interrupted, the agent and its workers are stopped: no orphans."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(RANKS),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port_for_torchrun()), str(WORKER),
               "--syncer", syncer, "--out", str(out), "--steps", str(STEPS), "--batch", str(BATCH),
               "--seq", str(SEQ)]
    log = out / "torchrun.log"  # a file, not a pipe: a stray worker holding a pipe open cannot block us
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"torchrun ran past {TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    finally:
        if proc.poll() is None:
            stop(proc)
    return proc.returncode, log.read_text()


def stop(proc: subprocess.Popen) -> None:
    """torchrun starts each worker in a session of its own, so killing the agent's group is not enough:
    SIGTERM lets the agent stop its workers; whatever is left of the tree is then killed."""
    tree = [proc.pid, *descendants(proc.pid)]
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree:
        try:
            if pid == proc.pid or WORKER.name in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.fixture
def syncer():
    """A decoupled syncer for one learner, with a short period so that several merges happen."""
    with serving_shard("learners.count=1", "strategy=decoupled", "outer.H=4", f"outer.fragments={FRAGMENTS}",
                       "train.tokens=100000000", workers=8) as started:
        yield started


def test_two_gloo_ranks_are_one_learner(syncer, tmp_path):
    """Both ranks end bit-identical (merges reach every rank, not only rank 0, which alone talks to the
    syncer); the syncer counts one learner whose tokens are the sum over ranks, each token once per
    fragment; every push is counted once."""
    shard, address = syncer
    code, output = torchrun(address, tmp_path)
    assert code == 0, output[-4000:]

    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(RANKS)]
    params = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(RANKS)]
    assert [r["rank"] for r in reports] == list(range(RANKS))
    assert all(r["world"] == RANKS and r["learner"] == 0 for r in reports)
    assert all(r["local_steps"] == r["steps"] == STEPS for r in reports)
    tokens = RANKS * BATCH * SEQ * STEPS
    assert all(r["tokens"] == tokens for r in reports)
    merges = reports[0]["merges"]
    assert merges > 0 and all(r["merges"] == merges for r in reports)

    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), f"ranks differ on {name}"

    assert shard.finished
    report = shard.report()
    assert list(report["ledger"]) == [0]
    entry = report["ledger"][0]
    assert entry["duplicates"] == 0
    assert entry["pushes"] == reports[0]["pushes"] > 0
    for p in range(FRAGMENTS):
        assert entry["merged"].get(p, 0) + entry["stale"].get(p, 0) == tokens, (p, entry)
    assert entry["steps_merged"] == FRAGMENTS * STEPS
    assert len(report["rounds"]) > 0 and all(v > 0 for v in report["versions"].values())
    assert set(shard.core.theta) == set(params[0])
