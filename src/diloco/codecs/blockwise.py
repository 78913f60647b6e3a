"""Block-scaled codecs: each run of `block` elements (the last may be shorter) shares one scale,
its absmax, and every element becomes a small integer code relative to it.

Scales are fp32 (4 bytes, 0.5 bit per element at the default block of 64): outer gradients span more
than fp16's range, in which a block of 1e-8 values would flush to zero and one of 1e30 would overflow.
Keeping the absmax itself (not absmax/levels) keeps subnormal and huge blocks exact to represent.

4-bit codes are packed two per byte, the earlier element in the low nibble. Decoding looks each
payload byte up in a 256-entry table of the values its codes stand for (relative to the scale), then
scales each block; codes no encoder writes stand for NaN, so a corrupt payload shows in the result.

On the CPU, large tensors are decoded (and linear codes encoded) by compiled loops where numba is
installed (`compiled.py`), giving the same bytes. Otherwise work goes in chunks that stay in cache
(`cache_chunks.py`): a decode scales, checks and (`decode_onto`) adds to each chunk as it is looked up,
and `encode_difference` takes its difference a chunk at a time. On an accelerator each loop runs once
over the whole tensor, and nothing leaves the device before the final bytes.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Iterator

import numpy as np
import torch

from diloco.cache_chunks import chunks
import diloco.codecs.compiled as compiled
from diloco.codecs.base import Codec, DeviceLike, extremes, flat_input, from_bytes, require_finite, to_bytes
from diloco.codecs.encoded import MAX_BLOCK, Encoded
from diloco.errors import DilocoError

DEFAULT_BLOCK = 64
SCALE_BYTES = 4


def pieces(numel: int, block: int, device: torch.device) -> Iterator[tuple[int, int, int]]:
    """(start, stop, width) ranges covering `numel` elements: chunks of whole blocks of `width` = `block`,
    then the last partial block on its own, `width` its length."""
    whole = numel // block * block
    for start, stop in chunks(whole, device, block):
        yield start, stop, block
    if whole < numel:
        yield whole, numel, numel - whole


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Even-length int8 codes → int8 bytes holding the low 4 bits of two codes each. Each pair, read as
    one little-endian int16 w, packs to the low byte of (w & 0x0F0F) | (w & 0x0F0F) >> 4."""
    pairs = codes.view(torch.int16)
    packed = torch.empty(pairs.numel(), dtype=torch.int8, device=codes.device)
    for start, stop in chunks(pairs.numel(), codes.device):
        nibbles = pairs[start:stop] & 0x0F0F
        packed[start:stop] = nibbles.bitwise_or_(nibbles >> 4)  # int16 → int8 keeps the low byte
    return packed


class BlockCodec(Codec):
    bits: int
    """Bits per element code: 8, or 4 (packed two per byte)."""
    levels: int | None = None
    """A linear code's largest code L (an element x of absmax s codes as round(x/s·L)); None otherwise."""

    def __init__(self, block: int = DEFAULT_BLOCK):
        if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= MAX_BLOCK:
            raise DilocoError(f"codec block size must be an integer in 1..{MAX_BLOCK}, got {block!r}")
        self.block = block
        self._byte_table: torch.Tensor | None = None
        self._loop_tables: compiled.DecodeTables | None = None

    @abstractmethod
    def quantize(self, x: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> None:
        """Write the int8 codes of `x` (rows of one block each) into `out`; `absmax` is a column, > 0."""

    @abstractmethod
    def code_values(self) -> torch.Tensor:
        """fp32 value of each code (indexed by its `bits` bits read unsigned) as a fraction of the block's
        absmax; NaN for codes no encoder writes."""

    def valid_block(self, block: int) -> bool:
        return block >= 1

    def payload_bytes(self, numel: int) -> int:
        return (numel * self.bits + 7) // 8

    def scale_bytes(self, numel: int, block: int) -> int:
        return -(-numel // block) * SCALE_BYTES

    def wire_bytes(self, numel: int, block: int | None = None) -> int:
        return super().wire_bytes(numel, self.block if block is None else block)

    def encode(self, tensor: torch.Tensor) -> Encoded:
        return self._encode(flat_input(tensor), None, tuple(tensor.shape))

    def encode_difference(self, tensor: torch.Tensor, minus: torch.Tensor) -> Encoded:
        return self._encode(flat_input(tensor), flat_input(minus), tuple(tensor.shape))

    def _encode(self, x: torch.Tensor, minus: torch.Tensor | None, shape: tuple[int, ...]) -> Encoded:
        """The codes of x − `minus` (x where None), the difference taken a chunk at a time in cache."""
        numel, block = x.numel(), self.block
        pad = numel % 2 if self.bits == 4 else 0  # an odd count's last byte has an empty high nibble
        if self.levels is not None and compiled.usable(numel, x, *([] if minus is None else [minus])):
            return self._encode_compiled(x, minus, shape, pad)
        codes = torch.empty(numel + pad, dtype=torch.int8, device=x.device)
        codes[numel:] = 0
        scales = torch.empty(-(-numel // block), dtype=torch.float32, device=x.device)
        for start, stop, width in pieces(numel, block, x.device):
            part = x[start:stop] if minus is None else torch.sub(x[start:stop], minus[start:stop])
            part = part.view(-1, width)
            absmax = scales[start // block:start // block + part.shape[0]]
            torch.amax(part.abs(), dim=1, out=absmax)
            divisor = torch.where(absmax > 0, absmax, 1.0)  # an all-zero block codes as zeros
            self.quantize(part, divisor[:, None], codes[start:stop].view(-1, width))
        require_finite(scales, "tensor to encode")  # NaN and Inf reach the block absmax
        payload = pack_nibbles(codes) if self.bits == 4 else codes
        return Encoded(self.name, shape, block, to_bytes(payload), to_bytes(scales))

    def encode_difference_onto(self, tensor: torch.Tensor, base: torch.Tensor,
                               new: Callable[[torch.Tensor], torch.Tensor] | None = None
                               ) -> tuple[Encoded, torch.Tensor]:
        x, minus = flat_input(tensor), flat_input(base)
        if self.levels is None or not compiled.usable(x.numel(), x, minus):
            return super().encode_difference_onto(tensor, base)
        onto = torch.empty(x.numel(), dtype=torch.float32) if new is None else new(tensor).view(-1)
        encoded = self._encode_compiled(x, minus, tuple(tensor.shape), x.numel() % 2 if self.bits == 4 else 0,
                                        onto=onto)
        return encoded, onto.view(tensor.shape)

    def _encode_compiled(self, x: torch.Tensor, minus: torch.Tensor | None, shape: tuple[int, ...],
                         pad: int, onto: torch.Tensor | None = None) -> Encoded:
        """`_encode` of a linear code in one compiled pass per block: the same bytes. With `onto`, also
        `decode_onto` of them onto `minus` into it, in the same pass (`encode_difference_onto`)."""
        scales = np.empty(-(-x.numel() // self.block), dtype=np.float32)
        decoding = None if onto is None else (onto, self.loop_tables(), (1 << self.bits) - 1)
        if self.bits == 4 and self.block % 2 == 0:  # packed as each block is coded
            payload = np.empty((x.numel() + 1) // 2, dtype=np.uint8)
            compiled.encode_linear(x, minus, self.block, self.levels, None, scales, decoding, packed=payload)
        else:
            codes = np.zeros(x.numel() + pad, dtype=np.int8)
            compiled.encode_linear(x, minus, self.block, self.levels, codes, scales, decoding)
            payload = compiled.pack_nibbles(codes) if self.bits == 4 else codes.view(np.uint8)
        require_finite(torch.from_numpy(scales), "tensor to encode")
        return Encoded(self.name, shape, self.block, memoryview(payload).toreadonly(), scales.tobytes())

    def byte_table(self) -> torch.Tensor:
        """What each payload byte decodes to, before scaling, as raw bits: int32 (one fp32 value per
        byte) or int64 (two), so a lookup copies bits and never does float arithmetic on them."""
        if self._byte_table is None:
            values = self.code_values()
            byte = torch.arange(256)
            if self.bits == 8:
                self._byte_table = values.view(torch.int32)
            else:
                pairs = torch.stack((values[byte & 15], values[byte >> 4]), dim=1).contiguous()
                self._byte_table = pairs.view(torch.int64).view(-1)
        return self._byte_table

    def decode(self, encoded: Encoded, device: DeviceLike = None) -> torch.Tensor:
        return self._decode(encoded, device, None)

    def decode_onto(self, encoded: Encoded, base: torch.Tensor) -> torch.Tensor:
        return self._decode(encoded, base.device, base.reshape(-1))

    def _decode(self, encoded: Encoded, device: DeviceLike, plus: torch.Tensor | None) -> torch.Tensor:
        """decode(encoded) (+ `plus`) in one pass: each chunk is looked up, scaled, checked and
        added to while it is in cache, the same arithmetic as separate passes over the whole tensor."""
        numel = self.checked_numel(encoded)
        block, per_byte = encoded.block, 8 // self.bits
        scales = self.check_scales(from_bytes(encoded.scales, torch.float32, device))
        payload = from_bytes(encoded.payload, torch.uint8, device)
        if compiled.decodes(per_byte, block) and compiled.usable(numel, payload, *([] if plus is None else [plus])):
            flat = torch.empty(numel, dtype=torch.float32)
            corrupt = compiled.decode(payload.numpy(), self.loop_tables(), scales.numpy(), block, flat, plus)
        else:
            flat, corrupt = self._decode_chunks(payload, scales, numel, block, plus)
        if corrupt:
            raise DilocoError(f"corrupt {self.name} tensor: the payload holds a code no encoder writes")
        return flat[:numel].view(encoded.shape)

    def check_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """`scales` if every block scale is finite and not negative, as an encoder writes them."""
        if scales.numel():
            low, high = extremes(scales)
            if not (math.isfinite(low) and math.isfinite(high)):
                raise DilocoError(f"{self.name} tensor's scales holds NaN or Inf: outer gradients must be finite")
            if low < 0:
                raise DilocoError(f"corrupt {self.name} tensor: a block scale is negative")
        return scales

    def loop_tables(self) -> compiled.DecodeTables:
        """The byte table as the compiled loops read it, made once."""
        if self._loop_tables is None:
            values = self.byte_table().view(torch.float32).view(256, 8 // self.bits).numpy()
            self._loop_tables = compiled.DecodeTables.of(values)
        return self._loop_tables

    def _decode_chunks(self, payload: torch.Tensor, scales: torch.Tensor, numel: int, block: int,
                       plus: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """The decoded values (one more for an odd int4 count) and whether a value was NaN, in torch ops."""
        per_byte = 8 // self.bits
        table = self.byte_table().to(payload.device)
        flat = torch.empty(payload.numel() * per_byte, dtype=torch.float32, device=payload.device)
        words = flat.view(table.dtype)
        highest = []
        for start, stop in chunks(numel, payload.device, block * per_byte):  # whole bytes and blocks
            first, last = start // per_byte, -(-stop // per_byte)
            # int64 indices: index_select looked up 1.8x faster with them than with int32 here (s39)
            torch.index_select(table, 0, payload[first:last].long(), out=words[first:last])
            part, whole = flat[start:stop], (stop - start) // block * block
            part[:whole].view(-1, block).mul_(scales[start // block:(start + whole) // block, None])
            if whole < stop - start:  # the last block, shorter
                part[whole:].mul_(scales[-1])
            highest.append(part.amax())
            if plus is not None:
                part.add_(plus[start:stop])
        return flat, bool(highest) and bool(torch.isnan(torch.stack(highest)).any())
        return flat[:numel].view(encoded.shape)
