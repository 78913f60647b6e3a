"""The collective timeout of a multi-rank learner is derived from its measured steps: the floor before
anything is measured, then FACTOR × the slowest step (at least the minimum), never above the floor; a
rank that dies or hangs while rank 0 gathers a due push, or mid training step, ends rank 0 with one line
within that bound, and the syncer counts nothing twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import TINY, child_env, free_port_for_torchrun, tiny_config
from diloco.client import collective_bound
from diloco.client.collective_bound import FACTOR, CollectiveBound, bound_s
from diloco.shard.server import ShardPlan, SyncerShard, serve


def test_the_bound_is_the_floor_until_measured_then_derived_from_the_slowest_step(monkeypatch):
    monkeypatch.setenv("DILOCO_COLLECTIVE_TIMEOUT_S", "600")
    monkeypatch.setenv("DILOCO_COLLECTIVE_MIN_S", "30")
    assert bound_s(None) == 600
    assert bound_s(0.1) == 30  # a fast step: the minimum
    assert bound_s(20.0) == FACTOR * 20.0
    assert bound_s(1000.0) == 600  # never above the floor


def test_the_bound_grows_with_a_slower_step_and_a_relaxed_stretch_is_no_step(monkeypatch):
    monkeypatch.setenv("DILOCO_COLLECTIVE_MIN_S", "0.01")
    now = [0.0]
    monkeypatch.setattr(collective_bound.clock, "monotonic", lambda: now[0])
    bound = CollectiveBound()
    bound.step()
    assert bound.slowest_s is None and bound.floor() == collective_bound.floor_s() == 600
    now[0] += 2.0
    bound.step()
    assert bound.slowest_s == 2.0 and bound.applied_s == FACTOR * 2.0
    with bound.relaxed():
        assert bound.applied_s == collective_bound.floor_s()
        now[0] += 100.0  # a checkpoint's write
    now[0] += 1.0
    bound.step()
    assert bound.slowest_s == 2.0 and bound.applied_s == FACTOR * 2.0
    now[0] += 3.0
    bound.step()
    assert bound.slowest_s == 3.0 and bound.applied_s == FACTOR * 3.0
    bound.relax()
    now[0] += 9.0
    bound.step()
    assert bound.applied_s == collective_bound.floor_s()


def test_only_the_process_groups_failures_are_taken_for_a_lost_rank():
    """A training step's own error (a model's bug) keeps its traceback; Gloo's or torch's distributed
    errors become the one line of a lost rank."""
    from diloco.client.row_moves import collective_error, is_collective_failure

    reset = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert is_collective_failure(reset) and is_collective_failure(dist.DistBackendError("NCCL watchdog timeout"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 7x8)"))
    assert not is_collective_failure(ValueError("gloo"))
    assert str(collective_error(reset, "training")).startswith("a rank of this learner stopped answering during "
                                                               "training ([third_party/gloo")


FRAGMENTS = 3
MIN_S = 4.0
BUILTIN = ["learners.count=1", "strategy=decoupled", "outer.H=4", f"outer.fragments={FRAGMENTS}",
           "train.tokens=100000", "failures.learner_checkpoints=false"]


@pytest.mark.integration  # two ranks of the built-in learner against a live shard
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed (Gloo)")
@pytest.mark.parametrize("fault", ["exit", "hang"])
@pytest.mark.parametrize("where", ["GATHER", "STEP"])
def test_a_rank_lost_mid_collective_ends_rank_0_in_one_line_within_the_bound(where, fault, tmp_path: Path):
    """Rank 1 dies (or stops, alive and silent) as rank 0 gathers its 6th push, or as it begins its 6th
    training step (rank 0 then waits in the step's FSDP collectives): rank 0 ends with exit code 2 and one
    line within the measured bound (far below the 600 s floor), and the syncer took each of its pushes once."""
    shard = SyncerShard(tiny_config(*BUILTIN), ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0", workers=8)
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    sets = [x for item in [*TINY, *BUILTIN, "train.sharding=fsdp"] for x in ("--set", item)]
    master, procs = free_port_for_torchrun(), []
    try:
        for rank in range(2):
            env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), OMP_NUM_THREADS="1",
                            GLOO_SOCKET_IFNAME="lo", DILOCO_COLLECTIVE_MIN_S=str(MIN_S),
                            **{f"DILOCO_FAULT_EXIT_AT_{where}": "1:6" + (":hang" if fault == "hang" else "")})
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "diloco.learner", "--syncer", address, "--id", "0", "--out", str(tmp_path),
                 "-q", *sets], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                start_new_session=True))
        output, _ = procs[0].communicate(timeout=240)
        ended = time.monotonic()
        hung = procs[1].poll() is None  # stopped, not gone
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        outputs = [proc.communicate()[0] for proc in procs[1:]]
        server.stop(0)
        shard.stop()
    assert hung == (fault == "hang") and (hung or procs[1].returncode == 9), outputs[0][-2000:]
    injected = [float(line.split()[-1]) for line in outputs[0].splitlines() if line.startswith("fault injected at")]
    assert len(injected) == 1, outputs[0][-2000:]
    took = ended - injected[0]
    print(f"rank 0 ended {took:.1f} s after rank 1's fault ({fault})")
    assert took < 60, took  # the measured bound (the unmeasured floor is 600 s)
    assert procs[0].returncode == 2, output[-3000:]  # a DilocoError: one line, exit code 2
    lines = [line for line in output.splitlines() if line.startswith("diloco: error: ")]
    assert len(lines) == 1 and "stopped answering" in lines[0], output[-3000:]
    entry = shard.report()["ledger"].get(0, {"duplicates": 0})
    assert entry["duplicates"] == 0
