"""Config keys the real runtime does not read: the simulator's failure plan and its step-time model.

A user who sets one is told so, once per key, rather than getting a run that silently differs from
what the config says. A key counts as set when its value differs from the default.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from diloco.config import Config

_STEP_TIME_MODEL = "the simulator's step-time model; a real learner's steps take what they take"
SIMULATOR_ONLY = {
    "failures": "the simulator's failure plan; use `diloco chaos` for real faults",
    "learners.step_time_s": _STEP_TIME_MODEL,
    "learners.jitter": _STEP_TIME_MODEL,
    "learners.drift": _STEP_TIME_MODEL,
    "learners.drift_steps": _STEP_TIME_MODEL,
}
"""Keys, or whole sections, that only the simulator reads, with the reason."""
READ_BY_THE_RUNTIME = {"failures.checkpoint_every", "failures.detect_s", "failures.restore",
                       "failures.learner_checkpoints", "failures.resume"}
"""Keys inside those sections that the runtime reads after all: its learners' checkpoints, the silence
after which the syncer counts a learner dead, and what a restarted learner restores."""


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a config dataclass by its dotted key (lists are leaves)."""
    leaves: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            leaves.update(flatten(value, f"{prefix}{f.name}."))
        else:
            leaves[prefix + f.name] = value
    return leaves


READ_BY_THE_LAUNCHER = {"failures.outages"}
"""What `diloco run` reads itself: a regional outage kills and restarts the region's processes
(`launch/outages.py`); an outage of one learner's link stays the simulator's."""


def ignored_keys(config: Config, command: str = "") -> dict[str, str]:
    """The keys set to something other than their default that the runtime (`command`) ignores, each with why."""
    defaults = flatten(Config())
    read = READ_BY_THE_RUNTIME | (READ_BY_THE_LAUNCHER if command == "run" else set())
    ignored = {}
    for key, value in flatten(config).items():
        reason = SIMULATOR_ONLY.get(key) or SIMULATOR_ONLY.get(key.split(".")[0])
        if reason and key not in read and value != defaults[key]:
            ignored[key] = reason
    if command == "run" and any(not o.region for o in config.failures.outages):
        ignored["failures.outages"] = "an outage of one learner's link is the simulator's (a region's is not)"
    return ignored


def warn_ignored(config: Config, command: str) -> None:
    """One line on stderr per ignored key: the key, the command that ignores it, and why."""
    for key, reason in ignored_keys(config, command).items():
        print(f"diloco: warning: {key} is ignored by `diloco {command}`: {reason}", file=sys.stderr, flush=True)
