"""One small read-only HTTP server, hardened for networks it does not trust: the status page and the
Prometheus endpoint are both served by it.

- An event loop on a daemon thread holds every connection, so idle or slow clients cost a socket each,
  not a thread. At most `MAX_CONNECTIONS` are open; a new one beyond that evicts the connection that
  has waited longest for its request (a half-open one), so a flood of silent clients cannot keep a
  real request out. A client gets `REQUEST_TIMEOUT_S` in all to send its whole request line and
  headers (a slow sender gains nothing) and `WRITE_TIMEOUT_S` to take the answer; a request head over
  `MAX_REQUEST_BYTES` is refused. One request per connection; only GET and HEAD.
- Optionally every request must carry the run's shared secret (`Authorization: Bearer TOKEN` or
  `x-diloco-secret: TOKEN`; TOKEN is the secret itself or the run token, HMAC of the secret), compared in
  constant time; anything else is a 401.
- Pages are rendered on a few worker threads (a page may wait on a lock), never on the loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from diloco.errors import DilocoError
from diloco.transport.security_settings import secret_token

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 128
"""Connections open at once; more evict the oldest one still sending its request."""
REQUEST_TIMEOUT_S = 5.0
"""Time a client has to send its request line and headers, in all."""
WRITE_TIMEOUT_S = 5.0
"""Time a client has to take the answer."""
RENDER_TIMEOUT_S = 10.0
"""Time a page may take to render before the request gets a 503."""
MAX_REQUEST_BYTES = 8192
"""Largest request head (request line and headers) read; no request here has a body."""
RENDER_THREADS = 4
LISTEN_BACKLOG = 1024

Route = Callable[[], tuple[str, bytes]]
"""A page: returns its content type and body; called on a worker thread, once per request."""

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def split_bind(bind: str) -> tuple[str, int]:
    """'127.0.0.1:0' -> ('127.0.0.1', 0); '[::1]:8080' -> ('::1', 8080); ':8080' -> ('0.0.0.0', 8080)."""
    host, sep, port_text = bind.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise DilocoError(f"address {bind!r} is not HOST:PORT with a port in 0..65535")
    return host.strip("[]") or "0.0.0.0", int(port_text)


def join_bind(host: str, port: int) -> str:
    """The inverse of `split_bind`: brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class HttpExposure:
    """Where a process's HTTP endpoints (Prometheus metrics, status page) listen and who may read them."""

    host: str = "127.0.0.1"
    credentials: tuple[bytes, ...] = ()
    """What a request must carry, one of them (`credentials_for`); empty: anyone."""


LOOPBACK = HttpExposure()
"""This machine only, without credentials: the default, and what `diloco run` gives its children."""


def credentials_for(secret: bytes | None) -> tuple[bytes, ...]:
    """What a request may carry to prove it knows `secret`: the secret itself (what Prometheus sends
    from a `credentials_file` holding the secret file) or the run token (`secret_token`). None: no check."""
    if secret is None:
        return ()
    return (secret, secret_token(secret).encode())


class HttpEndpoint:
    """Serves `routes` (path -> page) on `bind` ("host:port"; port 0 picks a free one) until `close()`.

    `credentials`: when not empty, each request must carry one of them (see the module's doc)."""

    def __init__(self, routes: Mapping[str, Route], bind: str = "127.0.0.1:0", *,
                 credentials: Sequence[bytes] = (), name: str = "http") -> None:
        self.name = name
        self._routes = dict(routes)
        self._credentials = tuple(credentials)
        host, port = split_bind(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.address = join_bind(bound_host, bound_port)
        """host:port actually bound."""
        self.port: int = bound_port
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        """Connections still sending their request, oldest first: the ones evicted when full."""
        self._open: set[asyncio.StreamWriter] = set()
        self._workers = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix=f"{name}-render-{bound_port}")
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-http-{bound_port}",
                                        daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    @property
    def url(self) -> str:
        return f"http://{self.address}/"

    def close(self) -> None:
        """Stops serving, drops every connection and frees the port; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._socket.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> HttpEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ on the loop's thread

    async def _start(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._connection, sock=self._socket, limit=MAX_REQUEST_BYTES)

    async def _stop(self) -> None:
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Room for this connection, made by evicting the oldest one still sending its request."""
        if len(self._open) >= MAX_CONNECTIONS:
            if not self._waiting:
                return False
            oldest = next(iter(self._waiting))
            self._waiting.pop(oldest)
            oldest.transport.abort()
        self._open.add(writer)
        self._waiting[writer] = None
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.transport.abort()
            return
        try:
            response = await self._answer(reader)
            self._waiting.pop(writer, None)
            if response is not None:
                writer.write(response)
                writer.close()  # one request per connection: close once the answer is out
                await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError, OSError):
            pass  # the client went away or was too slow: nothing to answer
        finally:
            self._waiting.pop(writer, None)
            self._open.discard(writer)
            writer.transport.abort()  # a no-op once closed; drops a client too slow to take its answer

    async def _answer(self, reader: asyncio.StreamReader) -> bytes | None:
        """The response to the connection's one request; None when there is no one to answer."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            return _response(431, b"request head too large\n")
        except asyncio.TimeoutError:
            return _response(408, b"request not received in time\n")
        except asyncio.IncompleteReadError:
            return None
        request = _parse(head)
        if request is None:
            return _response(400, b"bad request\n")
        method, target, headers = request
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD\n", extra={"Allow": "GET, HEAD"})
        if not self._authorized(headers):
            return _response(401, b"this endpoint needs the run's secret: send Authorization: Bearer TOKEN\n",
                             extra={"WWW-Authenticate": 'Bearer realm="diloco"'})
        route = self._routes.get(urlsplit(target).path)
        if route is None:
            return _response(404, b"not found\n", head=method == "HEAD")
        try:
            content_type, body = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._workers, route), RENDER_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _response(503, f"{self.name} busy: try again\n".encode(), head=method == "HEAD")
        except Exception as exc:  # a failing page must not take the server down
            log.debug("%s page failed", self.name, exc_info=True)
            message = f"{self.name} unavailable: {type(exc).__name__}: {exc}"[:300].replace("\n", " ")
            return _response(500, (message + "\n").encode(), head=method == "HEAD")
        return _response(200, body, content_type, head=method == "HEAD")

    def _authorized(self, headers: dict[str, str]) -> bool:
        """Whether the request carries one of the credentials; every comparison in constant time."""
        if not self._credentials:
            return True
        offered = []
        scheme, _, value = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            offered.append(value.strip())
        if "x-diloco-secret" in headers:
            offered.append(headers["x-diloco-secret"].strip())
        matched = False
        for candidate in offered:
            for credential in self._credentials:
                matched |= hmac.compare_digest(candidate.encode("latin-1"), credential)
        return matched


def _parse(head: bytes) -> tuple[str, str, dict[str, str]] | None:
    """Method, target and headers (names lower-cased) of a request head; None if it is not one."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/") or not parts[1].startswith("/"):
        return None
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


def _response(code: int, body: bytes, content_type: str = "text/plain; charset=utf-8", *, head: bool = False,
              extra: Mapping[str, str] | None = None) -> bytes:
    headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store",
               "Connection": "close", "Server": "diloco", **(extra or {})}
    lines = [f"HTTP/1.1 {code} {_REASONS[code]}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head else body)
