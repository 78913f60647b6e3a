"""`[failures]`: scheduled and random crashes, link and regional outages, recovery and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from diloco.config.rules import known, require
from diloco.errors import ConfigError


@dataclass
class CrashConfig:
    learner: int = 0
    at_s: float = 0.0
    """Virtual time of the crash."""


@dataclass
class OutageConfig:
    learner: int = 0
    """The learner whose link goes down (when `region` is empty)."""
    region: str = ""
    """A region that goes down as a whole instead (`regions`): its learners crash for the duration."""
    at_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class FailuresConfig:
    crashes: list[CrashConfig] = field(default_factory=list)
    """Crashes at given times, e.g. [{learner = 2, at_s = 60}]."""
    mtbf_s: float = 0.0
    """Mean time between random crashes of each learner; 0 turns random crashes off."""
    recovery_s: float = 30.0
    """From a crash until the learner is back and asks for Θ."""
    detect_s: float = 5.0
    """The silence after which the syncer counts a learner as dead (or 5 of its measured heartbeat
    intervals, if longer): rounds stop counting on it. Both the simulator and the real runtime."""
    restore: Literal["checkpoint", "fresh"] = "checkpoint"
    """Inner-optimizer state after a crash: the learner's own last checkpoint, or a fresh AdamW (both
    drivers; data position and step always come from the checkpoint)."""
    checkpoint_every: int = 25
    """Inner steps between a learner's checkpoints of its optimizer state and data position (the simulator);
    the real runtime's learners checkpoint as often as costs them at most 1% of a step, and at least this often."""
    learner_checkpoints: bool = True
    """The real runtime's learners write their own checkpoints (off: a restart takes Θ with nothing of its own)."""
    resume: Literal["own", "theta"] = "own"
    """A restarted learner of the real runtime: `own` puts the progress its checkpoint holds and no push
    carried back on top of Θ, fragment by fragment where it is usable; `theta` takes Θ alone."""
    outages: list[OutageConfig] = field(default_factory=list)
    """Link outages, e.g. [{learner = 1, at_s = 30, duration_s = 20}]: nothing crosses that link meanwhile;
    or regional outages, e.g. [{region = "eu", at_s = 30, duration_s = 60}]: the region's learners crash and
    are back when it ends (simulator)."""


def check_outage_targets(raw: dict[str, Any]) -> None:
    """An outage names a learner (its link goes down) or a region (its learners crash), not both."""
    failures = raw.get("failures", {})
    for i, outage in enumerate(failures.get("outages", []) if isinstance(failures, dict) else []):
        if isinstance(outage, dict) and "learner" in outage and "region" in outage:
            raise ConfigError(f"config key 'failures.outages[{i}]' names a learner and a region: give one; "
                              f"got {outage!r}")


def check_failures(f: FailuresConfig, learners: int, regions: list[str]) -> None:
    """Scheduled crashes and outages must name an existing learner (or region); then the random-failure
    knobs."""
    for kind, events in (("crashes", f.crashes), ("outages", f.outages)):
        for i, event in enumerate(events):
            key = f"failures.{kind}[{i}]"
            require(0 <= event.learner < learners, f"{key}.learner", f"must be in [0, {learners})", event.learner)
            require(event.at_s >= 0, f"{key}.at_s", "must be zero or positive", event.at_s)
    for i, outage in enumerate(f.outages):
        require(outage.duration_s > 0, f"failures.outages[{i}].duration_s", "must be positive", outage.duration_s)
        require(not outage.region or outage.region in regions, f"failures.outages[{i}].region",
                f"must name a region ({known(regions)})", outage.region)
    require(f.mtbf_s >= 0, "failures.mtbf_s", "must be zero or positive (0: no random crashes)", f.mtbf_s)
    require(f.recovery_s >= 0, "failures.recovery_s", "must be zero or positive", f.recovery_s)
    require(f.detect_s >= 0, "failures.detect_s", "must be zero or positive", f.detect_s)
    require(f.checkpoint_every > 0, "failures.checkpoint_every", "must be positive", f.checkpoint_every)
