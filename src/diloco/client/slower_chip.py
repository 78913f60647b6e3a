"""A learner slower than its chip, emulated (a `learners.speeds` entry below 1): each step is followed by
a sleep that makes it last 1/speed times its compute.

What the sleep scales is the step's compute. On an accelerator that is the step's wall time. On the CPU it
is the process's CPU time over the step: `diloco run` puts every learner on the same cores, and the time
a step waits for a core is not compute. Scaling wall time multiplied that wait, and unevenly: a slow
learner computes while the fast ones run (they compute through its sleeps), so its steps waited about
twice as long as theirs, and at speeds 0.5 and 0.25 it trained 0.33 and 0.15 of a fast learner's tokens
(docs/runtime.md, "Slower learners, emulated").
"""

from __future__ import annotations


def stretch_s(speed: float, wall_s: float, cpu_s: float | None) -> float:
    """How long a step at `speed` sleeps after its compute: `cpu_s` (the step's CPU time, where it computes
    on the CPU) or else `wall_s`, times 1/speed − 1."""
    if not 0 < speed <= 1:
        raise ValueError(f"a learner's speed must be in (0, 1], not {speed}")
    return (wall_s if cpu_s is None else cpu_s) * (1 / speed - 1)
