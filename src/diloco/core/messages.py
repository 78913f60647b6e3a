"""What learners and the syncer say to each other, independent of how it travels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.codecs import TENSOR_HEADER_BYTES, Encoded

MESSAGE_HEADER_BYTES = 64
"""Ids, version, sequence number, counters and codec of one message."""


def tensors_wire_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes one message carrying `tensors` uncompressed puts on the wire, headers included."""
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
    """The outer gradients as the syncer decodes them."""
    tokens: int
    """Tokens the learner trained on since its previous push of this fragment."""
    steps: int
    step_time_s: float = 0.0
    """The learner's recent inner-step time, as it measured it: the syncer sizes grace windows with it."""
    sent_at: float | None = None
    """When the learner sent it, by its clock: the syncer estimates transfer times with it."""
    payload_bytes: int = 0
    """Bytes of the encoded tensors, their headers included."""
    step: int = 0
    """The learner's inner step when it sent this: the syncer paces the next push of the fragment from it."""
    final: bool = False
    """The learner's last push of this fragment: its run is over (the final consolidation waits for it)."""
    answered: bool = True
    """Its sender merges the answer. False for a leaving learner's last pushes (`LearnerCore.finish`): it
    merges nothing after them, so the syncer sends no answer, which would be the whole fragment where the
    learner is versions behind."""

    def wire_bytes(self) -> int:
        return MESSAGE_HEADER_BYTES + self.payload_bytes


@dataclass(frozen=True)
class Progress:
    """Where a learner stands, reported often (every step in the simulator, with each heartbeat for real):
    the syncer predicts from it when each learner's next push of each fragment will arrive."""

    learner: int
    step: int
    """Inner steps taken in this life (a restarted learner resumes its count from its checkpoint)."""
    tokens: int
    """Tokens trained in this life: the shared budget adds up every life of every learner."""
    step_time_s: float
    """The learner's recent inner-step time, as it measured it."""
    due_in_s: tuple[float, ...] = ()
    """Per fragment, how long until the learner pushes it next, by its own reckoning (its schedule, or
    the time the syncer asked for, rounded to the end of a step)."""

    def wire_bytes(self) -> int:
        return MESSAGE_HEADER_BYTES + 8 * len(self.due_in_s)


@dataclass(frozen=True)
class Update:
    """A new global version of one fragment, as the syncer sent it."""

    fragment: int
    version: int
    values: dict[str, torch.Tensor]
    """What the recipient holds once it applies this update: its new anchor, bit for bit."""
    ack_seq: int = 0
    """The recipient's newest push that this version includes: an answer to an older push is stale."""
    payload_bytes: int = 0
    """Bytes of the encoded tensors (the difference to what the recipient held), headers included."""
    wire: tuple[dict[str, Encoded], ...] = field(default=(), repr=False)
    """The tensors as they travel, as messages in order: `values` encoded, or the differences that bring
    the recipient's anchors to them, one per version (`core/downlink.py`)."""
    relative: bool = False
    base_version: int = 0
    """The version the recipient held when it was made: a relative update's first difference applies to it."""
    next_push_at: float | None = None
    """When the recipient should push this fragment next, on its own clock (at the end of the step
    nearest to it): chosen by the syncer so that every learner's next push lands together. None leaves
    the learner on its own schedule."""

    def wire_bytes(self) -> int:
        """Its messages' headers (one per difference sent) and tensors."""
        return MESSAGE_HEADER_BYTES * max(1, len(self.wire)) + self.payload_bytes
