"""A shard's bulk connections between transfers (`bulk.py`): kept open for the learner's next ticket, since a
new connection is slow (`bulk_client.py` says why), and watched by one thread so that an idle one holds none.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

IDLE_CONNECTIONS = 256
"""Connections kept open between transfers (the longest idle closed first)."""
IDLE_S = 60.0
"""How long a connection may wait for its next ticket before it is closed."""


class IdleConnections:
    """Connections between transfers, watched by one thread: a connection that has something to say (its
    next ticket, or its close) goes back to a serving thread (`ready`); one idle IDLE_S, or beyond
    IDLE_CONNECTIONS (the longest idle first), is closed. A kept connection holds no thread while idle."""

    def __init__(self, ready: Callable[[socket.socket, tuple], None]) -> None:
        self.ready = ready
        self.selector = selectors.DefaultSelector()
        self.incoming: queue.SimpleQueue[tuple[socket.socket, tuple]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self.selector.register(self._wake_read, selectors.EVENT_READ)
        self.since: collections.OrderedDict[socket.socket, tuple[tuple, float]] = collections.OrderedDict()
        self.closed = False
        self.dropped = 0
        """Connections closed for a bound (idle too long, or too many idle)."""
        threading.Thread(target=self._watch, name="bulk-idle", daemon=True).start()

    def keep(self, conn: socket.socket, peer: tuple) -> None:
        self.incoming.put((conn, peer))
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")

    def _watch(self) -> None:
        while not self.closed:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self._wake_read:
                    with contextlib.suppress(OSError):
                        self._wake_read.recv(4096)
                    continue
                self.selector.unregister(key.fileobj)
                peer, _ = self.since.pop(key.fileobj)
                self.ready(key.fileobj, peer)
            self._take_incoming()
            self._close_over(time.monotonic())
        self._take_incoming()
        for conn in list(self.since):
            self._drop(conn)

    def _take_incoming(self) -> None:
        while True:
            try:
                conn, peer = self.incoming.get_nowait()
            except queue.Empty:
                return
            if self.closed:
                _close_quietly(conn)
                continue
            if isinstance(conn, ssl.SSLSocket) and conn.pending():  # its next ticket is read already
                self.ready(conn, peer)
                continue
            self.selector.register(conn, selectors.EVENT_READ)
            self.since[conn] = (peer, time.monotonic())

    def _close_over(self, now: float) -> None:
        while self.since:
            conn, (_, since) = next(iter(self.since.items()))
            if len(self.since) <= IDLE_CONNECTIONS and now - since < IDLE_S:
                return
            self._drop(conn)
            self.dropped += 1

    def _drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(conn)
        _close_quietly(conn)
        self.since.pop(conn, None)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")


def _close_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
