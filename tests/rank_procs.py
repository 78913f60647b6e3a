"""One process per rank of a learner (Gloo over loopback), as torchrun would start them, for the tests of
multi-rank learners."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from conftest import child_env, free_port_for_torchrun


def start_ranks(world: int, argv: list[str], out: Path, log_name: str = "rank") -> list[subprocess.Popen]:
    """Start `argv` once per rank, each rank's output in OUT/LOG_NAME-R.log."""
    port = free_port_for_torchrun()
    procs = []
    for rank in range(world):
        env = child_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        GLOO_SOCKET_IFNAME="lo")
        with (out / f"{log_name}-{rank}.log").open("w") as sink:
            procs.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    return procs


def wait_ranks(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float, started: float) -> list[int]:
    """Their exit codes; any rank still running past `timeout_s` fails the test (every rank is killed)."""
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks ran past {timeout_s} s:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
    finally:
        kill_ranks(procs)
    return [p.returncode for p in procs]


def kill_ranks(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def launch(world: int, argv: list[str], out: Path, timeout_s: float, log_name: str = "rank"
           ) -> tuple[list[int], list[str], float]:
    """Run `argv` once per rank to the end; their exit codes, outputs and the seconds until the last ended."""
    started = time.monotonic()
    procs = start_ranks(world, argv, out, log_name)
    logs = [out / f"{log_name}-{rank}.log" for rank in range(world)]
    codes = wait_ranks(procs, logs, timeout_s, started)
    return codes, [log.read_text() for log in logs], time.monotonic() - started
