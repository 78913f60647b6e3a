"""Faults a test injects into one rank of a multi-rank learner, at a known point: the rank exits (code 9)
or stops itself (SIGSTOP: alive, its sockets open, silent). Read from the environment once, so a learner
started without these variables pays one string comparison per point.

- `DILOCO_FAULT_EXIT_AT_GATHER="RANK:N[:hang]"`: as that rank joins its N-th push's gather.
- `DILOCO_FAULT_EXIT_AT_STEP="RANK:N[:hang]"`: as that rank begins its N-th training step of this life
  (the FSDP collectives of the step then wait on it).
"""

from __future__ import annotations

import os
import signal
import time

AT_GATHER = os.environ.get("DILOCO_FAULT_EXIT_AT_GATHER", "")
AT_STEP = os.environ.get("DILOCO_FAULT_EXIT_AT_STEP", "")


def maybe_fail(spec: str, rank: int, count: int) -> None:
    """Exit or stop this process if `spec` names this rank and this count."""
    if spec and spec.split(":")[:2] == [str(rank), str(count)]:
        print(f"fault injected at {time.monotonic()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP) if spec.endswith(":hang") else os._exit(9)
