"""Serving a syncer shard over gRPC: the server, its options, and a one-line error for a bad address.

What a shard can be made to spend is bounded before anyone is authenticated: the pool has a thread for
every call the configured learners may hold at once (`CallLimits`) and no more calls run than that
(gRPC refuses the excess at once with RESOURCE_EXHAUSTED instead of queuing it); a refused call holds no
thread; connections that never finish their handshake, or sit idle, are closed; and the shard may open
as many files as the host allows (`raise_open_file_limit`). Its memory does not grow with the threads
that serve learners (`limit_malloc_arenas`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import resource
import socket
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from diloco.errors import DilocoError
from diloco.transport.bulk import BulkServer
from diloco.transport.security import (PLAINTEXT, CallLimits, TransportSecurity, secure_server_port,
                                       server_interceptors)
from diloco.transport.stream_calls import add_syncer_to_server

if TYPE_CHECKING:
    from diloco.shard.shard_view import ShardView

log = logging.getLogger("diloco.syncer")

REFUSAL_THREADS = 16
"""Threads beyond the admitted calls' for refusing calls (each refusal is over in a moment)."""
HANDSHAKE_TIMEOUT_MS = 10_000
"""A connection that has not finished its TLS and HTTP/2 handshake by then is closed."""
IDLE_CONNECTION_MS = 5 * 60_000
"""A connection with no call for this long is closed (a learner always holds its update stream)."""
SERVER_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                  ("grpc.max_send_message_length", 64 << 20),
                  ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                  ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
                  # Learners ping every 20 s to find dead links (transport/calls.py): allow it, and
                  # ping back so that a peer that vanished frees its connection.
                  ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                  ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                  ("grpc.http2.max_ping_strikes", 0)]


def pool_size(learners: int, limits: CallLimits) -> int:
    """Threads for every call the configured learners and the run's operator may hold at once, and for
    refusals. Learners beyond the configured count share what is left, then are told to retry."""
    return learners * limits.per_learner + limits.operator + REFUSAL_THREADS


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard one, so that many connections cannot starve the
    shard of files (its saves, its journal); the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return soft


MALLOC_ARENAS = 2
"""glibc gives every thread that allocates an arena of its own (up to eight per core), and what is freed in
an arena stays with it. A shard serves each learner's calls on their own threads, so the buffers of pushes
received and answers sent left its memory growing with its learners; two arenas keep it flat."""
M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for the threads that allocate from now on; whether the cap is in force.
    Left alone where MALLOC_ARENA_MAX says otherwise, and off glibc."""
    if "MALLOC_ARENA_MAX" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):
        return False


def huge_pages_for_tensors() -> None:
    """Ask torch to back large CPU tensors with transparent huge pages (its THP_MEM_ALLOC_ENABLE), read at
    its first large allocation, so before Θ is seeded. A shard allocates fragment-sized tensors every round
    (the new Θ, the outer optimizer's sums): on 4 KiB pages, faulting them in cost 1.6-1.8 ns per
    parameter, six times an in-place pass over them; on huge pages, 0.2-0.3 (`benchmarks/core_events.py
    --merge` on this host). Left alone where the environment says otherwise."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def merge_threads(count: int) -> int:
    """Give a shard's merge `count` threads; torch's intra-op threads as they come out. With numba the merge's
    arithmetic is its compiled loops, which take the threads in pieces (`chunk_threads`), and torch keeps
    one: its idle threads spin beside them (1.3-1.6x the CPU, no faster: docs/benchmarks.md, s63). Without
    numba torch's ops are the arithmetic and take the threads."""
    import torch

    from diloco import chunk_threads
    from diloco.codecs import compiled

    chunk_threads.set_threads(count)
    torch.set_num_threads(1 if compiled.is_enabled() else count)
    return torch.get_num_threads()


INIT_LIMIT_BYTES = 1 << 38
"""The largest Θ a shard accepts to be seeded with (256 GiB of fp32), whatever the host."""


def available_memory_bytes() -> int:
    """Memory this host can still give (MemAvailable; without /proc, the free physical pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return INIT_LIMIT_BYTES


def init_limit_bytes() -> int:
    """The largest Θ this shard can be seeded with now: the message and its decoded copy are held at
    once, so half of what the host can give (at most INIT_LIMIT_BYTES). Declared sizes above it are
    refused from the header, before any data is read."""
    return min(INIT_LIMIT_BYTES, available_memory_bytes() // 2)


def serve(shard: ShardView, bind: str, workers: int | None = None, security: TransportSecurity | None = None,
          limits: CallLimits | None = None, bulk_port: bool = False) -> tuple[grpc.Server, int]:
    """Start serving `shard` on `bind` (HOST:PORT; port 0 picks a free one); return the server and its
    port. `workers` defaults to what the configured learners need (`pool_size`), up to `learners.max` of an
    elastic run. With `bulk_port`, also a bulk port on the same host (`transport/bulk.py`). A one-line error
    if the port is taken."""
    security = security or PLAINTEXT
    limits = limits or CallLimits()
    workers = workers or pool_size(max(shard.settings.learners, shard.config.learners.bounds()[1]), limits)
    raise_open_file_limit()
    limit_malloc_arenas()
    huge_pages_for_tensors()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="syncer-rpc"),
                         interceptors=server_interceptors(security, limits, shard.run_id), options=SERVER_OPTIONS,
                         maximum_concurrent_rpcs=workers)
    add_syncer_to_server(shard, server)
    check_bindable(bind)
    try:
        port = secure_server_port(server, bind, security)
    except RuntimeError:
        port = 0
    if port == 0:
        raise DilocoError(f"cannot listen on {bind}: the port is in use or the address is not this host's")
    if bulk_port:
        shard.bulk = BulkServer(bind.rpartition(":")[0].strip("[]") or "0.0.0.0", security)
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
