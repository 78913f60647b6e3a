"""What every codec does: fp32 tensor in, `Encoded` out, and back; plus the checks they share."""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from diloco.codecs.encoded import TENSOR_HEADER_BYTES, Encoded
from diloco.errors import DilocoError

DeviceLike = torch.device | str | None


class Codec(ABC):
    """Encodes fp32 tensors of any shape (empty included) on their own device; decodes to fp32."""

    name: str

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> Encoded:
        """Raises DilocoError for a tensor that is not fp32 or holds NaN or Inf."""

    @abstractmethod
    def decode(self, encoded: Encoded, device: DeviceLike = None) -> torch.Tensor:
        """A new fp32 tensor on `device` (default CPU). Raises DilocoError for a malformed `encoded`."""

    def encode_difference(self, tensor: torch.Tensor, minus: torch.Tensor) -> Encoded:
        """encode(tensor − minus): the block codecs take the difference a chunk at a time, in cache."""
        return self.encode(torch.sub(tensor, minus))

    def decode_onto(self, encoded: Encoded, base: torch.Tensor) -> torch.Tensor:
        """decode(encoded) + base, a new tensor on base's device: the block codecs add each chunk while it
        is in cache, instead of in a pass of its own."""
        return self.decode(encoded, device=base.device).add_(base)

    def encode_difference_onto(self, tensor: torch.Tensor, base: torch.Tensor,
                               new: Callable[[torch.Tensor], torch.Tensor] | None = None
                               ) -> tuple[Encoded, torch.Tensor]:
        """encode_difference(tensor, base) and decode_onto of it onto base, the same bytes and values: a
        syncer moves its published copy towards Θ this way every round. The linear block codecs do both in
        one pass where their compiled loops run, reading neither the codes nor base a second time, and write
        the new copy into `new(tensor)` where given (fp32, tensor's shape, nobody else's: the syncer's
        recycled buffers); other paths make it themselves and never call `new`."""
        encoded = self.encode_difference(tensor, base)
        return encoded, self.decode_onto(encoded, base)

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Bytes of element codes for `numel` elements."""

    def scale_bytes(self, numel: int, block: int) -> int:
        """Bytes of scales for `numel` elements in blocks of `block`."""
        return 0

    def valid_block(self, block: int) -> bool:
        """Whether an encoded tensor may carry this block size: 0, for codecs without scales."""
        return block == 0

    def wire_bytes(self, numel: int, block: int = 0) -> int:
        """What `encode` of `numel` elements puts on the wire, header included."""
        return TENSOR_HEADER_BYTES + self.payload_bytes(numel) + self.scale_bytes(numel, block)

    def checked_numel(self, encoded: Encoded) -> int:
        """The element count of `encoded`, once its codec, fields and byte lengths all agree."""
        if not isinstance(encoded, Encoded):
            raise DilocoError(f"{self.name} can only decode an Encoded, got {type(encoded).__name__}")
        numel = encoded.numel()
        if encoded.codec != self.name:
            raise DilocoError(f"{self.name} cannot decode a tensor encoded with {encoded.codec!r}")
        if not self.valid_block(encoded.block):
            raise DilocoError(f"corrupt {self.name} tensor: block size {encoded.block} is not one it uses")
        for what, got, want in (("payload", len(encoded.payload), self.payload_bytes(numel)),
                                ("scales", len(encoded.scales), self.scale_bytes(numel, encoded.block))):
            if got != want:
                raise DilocoError(f"corrupt {self.name} tensor of shape {list(encoded.shape)}: {what} has {got} "
                                  f"bytes, expected {want}")
        return numel


def flat_input(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a flat contiguous fp32 tensor (a view where possible)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise DilocoError(f"codecs encode fp32 tensors, got {got}")
    return tensor.detach().reshape(-1)


def extremes(values: torch.Tensor) -> tuple[float, float]:
    """(smallest, largest) element of a non-empty real tensor, in one pass with no mask written: a NaN makes
    both NaN, so any NaN or ±Inf shows in them (`isfinite(...).all()` cost 20 times as much on a push's
    scales). One host sync either way."""
    low, high = torch.aminmax(values)
    if values.device.type == "cpu":
        return float(low), float(high)
    low, high = torch.stack((low, high)).tolist()
    return low, high


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element is finite (integer and bool tensors always are)."""
    if not values.numel() or not (values.is_floating_point() or values.is_complex()):
        return True
    if values.is_complex():
        return bool(torch.isfinite(values).all())
    return all(math.isfinite(x) for x in extremes(values))


def require_finite(values: torch.Tensor, what: str) -> None:
    """Raise unless every element of `values` is finite."""
    if not all_finite(values):
        raise DilocoError(f"{what} holds NaN or Inf: outer gradients must be finite")


def to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (little-endian on every machine torch runs on); the only copy to the host."""
    return tensor.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype, device: DeviceLike) -> torch.Tensor:
    """`data` as a flat tensor of `dtype` on `device`. On the CPU it is a read-only view of `data`:
    callers only read it."""
    if not data:
        return torch.empty(0, dtype=dtype, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of any read-only buffer
        view = torch.frombuffer(data, dtype=dtype)
    return view.to(device)
