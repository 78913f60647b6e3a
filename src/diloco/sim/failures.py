"""When learners crash and links go down, from the config: fixed events and seeded random crashes."""

from __future__ import annotations

import numpy as np

from diloco.config import FailuresConfig


class CrashPlan:
    """Crash times per learner: the configured ones, plus exponential gaps of mean `mtbf_s`, drawn
    from the learner's own seeded stream so that runs repeat exactly."""

    def __init__(self, cfg: FailuresConfig, learners: int, seed: int) -> None:
        self.cfg = cfg
        self.fixed = [(c.at_s, c.learner) for c in cfg.crashes]
        self._rngs = [np.random.default_rng((seed, m, 0xC0A5)) for m in range(learners)]

    @property
    def any(self) -> bool:
        return bool(self.fixed) or self.cfg.mtbf_s > 0

    def next_random(self, learner: int, now: float) -> float | None:
        if self.cfg.mtbf_s <= 0:
            return None
        return now + float(self._rngs[learner].exponential(self.cfg.mtbf_s))


def outage_windows(cfg: FailuresConfig, learner: int) -> list[tuple[float, float]]:
    return [(o.at_s, o.at_s + o.duration_s) for o in cfg.outages if o.learner == learner]
