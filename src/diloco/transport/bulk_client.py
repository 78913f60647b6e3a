"""A learner's side of a shard's bulk port (`bulk.py`): connections kept open between transfers, and the
two transfers, a receive (Θ on a pull, an answer's data) and a send (a push's data, then its reply).

A connection is kept because a new one is slow, not only to open: its windows start small and grow with
what it carries (on loopback a new connection per 2.8 MB push took twice a kept one's time,
`docs/benchmarks.md`), a wide-area link pays slow start and a TLS handshake's round trips on every push,
and the shard's kernel sets up a socket each time. So after a transfer that ended cleanly the connection
goes back to `BulkConnections`, and the next transfer to the same port says its ticket on it. One that
the shard closed while it waited (its idle bound, a restart) reads as closed and is dropped before use;
one that breaks in use is never reused, and its error is the transfer's, as on a new connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from diloco.transport.bulk import (CONNECT_TIMEOUT_S, MAX_REPLY_BYTES, REFUSED, REPLY, TAKEN, TICKET_BYTES,
                                   TRANSFER_TIMEOUT_S, UNAVAILABLE, BulkTransferError, BulkUnreachable,
                                   _pem_files, _receive_into)
from diloco.transport.security_settings import TransportSecurity

T = TypeVar("T")

KEPT_PER_PORT = 4
"""Idle connections kept to one bulk port (a push, an answer and a join's parallel pulls may overlap);
more are closed once used."""
KEPT_IDLE_S = 20.0
"""A connection idle longer is closed rather than reused: well inside the shard's own bound
(`bulk.IDLE_S`), so a connection is not reused just as the shard closes it."""


def client_context(security: TransportSecurity) -> ssl.SSLContext | None:
    """A learner's TLS for a shard's bulk port: as its gRPC channel verifies the shard (None: no TLS)."""
    if not security.connects_tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if security.tls_ca is not None:
        context.load_verify_locations(cadata=security.tls_ca.decode())
    else:
        context.load_default_certs()
    if security.tls_cert is not None and security.tls_key is not None:
        with _pem_files(security.tls_cert, security.tls_key) as (cert, key):
            context.load_cert_chain(cert, key)
    return context


class BulkConnections:
    """One client's connections to bulk ports, idle ones kept per (host, port) for the next transfer."""

    def __init__(self, security: TransportSecurity) -> None:
        self.security = security
        self._tls: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self.opened = 0
        """Connections opened so far (the rest of the transfers reused one)."""

    def exchange(self, host: str, port: int, ticket: bytes, address: str, data: list[memoryview],
                 first: memoryview, what: str, rest: Callable[[socket.socket], T]) -> T:
        """Say `ticket` on a connection to the bulk port, send `data`, read the first byte that comes back
        into `first` (a view of one byte, or none) and the rest with `rest`. BulkUnreachable if no
        connection can be made; any failure after that a BulkTransferError naming the shard at `address`.
        A kept connection that the shard closed as it was taken (its bound on idle connections) answers
        nothing: the ticket, never answered, is said again on a new connection."""
        if len(ticket) != TICKET_BYTES or not 0 < port < 65536:
            raise BulkUnreachable(f"syncer at {address} named bulk port {port} with a {len(ticket)}-byte ticket")
        conn = self._take_idle(host, port)
        if conn is not None:
            try:
                _start(conn, ticket, data, first, what)
            except (OSError, ssl.SSLError, BulkTransferError):
                _close(conn)
                conn = None
        try:
            if conn is None:
                conn = self._connect(host, port, address)
                _start(conn, ticket, data, first, what)
            result = rest(conn)
        except (OSError, ssl.SSLError, BulkTransferError) as exc:
            if conn is not None:
                _close(conn)
            if isinstance(exc, BulkUnreachable):
                raise
            how = f": {exc}" if isinstance(exc, BulkTransferError) else f" failed: {exc}"
            raise BulkTransferError(f"bulk transfer with {address} (port {port}){how}") from None
        except BaseException:
            if conn is not None:
                _close(conn)
            raise
        self._keep(host, port, conn)
        return result

    def _connect(self, host: str, port: int, address: str) -> socket.socket:
        try:
            if self.security.connects_tls and self._tls is None:
                self._tls = client_context(self.security)
            raw = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the ticket and a reply are small
            try:
                conn = (self._tls.wrap_socket(raw, server_hostname=self.security.server_name or host)
                        if self._tls is not None else raw)
            except BaseException:
                raw.close()
                raise
        except (OSError, ssl.SSLError) as exc:
            raise BulkUnreachable(f"bulk port {port} of the syncer at {address} unreachable: {exc}") from None
        with self._lock:
            self.opened += 1
        return conn

    def _take_idle(self, host: str, port: int) -> socket.socket | None:
        """A kept connection still open (the shard has sent nothing on it since: readable means closed)."""
        now = time.monotonic()
        while True:
            with self._lock:
                kept = self._idle.get((host, port))
                if not kept:
                    return None
                conn, since = kept.pop()
            if now - since < KEPT_IDLE_S and not _readable(conn):
                return conn
            _close(conn)

    def _keep(self, host: str, port: int, conn: socket.socket) -> None:
        """Keep `conn` for the next transfer to its port; close those kept past KEPT_IDLE_S, to any port (a
        restarted shard's bulk port is a new one: nothing would take them)."""
        now = time.monotonic()
        with self._lock:
            stale = [c for kept in self._idle.values() for c, since in kept if now - since >= KEPT_IDLE_S]
            for where in list(self._idle):
                self._idle[where] = [(c, since) for c, since in self._idle[where] if now - since < KEPT_IDLE_S]
                if not self._idle[where]:
                    del self._idle[where]
            kept = self._idle.setdefault((host, port), [])
            if len(kept) < KEPT_PER_PORT:
                kept.append((conn, now))
            else:
                stale.append(conn)
        for old in stale:
            _close(old)

    def close(self) -> None:
        with self._lock:
            idle = [conn for kept in self._idle.values() for conn, _ in kept]
            self._idle.clear()
        for conn in idle:
            _close(conn)


def _readable(conn: socket.socket) -> bool:
    """Whether the shard has said anything (between transfers: only its close). poll, not select: a
    descriptor above select's 1024 is common in a process that holds many."""
    try:
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()


def _start(conn: socket.socket, ticket: bytes, data: list[memoryview], first: memoryview, what: str) -> None:
    conn.settimeout(TRANSFER_TIMEOUT_S)
    conn.sendall(ticket)
    for view in data:
        conn.sendall(view)
    if first.nbytes and conn.recv_into(first) == 0:
        raise BulkTransferError(f"the connection ended after 0 of {what}")


def receive(connections: BulkConnections, host: str, port: int, ticket: bytes, targets: list[memoryview],
            address: str) -> None:
    """Fill `targets` (byte views, in the header's order) from a shard's bulk port with `ticket`; a
    BulkTransferError naming the shard at `address` if it cannot be reached or sends anything short."""
    at = next((i for i, target in enumerate(targets) if target.nbytes), None)
    first = targets[at][:1] if at is not None else memoryview(b"")

    def rest(conn: socket.socket) -> None:
        for i, target in enumerate(targets[at:] if at is not None else [], start=at or 0):
            _receive_into(conn, target[1:] if i == at else target, f"value {i}")

    connections.exchange(host, port, ticket, address, [], first, f"{targets[at].nbytes if at is not None else 0} "
                         f"bytes of value {at}", rest)


def send(connections: BulkConnections, host: str, port: int, ticket: bytes, data: list[memoryview],
         address: str) -> tuple[int, bytes]:
    """Send a push's `data` (byte views, in its header's order) to a shard's bulk port with `ticket`; the
    shard's reply (TAKEN and a serialized PushReply, or REFUSED/UNAVAILABLE and one line)."""
    head = bytearray(REPLY.size)

    def rest(conn: socket.socket) -> tuple[int, bytes]:
        _receive_into(conn, memoryview(head)[1:], "the reply")
        status, size = REPLY.unpack(head)
        if status not in (TAKEN, REFUSED, UNAVAILABLE) or size > MAX_REPLY_BYTES:
            raise BulkTransferError(f"a reply of status {status} and {size} bytes")
        body = bytearray(size)
        _receive_into(conn, memoryview(body), "the reply")
        return status, bytes(body)

    return connections.exchange(host, port, ticket, address, data, memoryview(head)[:1],
                                f"{REPLY.size} bytes of the reply", rest)


def bulk_host(address: str) -> str:
    """The host part of a shard's gRPC address (HOST:PORT, IPv6 in brackets): its bulk port is there."""
    return address.rpartition(":")[0].strip("[]") or "127.0.0.1"
