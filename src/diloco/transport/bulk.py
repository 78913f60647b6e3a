"""Bulk bytes off gRPC: Θ's values on a pull, and a push's data, over TCP connections of their own at
the socket's speed.

gRPC moves bulk bytes at a fraction of a plain socket's rate (`benchmarks/grpc_ceiling.py`: 3-4x slower
on loopback), and a learner joining a large run pulls all of Θ. A shard started with `--bulk-port` listens
on a second port. A pull that asks for it (`PullRequest.bulk`) is answered on the gRPC stream with the
header alone, naming that port and a ticket, and the values follow on a connection the learner opens to
it: the ticket (32 bytes), then exactly the bytes the header declares, sent from Θ's own memory and
received straight into the learner's tensors. A push the other way round: its header alone over gRPC
(`PushHeader.bulk`, to a shard whose Join said `bulk_pushes`) is checked and answered with a ticket; the
learner sends the ticket and exactly the bytes that header declared, and the push's reply comes back on
the same connection (`REPLY`: a status, then a serialized PushReply or the refusal's one line). A
connection whose transfer ended cleanly stays open for the learner's next ticket (`bulk_client.py` says
why); between transfers it holds no thread (`IdleConnections`).

A push's reply that came over the port carries a ticket for the same learner's next push to the shard
(`PushReply.next_ticket`, `ticket_ahead`): that push then says the ticket, its header (`AHEAD_HEADER`: its
length; then the serialized PushHeader) and its data together, one round trip instead of a gRPC call and
a transfer after it. The header is checked as the gRPC call would check it (`PushAhead.check`), for the
learner the ticket was issued to, before a byte of data is read; a header refused there, or a ticket
wrong, used or expired, gets the connection closed, and the learner sends that push the two-step way.

Who may read or write: only the holder of a ticket, and a ticket is handed out only by an authenticated
call (Pull or Push: the shared secret, a learner's credential or its certificate) or, for the same learner,
by the reply to a push that such a ticket carried; it is unguessable (256 random bits), good for one
transfer and for TICKET_TTL_S (a ticket ahead AHEAD_TTL_S), and names the values it was issued for (a
snapshot: the shard's Θ tensors are replaced on commit, never written) or the push header it was issued
to (so its learner, fragment and sizes were checked before a byte of data was read). With TLS in the
run's settings the bulk connection is TLS too, the shard presenting the same certificate; a run without
TLS moves the same bytes in the clear over gRPC as well. What a shard can be made to spend is bounded:
BULK_CONNECTIONS not yet past their ticket (more are closed at once), TICKET_WAIT_S for one to say its
ticket and a ticket ahead's header (and finish its TLS handshake), MAX_TICKETS and MAX_AHEAD held (the
oldest go first), UPLOADS_AT_ONCE pushes' buffers filled at once, IDLE_CONNECTIONS kept between transfers
for at most IDLE_S (`bulk_idle.py`). A learner that cannot reach the port pulls and pushes over gRPC from
then on (`calls.ShardClient`). A wrong, used or expired
ticket gets the connection closed with nothing sent, and one line in the shard's log.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import secrets
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import DilocoError
from diloco.transport.bulk_idle import IdleConnections
from diloco.transport.receive_buffers import UPLOADS_AT_ONCE, ReceiveBuffers
from diloco.transport.security_settings import TransportSecurity

log = logging.getLogger("diloco.syncer")

TICKET_BYTES = 32
TICKET_TTL_S = 15.0
"""A ticket unused this long after its Pull is void: the learner connects as soon as it reads the header."""
MAX_TICKETS = 64
"""Tickets held at once, the oldest dropped first: each keeps the Θ tensors it names alive (a version
that commits have since replaced stays in memory until its ticket is used or void), so at most this
many pulls' worth, each for at most TICKET_TTL_S. A join takes one per fragment, used within moments."""
BULK_CONNECTIONS = 16
"""Connections not yet past their ticket; a ticket's holder is bounded by the tickets handed out."""
BULK_THREADS = BULK_CONNECTIONS + UPLOADS_AT_ONCE
"""Threads serving connections, kept for the server's life (daemons: a stalled transfer never holds up
the process's exit): a push is taken (decoded and merged by torch) on the thread that read it, and a
thread new to torch pays for a pool of OpenMP threads of its own (a thread per connection cost the merge
about a tenth more CPU). Connections beyond them wait their turn."""
TICKET_WAIT_S = 10.0
"""How long a bulk connection may take to say its ticket."""
CONNECT_TIMEOUT_S = 10.0
"""How long a learner tries to reach a bulk port (a firewall that drops packets): then gRPC."""
TRANSFER_TIMEOUT_S = 300.0
"""The longest any one send or receive of a transfer may stall (a pull over gRPC has the same bound)."""


AHEAD_TTL_S = 60.0
"""A ticket for a learner's next push is void after this long: its learner then asks by a gRPC call again."""
MAX_AHEAD = 1024
"""Tickets for next pushes held at once, one per learner (a new one replaces its learner's last), the oldest
dropped first. They hold no values: what a dropped one costs is its learner's next push going the two-step way."""
AHEAD_HEADER = struct.Struct("<I")
MAX_AHEAD_HEADER_BYTES = 1 << 20
"""The longest push header said on the port: a header names each tensor of a fragment once."""
REPLY = struct.Struct("<BI")
"""After a push's data, the shard's reply: a status (TAKEN, REFUSED, UNAVAILABLE), then that many bytes of body."""
TAKEN, REFUSED, UNAVAILABLE = 0, 1, 2
MAX_REPLY_BYTES = 1 << 16


class BulkTransferError(DilocoError):
    """A bulk transfer that did not deliver exactly the bytes its header declared."""


class BulkUnreachable(BulkTransferError):
    """The bulk port could not be reached at all (refused, filtered, or its TLS not trusted): the same
    would happen again, so the caller moves its bytes over gRPC from then on."""


@dataclass(frozen=True)
class _Held:
    """A ticket's due: until when, what it sends (byte views) or takes (`Upload`), and whom to tell once it
    is used, void or dropped (`done`: an answer's memory bound lets go)."""

    expires: float
    what: list[memoryview] | Upload
    done: Callable[[], None] | None


@dataclass(frozen=True)
class Upload:
    """What a push's ticket stands for: `nbytes` of data to read, then `take` of them makes the reply
    (a status and its body)."""

    nbytes: int
    take: Callable[[memoryview], tuple[int, bytes]]


@dataclass(frozen=True)
class PushAhead:
    """What a ticket for a learner's next push stands for: `check` of the header said on the connection
    gives the push's `Upload`, or the line why it is refused."""

    check: Callable[[bytes], Upload | str]


@contextlib.contextmanager
def _pem_files(*pems: bytes) -> Iterator[list[str]]:
    """PEM blobs as files only this user can read, for as long as `ssl` needs paths; removed after."""
    with tempfile.TemporaryDirectory(prefix="diloco-tls-") as folder:
        paths = []
        for i, pem in enumerate(pems):
            path = Path(folder) / f"{i}.pem"
            path.touch(mode=0o600)
            path.write_bytes(pem)
            paths.append(str(path))
        yield paths


def server_context(security: TransportSecurity) -> ssl.SSLContext | None:
    """The shard's TLS for its bulk port, from the run's settings (None: the run has no TLS)."""
    if not security.serves_tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with _pem_files(security.tls_cert, security.tls_key) as (cert, key):
        context.load_cert_chain(cert, key)
    if security.requires_client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=security.tls_ca.decode())
    return context


class BulkServer:
    """A shard's bulk port: tickets issued by its authenticated calls (Pull, Push, an update stream); the
    values a ticket names sent to whoever presents it, or a push's data taken from them."""

    def __init__(self, host: str, security: TransportSecurity) -> None:
        self.tls = server_context(security)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((host, 0))
        except OSError as exc:
            self.listener.close()
            raise DilocoError(f"cannot listen for bulk transfers on {host}: {exc.strerror or exc}") from None
        self.listener.listen(BULK_CONNECTIONS)
        self.port: int = self.listener.getsockname()[1]
        self.tickets: collections.OrderedDict[bytes, _Held] = collections.OrderedDict()
        self.ahead: collections.OrderedDict[bytes, tuple[object, _Held]] = collections.OrderedDict()
        """Tickets for next pushes (`ticket_ahead`) and their owners (learners), the oldest first."""
        self.ahead_of: dict[object, bytes] = {}
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(BULK_CONNECTIONS)
        self.uploads = threading.BoundedSemaphore(UPLOADS_AT_ONCE)
        self.receive_buffers = ReceiveBuffers()
        self.served = 0
        """Tickets whose values were sent (pulls of Θ, answers)."""
        self.received = 0
        """Pushes whose data was read and taken (whatever the shard then decided of them)."""
        self.refused = 0
        self.closed = False
        self.connections: queue.SimpleQueue[tuple[socket.socket, tuple, bool] | None] = queue.SimpleQueue()
        self.idle = IdleConnections(lambda conn, peer: self.connections.put((conn, peer, True)))
        """Connections between transfers, each back to a serving thread when its next ticket comes."""
        for i in range(BULK_THREADS):
            threading.Thread(target=self._serve_each, name=f"bulk-{i}", daemon=True).start()
        threading.Thread(target=self._accept, name="bulk-accept", daemon=True).start()

    def ticket(self, what: list[memoryview] | Upload, done: Callable[[], None] | None = None) -> bytes:
        """A one-use ticket for `what`: values to send (byte views, in the order the header lists them), or
        the data of one push to take (`Upload`). `done` is called once the ticket is used, void or dropped."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self.lock:
            dropped = self._forget_expired(now)
            while len(self.tickets) >= MAX_TICKETS:
                dropped.append(self.tickets.popitem(last=False)[1])
            self.tickets[ticket] = _Held(now + TICKET_TTL_S, what, done)
        _tell(dropped)
        return ticket

    def ticket_ahead(self, owner: object, what: PushAhead) -> bytes:
        """A one-use ticket for `owner`'s next push, good for AHEAD_TTL_S; `owner`'s earlier one is void."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self.lock:
            self.ahead.pop(self.ahead_of.pop(owner, b""), None)
            while len(self.ahead) >= MAX_AHEAD:
                self.ahead_of.pop(self.ahead.popitem(last=False)[1][0])
            self.ahead[ticket] = (owner, _Held(time.monotonic() + AHEAD_TTL_S, what, None))
            self.ahead_of[owner] = ticket
        return ticket

    def _held(self, ticket: bytes, now: float) -> _Held | None:
        """What `ticket` stands for, taken out (one use), or None if it is wrong, used or expired."""
        with self.lock:
            dropped = self._forget_expired(now)
            held = self.tickets.pop(ticket, None)
            if held is None and (ahead := self.ahead.pop(ticket, None)) is not None:
                owner, held = ahead
                del self.ahead_of[owner]
        if held is not None and held.expires <= now:
            dropped.append(held)
            held = None
        _tell(dropped)
        return held

    def _forget_expired(self, now: float) -> list[_Held]:
        dropped = []
        while self.tickets and next(iter(self.tickets.values())).expires <= now:
            dropped.append(self.tickets.popitem(last=False)[1])
        return dropped

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return  # closed
            if not self.slots.acquire(blocking=False):
                self._refuse(conn, peer, f"more than {BULK_CONNECTIONS} bulk connections at once")
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a push's reply is small
            self.connections.put((conn, peer, False))

    def _serve_each(self) -> None:
        while (connection := self.connections.get()) is not None:
            self._serve(*connection)

    def _serve(self, conn: socket.socket, peer: tuple, kept: bool) -> None:
        """One transfer: a new connection holds a slot until past its ticket; a kept one (back from the
        idle, `IdleConnections`) holds none, and its closing before a next ticket is the client's goodbye."""
        slot, keep = not kept, False
        try:
            conn.settimeout(TICKET_WAIT_S)
            if self.tls is not None and not kept:
                conn = self.tls.wrap_socket(conn, server_side=True)
            ticket = _receive_ticket(conn, quiet_eof=kept)
            if ticket is None:
                return
            held = self._held(ticket, time.monotonic())
            if held is None:
                self._refuse(conn, peer, "a ticket that is wrong, used or expired")
                return
            if isinstance(held.what, PushAhead):  # its header first, checked before the data is read
                upload = held.what.check(_receive_header(conn))
                if isinstance(upload, str):
                    self._refuse(conn, peer, f"a push header said with a ticket ahead: {upload}")
                    return
                held = _Held(held.expires, upload, None)
            if slot:
                self.slots.release()
                slot = False
            conn.settimeout(TRANSFER_TIMEOUT_S)
            if isinstance(held.what, Upload):
                self._take_upload(conn, held.what)
            else:
                try:
                    for view in held.what:
                        conn.sendall(view)
                finally:
                    _tell([held])
                with self.lock:
                    self.served += 1
            keep = not self.closed
        except (OSError, ssl.SSLError, BulkTransferError) as exc:
            log.warning("bulk transfer with %s broke: %s", peer, exc)
        finally:
            if keep:
                self.idle.keep(conn, peer)
            else:
                with contextlib.suppress(OSError):
                    conn.close()
            if slot:
                self.slots.release()

    def _take_upload(self, conn: socket.socket, upload: Upload) -> None:
        """A push's data read into a buffer of the size its header declared, taken, and the reply sent."""
        with self.uploads:
            data = self.receive_buffers.take(upload.nbytes)
            _receive_into(conn, memoryview(data), "the push")
            status, body = upload.take(memoryview(data).toreadonly())
        with self.lock:
            self.received += 1
        conn.sendall(REPLY.pack(status, len(body)) + body)

    def _refuse(self, conn: socket.socket, peer: tuple, why: str) -> None:
        with self.lock:
            self.refused += 1
        log.warning("bulk connection from %s refused: %s", peer, why)
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            dropped = list(self.tickets.values())
            self.tickets.clear()
            self.ahead.clear()
            self.ahead_of.clear()
        _tell(dropped)
        self.idle.close()
        for _ in range(BULK_THREADS):
            self.connections.put(None)


def _tell(dropped: list[_Held]) -> None:
    """Tell the issuers of tickets used, void or dropped (outside the server's lock)."""
    for held in dropped:
        if held.done is not None:
            held.done()


def _receive_into(conn: socket.socket, target: memoryview, what: str) -> None:
    got = 0
    while got < target.nbytes:
        n = conn.recv_into(target[got:])
        if n == 0:
            raise BulkTransferError(f"the connection ended after {got} of {target.nbytes} bytes of {what}")
        got += n


def _receive_header(conn: socket.socket) -> bytes:
    """A push header said after a ticket ahead: its length (at most MAX_AHEAD_HEADER_BYTES), then itself."""
    length = bytearray(AHEAD_HEADER.size)
    _receive_into(conn, memoryview(length), "the push header's length")
    (size,) = AHEAD_HEADER.unpack(length)
    if size > MAX_AHEAD_HEADER_BYTES:
        raise BulkTransferError(f"a push header of {size} bytes, more than the {MAX_AHEAD_HEADER_BYTES} allowed")
    header = bytearray(size)
    _receive_into(conn, memoryview(header), "the push header")
    return bytes(header)


def _receive_ticket(conn: socket.socket, quiet_eof: bool) -> bytes | None:
    """The ticket a connection says; None if it closed before a byte of it and `quiet_eof` (a kept
    connection the client let go)."""
    ticket = bytearray(TICKET_BYTES)
    first = conn.recv_into(ticket)
    if first == 0 and quiet_eof:
        return None
    if first == 0:
        raise BulkTransferError("the connection ended before its ticket")
    _receive_into(conn, memoryview(ticket)[first:], "ticket")
    return bytes(ticket)
