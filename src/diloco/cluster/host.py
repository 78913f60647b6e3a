"""Our processes on Ray nodes: an actor per process (`ProcessHost`) and the launcher's handle on them.

Each shard and each learner runs as a plain `python -m diloco …` process, exactly as on one machine,
started by a small actor that Ray placed on the chosen node with the resources it reserves. The actor
starts it the way the local launcher does (`processes.Children`): the kernel ends the process when
the actor's process ends, so a node that dies, an actor that is killed or a driver that exits leaves
no process behind.

`RayChildren` gives the launcher the interface of `Children` (start, kill, restart, stop, running), so
the local launcher's logic serves here unchanged. A child whose actor is gone (its node died) gets the
return code `LOST`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.cluster.node_choice import Demand, Node
from diloco.errors import DilocoError
from diloco.launch.processes import Children, Started

log = logging.getLogger(__name__)

LOST = -1000
"""Return code of a child whose actor (and so whose node, or process) is gone."""
START_TIMEOUT_S = 60.0
"""Bound on Ray placing an actor and the actor starting its process; longer means no room there."""
POLL_EVERY_S = 0.5
CALL_TIMEOUT_S = 10.0


class NotStarted(DilocoError):
    """Ray could not place the actor on its node, or the actor could not start the process."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(message)
        self.node = node


class ProcessHost:
    """Keeps one of our processes on this node; every method returns at once."""

    def __init__(self, log_dir: str) -> None:
        self.children = Children(Path(log_dir))
        self.name: str | None = None

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: str) -> int:
        """Start the process with this node's Python (argv[0] names the launcher's), in the launcher's
        folder when this node has it (relative paths in the config then mean the same); return its pid."""
        self.name = name
        child = self.children.start(name, [sys.executable, *argv[1:]], env, cwd=cwd if Path(cwd).is_dir() else None)
        return child.process.pid

    def poll(self) -> int | None:
        return self.children.children[self.name].returncode if self.name else None

    def stop(self, sig: int, grace_s: float) -> int | None:
        self.children.stop(sig=sig, grace_s=grace_s)
        self.children.close()
        return self.poll()

    def kill(self) -> None:
        if self.name and self.poll() is None:
            self.children.kill(self.name)


RemoteHost = ray.remote(max_restarts=0, max_task_retries=0)(ProcessHost)


@dataclass
class RayChild(Started):
    actor: ray.actor.ActorHandle | None = None
    node: Node | None = None
    demand: Demand | None = None
    started_s: float = 0.0
    """When its process started (the launcher's monotonic clock)."""
    ended_s: float | None = None
    code: int | None = None
    polled_s: float = 0.0

    @property
    def returncode(self) -> int | None:
        """The process's exit code, asked of its actor at most every POLL_EVERY_S; LOST once the actor is gone."""
        if self.code is None and clock.monotonic() - self.polled_s >= POLL_EVERY_S:
            self.polled_s = clock.monotonic()
            try:
                self.finish(ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT_S))
            except (GetTimeoutError, ActorUnavailableError):
                pass  # a busy node, or one Ray cannot reach for now (not dead: it says so when it is)
            except RayError as exc:
                log.warning("%s lost on node %s: %s", self.name, self.node.id[:8], type(exc).__name__)
                self.finish(LOST)
        return self.code

    def finish(self, code: int | None) -> None:
        if code is not None and self.code is None:
            self.code, self.ended_s = code, clock.monotonic()


class RayChildren:
    """The launcher's processes on the cluster, each on the node assigned to it before its start."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, RayChild] = {}
        self.assigned: dict[str, tuple[Node, Demand]] = {}
        self.history: list[RayChild] = []
        """Every child ever started, in order, restarts included: what the run used."""

    def assign(self, name: str, node: Node, demand: Demand) -> None:
        self.assigned[name] = (node, demand)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> RayChild:
        node, demand = self.assigned.pop(name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        resources = dict(demand.resources)
        actor = RemoteHost.options(
            num_cpus=resources.pop("CPU", 0.0), num_gpus=resources.pop("GPU", 0.0), resources=resources,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.id, soft=False)).remote(str(self.log_dir))
        try:
            ray.get(actor.start.remote(name, list(argv), dict(env or {}), os.getcwd()), timeout=START_TIMEOUT_S)
        except (GetTimeoutError, RayError) as exc:
            ray.kill(actor)
            raise NotStarted(node.id, f"could not start {name} on node {node.id[:8]} ({type(exc).__name__})") from None
        child = RayChild(name, list(argv), dict(env or {}), self.log_dir / f"{name}.log", actor=actor, node=node,
                         demand=demand, started_s=clock.monotonic())
        self.children[name] = child
        self.history.append(child)
        return child

    def kill(self, name: str) -> None:
        """Kill the process and its actor: a crash, as a chaos test causes them."""
        child = self.children[name]
        try:
            ray.get(child.actor.kill.remote(), timeout=CALL_TIMEOUT_S)
        except (GetTimeoutError, RayError):
            pass
        ray.kill(child.actor)
        child.finish(-signal.SIGKILL)

    def restart(self, name: str, extra_args: tuple[str, ...] = ()) -> RayChild:
        """Start a child again (on the node assigned to it now) with its arguments, plus `extra_args`."""
        old = self.children[name]
        return self.start(name, old.argv + [a for a in extra_args if a not in old.argv], old.env)

    def running(self, prefix: str = "") -> list[RayChild]:
        return [c for n, c in self.children.items() if n.startswith(prefix) and c.returncode is None]

    def stop(self, prefix: str = "", grace_s: float = 20.0, sig: int = signal.SIGINT) -> None:
        """Ask the matching children to stop (each actor stops its process as the local launcher does)."""
        targets = self.running(prefix)
        replies = [(child, child.actor.stop.remote(sig, grace_s)) for child in targets]
        for child, reply in replies:
            try:
                child.finish(ray.get(reply, timeout=grace_s + CALL_TIMEOUT_S))
            except (GetTimeoutError, RayError):
                child.finish(LOST)
            ray.kill(child.actor)

    def close(self) -> None:
        """Kill every actor still there (its process goes with it); safe to call twice."""
        for child in self.history:
            if child.code is None:
                child.finish(LOST)
            try:
                ray.kill(child.actor)
            except RayError:
                pass
