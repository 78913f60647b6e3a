"""A Ray cluster of several nodes on this one host, its nodes started and stopped by a process of its own.

Ray's `Cluster` utility starts each node's processes with a fork that runs Python in the child
(`preexec_fn`). In a process that is also driving a run (the launcher's threads in gRPC calls), that
child can crash before it execs: the node never comes up, its first actor dies, Ray marks it dead.
A node that joins a real cluster is started by another machine, so the tests and the elastic
benchmark do the same: the nodes are started by a child process that does nothing else, and the
caller says what to add and what to take away.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

REPLY_TIMEOUT_S = 120.0
"""Bound on one node's start or removal (Ray waits 30 s for a raylet; a busy host needs more)."""


@dataclass(frozen=True)
class NodeRef:
    node_id: str


class LocalCluster:
    """A head node (`head_cpus`, `head_labels`) and the nodes added to it, all on this host."""

    def __init__(self, head_cpus: int, head_labels: dict[str, str]) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of this process's threads
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, head_cpus, head_labels), daemon=True,
                                        name="diloco-local-cluster")
        self._process.start()
        child_end.close()
        self.address: str = self._call("address")

    def add_node(self, num_cpus: int = 1, labels: dict[str, str] | None = None) -> NodeRef:
        return NodeRef(self._call("add", num_cpus=num_cpus, labels=dict(labels or {})))

    def remove_node(self, node: NodeRef) -> None:
        """Take the node away at once (its processes killed), as a machine that dies."""
        self._call("remove", node_id=node.node_id)

    def shutdown(self) -> None:
        if self._process.is_alive():
            try:
                self._call("shutdown")
            finally:
                self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _call(self, op: str, **args: Any) -> Any:
        self._conn.send((op, args))
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"the local cluster did not answer {op!r} within {REPLY_TIMEOUT_S:.0f} s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"the local cluster could not {op}: {value}")
        return value


def _serve(conn: Connection, head_cpus: int, head_labels: dict[str, str]) -> None:
    """The child: one request at a time, each answered (ok, value) or (False, why)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "labels": head_labels})
    nodes: dict[str, Any] = {}
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the caller is gone
            op, args = "shutdown", {}
        try:
            if op == "address":
                reply: Any = cluster.address
            elif op == "add":
                node = cluster.add_node(num_cpus=args["num_cpus"], labels=args["labels"])
                nodes[node.node_id] = node
                reply = node.node_id
            elif op == "remove":
                cluster.remove_node(nodes[args["node_id"]], allow_graceful=False)
                del nodes[args["node_id"]]  # only once it is gone: a refused removal changes nothing
                reply = None
            elif op == "shutdown":
                cluster.shutdown()
                _send(conn, (True, None))
                return
            else:
                raise ValueError(f"unknown request {op!r}")
            _send(conn, (True, reply))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, who raises it
            _send(conn, (False, f"{type(exc).__name__}: {exc}"))


def _send(conn: Connection, message: tuple[bool, Any]) -> None:
    try:
        conn.send(message)
    except OSError:  # the caller is gone
        pass
