"""What learners and the syncer say to each other, independent of how it travels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MESSAGE_HEADER_BYTES = 64
"""Ids, version, sequence number, counters and codec of one message."""
TENSOR_HEADER_BYTES = 16
"""Name id, dtype and shape of one tensor in a message."""


def tensors_wire_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes one message carrying `tensors` puts on the wire, headers included."""
    payload = sum(t.numel() * t.element_size() + TENSOR_HEADER_BYTES for t in tensors.values())
    return MESSAGE_HEADER_BYTES + payload


@dataclass(frozen=True)
class Push:
    """A learner's outer gradient for one fragment, relative to the version it last merged."""

    learner: int
    fragment: int
    base_version: int
    seq: int
    """Per-learner sequence number: lets the syncer count a retried push once."""
    deltas: dict[str, torch.Tensor]
    tokens: int
    """Tokens the learner trained on since its previous push of this fragment."""
    steps: int
    step_time_s: float = 0.0
    """The learner's recent inner-step time, as it measured it: the syncer sizes grace windows with it."""
    sent_at: float | None = None
    """When the learner sent it, by its clock: the syncer estimates transfer times with it."""

    def wire_bytes(self) -> int:
        return tensors_wire_bytes(self.deltas)


@dataclass(frozen=True)
class Update:
    """A new global version of one fragment, as the syncer sent it."""

    fragment: int
    version: int
    values: dict[str, torch.Tensor]
    ack_seq: int = 0
    """The recipient's newest push that this version includes: an answer to an older push is stale."""

    def wire_bytes(self) -> int:
        return tensors_wire_bytes(self.values)
