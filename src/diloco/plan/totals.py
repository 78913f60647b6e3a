"""A run's totals from the steady state: bytes both ways and time, over the token budget.

`replay.py` gives the simulator's exact totals where it can (synchronous and data-parallel configs on the
real model); these are for the rest: a hypothetical model (`--params`), asynchronous strategies, regions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.fragments import Schedule
from diloco.plan.deployment import Deployment, traffic
from diloco.plan.steady_links import Traffic
from diloco.plan.reports import SiteReport, Totals
from diloco.plan.wire import LEAVE_BYTES

if TYPE_CHECKING:
    from diloco.plan.replay import ReplayResult


def replayed_totals(result: ReplayResult) -> Totals:
    """The replayed run's totals: the simulator's, exactly."""
    up, down = result.wire_bytes
    return Totals(result.steps, result.training_time_s, up, down, True,
                  "the simulator's schedule replayed: equals `diloco sim`'s wire bytes")


def estimate_totals(d: Deployment, sites: list[SiteReport]) -> Totals:
    """Bytes and time over the run from the steady state (`replay.py` gives exact ones where it can)."""
    per_step = d.learners * d.tokens_per_step
    if d.exchange == "gradients":
        steps = d.tokens // per_step
        s = sites[0]
        total = steps * s.up_per_period * d.learners
        return Totals(steps, steps * (d.grid_step_s + s.round_trip_s), total, total, d.layout.exact,
                      "data-parallel: every step's all-reduce share, on every link")
    t = traffic(d)
    if d.synchronous:
        return _synchronous_totals(d, t, sites)
    time_s = d.tokens / (sum(d.speeds) * d.tokens_per_step / d.step_time_s)  # every learner at its own speed
    syncs = time_s / d.period_s
    last = sum(t.push) + LEAVE_BYTES  # at the end: a push of what no push carried, and the leaving
    up = sum(s.learners * (sum(t.push) * syncs + t.progress * time_s * s.speed / d.step_time_s + last) for s in sites)
    down = sum(s.learners * sum(t.update) * syncs for s in sites)
    return Totals(round(time_s / d.step_time_s), time_s, round(up), round(down), False,
                  "asynchronous: steady-state rates over the run's time at full speed, and the last pushes")


def _synchronous_totals(d: Deployment, t: Traffic, sites: list[SiteReport]) -> Totals:
    """Up is the schedule's, hence exact for the layout: every scheduled push, each fragment's last push of
    what no push carried, a report per step, the leaving. Down counts the answers certain to be sent, to
    pushes more than τ steps before the end; whether the last ones are depends on the end's timing (a
    lower bound, then)."""
    steps = d.tokens // (d.learners * d.tokens_per_step)
    schedule = Schedule(d.H, len(t.push))
    up = down = 0
    for p in range(len(t.push)):
        first = schedule.next_due(p, 0)
        pushed = range(first, steps + 1, d.H)
        final = 0 if steps in pushed else 1
        answered = sum(1 for step in pushed if step + d.tau < steps)
        up += (len(pushed) + final) * t.push[p]
        down += answered * t.update[p]
    up += steps * t.progress + LEAVE_BYTES
    stall = max(s.stall_s for s in sites)
    time_s = steps * d.grid_step_s + (steps / d.H) * stall
    return Totals(steps, time_s, up * d.learners, down * d.learners, False,
                  "up: the schedule's; down: without the answers to the last τ steps' pushes (a lower bound)")
