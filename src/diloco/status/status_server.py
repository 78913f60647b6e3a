"""A syncer shard's status page, served by the hardened `HttpEndpoint` on its own port.

GET `/` serves the HTML page (`render_page`), GET `/status.json` the snapshot itself; anything else
is a 404. The snapshot function is called once per request, on a worker thread, so it must be
thread-safe (take the shard's lock, copy, release). If it raises, the request gets a 500 with a
one-line message and the server keeps serving.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from diloco.status.endpoint import HttpEndpoint
from diloco.status.page import render_page


class StatusServer(HttpEndpoint):
    """Serves the status page for `snapshot()` on `bind` ("host:port"; port 0 picks a free one);
    with `credentials`, only to requests that carry one (see `diloco.status.endpoint`)."""

    def __init__(self, snapshot: Callable[[], dict], bind: str = "127.0.0.1:0", *,
                 credentials: Sequence[bytes] = ()) -> None:
        def page() -> tuple[str, bytes]:
            return "text/html; charset=utf-8", render_page(snapshot()).encode()

        def as_json() -> tuple[str, bytes]:
            return "application/json", json.dumps(snapshot(), default=str).encode()

        super().__init__({"/": page, "/status.json": as_json}, bind, credentials=credentials, name="status")
