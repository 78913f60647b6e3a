"""What a syncer shard holds, and how many shards a memory size calls for.

Shard i of S owns the fragments p with p mod S = i, or with homes spread over regions (`placement = "links"`)
the fragments homed in its region (`shard/ownership.py`). Per owned fragment, in fp32
copies of its parameters:

- Θ itself: 1;
- the outer optimizer's state (`outer/`): Nesterov 1 (its momentum), delayed Nesterov 2 (the momentum
  and the sum of arrivals since it last moved);
- the open round's running sums (a fragment has at most one round open; pushes are folded in as they
  arrive, `outer.merge.MergeSums`): the plain mean keeps Σ Δ (1), the weighted mean Σ w·Δ (1), the
  radial-directional rule Σ w·Δ and Σ w·Δ/‖Δ‖ (2; embeddings, merged by the weighted mean, 1); the final
  consolidation needs Σ w·Δ too (+1 where the rule would not keep it);
- with a lossy downlink codec, the published values that answers are differences to (1), and the recent
  encoded differences kept for learners a few versions behind (at most DIFFERENCES of a copy).

None of it grows with the number of learners. On top, while a round closes, the new values and
optimizer state of that one fragment are computed on copies and committed only if finite, and a lossless
answer is encoded once for all its recipients: a transient of (1 + optimizer copies), +1 for an fp32
downlink, of the largest fragment owned. And the pushes' own bytes, which a shard reads in place
(`transport/receive_buffers.held_bytes`): those being received and taken over the bulk port at once, those
an open round keeps whole until it can weigh them, and the free buffers kept to receive the next ones in;
plus, per owned fragment, the coded pushes whose adds wait for their round's close (at most WAIT_SHARE of
an fp32 copy, `outer/merge.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diloco.core.downlink import CHAIN_SHARE
from diloco.outer.merge import WAIT_SHARE
from diloco.transport.receive_buffers import held_bytes

FP32 = 4
OPTIMIZER_COPIES = {"nesterov": 1, "delayed-nesterov": 2}
DIFFERENCES = CHAIN_SHARE
"""Encoded differences kept per fragment, in fp32 copies of it (`core/downlink.py`)."""


@dataclass(frozen=True)
class SyncerState:
    """What decides a shard's memory per parameter."""

    optimizer: str
    merge_rule: str
    consolidate: bool
    lossy_down: bool

    def sums(self, embedding: bool) -> int:
        """fp32 copies the open round's running sums keep."""
        if self.merge_rule == "rda":
            return 1 if embedding else 2
        return 1 + (1 if self.merge_rule == "mean" and self.consolidate else 0)

    def resident_copies(self, embedding: bool) -> float:
        down = 1 + DIFFERENCES if self.lossy_down else 0
        return 1 + OPTIMIZER_COPIES[self.optimizer] + self.sums(embedding) + down

    @property
    def transient_copies(self) -> int:
        return 1 + OPTIMIZER_COPIES[self.optimizer] + (0 if self.lossy_down else 1)


@dataclass(frozen=True)
class Pushes:
    """What a shard's pushes hold while they arrive: each fragment's push in bytes (its codec's), how many
    learners push, and how many of a round's pushes it keeps whole (1; every learner's in a reproducible run)."""

    push_bytes: tuple[int, ...]
    learners: int
    whole: int = 1


@dataclass(frozen=True)
class ShardMemory:
    index: int
    fragments: tuple[int, ...]
    parameters: int
    resident_bytes: int
    transient_bytes: int
    receiving_bytes: int = 0
    """The pushes' own bytes at most (`Pushes`): being received, kept whole, waiting to be folded, and free
    buffers for the next."""

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.transient_bytes + self.receiving_bytes


def owned(fragments: int, shards: int, owners: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Each shard's fragments: by `owners` (per fragment, its shard: homes spread over regions), else
    p mod S."""
    return [tuple(p for p in range(fragments) if (owners[p] if owners is not None else p % shards) == i)
            for i in range(shards)]


def shard_memory(numels: list[int], embedding: list[bool], shards: int, state: SyncerState,
                 owners: Sequence[int] | None = None, pushes: Pushes | None = None) -> list[ShardMemory]:
    """Each shard's fragments and memory, for fragments of `numels` elements (with `pushes`, their bytes too)."""
    result = []
    for i, mine in enumerate(owned(len(numels), shards, owners)):
        resident = sum(FP32 * numels[p] * state.resident_copies(embedding[p]) for p in mine)
        transient = FP32 * state.transient_copies * max((numels[p] for p in mine), default=0)
        receiving = 0 if pushes is None else held_bytes([pushes.push_bytes[p] for p in mine], pushes.learners,
                                                        pushes.whole) + sum(
            waiting_bytes(numels[p], pushes.push_bytes[p]) for p in mine)
        result.append(ShardMemory(i, mine, sum(numels[p] for p in mine), round(resident), transient, receiving))
    return result


def waiting_bytes(numel: int, push_bytes: int) -> int:
    """The most bytes of a fragment's pushes whose adds wait for its round's close: as many whole pushes as
    fit in WAIT_SHARE of its fp32 bytes (none of an fp32 push, which is folded as it comes)."""
    return int(WAIT_SHARE * FP32 * numel // push_bytes) * push_bytes if push_bytes > 0 else 0


def shards_needed(numels: list[int], embedding: list[bool], state: SyncerState, limit_bytes: float,
                  pushes: Pushes | None = None) -> int | None:
    """The fewest shards whose every peak fits in `limit_bytes`; None if even one fragment per shard does not."""
    for shards in range(1, len(numels) + 1):
        if all(s.peak_bytes <= limit_bytes for s in shard_memory(numels, embedding, shards, state, pushes=pushes)):
            return shards
    return None
