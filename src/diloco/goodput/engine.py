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
from collections.abc import Callable, Iterator
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


def _draws(draw: Callable[[int], np.ndarray]) -> Iterator[float]:
    """Endless stream of ``draw``'s variates, fetched ``_BLOCK`` at a time.

    One numpy call per block instead of one per event. A block is drawn only when the previous one
    runs out, so the two streams of a simulation consume ``rng`` in the order they are used.
    """
    while True:
        yield from draw(_BLOCK).tolist()


def _remove_unit(up: list[int], u: float) -> int:
    """Remove and return the running unit picked by ``u`` in [0, 1): each equally likely.

    Swap-remove: the last unit takes the victim's place, so ``up`` has no order but removal is O(1).
    """
    k = int(u * len(up))
    victim = up[k]
    last = up.pop()
    if last != victim:
        up[k] = last
    return victim


def _failure_loss(layout: Layout, n_up: int, run_since: float, credited: float) -> float:
    """Chip-seconds of useful work a failure takes back: the work since the last durable point.

    ``run_since`` is the running time since that work began (the epoch with job scope, else the
    victim's last start), ``credited`` the progress credited to the victim since its last start: one
    unit never loses more than it was credited (its time below quorum earned nothing).
    """
    lost_s = run_since - durable_work(run_since, layout.durable_every_s, layout.durable_cost_s, failed=True)
    if layout.job_scope:
        # A synchronous step dies with any of its chips: every running chip loses it.
        return lost_s * n_up * layout.unit_chips
    return min(lost_s, credited) * layout.unit_chips


def _unsaved_at_horizon(
    layout: Layout, up: list[int], run: float, epoch_run: float, progress: float,
    resume_run: list[float], resume_progress: list[float],
) -> Iterator[float]:
    """Chip-seconds to take back, unit by unit, for runs still open at the horizon.

    Stalls already taken inside those runs were credited as work; with free saves there are none.
    """
    if layout.durable_cost_s > 0.0:
        for unit in up:
            x = run - (epoch_run if layout.job_scope else resume_run[unit])
            credited = progress - resume_progress[unit]
            kept = durable_work(x, layout.durable_every_s, layout.durable_cost_s, failed=False)
            yield min(x - kept, credited) * layout.unit_chips


def simulate_layout(layout: Layout, params: GoodputParams, rng: np.random.Generator) -> Outcome:
    """Run one policy layout to ``params.hours``; deterministic for the state of ``rng``."""
    n, chips_per_unit, quorum = layout.units, layout.unit_chips, layout.quorum
    unit_rate = chips_per_unit / params.mtbi_s
    horizon, pause_s, job_scope = params.horizon_s, layout.pause_s, layout.job_scope
    spares = SparePool(round(params.spare_fraction * n * chips_per_unit), params.swap_s, params.repair_s)

    up = list(range(n))  # running units, in no order (see `_remove_unit`)
    resume_run = [0.0] * n  # `run` clock when the unit last came up
    resume_progress = [0.0] * n  # `progress` clock when the unit last came up
    returning: list[tuple[float, int]] = []  # heap of (time back, unit)
    exps, unis = _draws(rng.standard_exponential), _draws(rng.random)
    t = run = progress = useful = epoch_run = pause_until = 0.0
    failures = 0

    while True:
        n_up = len(up)
        running = n_up > 0 and t >= pause_until
        next_fail = t + next(exps) / (n_up * unit_rate) if running else _INF
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
            victim = _remove_unit(up, next(unis))
            run_since = run - (epoch_run if job_scope else resume_run[victim])
            useful -= _failure_loss(layout, n_up, run_since, progress - resume_progress[victim])
            heapq.heappush(returning, (spares.replace(t, t + params.detect_s) + params.restart_s, victim))
            if pause_s > 0.0:
                pause_until = max(pause_until, t + pause_s)
                epoch_run = run
        elif next_t == next_back:
            _, unit = heapq.heappop(returning)
            up.append(unit)
            resume_run[unit] = run
            resume_progress[unit] = progress

    for lost in _unsaved_at_horizon(layout, up, run, epoch_run, progress, resume_run, resume_progress):
        useful -= lost
    return Outcome(useful_chip_s=useful, total_chip_s=float(n * chips_per_unit) * horizon,
                   progress_s=progress, horizon_s=horizon, failures=failures)
