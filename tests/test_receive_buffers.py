"""A shard receives pushes into bytearrays of earlier pushes (`transport/receive_buffers.py`): one that a push
still held by the core reads (through any view of it) is never handed out again, so a later push cannot
overwrite it; a warm port makes no new one; the free ones kept stay within a few pushes' size."""

from __future__ import annotations

import threading

import numpy as np
import torch

from diloco.transport import receive_buffers
from diloco.transport.bulk import TAKEN, BulkServer, Upload
from diloco.transport.receive_buffers import ReceiveBuffers
from diloco.transport.security import PLAINTEXT
from test_bulk_transfers import byte_views, send_once


def test_a_buffer_any_view_of_which_is_alive_is_never_taken_again():
    pool = ReceiveBuffers()
    views = []
    for make_view in (memoryview, lambda b: np.frombuffer(memoryview(b).toreadonly(), np.uint8),
                      lambda b: torch.frombuffer(b, dtype=torch.uint8)):
        buffer = pool.take(4096)
        views.append(make_view(buffer))
        del buffer
    assert pool.made == 3 and len({id(v.obj if isinstance(v, memoryview) else v) for v in views}) == 3
    held = [pool.take(4096) for _ in range(2)]  # all three still read: two new ones
    assert pool.made == 5
    del views[1:]
    again = pool.take(4096)  # the numpy and torch views gone: one of theirs, no new memory
    assert pool.made == 5 and all(again is not h for h in held)


def test_a_warm_pool_makes_no_new_buffer_and_keeps_at_most_a_few_pushes_free(monkeypatch):
    pool = ReceiveBuffers()
    for _ in range(50):
        pool.take(10_000)
    assert pool.made == 1
    held = [pool.take(10_000) for _ in range(3 * receive_buffers.KEPT)]  # more in use at once than it keeps free
    assert pool.made == 3 * receive_buffers.KEPT
    del held
    last = pool.take(10_000)  # they came free: all but the limit's worth let go at the next take
    assert pool.free_bytes() <= receive_buffers.KEPT * 10_000 and pool.made == 3 * receive_buffers.KEPT
    for size in range(1, 40):  # pushes of other sizes: the oldest free ones make room
        pool.take(size * 1000)
    last = pool.take(39_000)
    assert pool.free_bytes() <= receive_buffers.KEPT * 39_000 and len(last) == 39_000
    monkeypatch.setattr(receive_buffers, "KEPT_BYTES", 100_000)  # at any push size, at most KEPT_BYTES free
    large = ReceiveBuffers()
    for _ in range(3):
        large.take(60_000)
    last = large.take(60_000)
    assert large.free_bytes() <= 100_000 and len(last) == 60_000


def test_threads_taking_at_once_never_share_a_buffer():
    pool, got, lock = ReceiveBuffers(), [], threading.Lock()

    def take_and_hold() -> None:
        for _ in range(200):
            buffer = pool.take(2048)
            with lock:
                got.append(buffer)  # held until the end: no two may be one object

    threads = [threading.Thread(target=take_and_hold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(b) for b in got}) == len(got) == 800


def test_a_push_held_by_its_taker_keeps_its_bytes_while_later_pushes_arrive():
    """Over the port: the shard's taker keeps a push's bytes (as the core reads them until folded); later pushes
    of the same size go into other buffers, and once it lets go, into that one again."""
    server = BulkServer("127.0.0.1", PLAINTEXT)
    kept: list[memoryview] = []
    try:
        pushes = [torch.full((25_000,), float(i)) for i in range(6)]
        for i, push in enumerate(pushes):
            ticket = server.ticket(Upload(push.numel() * 4, lambda data: kept.append(data) or (TAKEN, b"")))
            assert send_once("127.0.0.1", server.port, ticket, byte_views(push), PLAINTEXT, "shard 0")[0] == TAKEN
            if i >= 2:
                kept.pop(0)  # the taker lets the oldest go: its buffer comes free
        assert [float(np.frombuffer(k, np.float32)[0]) for k in kept] == [4.0, 5.0]  # untouched by later pushes
        assert all(bytes(k) == bytes(byte_views(pushes[4 + i])[0]) for i, k in enumerate(kept))
        assert server.receive_buffers.made == 3
    finally:
        server.close()
