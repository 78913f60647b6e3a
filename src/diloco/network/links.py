"""Simulated links. A direction: a bandwidth shared in order by messages, a latency, and windows of outage
during which nothing moves. Without regions a learner has one `Link` of its own; with regions its
messages take a `Route` of several directions, some of them shared with other learners (`Network`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from diloco.config import Topology

if TYPE_CHECKING:
    from diloco.config import Config, Hop, LinkConfig

Window = tuple[float, float]


@dataclass(kw_only=True)
class Traffic:
    """What crossed something: bytes, messages, the largest message."""

    bytes_sent: int = 0
    messages: int = 0
    peak_message_bytes: int = 0

    def record(self, nbytes: int) -> None:
        """Count bytes that crossed (also those a collective timed as a whole)."""
        self.bytes_sent += nbytes
        self.messages += 1
        self.peak_message_bytes = max(self.peak_message_bytes, nbytes)


@dataclass
class Direction(Traffic):
    bandwidth_bps: float
    latency_s: float
    outages: list[Window] = field(default_factory=list)
    busy_until: float = 0.0
    last_end: float = 0.0
    """When the last message sent here was off the wire."""
    busy_s: float = 0.0
    """Seconds spent carrying bytes (its utilisation, over the run's time)."""

    def send(self, now: float, nbytes: int) -> float:
        """Queue a message behind those already on the wire; return when it has fully arrived."""
        return self._book(max(now, self.busy_until), nbytes)

    def signal(self, now: float) -> float:
        """When a control message of negligible size (a heartbeat) sent now arrives: behind what is
        on the wire and held up by outages, taking no bandwidth and not counted."""
        return self._resumed(max(now, self.busy_until)) + self.latency_s

    def record(self, nbytes: int) -> None:
        super().record(nbytes)
        self.busy_s += nbytes * 8 / self.bandwidth_bps

    def forget_before(self, now: float) -> None:
        """Nothing will arrive here before `now` (a shared direction drops what it no longer needs)."""

    def _span(self, start: float, nbytes: int) -> tuple[float, float]:
        """When a message that may start at `start` is on the wire, outages included."""
        end = start + nbytes * 8 / self.bandwidth_bps
        for down_from, down_to in sorted(self.outages):
            if down_from <= start < down_to:  # the link is down when the message would start
                end += down_to - start
                start = down_to
            elif start < down_from < end:  # it goes down mid-message: the rest waits
                end += down_to - down_from
        return start, end

    def _resumed(self, start: float) -> float:
        """`start`, or the end of the outage it falls in."""
        for down_from, down_to in sorted(self.outages):
            if down_from <= start < down_to:
                start = down_to
        return start

    def _book(self, start: float, nbytes: int) -> float:
        _, end = self._span(start, nbytes)
        self.busy_until = max(self.busy_until, end)
        self.last_end = end
        self.record(nbytes)
        return end + self.latency_s


@dataclass
class SharedDirection(Direction):
    """A direction that several senders' routes cross (a WAN link between regions). Their messages reach
    it in an order the sending order does not fix (a message can be held up on its sender's own link),
    so each takes the earliest stretch, from when it arrives, that the messages already booked leave
    free, and delays none of them. A FIFO link would let a message that got there first go first; here
    one booked earlier keeps its place, which costs a message at most the booked one's time on the wire."""

    booked: list[Window] = field(default_factory=list)

    def send(self, now: float, nbytes: int) -> float:
        start = now
        for booked_from, booked_to in self.booked:
            if booked_to <= start:
                continue
            if self._span(start, nbytes)[1] <= booked_from:
                break  # it fits before this one
            start = booked_to
        arrival = self._book(start, nbytes)
        bisect.insort(self.booked, (start, self.last_end))
        return arrival

    def signal(self, now: float) -> float:
        """A heartbeat takes no bandwidth: only outages hold it up (its sender's order is its route's)."""
        return self._resumed(now) + self.latency_s

    def forget_before(self, now: float) -> None:
        self.booked = [b for b in self.booked if b[1] > now]


class Link:
    """A learner's own link to the syncer, the same both ways (the model without regions)."""

    def __init__(self, bandwidth_mbit: float, latency_ms: float, outages: list[Window] | None = None) -> None:
        self.up = Direction(bandwidth_mbit * 1e6, latency_ms / 1e3, list(outages or []))
        self.down = Direction(bandwidth_mbit * 1e6, latency_ms / 1e3, list(outages or []))


@dataclass
class Route(Traffic):
    """Directions crossed one after the other, store-and-forward: a message has fully arrived over one
    hop, its latency included, before it starts on the next, where it queues behind what others sent
    there. It offers what the driver uses of a Direction; its own counters are its sender's traffic, and
    each hop counts everything that crossed it.

    A shared hop serves messages in the order they were sent, not quite the order they reach it: the two
    differ only by the queueing on the senders' earlier hops (their LAN links: milliseconds)."""

    hops: list[Direction]
    _ready: list[float] = field(default_factory=list)
    """Per hop, when this route's last message there was off the wire: its next one starts no earlier,
    so that a sender's messages arrive in the order it sent them."""

    def __post_init__(self) -> None:
        self._ready = [0.0] * len(self.hops)

    def send(self, now: float, nbytes: int) -> float:
        at = now
        for i, hop in enumerate(self.hops):
            hop.forget_before(now)  # whatever is sent from now on reaches every hop after now
            at = hop.send(max(at, self._ready[i]), nbytes)
            self._ready[i] = hop.last_end
        super().record(nbytes)
        return at

    def signal(self, now: float) -> float:
        at = now
        for i, hop in enumerate(self.hops):
            at = hop.signal(max(at, self._ready[i]))
        return at

    def record(self, nbytes: int) -> None:
        for hop in self.hops:
            hop.record(nbytes)
        super().record(nbytes)

    @property
    def bandwidth_bps(self) -> float:
        return min(hop.bandwidth_bps for hop in self.hops)

    @property
    def latency_s(self) -> float:
        return sum(hop.latency_s for hop in self.hops)

    @property
    def outages(self) -> list[Window]:
        return sorted(window for hop in self.hops for window in hop.outages)


@dataclass
class Fanout(Traffic):
    """A sender's ways, one direction, to every region that homes fragments (one way unless `placement`
    spreads them). A message about one fragment takes the way to (or from) its home; one meant for every
    shard (a progress report, leaving, the word to stop) takes each way and has arrived when the last
    way has carried it. Its own counters are everything its sender sent over all its ways."""

    ways: dict[str, Direction | Route]
    """By home region ("" for a learner's own link without regions)."""
    home_of: list[str] = field(default_factory=list)
    """Per fragment, the key of its way (empty: a single way serves every fragment)."""

    def _way(self, fragment: int) -> Direction | Route:
        return self.ways[self.home_of[fragment]] if self.home_of else self.only

    @property
    def only(self) -> Direction | Route:
        """The first way: the one way of a sender whose fragments share a home."""
        return next(iter(self.ways.values()))

    def send(self, now: float, nbytes: int, fragment: int | None = None) -> float:
        """When a message of `nbytes` about `fragment` (None: for every home) has arrived."""
        ways = [self._way(fragment)] if fragment is not None else list(self.ways.values())
        for _ in ways:
            super().record(nbytes)
        return max(way.send(now, nbytes) for way in ways)

    def send_split(self, now: float, nbytes_of: dict[int, int]) -> float:
        """Each home's share of one message (per fragment, its bytes), sent as one message from each home
        (a joining learner's Θ: every shard sends its own fragments); arrived when the last share has."""
        shares: dict[int, int] = {}
        keys: dict[int, Direction | Route] = {}
        for fragment, nbytes in nbytes_of.items():
            way = self._way(fragment)
            shares[id(way)] = shares.get(id(way), 0) + nbytes
            keys[id(way)] = way
        arrivals = []
        for key, nbytes in shares.items():
            super().record(nbytes)
            arrivals.append(keys[key].send(now, nbytes))
        return max(arrivals, default=now)

    def signal(self, now: float) -> float:
        return max(way.signal(now) for way in self.ways.values())

    def record(self, nbytes: int) -> None:
        """Bytes a collective timed as a whole (data-parallel: a single way)."""
        self.only.record(nbytes)
        super().record(nbytes)

    @property
    def bandwidth_bps(self) -> float:
        return self.only.bandwidth_bps

    @property
    def latency_s(self) -> float:
        return self.only.latency_s


@dataclass
class Routes:
    """A sender's ways to the syncer's shards (`up`) and back (`down`), over a network of shared links."""

    up: Fanout
    down: Fanout


@dataclass
class HopLink:
    """Both directions of one hop, as the summary lists it."""

    hop: Hop
    up: Direction
    down: Direction


class Network:
    """Every simulated link of a run, each direction one object: a learner's LAN link, and per ordered
    pair of regions the WAN direction between them, shared by every learner whose route crosses it (and
    by whoever else will send from one region to the other, such as a regional syncer)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._directions: dict[tuple[str, str], Direction] = {}
        self.hops: dict[str, HopLink] = {}
        """Every hop some learner's route crosses, in the order they were first used."""

    def direction(self, source: str, target: str, link: LinkConfig, outages: list[Window] | None = None,
                  shared: bool = False) -> Direction:
        """The one direction from `source` to `target` (a learner or a region), made on first use."""
        key = (source, target)
        if key not in self._directions:
            kind = SharedDirection if shared else Direction
            self._directions[key] = kind(link.bandwidth_mbit * 1e6, link.latency_ms / 1e3, list(outages or []))
        return self._directions[key]

    def learner_link(self, learner: int, outages: list[Window], home_of: list[str] | None = None) -> Routes:
        """A learner's ways to the syncer's shards, its outages on its own link: without regions its own
        `Link`; with them its route to each region in `home_of` (per fragment, its home's region; empty:
        the syncer's region homes every fragment)."""
        if not Topology(self.config).route(learner):
            link = Link(self.config.link.bandwidth_mbit, self.config.link.latency_ms, outages)
            return Routes(Fanout({"": link.up}), Fanout({"": link.down}))
        # With the regional tier a learner's one syncer is its region's, over its LAN, whatever the homes.
        return self._routes(lambda home: Topology(self.config).route(learner, home),
                            [] if Topology(self.config).tiered else home_of or [], outages)

    def region_link(self, region: str, home_of: list[str] | None = None) -> Routes:
        """A regional syncer's ways to the global syncer's shards: its region's WAN link to each home
        (none to its own region, where both run side by side)."""
        return self._routes(lambda home: Topology(self.config).region_route(region, home), home_of or [], [])

    def _routes(self, route_to: Callable[[str | None], list[Hop]], home_of: list[str],
                outages: list[Window]) -> Routes:
        homes: list[str | None] = list(dict.fromkeys(home_of)) or [None]  # None: the syncer's region
        up, down = {}, {}
        for home in homes:
            links = [self._hop_link(hop, outages if hop.kind == "lan" else []) for hop in route_to(home)]
            up[home or ""] = Route([h.up for h in links])
            down[home or ""] = Route([h.down for h in reversed(links)])
        spread = home_of if len(homes) > 1 else []
        return Routes(Fanout(up, spread), Fanout(down, spread))

    def _hop_link(self, hop: Hop, outages: list[Window]) -> HopLink:
        if hop.name not in self.hops:
            shared = hop.kind == "wan"
            self.hops[hop.name] = HopLink(hop, self.direction(hop.near, hop.far, hop.up, outages, shared),
                                          self.direction(hop.far, hop.near, hop.down, outages, shared))
        return self.hops[hop.name]

    def link_entries(self, run_s: float) -> list[dict[str, Any]]:
        """Per link: bytes each way and the share of the run each direction was busy; a WAN link between
        two regions once, named the way it was first used."""
        from diloco.results import link_entry

        listed: set[tuple[str, str]] = set()
        entries = []
        for h in self.hops.values():
            if (h.hop.far, h.hop.near) in listed:
                continue  # the other way round of a WAN link already listed: the same two directions
            listed.add((h.hop.near, h.hop.far))
            entries.append(link_entry(h.hop, h.up.bytes_sent, h.down.bytes_sent,
                                      *(d.busy_s / run_s if run_s else 0.0 for d in (h.up, h.down))))
        return entries
