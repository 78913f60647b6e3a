"""fp4 E3M0, as in Streaming DiLoCo (arXiv 2501.18512): a sign bit and a 3-bit exponent, no mantissa.

Grid: magnitude code m = 0 is zero, m = 1..7 is 2^(m−7)·s, with s the block absmax; so a block holds
0 and ±s·{1/64, 1/32, 1/16, 1/8, 1/4, 1/2, 1}. The nibble is sign·8 + m.
Rounding: to nearest in the log sense, m = clamp(round(log2(|x|/s)) + 7, 0, 7), halves rounding up,
so thresholds lie at the geometric midpoints 2^(k+½)·s, and |x| < 2^-6.5·s becomes zero. Hence
|error| ≤ (√2 − 1)·|x| for |x| ≥ 2^-6.5·s, and ≤ 2^-6.5·s below. Log rounding keeps the relative
error of small elements bounded; its bias, like any codec's, is what `ErrorFeedback` carries into
the next round, which a grid this coarse needs.
"""

from __future__ import annotations

import math

import torch

from diloco.codecs.blockwise import BlockCodec

SQRT2 = math.sqrt(2.0)
FP32_EXPONENT_BIAS = 127
TOP_CODE = 7
"""The largest magnitude code, 2^0·s."""


class E3M0Codec(BlockCodec):
    name = "fp4"
    bits = 4

    def quantize(self, x: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> None:
        # ·√2 turns "nearest power of two in log2" into "floor of log2", which the fp32 exponent field holds.
        y = torch.div(x, absmax).mul_(SQRT2)
        fields = y.view(torch.int32).bitwise_right_shift_(23)  # biased exponent e ≤ 127, e − 256 if negative
        sign = (fields >> 5).bitwise_and_(8)
        fields.bitwise_and_(255).sub_(FP32_EXPONENT_BIAS - TOP_CODE).clamp_(0, TOP_CODE)
        out.copy_(fields.bitwise_or_(sign))

    def code_values(self) -> torch.Tensor:
        nibble = torch.arange(16)
        m = nibble & 7
        magnitude = torch.where(m > 0, torch.exp2((m - TOP_CODE).double()), 0.0)
        return torch.where(nibble >= 8, -magnitude, magnitude).float()
