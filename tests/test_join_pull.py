"""Pulling Θ at join (`joining.pull_theta`): a learner that takes Θ fragment by fragment holds at most its
byte budget of pulled tensors at once (rank 0 of a sharded learner: the largest fragment), where the
unbounded streams pile fragments up behind a slow take; a failed pull ends the join at once, pulls that
wait for room included."""

from __future__ import annotations

import time

import pytest
import torch

from diloco.client.joining import PullBudget, ShardLink, pull_theta
from diloco.client.row_moves import HeldBytes
from diloco.errors import DilocoError
from diloco.transport.calls import Pulled
from diloco.fragments import Fragment
from diloco.transport.wire_messages import fragment_layout

SIZES = [4096, 1024, 2048, 4096, 512, 1024]
PARAMS = {f"t{p}": torch.zeros(n) for p, n in enumerate(SIZES)}
FRAGMENTS = [Fragment(p, (f"t{p}",), n, False) for p, n in enumerate(SIZES)]


class Shard:
    """Answers each pull after a moment, with fresh tensors (or fails fragment `broken`)."""

    address = "fake"

    def __init__(self, broken: int | None = None) -> None:
        self.broken = broken

    def pull(self, learner: int, *, after_seq: int, fragments: list[int]):
        time.sleep(0.01)
        p = fragments[0]
        if p == self.broken:
            raise DilocoError(f"fragment {p} cannot be pulled")
        return Pulled({f"t{p}": torch.ones(SIZES[p])}, {p: 1}, [fragment_layout(FRAGMENTS[p], PARAMS)], {})


def pulled_at_once(budget: PullBudget, broken: int | None = None) -> tuple[int, list[int]]:
    """The most bytes of pulled tensors alive at once, and the fragments taken (each take is slow)."""
    held, taken = HeldBytes(), []
    link = ShardLink(0, Shard(broken), list(range(len(SIZES))))
    for p, values, _, _ in pull_theta([link], 0, 0, FRAGMENTS, PARAMS, budget, held.track):
        time.sleep(0.03)  # a scatter over the learner's ranks
        taken.append(p)
        del values
    return held.peak, taken


def test_a_budget_bounds_the_pulled_bytes_held_at_once():
    largest = max(SIZES) * 4
    peak, taken = pulled_at_once(PullBudget(largest))
    assert sorted(taken) == list(range(len(SIZES)))
    assert peak == largest  # the largest fragment alone at its turn, never more
    unbounded, _ = pulled_at_once(PullBudget(None))
    assert unbounded > largest  # without it, fragments arrive while one is taken


def test_a_failed_pull_ends_the_join_while_others_wait_for_room():
    started = time.monotonic()
    with pytest.raises(DilocoError, match="fragment 2 cannot be pulled"):
        pulled_at_once(PullBudget(1), broken=2)
    assert time.monotonic() - started < 5
