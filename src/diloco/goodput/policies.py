"""The three ways of running a job, each reduced to the same `Layout` the event engine runs.

A policy only decides *what fails together* and *what a failure costs*; the event machinery
(`engine.py`) is shared, so the policies cannot drift apart in how they count time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from diloco.errors import DilocoError
from diloco.goodput.params import GoodputParams

PolicyKind = Literal["data-parallel", "elastic", "decoupled"]


@dataclass(frozen=True)
class Policy:
    """A fault-tolerance policy: data-parallel, elastic data-parallel, or decoupled with M learners."""

    kind: PolicyKind
    learners: int = 1

    @property
    def label(self) -> str:
        if self.kind == "decoupled":
            return f"decoupled M={self.learners}"
        if self.kind == "elastic":
            return "elastic data-parallel"
        return "data-parallel"

    @staticmethod
    def standard(learners: tuple[int, ...] | list[int]) -> list[Policy]:
        """The paper's rows: data-parallel, elastic data-parallel, then decoupled for each M."""
        return [Policy("data-parallel"), Policy("elastic")] + [Policy("decoupled", m) for m in learners]


@dataclass(frozen=True)
class Layout:
    """What the engine simulates: identical units that fail independently, plus the costs.

    - ``units`` x ``unit_chips`` chips; a unit fails as a Poisson process of rate
      unit_chips / MTBI while it runs, and is then down for detection + spare swap + restart.
    - Work becomes durable every ``durable_every_s`` of running time, at a stall of ``durable_cost_s``
      (checkpoint, syncer push, step boundary); a failure loses the work since the last durable point,
      either of the failed unit only (``job_scope`` False) or of every running chip (True: a
      synchronous step dies with any of its chips).
    - ``pause_s``: on a failure every unit stops this long (elastic reconfiguration).
    - ``quorum``: the job progresses only while at least this many units are up.
    """

    units: int
    unit_chips: int
    durable_every_s: float
    durable_cost_s: float
    job_scope: bool
    pause_s: float
    quorum: int


def layout_for(policy: Policy, chips: int, params: GoodputParams) -> Layout:
    """Map a policy onto the shared event model; raises DilocoError for impossible sizes."""
    validate_size(policy, chips, params)
    if policy.kind == "data-parallel":
        return Layout(
            units=1,
            unit_chips=chips,
            durable_every_s=checkpoint_interval(chips, params),
            durable_cost_s=params.checkpoint_cost_s,
            job_scope=False,
            pause_s=0.0,
            quorum=1,
        )
    if policy.kind == "elastic":
        return Layout(
            units=chips // params.slice_chips,
            unit_chips=params.slice_chips,
            durable_every_s=params.step_s,
            durable_cost_s=0.0,
            job_scope=True,
            pause_s=params.detect_s + params.reconfigure_or_restart_s,
            quorum=1,
        )
    return Layout(
        units=policy.learners,
        unit_chips=chips // policy.learners,
        durable_every_s=params.sync_interval_s,
        durable_cost_s=0.0,
        job_scope=False,
        pause_s=0.0,
        quorum=params.quorum,
    )


def checkpoint_interval(chips: int, params: GoodputParams) -> float:
    """The data-parallel checkpoint interval: as given, or Young's optimum sqrt(2 C MTBF_job).

    Operators tune the interval to the job's failure rate; a fixed interval would make
    data-parallel collapse to zero at millions of chips (a failure every few seconds).
    """
    if params.checkpoint_interval_s is not None:
        return params.checkpoint_interval_s
    return math.sqrt(2.0 * params.checkpoint_cost_s * params.mtbi_s / chips)


def validate_size(policy: Policy, chips: int, params: GoodputParams) -> None:
    """One-line errors naming the option: chips, learners, quorum and slice size must fit together."""
    if chips < 1:
        raise DilocoError(f"--chips must be positive integers, got {chips}")
    if policy.kind == "decoupled":
        m = policy.learners
        if m < 1:
            raise DilocoError(f"--learners must be positive integers, got {m}")
        if m > chips:
            raise DilocoError(f"--learners {m} exceeds --chips {chips}")
        if chips % m:
            raise DilocoError(f"--learners {m} does not divide --chips {chips}")
        if params.quorum > m:
            raise DilocoError(f"--quorum {params.quorum} exceeds --learners {m}")
    elif policy.kind == "elastic":
        s = params.slice_chips
        if s > chips:
            raise DilocoError(f"--slice-chips {s} exceeds --chips {chips}")
        if chips % s:
            raise DilocoError(f"--slice-chips {s} does not divide --chips {chips}")
