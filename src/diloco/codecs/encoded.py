"""One tensor as it crosses the link: codec, shape, block size and raw bytes, nothing executable.

Built from untrusted bytes later, so it is plain data (no pickle); `numel` and the codecs' `decode`
check every field before any byte is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diloco.errors import DilocoError

TENSOR_HEADER_BYTES = 16
"""Fixed header of one encoded tensor: name id (4), element count (4), block size (4), codec (1),
reserved (3). The shape is not sent: both ends hold the same model and know it from the name, and the
element count lets the receiver check it."""

MAX_NDIM = 32
MAX_BLOCK = 2**32 - 1
"""The header's block field is 32 bits wide."""


@dataclass(frozen=True)
class Encoded:
    """An encoded fp32 tensor. Decoding always gives fp32, the dtype of outer gradients."""

    codec: str
    shape: tuple[int, ...]
    block: int
    """Elements per scale in the block-scaled codecs; 0 for codecs without scales."""
    payload: bytes | memoryview = field(repr=False)
    """The element codes, packed (a read-only view of a received message's buffer, or bytes)."""
    scales: bytes | memoryview = field(default=b"", repr=False)
    """One scale per block, fp32 little-endian."""

    def wire_bytes(self) -> int:
        """Bytes this tensor puts on the wire: header, codes and scales."""
        return TENSOR_HEADER_BYTES + len(self.payload) + len(self.scales)

    def numel(self) -> int:
        """The element count the shape implies, after checking every field's type."""
        if not isinstance(self.codec, str):
            raise DilocoError(f"encoded tensor has codec {self.codec!r}, not a name")
        if not (_raw_bytes(self.payload) and _raw_bytes(self.scales)):
            raise DilocoError("encoded tensor payload and scales must be bytes")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or not 0 <= self.block <= MAX_BLOCK:
            raise DilocoError(f"encoded tensor has block size {self.block!r}, not an integer in 0..{MAX_BLOCK}")
        if (not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM
                or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape)):
            raise DilocoError(f"encoded tensor has shape {self.shape!r}, not up to {MAX_NDIM} non-negative integers")
        return math.prod(self.shape)


def _raw_bytes(blob: object) -> bool:
    """bytes, or a read-only view of plain bytes (a message's buffer): nothing else is read as data."""
    return isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly and blob.format == "B"
                                       and blob.ndim == 1 and blob.c_contiguous)
