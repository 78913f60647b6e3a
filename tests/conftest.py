"""Shared helpers: tiny configurations that train in well under a second; waiting for a condition."""

from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from diloco.config import Config, load_config

TINY = [
    "model.layers=1", "model.width=32", "model.heads=2",
    "train.seq_len=16", "train.batch_size=4", "train.tokens=10240", "train.eval_batches=2",
    "train.eval_points=2", "train.warmup_steps=2", "outer.H=5", "learners.speeds=[]",
    # The lockstep timing model: tests that need noisy steps ask for it.
    "learners.jitter=0", "learners.drift=0", "learners.step_time_s=0.25",
]


def tiny_config(*overrides: str) -> Config:
    """A tiny model and budget; later overrides win."""
    return load_config(None, [*TINY, *overrides])


def computed(summary: dict) -> dict:
    """A summary without what the host's speed decides (`wall_clock_s`): what two runs of one seed
    must agree on."""
    return {k: v for k, v in summary.items() if k != "wall_clock_s"}


@pytest.fixture
def tiny():
    return tiny_config


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, with tests/ (the toy models) on its path ahead of
    what this process has there, so that it runs the same sources."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def wait_for(predicate: Callable[[], object], timeout: float, what: str | Callable[[], str],
             poll_s: float = 0.05) -> None:
    """Return as soon as `predicate()` holds; fail the test after `timeout` seconds, saying what was
    awaited (`what` may be a function, to describe the state at that moment)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(poll_s)


def _stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (a SIGSTOP is delivered asynchronously)."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT" for t in tasks.iterdir())
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True  # it is gone: nothing of it can change any more


def freeze_when(pids: list[int], ready: Callable[[], object], holds: Callable[[], object], timeout: float,
                what: str | Callable[[], str]) -> None:
    """Wait until `ready()`, then until `holds()` is true of the processes `pids` frozen by SIGSTOP, and
    leave them frozen: a SIGKILL next finds them in the state checked (nothing they write, a checkpoint
    say, can land between the check and the kill)."""
    def frozen_and_holds() -> bool:
        if not ready():
            return False
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(_stopped(pid) for pid in pids), 10, "the processes to stop", poll_s=0.005)
        if holds():
            return True
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        return False

    wait_for(frozen_and_holds, timeout, what)


def free_port_for_torchrun() -> int:
    """A port no one listens on now, for torchrun's `--master-port` (torch's own rendezvous, which
    takes a number). Our own servers never need this: they bind port 0 and report the port they got."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def retire_update_stream(shard, learner: int) -> None:
    """End a halted learner's update stream on the shard's side, so that answers stay queued as notices
    (nothing takes them): what a test sends is then all the shard journals."""
    from diloco.shard.server import OUTBOX_POLL_S

    wait_for(lambda: learner in shard.streams, 10, f"learner {learner}'s update stream")
    with shard.lock:
        shard.streams[learner] += 1  # a newer stream id retires the open one
    time.sleep(2 * OUTBOX_POLL_S)


def live_shard(*overrides: str, workers: int | None = None, state_dir: Path | None = None) -> tuple[Any, Any, str]:
    """One syncer shard of a tiny config serving on a free loopback port: (shard, gRPC server, address).
    The caller stops both (`server.stop(0)`, `shard.stop()`)."""
    from diloco.shard.server import ShardPlan, SyncerShard, serve

    shard = SyncerShard(tiny_config(*overrides), ShardPlan(0, 1, ("",)), state_dir=state_dir)
    server, port = serve(shard, "127.0.0.1:0", workers=workers)
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    return shard, server, address


@contextmanager
def serving_shard(*overrides: str, workers: int | None = None) -> Iterator[tuple[Any, str]]:
    """`live_shard` for the length of a `with`: yields (shard, address), always stopped."""
    shard, server, address = live_shard(*overrides, workers=workers)
    try:
        yield shard, address
    finally:
        server.stop(0)
        shard.stop()
