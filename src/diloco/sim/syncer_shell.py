"""The simulated syncer shell: delivers a syncer core's events when they arrive and carries out the
actions it answers with, as the shard server does over gRPC (`shard/server.py`)."""

from __future__ import annotations

import torch

from diloco.core.events import HeartbeatArrived, ProgressArrived, PushArrived, StreamLost, TimerFired, sender
from diloco.core.learner_events import PushRefused
from diloco.core.messages import MESSAGE_HEADER_BYTES, Push, tensors_wire_bytes
from diloco.core.regional import Upstream
from diloco.core.syncer_core import Action, ProtocolError, Publish, SendState, Stop, Timer
from diloco.network.links import Routes
from diloco.sim.sim_events import StateArrives, StopArrives, ToSyncer, UpdateArrives
from diloco.sim.sim_state import SimState
from diloco.sim.tier import SimRegion


class SyncerShell(SimState):
    def _on_arrival(self, arrival: ToSyncer) -> None:
        """One of a syncer core's events arrives (the global one's, or with the regional tier a region's):
        the core decides, the driver carries out its actions."""
        event = arrival.event
        region = self.regions[arrival.region] if arrival.region is not None else None
        if region is not None and (region.syncer is None or arrival.incarnation != region.incarnation):
            return  # its syncer died with what was on its way to it
        origin = sender(event)
        if isinstance(event, StreamLost) and arrival.life is not None \
                and self.learners[event.learner].rejoins != arrival.life:
            return  # a connection of an earlier life ended: the learner has a newer one
        if isinstance(event, (ProgressArrived, HeartbeatArrived)) and origin is not None and not (
                self.regions[origin].alive if self.regions and region is None else self.learners[origin].alive):
            return  # sent by a process that has crashed since: its life's counters are gone with it
        core = self.syncer if region is None else region.syncer
        events = [event]
        if region is None and isinstance(event, PushArrived):
            events = self._in_order.arrived(event.push.learner, event.push.seq, event)
        for event in events:
            try:
                self._handle(core.handle(event, self.now), region)
            except ProtocolError:  # a refused push (an outlier): its sender sends that progress again later
                if isinstance(event, PushArrived):
                    self._refused(event.push, region)

    def _refused(self, push: Push, region: SimRegion | None) -> None:
        if self.regions and region is None:
            pusher = self.regions[push.learner]
            if pusher.syncer is not None:
                self._handle(pusher.syncer.on_refused(push), pusher)
            return
        learner = self.learners[push.learner]
        if learner.core is not None and learner.alive:
            learner.core.handle(PushRefused(push), self.now)  # asks nothing now: a later push carries it

    def _handle(self, actions: list[Action | Upstream], region: SimRegion | None = None) -> None:
        """Carry out a syncer core's actions: the global one's (`region` None) or a region's. The global
        syncer's recipients are the learners, or with the regional tier the regions' syncers."""
        for action in actions:
            if isinstance(action, Upstream):
                self._send_up(region, action.event)
            elif isinstance(action, Timer):
                self.queue.schedule(action.at, ToSyncer(TimerFired()) if region is None
                                    else ToSyncer(TimerFired(), region.index, region.incarnation))
            elif region is None and self.regions:
                self._to_regions(action)
            elif isinstance(action, Stop):
                for learner in self.learners:
                    if not learner.finished and learner.alive and (region is None or learner.index in region.members):
                        arrival = learner.link.down.send(self.now, MESSAGE_HEADER_BYTES)
                        self.queue.schedule(arrival, StopArrives(learner.index, learner.incarnation))
            elif isinstance(action, Publish):
                self.last_event_s = max(self.last_event_s, self.now)
                for m, update in action.updates.items():
                    learner = self.learners[m]
                    if learner.gone:
                        continue
                    arrival = learner.link.down.send(self.now, update.wire_bytes(), update.fragment)
                    self.queue.schedule(arrival, UpdateArrives(m, learner.incarnation, update))
            elif isinstance(action, SendState):
                learner = self.learners[action.learner]
                versions = [action.versions[p] for p in range(len(self.fragments))]
                arrival = self._send_state(learner.link, action.values)
                push_at = {p: self.now + d for p, d in action.push_in_s.items()}  # one clock in the simulator
                self.queue.schedule(arrival, StateArrives(learner.index, learner.incarnation,
                                                          (action.values, versions, push_at)))
        if self.syncer is not None and region is None:
            self.round_meter.emit(self.syncer.rounds)

    def _send_state(self, link: Routes, values: dict[str, torch.Tensor]) -> float:
        """Θ for a joining sender: every home shard sends its own fragments' values."""
        if len(link.down.ways) == 1:
            return link.down.send(self.now, tensors_wire_bytes(values))
        return link.down.send_split(self.now, {
            f.index: tensors_wire_bytes({n: values[n] for n in f.names if n in values}) for f in self.fragments})
