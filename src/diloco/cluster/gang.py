"""A learner of several processes as one gang on one node: `python -m diloco.cluster.gang N learner …`.

torchrun starts the N ranks of the learner (data-parallel inside, as anywhere else). This process sits
between the actor and the ranks so that the chain ends together: it dies with the actor that started
it, and its ranks die with it (each checks, as any child of `diloco run` does, that its parent is the
process named in DILOCO_PARENT_PID).
"""

from __future__ import annotations

import os
import sys

from diloco.launch.processes import PARENT_ENV, die_with_parent


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        raise SystemExit("usage: python -m diloco.cluster.gang PROCESSES learner [options]")
    die_with_parent()
    os.environ[PARENT_ENV] = str(os.getpid())
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc-per-node={argv[0]}", "-m", "diloco", *argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
