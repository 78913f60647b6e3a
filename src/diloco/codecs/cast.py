"""fp32 and bf16: each element cast to a float type, no scales.

fp32 is lossless. bf16 rounds to nearest even, so |error| ≤ 2^-8·|x| for normal x and ≤ 2^-134 (half
a bf16 subnormal step) below; values beyond bf16's largest finite value (≈3.39e38, which the largest
fp32 values would round past to Inf) are first clamped to it, which keeps them within 2^-8.
"""

from __future__ import annotations

import torch

from diloco.codecs.base import Codec, DeviceLike, flat_input, from_bytes, require_finite, to_bytes
from diloco.codecs.encoded import Encoded


class CastCodec(Codec):
    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.dtype = dtype
        self._itemsize = torch.empty(0, dtype=dtype).element_size()
        self._max = torch.finfo(dtype).max

    def payload_bytes(self, numel: int) -> int:
        return numel * self._itemsize

    def encode(self, tensor: torch.Tensor) -> Encoded:
        x = flat_input(tensor)
        if x.numel():
            lo, hi = torch.aminmax(x)
            extremes = torch.stack((lo, hi))
            require_finite(extremes, "tensor to encode")
            if bool(extremes.abs().max() > self._max):
                x = x.clamp(-self._max, self._max)
        return Encoded(self.name, tuple(tensor.shape), 0, to_bytes(x.to(self.dtype)))

    def decode(self, encoded: Encoded, device: DeviceLike = None) -> torch.Tensor:
        self.checked_numel(encoded)
        out = from_bytes(encoded.payload, self.dtype, "cpu").to(device=device, dtype=torch.float32, copy=True)
        if out.numel():
            require_finite(torch.stack(torch.aminmax(out)), f"decoded {self.name} tensor")
        return out.view(encoded.shape)
