"""`python -m diloco.spare_learner`: a pre-started spare learner (`launch/spare.py` starts them and hands
them over). It imports what a learner imports, then waits on its stdin for the learner it is to become:
that learner's `diloco` arguments, its log, and when it was handed over; then it runs them as
`python -m diloco` would, its output in the learner's log and its start metrics counted from the handover."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from diloco.cli import main
from diloco.client.builtin_loop import HANDED_OVER_ENV
from diloco.launch.processes import die_with_parent


def become_learner(message: dict[str, Any]) -> int:
    """In a spare: run the learner named by the launcher's `message`, its output in the learner's log."""
    log = os.open(message["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ[HANDED_OVER_ENV] = repr(float(message["handed_over_unix"]))
    return main(list(message["argv"]))


def wait_as_spare() -> int:
    """A spare's life: everything a learner imports, then wait for the learner to become (EOF: none)."""
    die_with_parent()
    try:
        import torch._dynamo  # noqa: F401 - what an optimizer's constructor imports: seconds of a start

        import diloco.client.builtin_loop  # noqa: F401 - what `diloco learner` imports when it runs

        line = sys.stdin.readline()
    except KeyboardInterrupt:  # stopped before it was needed
        return 130
    if not line.strip():
        return 0
    return become_learner(json.loads(line))


if __name__ == "__main__":
    sys.exit(wait_as_spare())
