"""`diloco run --ray ADDRESS`: the local launcher's run, with every process placed on a Ray cluster.

What changes from one machine is only where processes go and what happens when a node goes:

- shards and learners run on nodes the launcher chooses (`network/homes.py`: the cheapest with room and
  the right labels), each kept by an actor (`host.py`) that reserves what it needs there;
- on every look at the run (`_tend`), a learner whose node died is counted lost and started again, with
  its id, where there is room (it resumes from its checkpoint on the shared storage and the current Θ);
  new capacity gets new learners up to `learners.max`; a shard whose node died is started again on
  another node from its saved state and journal (`--resume`), on the same port;
- the summary adds what the run used: node-hours, cost and cost per million merged tokens.

The syncer counts a vanished learner dead by its silence, as it always does: nothing it merged is
merged twice, and what the learner trained after its last push is counted lost.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import ray

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.cluster.host import LOST, NotStarted, RayChild, RayChildren
from diloco.cluster.node_choice import Demand, Fleet, Node, add, choose_nodes, learner_demand, live_nodes, syncer_demand
from diloco.config import Config
from diloco.errors import DilocoError
from diloco.launch.launcher import Launcher
from diloco.shard.ownership import placed_shard_count
from diloco.transport.ports import read_port_file
from diloco.transport.security_settings import SECRET_ENV

log = logging.getLogger(__name__)

RESTART_AFTER_S = 1.0
"""Pause before a lost shard is started again (its old process must have let go of the port)."""
SHARD_RESTART_ATTEMPTS = 10
REST_S = 60.0
"""How long a node where a start failed is left alone."""
GONE = (LOST, -signal.SIGKILL)
"""Exit codes that mean the node or the process was taken away, not that the program failed."""


def connect(address: str, config: Config, shards: int) -> bool:
    """Join the cluster at `address`; `local` starts a one-node instance sized for this run. Returns
    whether this call connected (and so must disconnect at the end): a caller already connected to
    Ray keeps its connection."""
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                               "logging_level": logging.WARNING}
    if address != "local":
        ray.init(address=address, **options)
        return True
    c = config.cluster
    per_learner = learner_demand(c).resources
    learners = config.learners.bounds()[1]
    custom = {k: v * learners for k, v in per_learner.items() if k not in ("CPU", "GPU")}
    cpus = per_learner.get("CPU", 0.0) * learners + c.syncer_cpus * shards
    labels = dict(c.syncer_labels)
    for key, value in c.learner_labels.items():
        if labels.setdefault(key, value) != value:
            raise DilocoError(f"--ray local runs everything on one node: cluster.learner_labels and "
                              f"cluster.syncer_labels cannot both hold there ({key} = {value!r} and {labels[key]!r})")
    ray.init(num_cpus=max(1, int(cpus + 0.999)), num_gpus=int(per_learner.get("GPU", 0.0) * learners + 0.999),
             resources=custom, labels=labels, **options)
    return True


class RayLauncher(Launcher):
    launcher_name = "ray"

    def __init__(self, config: Config, config_args: list[str], out: Path, *, address: str, shards: int = 1,
                 **options: Any) -> None:
        self.connected = connect(address, config, placed_shard_count(config, shards))
        if SECRET_ENV in os.environ:  # a node's processes see that node's environment, not this one's
            options["env"] = {SECRET_ENV: os.environ[SECRET_ENV], **(options.get("env") or {})}
        try:
            self.fleet = Fleet(config.learners)
            self.learner_need, self.syncer_need = learner_demand(config.cluster), syncer_demand(config.cluster)
            self.price_label, self.region_label = config.cluster.price_label, config.cluster.region_label
            self.node_seen: dict[str, float] = {}
            """When the launcher first saw each node (monotonic)."""
            self.resting: dict[str, float] = {}
            """Nodes where a start failed, and until when they are left alone (another job may hold what
            the launcher thought free)."""
            self.refused_prices: set[str] = set()
            self.dead_nodes: set[str] = set()
            """Nodes where a process of the run was lost: never used again (Ray still lists a node as alive
            for a while after it died; a node that comes back has a new id)."""
            self.handled: set[int] = set()
            """Children (by id()) whose end was dealt with."""
            self.shard_restarts: dict[str, int] = {}
            self.below_min_since: float | None = None
            self.emulate_link = config.cluster.emulate_link
            self.learner_threads = max(1, int(config.cluster.learner_cpus))
            super().__init__(config, config_args, out.resolve(), shards=shards, **options)
        except BaseException:
            self._disconnect()
            raise

    # ------------------------------------------------------------ the hooks of the local launcher

    @staticmethod
    def shared_folder(config: Config, out: Path) -> Path:
        storage = config.cluster.storage
        return (Path(storage) / out.name).resolve() if storage else out.resolve()

    def make_children(self) -> RayChildren:
        return RayChildren(self.shared / "logs")

    def _python(self, *args: str) -> list[str]:
        """A learner of several processes runs as one gang under torchrun (`gang.py`)."""
        n = self.config.cluster.learner_processes
        if args and args[0] == "learner" and n > 1:
            return [*super()._python()[:2], "diloco.cluster.gang", str(n), *args, *self.config_args]
        return super()._python(*args)

    def _place(self, name: str) -> str:
        if name not in self.children.assigned:
            demand = self.syncer_need if name.startswith("syncer") else self.learner_need
            self.children.assign(name, self._wait_for_room(name, demand), demand)
        return self.children.assigned[name][0].address

    def _start_learners(self) -> None:
        """Wait for room for `learners.min`, then start as many as there is room for, up to the max."""
        deadline = clock.monotonic() + self.config.cluster.below_min_timeout_s
        while len(chosen := self._room_for_learners()) < self.fleet.low:
            if clock.monotonic() > deadline:
                raise DilocoError(f"the cluster has room for {len(chosen)} learner(s), learners.min is "
                                  f"{self.fleet.low}: {self._describe_need(self.learner_need)}")
            clock.sleep(0.5)
        self._fill(chosen)

    def _tend(self) -> None:
        for child in list(self.children.children.values()):
            code = child.returncode
            if code is None or id(child) in self.handled:
                continue
            self.handled.add(id(child))
            if code in GONE:
                self.dead_nodes.add(child.node.id)
            if child.name.startswith("learner"):
                self._learner_ended(child, code)
            elif code != 0:
                self._restart_shard(child)
        self._check_restarted_shards()
        budget_left = sum(self.progress.tokens.values()) < self.budget
        if budget_left and self.fleet.room():
            self._fill(self._room_for_learners())
        if not budget_left:  # nobody replaces a learner once the budget is spent
            self.expected_down -= {f"learner-{m}" for m in self.fleet.vacant}
        self._check_fleet_size(budget_left)

    def learner_ids(self) -> list[int]:
        return sorted(self.fleet.started)

    def may_vanish(self, learner: int) -> bool:
        return learner in self.fleet.vacant

    def _failed(self, child: RayChild, code: int | None) -> bool:
        """A learner taken away with its node is a loss the run survives, not a failure (a shard's is
        one while its restarts last: `expected_down`). An ending `_tend` has not seen yet is judged there
        first, next turn: a code can appear between its look and this one (a shard found lost here ended
        the run before `_tend` could restart it)."""
        if code is not None and id(child) not in self.handled:
            return False
        lost_learner = child.name.startswith("learner") and code in GONE
        return not lost_learner and super()._failed(child, code)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._disconnect()

    def _disconnect(self) -> None:
        if getattr(self, "connected", False) and ray.is_initialized():
            ray.shutdown()

    # ------------------------------------------------------------ placement

    def _nodes(self) -> list[Node]:
        now = clock.monotonic()
        nodes = [n for n in live_nodes(ray.nodes(), self.price_label, self.refused_prices)
                 if n.id not in self.dead_nodes and self.resting.get(n.id, 0.0) <= now]
        for node in nodes:
            self.node_seen.setdefault(node.id, clock.monotonic())
        return nodes

    def _held(self) -> dict[str, dict[str, float]]:
        """What this run's processes hold (or are about to) on each node."""
        held: dict[str, dict[str, float]] = {}
        for child in self.children.children.values():
            if child.code is None:
                add(held.setdefault(child.node.id, {}), child.demand)
        for node, demand in self.children.assigned.values():
            add(held.setdefault(node.id, {}), demand)
        return held

    def _room_for_learners(self) -> list[Node]:
        return choose_nodes(self._nodes(), self.learner_need, self._held(), self.fleet.room(), self.price_label)

    def _wait_for_room(self, name: str, demand: Demand) -> Node:
        deadline = clock.monotonic() + self.config.cluster.below_min_timeout_s
        while not (chosen := choose_nodes(self._nodes(), demand, self._held(), 1, self.price_label)):
            if clock.monotonic() > deadline:
                raise DilocoError(f"no node has room for {name}: {self._describe_need(demand)}")
            clock.sleep(0.5)
        return chosen[0]

    def _describe_need(self, demand: Demand) -> str:
        labels = f" on a node labelled {demand.labels}" if demand.labels else ""
        nodes = "; ".join(f"{n.id[:8]} {dict(n.resources)} {dict(n.labels)}" for n in self._nodes())
        return f"each needs {dict(demand.resources)}{labels} (nodes: {nodes or 'none'})"

    def _fill(self, nodes: list[Node]) -> None:
        """Start a learner on each of `nodes`: lost ids first, then new ones."""
        for node, m in zip(nodes, self.fleet.next_ids(len(nodes))):
            name = f"learner-{m}"
            self.children.assign(name, node, self.learner_need)
            try:
                self._start_learner(m)
            except NotStarted as exc:
                self.children.assigned.pop(name, None)
                self.resting[node.id] = clock.monotonic() + REST_S
                log.warning("%s not started on node %s: %s", name, node.id[:8], exc)
                continue
            self.fleet.start(m, node.id)
            self.expected_down.discard(name)
            log.info("%s started on node %s (%s)", name, node.id[:8], node.labels.get(self.region_label, "no region"))

    # ------------------------------------------------------------ losses

    def _learner_ended(self, child: RayChild, code: int) -> None:
        m = int(child.name.split("-")[1])
        if code == 0:
            self.fleet.finished(m)
        elif code in GONE:  # its node went: started again where there is room
            log.warning("%s lost with node %s", child.name, child.node.id[:8])
            self.fleet.lost(m)
            self.expected_down.add(child.name)
        # any other code is the program failing: `_check_children` ends the run with its log

    def _restart_shard(self, child: RayChild) -> None:
        attempts = self.shard_restarts.get(child.name, 0) + 1
        if attempts > SHARD_RESTART_ATTEMPTS:
            self.expected_down.discard(child.name)  # `_check_children` reports it
            return
        self.shard_restarts[child.name] = attempts
        self.expected_down.add(child.name)
        log.warning("%s ended (code %s): starting it again from its saved state (attempt %d)", child.name,
                    child.code, attempts)
        clock.sleep(RESTART_AFTER_S)
        port = child.argv[child.argv.index("--bind") + 1].rpartition(":")[2]
        host = self._place(child.name)
        child.set_option("--bind", f"{host}:{port}")  # where the learners look for it
        port_file = Path(child.argv[child.argv.index("--port-file") + 1])
        port_file.unlink(missing_ok=True)
        try:
            self.children.restart(child.name, ("--resume",))
        except NotStarted as exc:
            self.resting[exc.node] = clock.monotonic() + REST_S
            log.warning("%s not restarted: %s", child.name, exc)
            self.handled.discard(id(child))  # try again next time

    def _check_restarted_shards(self) -> None:
        """A restarted shard is back once it has written its port again."""
        for name in [n for n in self.expected_down if n.startswith("syncer")]:
            child = self.children.children[name]
            if child.code is None and read_port_file(Path(child.argv[child.argv.index("--port-file") + 1])):
                self.expected_down.discard(name)

    def _check_fleet_size(self, budget_left: bool) -> None:
        if not budget_left or len(self.fleet.running) >= self.fleet.low:
            self.below_min_since = None
            return
        now = clock.monotonic()
        self.below_min_since = self.below_min_since or now
        if now - self.below_min_since > self.config.cluster.below_min_timeout_s:
            raise DilocoError(f"only {len(self.fleet.running)} learner(s) for {now - self.below_min_since:.0f} s, "
                              f"learners.min is {self.fleet.low}: {self._describe_need(self.learner_need)}")

    # ------------------------------------------------------------ what the run used

    def cluster_report(self, tokens_merged: float) -> dict[str, Any]:
        """Node-hours (the time this run held something on each node), cost at each node's price, and
        every placement with how it ended, its times in seconds from the run's start (as in the metrics)."""
        now, origin = clock.monotonic(), self.origin_monotonic
        spans: dict[str, list[tuple[float, float]]] = {}
        placements, prices, regions = [], {}, {}
        for child in self.children.history:
            end = child.ended_s if child.ended_s is not None else now
            spans.setdefault(child.node.id, []).append((child.started_s, end))
            prices[child.node.id] = child.node.price(self.price_label) or 0.0
            regions[child.node.id] = child.node.labels.get(self.region_label, "")
            outcome = ("running" if child.code is None else "lost" if child.code in GONE else f"exited {child.code}")
            placements.append({"name": child.name, "node": child.node.id, "region": regions[child.node.id],
                               "price_per_hour": prices[child.node.id],
                               "node_seen_s": self.node_seen.get(child.node.id, child.started_s) - origin,
                               "started_s": child.started_s - origin, "ended_s": end - origin,
                               "outcome": outcome})
        hours = {node: _covered_s(s) / 3600 for node, s in spans.items()}
        cost = sum(hours[n] * prices[n] for n in hours)
        return {
            "node_hours": sum(hours.values()), "cost": cost,
            "cost_per_million_tokens": cost / (tokens_merged / 1e6) if tokens_merged else None,
            "learner_hours": sum(p["ended_s"] - p["started_s"] for p in placements
                                 if p["name"].startswith("learner")) / 3600,
            "learners_started": len(self.fleet.started),
            "learners_lost": sum(p["outcome"] == "lost" for p in placements if p["name"].startswith("learner")),
            "shard_restarts": sum(self.shard_restarts.values()),
            "nodes": {n: {"region": regions[n], "price_per_hour": prices[n], "hours": hours[n]} for n in hours},
            "placements": placements,
        }


def _covered_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
