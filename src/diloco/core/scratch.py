"""Fragment-sized tensors taken again once nobody holds them, instead of allocated for every round.

A round makes several tensors of its fragment's size: the sums its pushes are folded into, the merged
outer gradient, the outer optimizer's new state, the new Θ, the downlink's new published copy. A new tensor
that large is new memory: the kernel maps and zeroes every page on first touch, which cost 0.3 ns per
parameter with huge pages here (`benchmarks/core_events.py --merge`), more than the in-place pass that then
fills it. So the core takes them from a `Scratch`: a tensor it made before that is free again, or a new one
that it keeps for later.

Free means that nothing but the scratch holds it: no other reference to the tensor object (an answer in
flight, a saved state, the undo log of a transaction in progress, a test) and no view of its memory.
Reusing a tensor someone holds would change what they hold, so this is decided from the reference counts
themselves, never from the core's own bookkeeping: a tensor handed out is simply not taken again while it
is held. Where the storage's count cannot be read (another torch), nothing is reused.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch

MIN_NUMEL = 1 << 16
"""Smaller tensors are allocated as usual: their memory comes from the allocator's own free lists."""
KEPT = 8
"""Tensors kept per dtype and per tensor of the shape in the shard's fragments, free or in use: a round of a
fragment has about this many alive for each of its tensors. A shape that n tensors share (a model's layers,
fragments of one size) keeps n times as many, or its rounds would allocate afresh all the same."""
ROUND_COPIES = 7
"""Free tensors always kept, in copies of the largest fragment: what closing a round frees (the old Θ, the
outer optimizer's old state, the sums, the merged Δ, a temporary and the downlink's old published copy), so
that the next round finds them all. Beyond it, free tensors are kept up to what the scratch's tensors held in
use at once at most (`peak_in_use`): several fragments closing one after the other while their answers still
hold the last versions (a paced grid) free many at once, and the next closes take as many again. Dropping
those made a paced shard allocate (and the kernel zero) about twenty fragment-sized tensors a second,
without lowering its peak."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _counts(tensor: torch.Tensor) -> tuple[int, int]:
    """References to the tensor object, and uses of its memory (the tensor's own, and any view's)."""
    uses = -1 if _use_count is None else _use_count(tensor.untyped_storage()._cdata)
    return sys.getrefcount(tensor), uses


class Scratch:
    """Tensors the core made, each taken again once it is free (see the module's docstring)."""

    def __init__(self, limit_bytes: int, shapes: Mapping[tuple[int, ...], int] | None = None) -> None:
        self.kept: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self.limit_bytes = limit_bytes
        """Most bytes of free kept tensors: fragments of other shapes drop each other's, not grow the shard."""
        self.shapes = dict(shapes or {})
        """How many of the shard's tensors have each shape (one where not given)."""
        self.made = 0
        """Tensors of at least MIN_NUMEL made so far: a warm shard makes none (`tests/test_syncer_memory.py`)."""
        self.peak_in_use = 0
        """The most bytes of kept tensors in use at once, as seen when one is made: free ones are kept up to it
        (with what is in use now), so keeping them never raises the memory the shard already needed."""
        probe = [torch.empty(1)]
        self._unheld = (-1, -1)
        for tensor in probe:  # the counts of a tensor held only by a list, read through as many calls as `take`'s
            self._unheld = self._calibrate(tensor)

    def _calibrate(self, tensor: torch.Tensor) -> tuple[int, int]:
        return self._read(tensor)

    def _read(self, tensor: torch.Tensor) -> tuple[int, int]:
        return _counts(tensor)

    def _free(self, tensor: torch.Tensor) -> bool:
        return self._unheld[1] >= 0 and self._read(tensor) == self._unheld

    def take(self, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of `like`'s shape (and `dtype`), on the CPU, whose values are to be overwritten: one kept
        that is free, else a new one (kept, while there is room: KEPT per tensor of its shape, free ones up to
        the limit)."""
        if like.numel() < MIN_NUMEL or like.device.type != "cpu":
            return torch.empty(like.shape, dtype=dtype, device=like.device)
        kept = self.kept.setdefault((tuple(like.shape), dtype), [])
        for index in range(len(kept)):  # the longest untaken first: with many of a shape, found at once
            tensor = kept[index]
            if self._free(tensor):
                del kept[index]
                kept.append(tensor)
                # Its old values are void: what was remembered of them by version (`accumulate.norm_of`) must not
                # hold for the new ones, which the compiled loops write through numpy, unseen by torch's counter.
                torch.autograd.graph.increment_version(tensor)
                return tensor
        made = torch.empty(like.shape, dtype=dtype)
        self.made += 1
        if len(kept) < KEPT * self.shapes.get(tuple(like.shape), 1):
            self.trim(_nbytes(made))
            kept.append(made)
        return made

    def trim(self, room: int = 0) -> None:
        """Drop free kept tensors, oldest shapes first, until their bytes are within the larger of `limit_bytes`
        and what the peak in use leaves beside those in use now (`room`: a tensor being made, in use from now
        on). A round's close trims first: tensors that answers held may have come free in any number since the
        last round."""
        free, in_use = [], room
        for key, kept in self.kept.items():
            for t in kept:
                if self._free(t):
                    free.append((key, t))
                else:
                    in_use += _nbytes(t)
        if room:
            self.peak_in_use = max(self.peak_in_use, in_use)
        limit = max(self.limit_bytes, self.peak_in_use - in_use)
        total = sum(_nbytes(t) for _, t in free)
        for key, tensor in free:
            if total <= limit:
                break
            self.kept[key] = [t for t in self.kept[key] if t is not tensor]
            total -= _nbytes(tensor)

    def free(self) -> list[torch.Tensor]:
        """The kept tensors nobody else holds: the scratch's own memory (the others are their holders')."""
        return [t for kept in self.kept.values() for t in kept if self._free(t)]

    def nbytes(self) -> int:
        """Bytes of the kept tensors that are free now (those in use are counted by whoever holds them)."""
        return sum(_nbytes(t) for t in self.free())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
