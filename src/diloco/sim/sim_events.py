"""The simulator's own events, in virtual time, dispatched by type (`Simulation.run`).

`ToSyncer` carries one of the syncer core's events (`core/events.py`) to the moment it arrives; the
others are what happens to learners. Events for a learner carry its incarnation: one meant for an
earlier life (before a crash) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from diloco.core.events import SyncerEvent
from diloco.core.messages import Update


@dataclass(frozen=True)
class ToSyncer:
    event: SyncerEvent
    region: int | None = None
    """None: for the global syncer; else for that region's syncer (the regional tier), in its life
    `incarnation`: what was on its way to a regional syncer that died is gone with it."""
    incarnation: int = 0
    life: int | None = None
    """For a learner's connection ending: its `rejoins` then. Dropped if it rejoined since, as the real shard
    heeds only the end of a learner's newest update stream: a restart quicker than one trip must not have its
    new life found dead by the old one's connection."""


@dataclass(frozen=True)
class StepEnds:
    learner: int
    incarnation: int


@dataclass(frozen=True)
class Beat:
    """Time for a learner's heartbeat (every HEARTBEAT_S, on its own thread in the real runtime)."""

    learner: int
    incarnation: int


@dataclass(frozen=True)
class UpdateArrives:
    learner: int
    incarnation: int
    update: Update


@dataclass(frozen=True)
class StopArrives:
    learner: int
    incarnation: int


@dataclass(frozen=True)
class StateArrives:
    """Θ reached a learner that is back from a crash (`state` None: data-parallel, take a peer's): values,
    versions, and when (the learner's clock) to push the fragments the syncer named first."""

    learner: int
    incarnation: int
    state: tuple[dict[str, Any], list[int], dict[int, float]] | None


@dataclass(frozen=True)
class Crash:
    learner: int
    until: float | None = None
    """When it is back (a regional outage's end); None: `failures.recovery_s` after the crash."""


@dataclass(frozen=True)
class Recover:
    learner: int
    incarnation: int


@dataclass(frozen=True)
class AllReduceDone:
    pass


@dataclass(frozen=True)
class ToRegion:
    """Something from the global syncer reached a regional syncer, in its life `incarnation`: an answer
    (`update`), the word to stop (`stop`), or Θ to (re)start from (`state`: values and versions)."""

    region: int
    incarnation: int
    update: Update | None = None
    stop: bool = False
    state: tuple[dict[str, Any], dict[int, int]] | None = None


@dataclass(frozen=True)
class RegionBeat:
    region: int
    incarnation: int


@dataclass(frozen=True)
class RegionDown:
    """A regional outage takes the region's syncer down until `until` (its learners crash with it)."""

    region: int
    until: float


@dataclass(frozen=True)
class RegionBack:
    region: int
    incarnation: int


SimEvent = Union[ToSyncer, StepEnds, Beat, UpdateArrives, StopArrives, StateArrives, Crash, Recover, AllReduceDone,
                 ToRegion, RegionBeat, RegionDown, RegionBack]
