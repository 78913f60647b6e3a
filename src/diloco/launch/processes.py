"""Child processes of `diloco run`: started, watched, stopped in order, and never left behind.

- Every child asks the kernel to kill it when the launcher dies (PR_SET_PDEATHSIG), so even a
  SIGKILLed launcher leaves no orphan. The kernel counts the thread that started the child as its
  parent: a thread that starts children must live as long as they should.
- Children run in sessions of their own: Ctrl-C (or SIGTERM, which `diloco run` treats alike) reaches
  the launcher only, which then stops them in order (learners first, so they push and leave; then the
  syncer shards, so they save their state).
- A stop is SIGINT, then SIGKILL for whatever has not exited within the grace period.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from diloco.clock import SYSTEM_CLOCK as clock

PARENT_ENV = "DILOCO_PARENT_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Called first in a child of `diloco run`: the kernel ends it when its launcher ends."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the launcher died before the request took effect
        os._exit(1)


@dataclass
class Started:
    """What every started child has, wherever it runs: its command line and its log."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path

    def set_option(self, option: str, value: str) -> None:
        """Give `option` this value from the child's next restart on."""
        self.argv[self.argv.index(option) + 1] = value

    @property
    def returncode(self) -> int | None:
        """Its exit code; None while it runs (asked of wherever it runs)."""
        raise NotImplementedError

    def why_gone(self) -> str | None:
        """Why the child will never report its port: it exited. None while it runs."""
        code = self.returncode
        return None if code is None else f"exited with code {code} (see {self.log_path})"

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


@dataclass
class Child(Started):
    process: subprocess.Popen | None = None
    log_file: IO[bytes] | None = None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def log_tail(self, lines: int = 5) -> str:
        self.log_file.flush()
        return super().log_tail(lines)


class Children:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              stdin: int = subprocess.DEVNULL) -> Child:
        """`stdin`: nothing, or a pipe the launcher writes to (a spare learner waits on it)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")  # a restarted child's log goes on after its previous life's
        full_env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=stdin,
                                   env=full_env, start_new_session=True, cwd=cwd)
        child = Child(name, list(argv), dict(env or {}), log_path, process=process, log_file=log_file)
        self.children[name] = child
        return child

    def kill(self, name: str) -> None:
        """SIGKILL a child and its session: a crash, as the chaos command causes them."""
        child = self.children[name]
        _signal(child, signal.SIGKILL)
        child.process.wait()
        child.log_file.close()

    def restart(self, name: str, extra_args: tuple[str, ...] = ()) -> Child:
        """Start a child again with the arguments it had, plus `extra_args`."""
        old = self.children[name]
        return self.start(name, with_extra(old.argv, extra_args), old.env)

    def running(self, prefix: str = "") -> list[Child]:
        return [c for n, c in self.children.items() if n.startswith(prefix) and c.returncode is None]

    def stop(self, prefix: str = "", grace_s: float = 20.0, sig: int = signal.SIGINT) -> None:
        """Ask the matching children to stop; kill those still running after `grace_s`."""
        targets = self.running(prefix)
        for child in targets:
            _signal(child, sig)
        deadline = clock.monotonic() + grace_s
        for child in targets:
            try:
                child.process.wait(timeout=max(0.0, deadline - clock.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(child, signal.SIGKILL)
                child.process.wait()

    def close(self) -> None:
        """Kill anything still running and close the logs; safe to call twice."""
        for child in self.children.values():
            if child.returncode is None:
                _signal(child, signal.SIGKILL)
                child.process.wait()
            child.log_file.close()


def with_extra(argv: list[str], extra_args: tuple[str, ...]) -> list[str]:
    """A restarted child's command line: the one it had, plus those of `extra_args` it lacks."""
    return argv + [a for a in extra_args if a not in argv]


def _signal(child: Child, sig: int) -> None:
    """Signal the child's whole session: a child's own helpers (torchrun's workers) go with it."""
    try:
        os.killpg(child.process.pid, sig)
    except ProcessLookupError:
        pass
