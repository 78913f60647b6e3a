"""Work over a large tensor in chunks that stay in cache, so that several element-wise steps read it from
memory once: each eager torch op over a whole fragment is a pass over memory (a few ns per element on
this kind of host), the same op over a chunk just written or read is a pass over the cache."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

CPU_CHUNK_ELEMENTS = 1 << 20
"""4 MB of fp32 per chunk on the CPU: it and its temporaries stay in the last-level cache, and chunks
are few enough that each op's thread synchronisation stays cheap. A 16M-element tensor encodes several
times faster than in one piece, whose temporaries are paged in afresh on every call."""


def chunks(numel: int, device: torch.device, multiple: int = 1) -> Iterator[tuple[int, int]]:
    """(start, stop) ranges covering `numel` elements, each a multiple of `multiple` but the last. On an
    accelerator one range covers everything: its kernels gain nothing from the host's cache."""
    step = max(1, CPU_CHUNK_ELEMENTS // multiple) * multiple if device.type == "cpu" else max(numel, 1)
    for start in range(0, numel, step):
        yield start, min(start + step, numel)


class Coded(Protocol):
    """A tensor still in its wire form that can be measured, sampled and added to sums without being decoded
    (`codecs.coded_blocks`): a push as a shard takes it in. `coded_of` finds one in a push's deltas."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def numel(self) -> int: ...

    def nbytes(self) -> int:
        """The bytes it holds (its wire form's): what waiting to be folded keeps alive."""
        ...

    def norm(self) -> float: ...

    def sample(self, index: torch.Tensor) -> torch.Tensor: ...

    def add_scaled(self, outs: list[torch.Tensor], totals: list[torch.Tensor | None],
                   alphas: list[float]) -> list[torch.Tensor]: ...


def coded_of(deltas: Mapping[str, torch.Tensor], name: str) -> Coded | None:
    """`deltas[name]` in its coded form where the mapping keeps one (`DecodedOnUse.coded`), else None."""
    get = getattr(deltas, "coded", None)
    return None if get is None else get(name)


def add_scaled(outs: list[torch.Tensor], totals: list[torch.Tensor | None], delta: torch.Tensor | Coded,
               alphas: list[float]) -> list[torch.Tensor]:
    """outs[i] = totals[i] + alphas[i]·delta (alphas[i]·delta where totals[i] is None; in place where
    outs[i] is totals[i]), a chunk of `delta` at a time, so that it is read from memory once for all of
    them. Element by element the same arithmetic as one `torch.add` per sum over the whole tensor."""
    if not isinstance(delta, torch.Tensor):
        return delta.add_scaled(outs, totals, alphas)
    flat = delta.reshape(-1)
    targets = [(out.view(-1), None if total is None else total.reshape(-1), alpha)
               for out, total, alpha in zip(outs, totals, alphas)]
    for start, stop in chunks(flat.numel(), flat.device):
        piece = flat[start:stop]
        for out, total, alpha in targets:
            if total is None:
                torch.mul(piece, alpha, out=out[start:stop])
            elif total.data_ptr() == out.data_ptr():
                out[start:stop].add_(piece, alpha=alpha)
            else:
                torch.add(total[start:stop], piece, alpha=alpha, out=out[start:stop])
    return outs


def add_scaled_group(outs: list[torch.Tensor], totals: list[torch.Tensor | None], deltas: list[torch.Tensor],
                     alphas: list[list[float]]) -> list[torch.Tensor]:
    """`add_scaled` of each of `deltas` in turn (`alphas[k]`: delta k's alpha for each sum), a chunk of every
    sum at a time: each sum is read and written once for them all, not once per delta. Element by element
    the same torch ops in the same order, so the same values."""
    flats = [d.reshape(-1) for d in deltas]
    targets = [(out.view(-1), None if total is None else total.reshape(-1)) for out, total in zip(outs, totals)]
    for start, stop in chunks(flats[0].numel(), flats[0].device):
        for i, (out, total) in enumerate(targets):
            piece, first = out[start:stop], 0
            if total is None:
                torch.mul(flats[0][start:stop], alphas[0][i], out=piece)
                first = 1
            elif total.data_ptr() != out.data_ptr():
                piece.copy_(total[start:stop])
            for k in range(first, len(flats)):
                piece.add_(flats[k][start:stop], alpha=alphas[k][i])
    return outs


@dataclass(frozen=True)
class Scaled:
    """`tensor`·factor (or ÷ factor with `divide`), not yet written: a merged outer gradient that the outer
    step reads a chunk at a time (`piece_of`), so it makes no pass over memory of its own."""

    tensor: torch.Tensor
    factor: float
    divide: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def piece(self, start: int, stop: int) -> torch.Tensor:
        part = self.tensor.reshape(-1)[start:stop]
        return torch.div(part, self.factor) if self.divide else torch.mul(part, self.factor)

    def whole(self, out: torch.Tensor) -> torch.Tensor:
        """Written out into `out`, the same values as its pieces."""
        if self.divide:
            return torch.div(self.tensor, self.factor, out=out)
        return torch.mul(self.tensor, self.factor, out=out)


def piece_of(values: torch.Tensor | Scaled, start: int, stop: int) -> torch.Tensor:
    """Elements start:stop of `values` (flattened), as fp32."""
    if isinstance(values, Scaled):
        return values.piece(start, stop)
    return values.reshape(-1)[start:stop].to(torch.float32)
