"""`python -m diloco.prestarted ROLE [READY_FILE]`: a pre-started spare process (`launch/spare.py` starts them
and hands them over). It imports what a learner (ROLE `learner`) or a syncer shard (`syncer`) imports, makes
READY_FILE, then waits on its stdin for the process it is to become: that process's `diloco` arguments, its
log, and when it was handed over; then it runs them as `python -m diloco` would, its output in that log and a
learner's start metrics counted from the handover."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from diloco.cli import main
from diloco.process_times import HANDED_OVER_ENV
from diloco.launch.processes import die_with_parent


def become(message: dict[str, Any]) -> int:
    """In a spare: run the `diloco` command of the launcher's `message`, its output in that process's log."""
    log = os.open(message["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ[HANDED_OVER_ENV] = repr(float(message["handed_over_unix"]))
    return main(list(message["argv"]))


def wait_as_spare(role: str = "learner", ready: str | None = None) -> int:
    """A spare's life: everything a learner or a syncer shard imports, then wait for the process to become
    (EOF: none). `ready`: a file made once the imports are done (the launcher waits for it)."""
    die_with_parent()
    try:
        if role == "syncer":
            import diloco.shard.regional_shard  # noqa: F401 - what `diloco syncer` imports when it runs
            import diloco.shard.server  # noqa: F401
            from diloco.outer import compiled_step

            # numba and the merge's loops, which a shard loads as it makes its core (`load_for`): on a
            # resume that is the outage's critical path (0.5-1.1 s of it in the s55 chaos runs).
            compiled_step.load_merge_loops()
        else:
            import torch._dynamo  # noqa: F401 - what an optimizer's constructor imports: seconds of a start

            import diloco.client.builtin_loop  # noqa: F401 - what `diloco learner` imports when it runs
        if ready:
            Path(ready).touch()
        line = sys.stdin.readline()
    except KeyboardInterrupt:  # stopped before it was needed
        return 130
    if not line.strip():
        return 0
    return become(json.loads(line))


if __name__ == "__main__":
    sys.exit(wait_as_spare(*sys.argv[1:3]))
