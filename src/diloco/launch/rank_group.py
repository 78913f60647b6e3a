"""A learner of several ranks in `diloco run`: `python -m diloco.launch.rank_group N -- COMMAND…`.

The launcher starts this process as the learner's one child; it starts COMMAND N times as one
torch.distributed group on this machine, with the environment torchrun gives its workers (MASTER_ADDR,
MASTER_PORT: a free port for each start of the group; RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).
So the launcher watches, stops, kills and restarts the learner as one child, whatever its ranks: its
ranks run in this process's session (the launcher's signals reach them all), each dies with this
process, and a restart starts the whole group again on a new port. Rank 0 writes the learner's report
and, with its peers, its checkpoint (`client/builtin_loop.py`).

Why not torchrun: its agent restarts nothing here (the launcher does), and when a rank fails this
process lets the others end on their own line first (a dead peer is noticed at their next collective,
within the collective timeout), then ends what is left and exits with the first failure's code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.launch.processes import PARENT_ENV, die_with_parent

POLL_S = 0.1
PEERS_GRACE_S = 30.0
"""After one rank failed, how long the others get to notice it and end with their own line (their
collective timeout is derived from measured times, `client/collective_bound.py`); then they are killed."""


def group_command(ranks: int, command: list[str]) -> list[str]:
    """The launcher's command line for a learner of `ranks` processes (one process: `command` itself)."""
    if ranks <= 1:
        return command
    return [sys.executable, "-m", "diloco.launch.rank_group", str(ranks), "--", *command]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for each worker, for one group on this machine (loopback)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo",
            PARENT_ENV: str(os.getpid())}


def free_port() -> int:
    """A port nobody listens on now, for rank 0's rendezvous store (torch takes a number, not port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(world: int, command: list[str]) -> int:
    """Start the ranks, wait for them all; the first failure's exit code (0 when every rank ended well)."""
    port = free_port()
    ranks = [subprocess.Popen(command, env={**os.environ, **rank_env(r, world, port)}, stdin=subprocess.DEVNULL)
             for r in range(world)]
    failed_at: float | None = None
    code = 0
    while [p.poll() for p in ranks].count(None):  # every rank polled: one that ended is seen at once
        failures = [p.returncode for p in ranks if p.returncode not in (None, 0)]
        if failures and failed_at is None:
            failed_at, code = clock.monotonic(), _exit_code(failures[0])
        if failed_at is not None and clock.monotonic() - failed_at > PEERS_GRACE_S:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        clock.sleep(POLL_S)
    failures = [p.returncode for p in ranks if p.returncode != 0]
    if failures and not code:
        code = _exit_code(failures[0])
    if code:
        print(f"diloco: a rank of this learner's group exited with code {code}; the group ended", file=sys.stderr,
              flush=True)
    return code


def _exit_code(returncode: int) -> int:
    """A rank killed by a signal exits as a shell reports it (128 + the signal)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> None:
    if len(argv) < 3 or not argv[0].isdigit() or int(argv[0]) < 1 or argv[1] != "--":
        raise SystemExit("usage: python -m diloco.launch.rank_group RANKS -- COMMAND [ARGS...]")
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the ranks get the launcher's signal too: they stop, then this
        signal.signal(sig, lambda *_: None)
    raise SystemExit(run_group(int(argv[0]), argv[2:]))


if __name__ == "__main__":
    main(sys.argv[1:])
