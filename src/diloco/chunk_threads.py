"""A shard's merge of a large fragment on several cores (`diloco syncer --threads N`).

Why: a round's arithmetic is a few compiled loops over its fragment (the outer step, the downlink's
encode, the fold of a group of pushes). On one thread a 375M-parameter fragment's round takes over a
second of wall time, while a syncer host has cores to spare. The loops release the GIL, so pieces of a
tensor can run on threads of one process at once. Each piece is a whole number of the loop's blocks and
every element is computed as the one-thread loop computes it: the values never depend on the thread
count. Sums over pieces (norms) stay on one thread, whose order they keep.

A learner keeps one thread: its cores train.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

Result = TypeVar("Result")

MIN_PIECE = 1 << 18
"""Elements below which a piece is not handed to another thread: the hand-off costs tens of µs, a piece
of this size a few hundred."""

_threads = 1
_pool: ThreadPoolExecutor | None = None
_guard = threading.Lock()
_inside = threading.local()


def set_threads(count: int) -> None:
    """Run the loops' pieces on `count` threads (the caller's and count − 1 kept for the process)."""
    global _threads, _pool
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"a thread count is a whole number of at least 1, got {count!r}")
    with _guard:
        if _pool is not None and count != _threads:
            _pool.shutdown(wait=True)
            _pool = None
        _threads = count


def threads() -> int:
    return _threads


def pieces(numel: int, multiple: int = 1) -> list[tuple[int, int]]:
    """(start, stop) ranges covering `numel` elements, one per thread at most and none smaller than
    MIN_PIECE (but a lone one), each start a multiple of `multiple` (a loop's block)."""
    count = max(1, min(_threads, numel // MIN_PIECE))
    step = -(-max(numel, 1) // count)
    step = -(-step // multiple) * multiple
    return [(start, min(start + step, numel)) for start in range(0, numel, step)] or [(0, 0)]


def run(spans: Sequence[tuple[int, int]], work: Callable[[int, int], Result]) -> list[Result]:
    """work(start, stop) for every span, results in span order. With more than one thread the spans are
    taken in turn by this thread and the pool's (whoever is free takes the next), and every span is done
    before this returns or raises the first failure. Called from a piece, it runs its spans itself."""
    if _threads == 1 or len(spans) < 2 or getattr(_inside, "piece", False):
        return [work(start, stop) for start, stop in spans]
    results: list[Result | None] = [None] * len(spans)
    taken = iter(range(len(spans)))
    turn = threading.Lock()

    def drain() -> None:
        _inside.piece = True
        try:
            while True:
                with turn:
                    index = next(taken, None)
                if index is None:
                    return
                results[index] = work(*spans[index])
        finally:
            _inside.piece = False

    helpers = [_shared_pool().submit(drain) for _ in range(min(_threads, len(spans)) - 1)]
    try:
        drain()
    finally:
        wait(helpers)
    for helper in helpers:
        helper.result()  # a helper's failure, once every span is done
    return results  # type: ignore[return-value]


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _guard:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_threads - 1, thread_name_prefix="diloco-piece")
        return _pool
