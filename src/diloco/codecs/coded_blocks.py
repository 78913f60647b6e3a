"""A block-coded push measured, sampled and folded into a round's sums straight from its codes.

Why: a shard reads each push three times after decoding it (its norm, a sample, the fold into the
round's sums), and the decoded tensor itself is new memory, four bytes per element written and paged in
before it is read again. From its codes the push is read as half a byte (int4) per element: once for its
norm and once per sum it is folded into, and its fp32 values are never written.

The fold is bit for bit what decoding and then `cache_chunks.add_scaled` gives (`compiled_sums.fold`, checked
against this torch by `compiled_sums.folds_like_torch`). The norm is not: each block's is its scale² times its
codes' Σ (code value)², summed in float64 (for the integer codecs (scale / levels)² times Σ q², the codes
summed exactly as integers), which differs from the decoded values' own norm by their fp32 rounding (about
1e-7 relative), where `tensor_norm` sums the decoded values in fp32 and is off by its
summation error (about 1e-6 relative for a few million elements). That moves the radial merge's scale
and the outlier bound's measure by as much; the finite check is unaffected (code values are at most 1,
so a finite scale gives finite values). A shard without the compiled loops decodes as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

import diloco.codecs.compiled as compiled
import diloco.codecs.compiled_sums as compiled_sums
from diloco.cache_chunks import add_scaled
from diloco.codecs.base import from_bytes
from diloco.codecs.encoded import Encoded
from diloco.errors import DilocoError

if TYPE_CHECKING:
    from diloco.codecs.blockwise import BlockCodec

Complaint = Callable[[str], Exception]
FP32_MAX = float(torch.finfo(torch.float32).max)
_LEVELS: dict[str, float | None] = {}
"""Per codec name, what `CodedBlocks.levels` found."""


class CodedBlocks:
    """One block-coded tensor, readable as a tensor is where a round takes a push in: shape, norm, a
    sample of coordinates, and `add_scaled` into sums. Made only by `coded_blocks` (checked bytes)."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, codec: BlockCodec, encoded: Encoded, numel: int, complain: Complaint) -> None:
        self.codec, self.encoded, self._numel, self.complain = codec, encoded, numel, complain
        self.shape = torch.Size(encoded.shape)
        self.payload = from_bytes(encoded.payload, torch.uint8, "cpu").numpy()
        self.scales = from_bytes(encoded.scales, torch.float32, "cpu").numpy()
        self.tables = codec.loop_tables()
        self._norm: float | None = None

    def numel(self) -> int:
        return self._numel

    def nbytes(self) -> int:
        return self.payload.nbytes + self.scales.nbytes

    def norm(self) -> float:
        """‖values‖ from the codes in float64, rounded to fp32 (left float64 where an fp32 sum of squares would
        overflow, as in `tensor_norm`); a code no encoder writes is refused as decoding refuses it."""
        if self._norm is None:
            squares, corrupt = compiled_sums.square_sum(self.payload, self.tables, self.scales,
                                                        self.encoded.block, self._numel, self.levels())
            if corrupt:
                raise self.complain(f"corrupt {self.codec.name} tensor: the payload holds a code no encoder writes")
            norm = math.sqrt(squares)  # fp32 as where its sum of squares fits, as `tensor_norm`'s does
            self._norm = float(np.float32(norm)) if squares <= FP32_MAX else norm
        return self._norm

    def levels(self) -> float | None:
        """L where this codec's codes decode as q / L (`compiled_sums.arithmetic_levels`): loops then decode by
        arithmetic instead of a table lookup. Found once per codec (by name: its table does not depend on the
        block size)."""
        name = self.codec.name
        if name not in _LEVELS:
            _LEVELS[name] = compiled_sums.arithmetic_levels(self.tables)
        return _LEVELS[name]

    def sample(self, index: torch.Tensor) -> torch.Tensor:
        """The values at flat positions `index`, as float64: each its code's value times its block's scale,
        the decode's fp32 product. In numpy, from the decode tables: a few thousand positions cost torch
        ten ops' fixed costs per tensor of every push."""
        at = index.numpy()
        byte = self.payload[at >> 1] if self.tables.second is not None else self.payload[at]
        values = self.tables.first[byte]
        if self.tables.second is not None:  # the later element of a pair is its byte's second code
            values = np.where(at & 1, self.tables.second[byte], values)
        values = values * self.scales[at // self.encoded.block]  # fp32 times fp32, rounded to fp32
        return torch.from_numpy(values.astype(np.float64))

    def add_scaled(self, outs: list[torch.Tensor], totals: list[torch.Tensor | None],
                   alphas: list[float]) -> list[torch.Tensor]:
        """`cache_chunks.add_scaled` of the decoded values, each sum read and written once, the values never
        written; through a decoded tensor where a sum is not a plain CPU tensor."""
        self.norm()  # the codes are checked before anything is written
        if not compiled.usable(self._numel, *outs, *(t for t in totals if t is not None)):
            return add_scaled(outs, totals, self.decoded(), alphas)
        compiled_sums.fold(self.payload, self.tables, self.scales, self.encoded.block, outs, totals, alphas)
        return outs

    def decoded(self) -> torch.Tensor:
        try:
            return self.codec.decode(self.encoded)
        except DilocoError as exc:
            raise self.complain(str(exc)) from None




def fold_together(pushes: list[CodedBlocks], outs: list[torch.Tensor], totals: list[torch.Tensor | None],
                  alphas: list[list[float]]) -> bool:
    """`add_scaled` of each push in turn into two sums, in one pass over them (`compiled_sums.fold_group`):
    the same values. False, with nothing written, where this group cannot go that way (another codec or
    block size, not two sums, the loops off or not checked here); then fold them one by one."""
    first = pushes[0]
    levels = first.levels() if isinstance(first, CodedBlocks) else None
    if (len(outs) != 2 or levels is None or first.tables.second is None or (totals[0] is None) != (totals[1] is None)
            or not all(isinstance(p, CodedBlocks) and p.codec.name == first.codec.name
                       and p.encoded.block == first.encoded.block
                       and p.numel() == first.numel() for p in pushes)
            or not compiled.usable(first.numel(), *outs, *(t for t in totals if t is not None))
            or not compiled_sums.groups_like_torch()):
        return False
    for push in pushes:
        push.norm()  # every push's codes checked before anything is written
    compiled_sums.fold_group([p.payload for p in pushes], [p.scales for p in pushes], first.encoded.block, levels,
                             (outs[0], outs[1]), (totals[0], totals[1]), np.array(alphas, dtype=np.float32))
    return True


def coded_blocks(codec: BlockCodec, encoded: Encoded, complain: Complaint = DilocoError) -> CodedBlocks | None:
    """`encoded` as CodedBlocks where the compiled loops fold it on this host, else None (decode it).
    Its bytes and scales are checked here as decoding checks them, refused through `complain`."""
    per_byte = 8 // codec.bits
    if not (compiled.decodes(per_byte, encoded.block) and encoded.numel() >= compiled.MIN_ELEMENTS
            and compiled_sums.folds()):
        return None
    try:
        numel = codec.checked_numel(encoded)
        codec.check_scales(from_bytes(encoded.scales, torch.float32, "cpu"))
    except DilocoError as exc:
        raise complain(str(exc)) from None
    return CodedBlocks(codec, encoded, numel, complain)
