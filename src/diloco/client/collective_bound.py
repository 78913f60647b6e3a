"""How long a rank of a multi-rank learner waits at a collective of its own process group before it ends
with one line: a bound derived from what this learner measured, not a fixed timeout.

- Until anything is measured (joining: Θ pulled fragment by fragment, the first step, compilation) the
  bound is the floor: `DILOCO_COLLECTIVE_TIMEOUT_S`, else the timeout the process group was made with
  (the built-in learner makes it with 600 s).
- Once the learner trains, every rank measures each step from one sync point to the next (compute,
  its pushes gathered, answers scattered, waits on slower peers, a checkpoint; rank 0 tells the others
  every second while it waits on the syncer) and the bound becomes `FACTOR` × the slowest step measured,
  at least `DILOCO_COLLECTIVE_MIN_S` (30 s): a live peer is never that late, a dead or hung one is
  noticed within it. It only grows: a slower step later raises it at once.
- Where ranks may part for longer than a step (leaving, the last evaluation and checkpoint, a DCP write)
  the floor holds again (`relaxed`, `relax`).

A process group's timeout is per process (torch's `_set_pg_timeout`), so the bound is kept per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from diloco.clock import SYSTEM_CLOCK as clock

log = logging.getLogger("diloco.learner")

FLOOR_S = 600.0
"""The bound before anything is measured (or `DILOCO_COLLECTIVE_TIMEOUT_S`)."""
MIN_S = 30.0
"""The least measured bound (or `DILOCO_COLLECTIVE_MIN_S`): a pause of the host (swap, GC, a busy core)
is not a dead rank."""
FACTOR = 4.0
"""The measured bound is this many times the slowest step: peers drift by less than a step between
two collectives, so four steps leave room for a step that runs slow."""
CHANGE = 1.25
"""The group's timeout is set again when the bound has grown by this factor (not on every step)."""


def floor_s() -> float:
    """`DILOCO_COLLECTIVE_TIMEOUT_S`, else the timeout the learner's process group was made with, else 600 s."""
    if "DILOCO_COLLECTIVE_TIMEOUT_S" in os.environ:
        return float(os.environ["DILOCO_COLLECTIVE_TIMEOUT_S"])
    return _initial_timeout_s() or FLOOR_S


def _initial_timeout_s() -> float | None:
    """The default process group's own timeout, as it was made (read before this module changes it)."""
    if not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(device)).options._timeout.total_seconds())
        except (RuntimeError, AttributeError):
            continue
    return None


def min_s() -> float:
    return float(os.environ.get("DILOCO_COLLECTIVE_MIN_S", MIN_S))


def bound_s(slowest_step_s: float | None, floor: float | None = None) -> float:
    """The bound for this slowest measured step (None: nothing measured yet), never above the floor."""
    floor = floor_s() if floor is None else floor
    if slowest_step_s is None:
        return floor
    return min(floor, max(min_s(), FACTOR * slowest_step_s))


class CollectiveBound:
    """One learner's bound: fed each step's length, it sets every process group's timeout."""

    def __init__(self) -> None:
        self.slowest_s: float | None = None
        self._floor: float | None = None
        """The floor, read once (the process group's own timeout changes as the bound is applied)."""
        self.applied_s = -1.0
        self._last: float | None = None
        self._relaxed = 0

    def floor(self) -> float:
        if self._floor is None:
            self._floor = floor_s()
            self.applied_s = self._floor
        return self._floor

    def step(self) -> None:
        """A sync point of this rank (every step): the time since the previous one is measured."""
        now = clock.monotonic()
        if self._last is not None:
            self.slowest_s = max(self.slowest_s or 0.0, now - self._last)
            wanted = bound_s(self.slowest_s, self.floor())
            if not self._relaxed and (wanted > self.applied_s or wanted * CHANGE < self.applied_s):
                self._apply(wanted)
        self._last = now

    @contextlib.contextmanager
    def relaxed(self) -> Iterator[None]:
        """The floor while ranks may part for longer than a step; the time it took is no step's."""
        self._relaxed += 1
        self._apply(self.floor())
        began = clock.monotonic()
        try:
            yield
        finally:
            self._relaxed -= 1
            if self._last is not None:
                self._last += clock.monotonic() - began
            self._apply(bound_s(self.slowest_s, self.floor()) if not self._relaxed and self.slowest_s else self.floor())

    def relax(self) -> None:
        """The floor from now on (the learner is leaving)."""
        self._relaxed += 1
        self._apply(self.floor())

    def _apply(self, seconds: float) -> None:
        if seconds == self.applied_s or not dist.is_initialized():
            self.applied_s = seconds
            return
        for group in _groups():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
        log.debug("collective bound %.1f s (slowest step %s s)", seconds, self.slowest_s)
        self.applied_s = seconds


def _groups() -> list[dist.ProcessGroup]:
    """Every process group of this process: the default one and the mesh's."""
    c10d = dist.distributed_c10d
    return [group for group in c10d._world.pg_map if not c10d._rank_not_in_group(group)]


BOUND = CollectiveBound()
"""This process's bound (its process groups are this process's)."""
