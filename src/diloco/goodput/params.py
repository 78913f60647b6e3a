"""The knobs of the goodput model, in one typed place, with their validation.

Defaults are the calibrated values (see ``docs/goodput.md`` and ``calibrate.py``): ``restart_s``
is fitted so that data-parallel reproduces the published row; the others are set by reasoning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from diloco.errors import DilocoError

HOURS_PER_YEAR = 365.25 * 24.0
"""One year, the chip mean time between interruptions used by the Decoupled DiLoCo paper."""

CALIBRATED_RESTART_S = 20.8
"""Fitted by ``diloco goodput --calibrate`` (see docs/goodput.md); copied here so runs are instant."""


@dataclass(frozen=True)
class GoodputParams:
    """Everything the simulation needs besides the job size and the policy.

    Times are in seconds of wall-clock time unless the name says otherwise.
    """

    mtbi_hours: float = HOURS_PER_YEAR
    """Mean time between interruptions of one running chip; failures are exponential."""
    detect_s: float = 5.0
    """From a chip failing to the system knowing it (heartbeat / collective timeout)."""
    restart_s: float = CALIBRATED_RESTART_S
    """Relaunching the failed unit's program on healthy chips and loading its state
    (a checkpoint for data-parallel, the syncer's parameters for a decoupled learner)."""
    checkpoint_interval_s: float | None = None
    """Running time between data-parallel checkpoints; None picks Young's optimum sqrt(2 C MTBF)."""
    checkpoint_cost_s: float = 5.0
    """Stall per data-parallel checkpoint (the blocking device-to-host copy of an async checkpoint)."""
    reconfigure_s: float | None = None
    """Elastic data-parallel: every chip pauses this long (after detection) to re-form the mesh
    without the failed slice. None means the same as ``restart_s``: it is a relaunch from memory."""
    step_s: float = 1.0
    """Elastic data-parallel: one synchronous training step; a failure loses the in-flight step."""
    sync_interval_s: float = 2.0
    """Decoupled: a learner's work becomes durable at the syncer this often (running time);
    a failed learner loses what it computed since its last sync."""
    slice_chips: int = 1000
    """Elastic data-parallel: chips per slice, the unit that drops out and rejoins."""
    spare_fraction: float = 0.01
    """Hot spare chips, as a fraction of the job's chips (not counted in its chip-time)."""
    swap_s: float = 0.0
    """Time to swap a free spare in for a failed chip (0: folded into ``restart_s``)."""
    repair_s: float = 86400.0
    """Time for a failed chip to come back as a spare; a unit with no free spare waits for it."""
    quorum: int = 1
    """Decoupled: the job progresses only while at least this many learners are up (K)."""
    hours: float = 168.0
    """Simulated wall-clock horizon of each run."""
    seed: int = 0
    """Seed of the numpy Generator; a run is a pure function of (params, policy, chips)."""

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_hours * 3600.0

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0

    @property
    def reconfigure_or_restart_s(self) -> float:
        return self.restart_s if self.reconfigure_s is None else self.reconfigure_s

    def as_dict(self) -> dict[str, float | int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def validate(self) -> GoodputParams:
        """Raise DilocoError naming the CLI option of the first impossible value."""
        _positive("--mtbi-hours", self.mtbi_hours)
        _positive("--hours", self.hours)
        for option, value in (
            ("--detect", self.detect_s),
            ("--restart", self.restart_s),
            ("--checkpoint-cost", self.checkpoint_cost_s),
            ("--step", self.step_s),
            ("--sync-interval", self.sync_interval_s),
            ("--spares", self.spare_fraction),
            ("--swap", self.swap_s),
            ("--repair", self.repair_s),
        ):
            _non_negative(option, value)
        if self.checkpoint_interval_s is not None:
            _non_negative("--checkpoint-interval", self.checkpoint_interval_s)
            if self.checkpoint_interval_s == 0 and self.checkpoint_cost_s > 0:
                raise DilocoError("--checkpoint-interval 0 needs --checkpoint-cost 0 (a free, continuous checkpoint)")
        if self.reconfigure_s is not None:
            _non_negative("--reconfigure", self.reconfigure_s)
        if self.slice_chips < 1:
            raise DilocoError(f"--slice-chips must be a positive integer, got {self.slice_chips}")
        if self.quorum < 1:
            raise DilocoError(f"--quorum must be a positive integer, got {self.quorum}")
        if self.seed < 0:
            raise DilocoError(f"--seed must be zero or more, got {self.seed}")
        return self


def _positive(option: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise DilocoError(f"{option} must be a positive number, got {value}")


def _non_negative(option: str, value: float) -> None:
    if math.isnan(value) or value < 0:
        raise DilocoError(f"{option} must be zero or more, got {value}")
