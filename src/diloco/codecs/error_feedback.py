"""Error feedback: what a codec lost on a tensor last time is added to that tensor next time, so the
sum of what was sent tracks the sum of what was meant to be sent within one step's error, and a
biased grid (fp4, int4) is right on average. Needed at 4 bits and below."""

from __future__ import annotations

import torch

from diloco.codecs.base import Codec
from diloco.codecs.encoded import Encoded
from diloco.errors import DilocoError


class ErrorFeedback:
    def __init__(self, codec: Codec):
        self.codec = codec
        self.residuals: dict[str, torch.Tensor] = {}
        """Per tensor name: (tensor + previous residual) − decode(encoded), on the tensor's device."""

    def encode(self, name: str, tensor: torch.Tensor) -> Encoded:
        return self.roundtrip(name, tensor)[0]

    def roundtrip(self, name: str, tensor: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """The encoded tensor and what the receiver will decode from it, which error feedback needs anyway."""
        residual = self.residuals.get(name)
        if residual is not None and residual.shape != tensor.shape:
            raise DilocoError(f"error feedback for {name!r}: shape {list(tensor.shape)} differs from the "
                              f"residual's {list(residual.shape)}")
        target = tensor if residual is None else tensor + residual
        encoded = self.codec.encode(target)
        decoded = self.codec.decode(encoded, device=target.device)
        self.residuals[name] = target - decoded
        return encoded, decoded

    def reset(self) -> None:
        """Forget every residual, e.g. after the model was replaced by a checkpoint."""
        self.residuals.clear()
