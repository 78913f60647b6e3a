"""An fp32 push read where it arrived: measured, sampled and folded into a round's sums from the wire
bytes themselves, never copied.

Why: decoding an fp32 tensor is a copy into new memory (four bytes per element written and paged in) and a
finite check over it, before the shard reads it again for its norm and its fold. Read in place, the norm is
the finite check (finite exactly when every element is: `core/checks.py` decodes only to tell a norm that
overflowed from a value that is not finite), and the fold reads the bytes once. The values are the same
tensor `CastCodec.decode` would copy out, so every result is the same bit for bit. The bytes are the
push's own (a message's or an upload's buffer, never reused), and nothing here writes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from diloco.cache_chunks import add_scaled
from diloco.codecs.base import from_bytes
from diloco.codecs.cast import CastCodec
from diloco.codecs.encoded import Encoded
from diloco.errors import DilocoError


class Fp32View:
    """One fp32 tensor as its bytes hold it, readable as a tensor is where a round takes a push in."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, values: torch.Tensor, shape: tuple[int, ...]) -> None:
        self.values, self.shape = values, torch.Size(shape)
        self._norm: float | None = None

    def numel(self) -> int:
        return self.values.numel()

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def norm(self) -> float:
        """`outer.merge.tensor_norm` of the values: fp32, in float64 where that overflows."""
        if self._norm is None:
            norm = float(torch.linalg.vector_norm(self.values))
            self._norm = norm if math.isfinite(norm) else float(torch.linalg.vector_norm(self.values,
                                                                                          dtype=torch.float64))
        return self._norm

    def sample(self, index: torch.Tensor) -> torch.Tensor:
        return self.values[index].to(torch.float64)

    def add_scaled(self, outs: list[torch.Tensor], totals: list[torch.Tensor | None],
                   alphas: list[float]) -> list[torch.Tensor]:
        return add_scaled(outs, totals, self.values, alphas)


def fp32_view(codec: CastCodec, encoded: Encoded, complain: Callable[[str], Exception] = DilocoError) -> Fp32View:
    """`encoded` (fp32) read in place; bytes of another length than its shape's are refused through `complain`."""
    try:
        codec.checked_numel(encoded)
    except DilocoError as exc:
        raise complain(str(exc)) from None
    return Fp32View(from_bytes(encoded.payload, torch.float32, "cpu"), tuple(encoded.shape))
