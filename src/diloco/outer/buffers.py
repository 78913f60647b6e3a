"""Where the outer step's new tensors come from: new memory by default, the syncer's recycled buffers
(`core/scratch.py`) when it passes its own."""

from __future__ import annotations

from typing import Callable

import torch

NewTensor = Callable[[torch.Tensor], torch.Tensor]
"""A tensor of the given one's shape, fp32, whose values are all to be overwritten; nobody else holds it."""


def fp32_like(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like, dtype=torch.float32)

Written = Callable[[str, int, int, "tuple[float, float] | None"], None]
"""written(name, start, stop, squares): elements start:stop of the named tensor's new values (flattened) are
done; `squares` is (Σ (new − old)², Σ new²) in float64 over them where the loop that wrote them summed those
as it went (`compiled_step`), else None. Chunks may be done on several threads at once (`chunk_threads`): a
callback keeps what it learns per chunk."""
