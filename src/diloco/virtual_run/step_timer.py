"""How long one inner step of a learner takes in virtual time: base / speed, with noise as real steps have.

Two kinds of noise, both multiplicative, measured from real runs (docs/algorithms.md gives the figures):
- `jitter`: each step's own, independent of the others (relative standard deviation);
- `drift`: a slowly wandering speed, the same for many steps in a row: log-normal, AR(1) with a
  correlation time of `drift_steps` steps, relative standard deviation `drift`. It is what makes
  learners of equal speed drift apart by several steps over a sync period, as they do for real (a busy
  host, a neighbour's job, thermal throttling), and what the lockstep model hides.
Both 0 is the lockstep model: every step of a learner takes exactly base / speed.
"""

from __future__ import annotations

import math

import numpy as np


class StepTimer:
    def __init__(self, base_s: float, speed: float, jitter: float, seed: int, learner: int,
                 drift: float = 0.0, drift_steps: float = 10.0) -> None:
        self.mean_s = base_s / speed
        self.jitter, self.drift = jitter, drift
        self._rho = math.exp(-1.0 / drift_steps) if drift_steps > 0 else 0.0
        self._rng = np.random.default_rng((seed, learner, 0x5EED))
        # The wander starts from its stationary distribution: learners differ from their first step.
        self._wander = drift * float(self._rng.standard_normal()) if drift > 0 else 0.0
        self.last_s = self.mean_s

    def next(self) -> float:
        factor = 1.0
        if self.drift > 0:
            shock = self.drift * math.sqrt(1 - self._rho ** 2) * float(self._rng.standard_normal())
            self._wander = self._rho * self._wander + shock
            factor = math.exp(self._wander - self.drift ** 2 / 2)  # mean 1
        if self.jitter > 0:
            # Clipped so that a step never takes less than a tenth of its mean.
            factor *= max(0.1, 1.0 + self.jitter * float(self._rng.standard_normal()))
        self.last_s = self.mean_s * factor
        return self.last_s


class Waiting:
    """Time a simulated learner spends held up, counted from `wait` to `resume` (the classes that mix
    this in keep `waiting_since: float | None` and `waiting_s: float`)."""

    waiting_since: float | None
    waiting_s: float

    def wait(self, now: float) -> None:
        if self.waiting_since is None:
            self.waiting_since = now

    def resume(self, now: float) -> None:
        if self.waiting_since is not None:
            self.waiting_s += now - self.waiting_since
            self.waiting_since = None
