"""The simulator's regional tier: a syncer per region between its learners and the global syncer.

`SimRegion` is what the driver tracks of one region: its regional syncer (`core/regional.py`), its route
to the global syncer, its life (a regional outage kills the syncer with the learners), and the ledger its
earlier lives left. The driver (`driver.py`) delivers events to the regional syncers as it does to the
global one; what it sends on the region's behalf crosses the region's WAN route.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.core.events import HeartbeatArrived, PushArrived, ProgressArrived, SyncerEvent
from diloco.core.messages import MESSAGE_HEADER_BYTES
from diloco.core.regional import RegionalSyncer
from diloco.core.rounds import RoundRecord
from diloco.network.links import Routes


@dataclass
class SimRegion:
    index: int
    """Its id among the global syncer's learners."""
    name: str
    members: list[int]
    link: Routes
    period: float
    """Its rounds' pacing period, in its fastest learner's steps: the global sync period in time."""
    syncer: RegionalSyncer | None = None
    incarnation: int = 0
    alive: bool = True
    last_seq: int = 0
    """Its latest push up, in any life: a new life numbers its pushes above it."""
    waiting: list[int] = field(default_factory=list)
    """Learners back before their region's syncer: they rejoin once it is."""
    banked: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    """Per learner, tokens merged (on time, stale) per fragment by the region's earlier lives and sent up."""
    rounds_banked: list[RoundRecord] = field(default_factory=list)
    duplicates_banked: int = 0

    def ledger(self, learner: int, fragments: int) -> tuple[list[int], list[int]]:
        """Tokens of `learner` merged here, on time and stale, per fragment, over every life."""
        merged, stale = self.banked.get(learner, ([0] * fragments, [0] * fragments))
        merged, stale = list(merged), list(stale)
        if self.syncer is not None and learner in self.syncer.down.ledger:
            entry = self.syncer.down.ledger[learner]
            for p in range(fragments):
                merged[p] += entry.merged[p]
                stale[p] += entry.stale[p]
        return merged, stale

    def rounds(self) -> list[RoundRecord]:
        return self.rounds_banked + (self.syncer.down.rounds if self.syncer is not None else [])

    def die(self, fragments: int) -> dict[int, list[int]]:
        """Its syncer is gone: bank what it merged and sent up; return, per learner and fragment, the
        tokens it merged that never left."""
        syncer = self.syncer
        lost: dict[int, list[int]] = {}
        if syncer is None:
            return lost
        gone = syncer.lose()
        for m in syncer.down.ledger:
            merged, stale = self.ledger(m, fragments)
            for p, (on_time, late) in gone.get(m, {}).items():
                merged[p] -= on_time
                stale[p] -= late
                lost.setdefault(m, [0] * fragments)[p] += on_time + late
            self.banked[m] = (merged, stale)
        self.rounds_banked += syncer.down.rounds
        self.duplicates_banked += sum(e.duplicates for e in syncer.down.ledger.values())
        self.last_seq = max(self.last_seq, syncer.up.seq)
        self.syncer = None
        return lost


def upstream_bytes(event: SyncerEvent) -> int | None:
    """What a regional syncer's message to the global syncer puts on the wire; None for a heartbeat,
    which takes no bandwidth."""
    if isinstance(event, PushArrived):
        return event.push.wire_bytes()
    if isinstance(event, ProgressArrived):
        return event.report.wire_bytes()
    if isinstance(event, HeartbeatArrived):
        return None
    return MESSAGE_HEADER_BYTES
