"""int8 and int4: symmetric linear codes. An element x of a block with absmax s becomes
q = round(x/s·L), L = 127 or 7, rounding half to even, and decodes to q/L·s: |error| ≤ s/L/2.
The codes -128 and -8 are never written; a payload holding one is rejected as corrupt.
"""

from __future__ import annotations

import torch

from diloco.codecs.blockwise import DEFAULT_BLOCK, BlockCodec


class IntCodec(BlockCodec):
    def __init__(self, bits: int, block: int = DEFAULT_BLOCK):
        super().__init__(block)
        self.bits = bits
        self.name = f"int{bits}"
        self.levels = 2 ** (bits - 1) - 1

    def quantize(self, x: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> None:
        # x/s first, so neither subnormal nor huge blocks overflow; |x/s| ≤ 1 exactly, so no clamp.
        out.copy_(torch.div(x, absmax).mul_(self.levels).round_())

    def code_values(self) -> torch.Tensor:
        unsigned = torch.arange(2**self.bits)
        q = torch.where(unsigned > self.levels, unsigned - 2**self.bits, unsigned)  # two's complement
        return torch.where(q < -self.levels, torch.nan, q / self.levels).float()
