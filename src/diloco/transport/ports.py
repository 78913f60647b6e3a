"""Servers bind port 0 and say which port they got, so that no one hands out a "free" port that
another process takes before it is bound.

The port goes in a port file, written whole (a temporary file renamed over it) so that a reader never
sees half a number; readers wait for it, bounded, and give up early when its writer is gone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.errors import DilocoError
from diloco.outputs import write_output

log = logging.getLogger("diloco.ports")

PORT_WAIT_S = 60.0
"""Bound on waiting for a port file: a process's start (imports, binding) takes far less."""
POLL_S = 0.05


def write_port_file(path: str | Path | None, port: int) -> None:
    """`port` in `path`, atomically: a reader finds the whole number or no file. No path, no file."""
    if path is None:
        return
    write_output(Path(path), f"{port}\n")


def report_port(port: int, what: str, port_file: str | Path | None = None) -> None:
    """Log the port `what` listens on, and write it to `port_file` when there is one."""
    log.info("%s listens on port %d", what, port)
    write_port_file(port_file, port)


def read_port_file(path: Path) -> int | None:
    """The port in `path`; None while there is no such file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError:
        raise DilocoError(f"port file {path} holds {text.strip()!r}, not a port number") from None


def wait_for_port(path: Path, what: str, gone: Callable[[], str | None] = lambda: None,
                  timeout_s: float = PORT_WAIT_S) -> int:
    """The port `what` wrote to `path`, once it is there. `gone()` says why `what` will never write it
    (e.g. "exited with code 2"), or None while it may."""
    deadline = clock.monotonic() + timeout_s
    while (port := read_port_file(path)) is None:
        if (why := gone()) is not None:
            raise DilocoError(f"{what} {why} before reporting its port")
        if clock.monotonic() > deadline:
            raise DilocoError(f"{what} did not report its port in {path} within {timeout_s:g} s")
        clock.sleep(POLL_S)
    return port


def resolve_address(address: str, what: str) -> str:
    """`HOST:PORT` as it is; `HOST:@FILE` with the port that `what` wrote to FILE (waited for)."""
    host, at, path = address.partition(":@")
    return f"{host}:{wait_for_port(Path(path), what)}" if at else address
