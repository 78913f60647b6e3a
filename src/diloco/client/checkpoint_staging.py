"""What a sharded learner's checkpoint copies on the training thread (`sharded_checkpoints.ShardedWriter`),
and how: the inner optimizer's rows (and the model's, for a learner that does not sync) into CPU buffers
kept from one checkpoint to the next, each already wrapped as the DTensor DCP writes, so a checkpoint is one
`copy_` per tensor.

DCP's own stager deep-copies the state dict every time: each DTensor is rebuilt through `__deepcopy__`
and `from_local` (about 0.6 ms of Python per tensor, ~200 ms a checkpoint of the 24M-parameter benchmark
model at W = 2, against ~60 ms of copying), and a stager made per call allocates and faults in fresh
buffers. The own progress is not copied again: `export_progress` made it a copy already. A buffer is
rewritten only once the write that read it is done (the writer keeps one write at a time). The price: the
buffers stay for the learner's life (one copy of its optimizer rows, which each checkpoint held
while it was written anyway), where DCP's were freed after each write.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - an older torch has no sharded learners
    AsyncStager, DTensor = object, None  # type: ignore[assignment,misc]

UNCOPIED = "progress"
"""The part of the checkpoint's state that is a copy already."""


class KeptStaging(AsyncStager):  # type: ignore[misc,valid-type]
    _synchronize_after_execute = False  # staged when `stage` returns

    def __init__(self) -> None:
        self.kept: dict[tuple, tuple[torch.Tensor, Any]] = {}
        """Per place in the state dict: the CPU buffer and what DCP is given (the buffer, or its DTensor)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` training can no longer change (`UNCOPIED` passed as it is)."""
        return {k: v if k == UNCOPIED else self._copied(v, (k,)) for k, v in state_dict.items()}

    def _copied(self, value: Any, place: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, place)
        if isinstance(value, dict):
            return {k: self._copied(v, (*place, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copied(v, (*place, i)) for i, v in enumerate(value))
        return value

    @torch.no_grad()
    def _tensor(self, tensor: torch.Tensor, place: tuple) -> Any:
        sharded = DTensor is not None and isinstance(tensor, DTensor)
        local = tensor.to_local() if sharded else tensor
        kept = self.kept.get(place)
        if kept is None or kept[0].shape != local.shape or kept[0].dtype != local.dtype or (
                sharded and kept[1].shape != tensor.shape):
            buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu")
            given = DTensor.from_local(buffer, tensor.device_mesh, tensor.placements, run_check=False,
                                       shape=tensor.shape, stride=tensor.stride()) if sharded else buffer
            kept = self.kept[place] = (buffer, given)
        kept[0].copy_(local.detach())
        return kept[1]

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.kept.clear()
