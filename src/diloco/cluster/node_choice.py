"""Which node takes the next learner or shard, and which learner id it runs: decided without Ray.

The launcher hands in the cluster's nodes (as `ray.nodes()` describes them) and what its own processes
hold on each. The cheapest node with room fills first; a node without a price label is capacity already
paid for and counts as free. A node whose price label is not a finite, non-negative number is left out
with one logged line: the label is a claim the launcher does not trust blindly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from diloco.config import ClusterConfig, LearnersConfig

log = logging.getLogger(__name__)

EPSILON = 1e-9
"""Slack when comparing sums of fractional resources (0.1 + 0.2 reserved of 0.3)."""
UNBOUNDED = 1 << 20
"""Room on a node for something that reserves nothing."""


@dataclass(frozen=True)
class Node:
    id: str
    address: str
    """The host other processes reach this node's servers at."""
    resources: Mapping[str, float]
    labels: Mapping[str, str]

    @classmethod
    def from_ray(cls, raw: Mapping[str, Any]) -> Node:
        return cls(id=raw["NodeID"], address=raw["NodeManagerAddress"], resources=dict(raw.get("Resources", {})),
                   labels=dict(raw.get("Labels", {})))

    def price(self, label: str) -> float | None:
        """Price per hour from the node's label: 0 without one; None when the label is not a price."""
        text = self.labels.get(label)
        if text is None:
            return 0.0
        try:
            value = float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) and value >= 0 else None


def live_nodes(raw_nodes: list[Mapping[str, Any]], price_label: str, refused: set[str] | None = None) -> list[Node]:
    """The alive nodes of `ray.nodes()`, those with a price that is not one left out (said once per node:
    `refused` keeps the nodes already said)."""
    refused = set() if refused is None else refused
    nodes = []
    for raw in raw_nodes:
        if not raw.get("Alive"):
            continue
        node = Node.from_ray(raw)
        if node.price(price_label) is None:
            if node.id not in refused:
                refused.add(node.id)
                log.warning("node %s left out: its label %s=%r is not a price", node.id[:8], price_label,
                            node.labels.get(price_label))
            continue
        nodes.append(node)
    return nodes


@dataclass(frozen=True)
class Demand:
    """What one process group reserves on one node, and the labels that node must carry."""

    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, node: Node) -> bool:
        return all(node.labels.get(k) == v for k, v in self.labels.items())

    def room(self, node: Node, held: Mapping[str, float]) -> int:
        """How many more of these fit on `node`, beside what is `held` there already."""
        if not self.matches(node):
            return 0
        if not self.resources:
            return UNBOUNDED
        fits = []
        for name, amount in self.resources.items():
            free = node.resources.get(name, 0.0) - held.get(name, 0.0)
            fits.append(int((free + EPSILON) // amount))
        return max(0, min(fits))


def learner_demand(c: ClusterConfig) -> Demand:
    """A learner's processes all run on one node: the gang reserves their sum there."""
    n = c.learner_processes
    wanted = {"CPU": c.learner_cpus * n, "GPU": c.learner_gpus * n,
              **{k: v * n for k, v in c.learner_resources.items()}}
    return Demand({k: v for k, v in wanted.items() if v > 0}, dict(c.learner_labels))


def syncer_demand(c: ClusterConfig) -> Demand:
    return Demand({"CPU": c.syncer_cpus} if c.syncer_cpus > 0 else {}, dict(c.syncer_labels))


def add(held: dict[str, float], demand: Demand, sign: float = 1.0) -> None:
    for name, amount in demand.resources.items():
        held[name] = held.get(name, 0.0) + sign * amount


def choose_nodes(nodes: list[Node], demand: Demand, held: Mapping[str, Mapping[str, float]], count: int,
                 price_label: str, avoid: frozenset[str] = frozenset()) -> list[Node]:
    """Up to `count` places for `demand`, the cheapest first (ties: the node with most room, then its
    id, so a choice is the same every time). A node may take several. Nodes in `avoid` come last."""
    room = {n.id: n_room for n in nodes if (n_room := demand.room(n, held.get(n.id, {}))) > 0}
    ranked = sorted((n for n in nodes if n.id in room),
                    key=lambda n: (n.id in avoid, n.price(price_label), -room[n.id], n.id))
    chosen: list[Node] = []
    for node in ranked:
        take = min(room[node.id], count - len(chosen))
        chosen += [node] * take
        if len(chosen) == count:
            break
    return chosen


@dataclass
class Fleet:
    """The elastic set of learners: which id runs on which node, and which ids start next.

    The configured ids (0 … count−1) come first; an id whose learner was lost is started again before
    any new one (it resumes from its own checkpoint); beyond them, new ids. The fleet grows to `max`
    wherever capacity allows and may shrink to `min` before the run is short of learners.
    """

    learners: LearnersConfig
    running: dict[int, str] = field(default_factory=dict)
    """Learner id → the node it runs on."""
    vacant: set[int] = field(default_factory=set)
    """Ids whose learner was lost and is not replaced yet."""
    done: set[int] = field(default_factory=set)
    """Ids whose learner finished its share: never started again."""
    started: list[int] = field(default_factory=list)
    """Every id ever started, in order."""

    @property
    def low(self) -> int:
        return self.learners.bounds()[0]

    @property
    def high(self) -> int:
        return self.learners.bounds()[1]

    def room(self) -> int:
        return max(0, self.high - len(self.running))

    def next_ids(self, count: int) -> list[int]:
        """The ids the next `count` learners take."""
        ids = sorted(self.vacant)
        candidate = 0
        while len(ids) < count:
            if candidate not in self.started and candidate not in self.running:
                ids.append(candidate)
            candidate += 1
        return ids[:count]

    def start(self, learner: int, node: str) -> None:
        self.vacant.discard(learner)
        self.running[learner] = node
        if learner not in self.started:
            self.started.append(learner)

    def lost(self, learner: int) -> None:
        """Its node or process is gone: the id waits to be started again elsewhere."""
        self.running.pop(learner, None)
        if learner not in self.done:
            self.vacant.add(learner)

    def finished(self, learner: int) -> None:
        self.running.pop(learner, None)
        self.vacant.discard(learner)
        self.done.add(learner)
