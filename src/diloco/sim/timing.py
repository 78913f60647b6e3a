"""How long one inner step of a learner takes in virtual time: base / speed, with optional jitter."""

from __future__ import annotations

import numpy as np


class StepTimer:
    def __init__(self, base_s: float, speed: float, jitter: float, seed: int, learner: int) -> None:
        self.mean_s = base_s / speed
        self.jitter = jitter
        self._rng = np.random.default_rng((seed, learner, 0x5EED))
        self.last_s = self.mean_s

    def next(self) -> float:
        if self.jitter > 0:
            # Multiplicative, clipped so that a step never takes less than a tenth of its mean.
            self.last_s = self.mean_s * max(0.1, 1.0 + self.jitter * float(self._rng.standard_normal()))
        return self.last_s
