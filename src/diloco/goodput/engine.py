"""The discrete-event simulation every policy runs on.

Failures are not simulated chip by chip: while ``u`` units of ``c`` chips run, the superposition
of their chips' exponential failures is one Poisson process of rate u*c/MTBI, and the unit hit
is uniform among the running ones (they are all the same size). Because the process is
memoryless the next failure is redrawn after every event, so a 2.4M-chip job costs one loop
iteration per failure or return, not per chip. Chips that are not running (down, paused,
restarting) do not fail: an interruption is by definition something that stops running work.

Time is counted on three clocks: wall time ``t``; ``run``, the time some unit was computing
(not paused); and ``progress``, the time the job made progress (running and quorum met).
Useful chip-time accrues at (running chips) x dt while the job progresses; a failure then takes
back the work since the last durable point.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from diloco.goodput.params import GoodputParams
from diloco.goodput.policies import Layout
from diloco.goodput.spares import SparePool

_BLOCK = 4096
_INF = math.inf


@dataclass(frozen=True)
class Outcome:
    """Totals of one simulated run."""

    useful_chip_s: float
    total_chip_s: float
    progress_s: float
    horizon_s: float
    failures: int

    @property
    def goodput(self) -> float:
        """Useful chip-time over the job's chip-time (spares are not counted)."""
        return self.useful_chip_s / self.total_chip_s

    @property
    def uptime(self) -> float:
        """Fraction of wall time in which the job made any progress."""
        return self.progress_s / self.horizon_s


def durable_work(run_s: float, every_s: float, cost_s: float, *, failed: bool) -> float:
    """Work that survives a run of ``run_s`` seconds that saves every ``every_s`` at a ``cost_s`` stall.

    A run is cycles of (work ``every_s``, stall ``cost_s``). If it ends in a failure only the
    completed cycles count; if it is still going at the horizon the open cycle's work counts too.
    ``every_s == 0`` means a free, continuous save: nothing is ever lost.
    """
    if every_s <= 0.0:
        return run_s
    period = every_s + cost_s
    cycles = math.floor(run_s / period)
    kept = cycles * every_s
    if not failed:
        kept += min(run_s - cycles * period, every_s)
    return kept


def simulate_layout(layout: Layout, params: GoodputParams, rng: np.random.Generator) -> Outcome:
    """Run one policy layout to ``params.hours``; deterministic for the state of ``rng``."""
    n, chips_per_unit, quorum = layout.units, layout.unit_chips, layout.quorum
    unit_rate = chips_per_unit / params.mtbi_s
    horizon = params.horizon_s
    every, cost, job_scope, pause_s = layout.durable_every_s, layout.durable_cost_s, layout.job_scope, layout.pause_s
    detect, restart = params.detect_s, params.restart_s
    spares = SparePool(round(params.spare_fraction * n * chips_per_unit), params.swap_s, params.repair_s)

    up = list(range(n))  # running units, in no order: swap-remove keeps choice and removal O(1)
    resume_run = [0.0] * n  # `run` clock when the unit last came up
    resume_progress = [0.0] * n  # `progress` clock when the unit last came up
    returning: list[tuple[float, int]] = []  # heap of (time back, unit)

    exps: list[float] = []
    unis: list[float] = []
    ie = iu = 0
    t = run = progress = useful = epoch_run = pause_until = 0.0
    failures = 0

    while True:
        n_up = len(up)
        running = n_up > 0 and t >= pause_until
        next_fail = _INF
        if running:
            if ie == len(exps):
                exps, ie = rng.standard_exponential(_BLOCK).tolist(), 0
            next_fail = t + exps[ie] / (n_up * unit_rate)
            ie += 1
        next_back = returning[0][0] if returning else _INF
        next_t = min(next_fail, next_back, horizon, pause_until if t < pause_until else _INF)
        if running:
            dt = next_t - t
            run += dt
            if n_up >= quorum:
                progress += dt
                useful += n_up * chips_per_unit * dt
        t = next_t
        if t >= horizon:
            break
        if next_t == next_fail:
            failures += 1
            if iu == len(unis):
                unis, iu = rng.random(_BLOCK).tolist(), 0
            k = int(unis[iu] * n_up)
            iu += 1
            victim = up[k]
            last = up.pop()
            if last != victim:
                up[k] = last
            if job_scope:
                # A synchronous step dies with any of its chips: every running chip loses it.
                x = run - epoch_run
                lost = (x - durable_work(x, every, cost, failed=True)) * n_up * chips_per_unit
            else:
                x = run - resume_run[victim]
                credited = progress - resume_progress[victim]
                lost = min(x - durable_work(x, every, cost, failed=True), credited) * chips_per_unit
            useful -= lost
            back = spares.replace(t, t + detect) + restart
            heapq.heappush(returning, (back, victim))
            if pause_s > 0.0:
                pause_until = max(pause_until, t + pause_s)
                epoch_run = run
        elif next_t == next_back:
            _, unit = heapq.heappop(returning)
            up.append(unit)
            resume_run[unit] = run
            resume_progress[unit] = progress

    if cost > 0.0:
        # Stalls already taken inside runs still open at the horizon were credited as work.
        for unit in up:
            x = run - (epoch_run if job_scope else resume_run[unit])
            credited = progress - resume_progress[unit]
            useful -= min(x - durable_work(x, every, cost, failed=False), credited) * chips_per_unit

    return Outcome(
        useful_chip_s=useful,
        total_chip_s=float(n * chips_per_unit) * horizon,
        progress_s=progress,
        horizon_s=horizon,
        failures=failures,
    )
