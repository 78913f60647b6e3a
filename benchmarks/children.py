"""Child processes of the benchmarks: each started in a session of its own, none left behind.

Children read PARENT_ENV and ask the kernel to kill them when the benchmark dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PARENT_ENV = "DILOCO_PARENT_PID"
"""Children of the runtime read this and ask the kernel to kill them when this process dies."""


def diloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco", *args]


class Processes:
    """Every child this benchmark starts, each in a session of its own; `stop_all` leaves none behind."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
              stdout_pipe: bool = False) -> subprocess.Popen:
        """Output goes to `log`; with `stdout_pipe`, stdout comes back as a text pipe and stderr to `log`."""
        full_env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE if stdout_pipe else log_file,
                                    stderr=log_file if stdout_pipe else subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True, text=stdout_pipe)
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen], grace_s: float = 10.0, sig: int = signal.SIGINT) -> None:
        """`sig` to each child's session, then SIGKILL whatever is left after `grace_s`."""
        for proc in procs:
            if proc.poll() is None:
                _signal(proc, sig)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
            if proc in self.procs:
                self.procs.remove(proc)

    def kill(self, procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)

    def stop_all(self) -> None:
        self.stop(list(self.procs))


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
