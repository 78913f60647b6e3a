"""`[learners]`: how many learners, their relative speeds, and the simulator's model of their step times."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.config.rules import MAX_LEARNERS, require, require_at_most

DEFAULT_SPEEDS = (1.0, 1.0, 0.5, 0.25)
FRAMEWORKS = ("torch", "jax")
SHARDINGS = ("ddp", "fsdp", "hsdp")
MAX_RANKS = 1024
"""Processes of one learner on one machine: far beyond any node's devices."""


@dataclass
class LearnersConfig:
    count: int = 4
    speeds: list[float] = field(default_factory=lambda: list(DEFAULT_SPEEDS))
    """Relative speeds, one per learner; empty means all 1. Setting it alone sets `count` too; setting
    `count` alone makes every learner equal. The default: two fast learners, one at half and one at a
    quarter of their speed, the heterogeneous fleet Decoupled DiLoCo is for."""
    jitter: float = 0.23
    """Simulator: relative standard deviation of each step's time, independent from step to step."""
    drift: float = 0.16
    """Simulator: relative standard deviation of a learner's slowly wandering speed (correlated over
    `drift_steps` steps): what lets equal learners drift apart. The defaults of jitter, drift and
    drift_steps are what `diloco run`'s learners show on a 2-core machine (docs/algorithms.md);
    jitter = drift = 0 is the lockstep model."""
    drift_steps: float = 10.0
    """Simulator: correlation time of the drift, in steps."""
    step_time_s: float = 0.05
    """Simulator: virtual seconds of one inner step at speed 1 (the built-in model's step in `diloco
    run` on a 2-core machine; set your learners' own to predict a real run)."""
    frameworks: list[str] = field(default_factory=list)
    """What each learner trains with in `diloco run`: "torch" or "jax" (`diloco[jax]`: the built-in GPT
    in Flax), one per learner; empty means all torch. The simulator trains every learner with torch."""
    ranks: list[int] = field(default_factory=list)
    """`diloco run`: processes per learner, one entry per learner; a learner of several is started as one
    torch.distributed group (`launch/rank_group.py`). Empty means one process each."""
    sharding: list[str] = field(default_factory=list)
    """`diloco run`: how each learner's ranks hold the model ("ddp", "fsdp" or "hsdp"), one per learner;
    empty means `train.sharding` for every learner."""
    min: int = 0
    """`diloco run --ray`: the fewest learners the run trains on (it waits for capacity below that);
    0 means `count`."""
    max: int = 0
    """`diloco run --ray`: the most learners at once, started wherever matching capacity appears; 0 means
    `count`. Learners beyond `count` get new ids and train at speed 1."""

    def framework_of(self, learner: int) -> str:
        """A learner's framework; one beyond the list (an elastic run's newcomer) trains with torch."""
        return self.frameworks[learner] if learner < len(self.frameworks) else "torch"

    def ranks_of(self, learner: int) -> int:
        """A learner's processes; one beyond the list (an elastic run's newcomer) is one process."""
        return self.ranks[learner] if learner < len(self.ranks) else 1

    def sharding_of(self, learner: int | None, default: str) -> str:
        """A learner's sharding: its `sharding` entry, else `default` (`train.sharding`)."""
        return self.sharding[learner] if learner is not None and learner < len(self.sharding) else default

    def bounds(self) -> tuple[int, int]:
        """(min, max) learners of an elastic run, their zeros resolved to `count`."""
        return self.min or self.count, self.max or self.count


def load_learners(learners: LearnersConfig, raw: Any) -> None:
    """`speeds` alone sets `count`; `count` alone makes every learner equal (speeds emptied)."""
    if isinstance(raw, dict) and learners.speeds and "count" not in raw:
        learners.count = len(learners.speeds)
    if isinstance(raw, dict) and "count" in raw and "speeds" not in raw:
        learners.speeds = []


def check_learners(lc: LearnersConfig) -> None:
    """The fleet: one speed per learner (when given) and the simulator's step-time noise."""
    if lc.speeds:
        require(len(lc.speeds) == lc.count, "learners.speeds",
                f"must have one entry per learner (learners.count = {lc.count})", lc.speeds)
        for i, s in enumerate(lc.speeds):
            require(s > 0, f"learners.speeds[{i}]", "must be positive", s)
    if lc.frameworks:
        require(len(lc.frameworks) == lc.count, "learners.frameworks",
                f"must have one entry per learner (learners.count = {lc.count})", lc.frameworks)
        for i, f in enumerate(lc.frameworks):
            require(f in FRAMEWORKS, f"learners.frameworks[{i}]", f"must be one of {', '.join(FRAMEWORKS)}", f)
    check_rank_groups(lc)
    require(0 <= lc.jitter < 1, "learners.jitter", "must be in [0, 1)", lc.jitter)
    require(0 <= lc.drift < 1, "learners.drift", "must be in [0, 1)", lc.drift)
    require(lc.drift_steps > 0, "learners.drift_steps", "must be positive", lc.drift_steps)
    require(lc.step_time_s > 0, "learners.step_time_s", "must be positive", lc.step_time_s)
    require(lc.min >= 0, "learners.min", "must be zero (the count) or positive", lc.min)
    require(lc.max >= 0, "learners.max", "must be zero (the count) or positive", lc.max)
    require(lc.min <= lc.count, "learners.min", f"must be at most learners.count ({lc.count})", lc.min)
    require(lc.max == 0 or lc.max >= lc.count, "learners.max", f"must be at least learners.count ({lc.count})",
            lc.max)
    require_at_most(lc.max, MAX_LEARNERS, "learners.max", low=0, why="the syncer keeps a ledger per learner")


def check_rank_groups(lc: LearnersConfig) -> None:
    """`ranks` and `sharding`: one entry each per learner; a sharded learner has several ranks, a JAX
    learner one (it has no torch.distributed group)."""
    for key, values in (("learners.ranks", lc.ranks), ("learners.sharding", lc.sharding)):
        if values:
            require(len(values) == lc.count, key, f"must have one entry per learner (learners.count = {lc.count})",
                    values)
    for i, n in enumerate(lc.ranks):
        require(isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"learners.ranks[{i}]",
                "must be a whole number of processes, at least 1", n)
        require_at_most(n, MAX_RANKS, f"learners.ranks[{i}]", why="the processes of one learner on one machine")
        require(n == 1 or lc.framework_of(i) == "torch", f"learners.ranks[{i}]",
                "must be 1 for a JAX learner (learners.frameworks): only torch learners run as rank groups", n)
    for i, s in enumerate(lc.sharding):
        require(s in SHARDINGS, f"learners.sharding[{i}]", f"must be one of {', '.join(SHARDINGS)}", s)
        require(s == "ddp" or lc.ranks_of(i) >= 2, f"learners.sharding[{i}]",
                f"shards the model over ranks: give this learner at least 2 in learners.ranks "
                f"(it has {lc.ranks_of(i)})", s)
