"""A tiny HTTP server for a syncer shard's status page, on its own port and daemon thread.

GET `/` serves the HTML page (`render_page`), GET `/status.json` the snapshot itself; anything else
is a 404. The snapshot function is called once per request, on the server's request thread, so it
must be thread-safe (take the shard's lock, copy, release). If it raises, the request gets a 500
with a one-line message and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from diloco.status.page import render_page

log = logging.getLogger(__name__)


def _split_bind(bind: str) -> tuple[str, int]:
    """'127.0.0.1:0' -> ('127.0.0.1', 0); '[::1]:8080' -> ('::1', 8080); ':8080' -> ('0.0.0.0', 8080)."""
    host, sep, port = bind.rpartition(":")
    if not sep:
        raise ValueError(f"status bind {bind!r} is not host:port")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class StatusServer:
    """Serves the status page for `snapshot()` on `bind` ("host:port"; port 0 picks a free one)."""

    def __init__(self, snapshot: Callable[[], dict], bind: str = "127.0.0.1:0") -> None:
        self._snapshot = snapshot
        host, port = _split_bind(bind)
        server_cls = _Server6 if ":" in host else _Server
        self._httpd = server_cls((host, port), self._handler_class())
        bound_host, bound_port = self._httpd.server_address[:2]
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        """host:port actually bound."""
        self.port: int = bound_port
        self._closed = False
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"status-http-{bound_port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}/"

    def close(self) -> None:
        """Stops serving and frees the port; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> StatusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        snapshot = self._snapshot

        class Handler(BaseHTTPRequestHandler):
            server_version = "diloco-status"
            sys_version = ""

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
                pass  # no line per request on stderr

            def _send(self, code: int, ctype: str, body: bytes, head: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _serve(self, head: bool) -> None:
                path = urlsplit(self.path).path
                if path not in ("/", "/status.json"):
                    self._send(404, "text/plain; charset=utf-8", b"not found\n", head)
                    return
                try:
                    snap = snapshot()
                    if path == "/status.json":
                        body, ctype = json.dumps(snap, default=str).encode(), "application/json"
                    else:
                        body, ctype = render_page(snap).encode(), "text/html; charset=utf-8"
                except Exception as exc:  # a bad snapshot must not take the server down
                    log.debug("status snapshot failed", exc_info=True)
                    msg = f"status unavailable: {type(exc).__name__}: {exc}"[:300]
                    self._send(500, "text/plain; charset=utf-8", (msg + "\n").encode(), head)
                    return
                self._send(200, ctype, body, head)

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                self._serve(head=False)

            def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
                self._serve(head=True)

        return Handler
