"""Where a round's sums are written as pushes are folded into them: in place where the current transaction
made the sum, else into a free buffer.

The syncer's transactions keep the sums as they were (`rounds.FragmentState.keep` copies their dicts, not
their tensors), so a sum an earlier transaction made is never written: its new value goes to a buffer from
`scratch.py`. A sum this transaction made is held by nobody else (a refused transaction drops it whole), so
the next push of a group is added to it in place: a group's pushes after its first at memory speed.
"""

from __future__ import annotations

import weakref

import torch

from diloco.cache_chunks import Coded, add_scaled, add_scaled_group
from diloco.codecs.coded_blocks import CodedBlocks, fold_together
from diloco.codecs.fp32_view import Fp32View
from diloco.core.scratch import Scratch
from diloco.core.undo import UndoLog


class SumWrites:
    def __init__(self, scratch: Scratch, undo: UndoLog) -> None:
        self.scratch, self.undo = scratch, undo
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}
        self._made_in = -1
        """The sums' tensors the current transaction made, and which transaction that is."""

    def add(self, totals: list[torch.Tensor | None], delta: torch.Tensor | Coded,
            alphas: list[float]) -> list[torch.Tensor]:
        """total + alpha·delta for each of a round's sums of one tensor, reading `delta` once for all
        (`cache_chunks.add_scaled`; a coded push as a group of one where it can: decoded by arithmetic)."""
        outs = self.outs(totals, delta)
        if isinstance(delta, CodedBlocks) and fold_together([delta], outs, totals, [alphas]):
            return outs
        return add_scaled(outs, totals, delta, alphas)

    def add_group(self, totals: list[torch.Tensor | None], deltas: list[Coded],
                  alphas: list[list[float]]) -> list[torch.Tensor] | None:
        """`add` of each of a group's coded pushes in turn, in one pass over the sums where their codec allows
        (int4: `coded_blocks.fold_together`; fp32 read in place: `cache_chunks.add_scaled_group`); None where
        it does not, with nothing written."""
        outs = self.outs(totals, deltas[0])
        if fold_together(deltas, outs, totals, alphas):
            return outs
        if all(isinstance(d, Fp32View) for d in deltas):
            return add_scaled_group(outs, totals, [d.values for d in deltas], alphas)
        return None

    def outs(self, totals: list[torch.Tensor | None], like: torch.Tensor | Coded) -> list[torch.Tensor]:
        """Where each sum's new value goes: the sum itself where this transaction made it, else a free buffer."""
        if self.undo.serial != self._made_in:
            self._made, self._made_in = {}, self.undo.serial
        outs = [total if total is not None and (mine := self._made.get(id(total))) is not None and mine() is total
                else self.scratch.take(like) for total in totals]
        if self.undo.active:
            self._made.update((id(out), weakref.ref(out)) for out in outs)
        return outs
