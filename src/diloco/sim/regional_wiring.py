"""The simulated regional tier's wiring: the regions' syncers between their learners and the global
syncer, their WAN routes, beats, outages and returns (`tier.py` holds what is tracked of a region)."""

from __future__ import annotations

import torch

from diloco.config import Topology

from diloco.core.events import LearnerRejoined, PushArrived
from diloco.core.liveness import HEARTBEAT_S
from diloco.core.messages import MESSAGE_HEADER_BYTES
from diloco.core.regional import RegionalSyncer
from diloco.core.syncer_core import Action, Publish, SendState, Stop
from diloco.sim.sim_events import RegionBack, RegionBeat, RegionDown, ToRegion, ToSyncer
from diloco.sim.sim_state import SimState
from diloco.sim.tier import SimRegion, upstream_bytes


class RegionalWiring(SimState):
    def _build_regions(self, params: dict[str, torch.Tensor], embeddings: set[str], tokens_per_step: int) -> None:
        """The regional tier: the global syncer's learners are the regions' syncers, each of which starts
        from Θ's first version and is the syncer of its region's learners."""
        for r in Topology(self.config).tier_regions():
            self.regions.append(SimRegion(len(self.regions), r.name, list(Topology(self.config).learners_of(r.name)),
                                          self.network.region_link(r.name, self.home_of),
                                          Topology(self.config).region_period(r.name)))
        self.syncer = self.spec.syncer_core(params, self.fragments, range(len(self.regions)), embeddings=embeddings)
        self._embeddings = embeddings
        for region in self.regions:
            self.syncer.declare(region.index, tokens_per_step, RegionalSyncer.burst_steps(
                len(region.members), self.spec.H, self.config.regional.push_every))
            values, versions = self.syncer.rejoin_state(region.index, after_seq=0)
            self._start_region(region, values, versions, region.members)

    def _start_region(self, region: SimRegion, values: dict[str, torch.Tensor], versions: dict[int, int],
                      members: list[int]) -> None:
        """A regional syncer's life begins from Θ as the global syncer sent it; `members` start with it
        (the others rejoin it when they are back)."""
        region.syncer = self.spec.regional_syncer(
            region.index, values, [versions[p] for p in range(len(self.fragments))], self.fragments, members,
            embeddings=self._embeddings, settings=self.config.regional, period=region.period,
            first_seq=region.last_seq)
        tokens_per_step = self.config.train.batch_size * self.config.train.seq_len
        for m in region.members:
            region.syncer.down.declare(m, tokens_per_step)
        for m in members:
            region.syncer.down.rejoin_state(m, after_seq=self.learners[m].last_seq)
        region.alive = True

    def _to_regions(self, action: Action) -> None:
        """The global syncer's action, for the regions' syncers: over each region's WAN route."""
        if isinstance(action, Stop):
            for region in self.regions:
                if region.alive:
                    arrival = region.link.down.send(self.now, MESSAGE_HEADER_BYTES)
                    self.queue.schedule(arrival, ToRegion(region.index, region.incarnation, stop=True))
        elif isinstance(action, Publish):
            self.last_event_s = max(self.last_event_s, self.now)
            for r, update in action.updates.items():
                region = self.regions[r]
                if region.alive and not (region.syncer is not None and region.syncer.left):
                    arrival = region.link.down.send(self.now, update.wire_bytes(), update.fragment)
                    self.queue.schedule(arrival, ToRegion(r, region.incarnation, update=update))
        elif isinstance(action, SendState):
            region = self.regions[action.learner]
            arrival = self._send_state(region.link, action.values)
            self.queue.schedule(arrival, ToRegion(region.index, region.incarnation,
                                                  state=(action.values, dict(action.versions))))

    def _send_up(self, region: SimRegion, event) -> None:
        nbytes = upstream_bytes(event)
        fragment = None
        if isinstance(event, PushArrived):
            fragment = event.push.fragment
            self._in_order.sent(region.index, event.push.seq)
        arrival = (region.link.up.signal(self.now) if nbytes is None
                   else region.link.up.send(self.now, nbytes, fragment))
        self.queue.schedule(arrival, ToSyncer(event))

    def _on_to_region(self, event: ToRegion) -> None:
        region = self.regions[event.region]
        if event.incarnation != region.incarnation or not region.alive:
            return
        if event.state is not None:  # back from an outage: a new life from Θ; its learners rejoin it
            self._start_region(region, *event.state, members=[])
            waiting, region.waiting = region.waiting, []
            if self.syncer.stopped:
                self._handle(region.syncer.on_stop(), region)
            for m in waiting:
                self._rejoin(self.learners[m])
            self._schedule_region_beat(region)
        elif region.syncer is None:
            return
        elif event.stop:
            self._handle(region.syncer.on_stop(), region)
        else:
            self._handle(region.syncer.on_upstream(event.update, self.now), region)

    def _schedule_region_beat(self, region: SimRegion) -> None:
        self.queue.schedule(self.now + HEARTBEAT_S, RegionBeat(region.index, region.incarnation))

    def _on_region_beat(self, event: RegionBeat) -> None:
        region = self.regions[event.region]
        if event.incarnation != region.incarnation or region.syncer is None or region.syncer.left:
            return
        self._handle(region.syncer.beat(self.now), region)
        self._schedule_region_beat(region)

    def _on_region_down(self, event: RegionDown) -> None:
        """A regional outage: the region's syncer dies with what it merged and had not sent up yet (its
        learners crash by their own events)."""
        region = self.regions[event.region]
        if region.syncer is not None and region.syncer.left:
            return  # its part of the run is over
        for m, tokens in region.die(len(self.fragments)).items():
            for p, t in enumerate(tokens):
                self.learners[m].lost_tokens[p] += t
        region.alive = False
        region.incarnation += 1
        self.queue.schedule(event.until, RegionBack(region.index, region.incarnation))

    def _on_region_back(self, event: RegionBack) -> None:
        """The region's syncer is back: it takes Θ from the global syncer, which takes a full download."""
        region = self.regions[event.region]
        if event.incarnation != region.incarnation:
            return
        region.alive = True
        self._handle(self.syncer.handle(LearnerRejoined(region.index, after_seq=region.last_seq), self.now))
