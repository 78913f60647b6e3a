"""When learners crash and links go down, from the config: fixed events and seeded random crashes."""

from __future__ import annotations

import numpy as np

from diloco.config import Config, FailuresConfig, Topology
from diloco.sim.sim_events import Crash


class CrashPlan:
    """Crash times per learner: the configured ones, plus exponential gaps of mean `mtbf_s`, drawn
    from the learner's own seeded stream so that runs repeat exactly.

    A regional outage (`failures.outages` naming a region) crashes every learner of the region for its
    duration: the machines are gone, so the learners lose their step in progress and their unpushed
    progress, as in any crash, and are back, from their own checkpoints and Θ, when the region is
    (not `recovery_s` later). The syncer is not taken down with its region: the simulated syncer does
    not crash."""

    def __init__(self, config: Config) -> None:
        cfg = self.cfg = config.failures
        self.fixed = [(c.at_s, Crash(c.learner)) for c in cfg.crashes] + [
            (o.at_s, Crash(m, until=o.at_s + o.duration_s))
            for o in cfg.outages if o.region for m in Topology(config).learners_of(o.region)]
        self._rngs = [np.random.default_rng((config.seed, m, 0xC0A5)) for m in range(config.learners.count)]

    @property
    def any(self) -> bool:
        return bool(self.fixed) or self.cfg.mtbf_s > 0

    def next_random(self, learner: int, now: float) -> float | None:
        if self.cfg.mtbf_s <= 0:
            return None
        return now + float(self._rngs[learner].exponential(self.cfg.mtbf_s))


def outage_windows(cfg: FailuresConfig, learner: int) -> list[tuple[float, float]]:
    """When a learner's own link is down (regional outages crash learners instead)."""
    return [(o.at_s, o.at_s + o.duration_s) for o in cfg.outages if o.learner == learner and not o.region]
