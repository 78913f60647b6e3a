"""Serving a syncer shard over gRPC: the server, its options, and a one-line error for a bad address."""

from __future__ import annotations

import errno
import socket
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from diloco.errors import DilocoError
from diloco.transport.security import PLAINTEXT, TransportSecurity, secure_server_port, server_interceptors
from diloco.v1 import diloco_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from diloco.runtime.syncer import SyncerShard


def serve(shard: SyncerShard, bind: str, workers: int = 32,
          security: TransportSecurity | None = None) -> tuple[grpc.Server, int]:
    """Start serving `shard` on `bind` (HOST:PORT; port 0 picks a free one); return the server and its
    port. A one-line error if the port is taken."""
    security = security or PLAINTEXT
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="syncer-rpc"),
                         interceptors=server_interceptors(security), options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_SyncerServicer_to_server(shard, server)
    check_bindable(bind)
    try:
        port = secure_server_port(server, bind, security)
    except RuntimeError:
        port = 0
    if port == 0:
        raise DilocoError(f"cannot listen on {bind}: the port is in use or the address is not this host's")
    shard.start()
    server.start()
    return server, port


def check_bindable(bind: str) -> None:
    """A one-line error for an address this host cannot listen on, before gRPC logs its own."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise DilocoError(f"--bind expects HOST:PORT, got {bind!r}")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise DilocoError(f"cannot listen on {bind}: {reason}") from None
