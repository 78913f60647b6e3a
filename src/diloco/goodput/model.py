"""Goodput and uptime of a policy at a job size: the entry points over the event engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diloco.goodput.engine import simulate_layout
from diloco.goodput.params import GoodputParams
from diloco.goodput.policies import Policy, checkpoint_interval, layout_for, validate_size


@dataclass(frozen=True)
class GoodputResult:
    """One cell of the table: a policy at a job size."""

    policy: str
    learners: int
    chips: int
    goodput: float
    uptime: float
    failures: int

    def as_dict(self) -> dict[str, str | int | float]:
        return {
            "policy": self.policy,
            "learners": self.learners,
            "chips": self.chips,
            "goodput": round(self.goodput, 6),
            "uptime": round(self.uptime, 6),
            "failures": self.failures,
        }


def rng_for(chips: int, params: GoodputParams) -> np.random.Generator:
    """The run's random stream depends on the seed and the size, not on the policy.

    So decoupled M=1 sees exactly data-parallel's failures, and policies compared at one size
    share as much randomness as their different event sequences allow.
    """
    return np.random.default_rng(np.random.SeedSequence([params.seed, chips]))


def simulate(policy: Policy, chips: int, params: GoodputParams) -> GoodputResult:
    """Simulate ``policy`` on ``chips`` chips for ``params.hours``; deterministic for ``params.seed``."""
    params.validate()
    outcome = simulate_layout(layout_for(policy, chips, params), params, rng_for(chips, params))
    label = policy.label
    if policy.kind == "decoupled" and params.quorum > 1:
        label += f", K={params.quorum}"  # the paper's rows are K = 1: this keeps them from being compared
    return GoodputResult(
        policy=label,
        learners=policy.learners,
        chips=chips,
        goodput=outcome.goodput,
        uptime=outcome.uptime,
        failures=outcome.failures,
    )


def sweep(chips: list[int], policies: list[Policy], params: GoodputParams) -> list[GoodputResult]:
    """Every policy at every size, after checking all of them, so bad input fails before any work."""
    params.validate()
    for policy in policies:
        for n in chips:
            validate_size(policy, n, params)
    return [simulate(policy, n, params) for policy in policies for n in chips]


def data_parallel_closed_form(chips: int, params: GoodputParams) -> float:
    """Expected data-parallel goodput, exact for the model when spares never run out.

    With job failure rate lam = chips/MTBI, recovery D = detect + swap + restart, checkpoints every
    tau of work at cost C, a run must survive s = tau + C to bank tau. Attempts are independent;
    each failed one costs its run time plus D, so the expected wall time per banked tau is
    (e^{lam s} - 1) (1/lam + D) and goodput = lam tau / ((1 + lam D)(e^{lam s} - 1)).
    With tau = C = 0 (free continuous checkpoints) it is 1 / (1 + lam D).
    """
    lam = chips / params.mtbi_s
    recovery = params.detect_s + params.swap_s + params.restart_s
    tau = checkpoint_interval(chips, params)
    if tau <= 0.0:
        return 1.0 / (1.0 + lam * recovery)
    return lam * tau / ((1.0 + lam * recovery) * math.expm1(lam * (tau + params.checkpoint_cost_s)))
