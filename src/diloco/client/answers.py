"""An answer as it arrives (update headers and encoded tensors) turned back into an `Update`: what a
learner and a regional syncer's uplink both receive from a syncer."""

from __future__ import annotations

from typing import Callable

import torch

from diloco.codecs import Encoded
from diloco.core.messages import MESSAGE_HEADER_BYTES, Update
from diloco.transport.frames import decode
from diloco.v1 import diloco_pb2 as pb


class LostAnswer(ValueError):
    """An answer's differences apply to another version than the one held: an answer was lost."""


def update_of(header: pb.UpdateHeader, tensors: dict[str, Encoded], anchors: dict[str, torch.Tensor],
              held_version: int, nbytes: int, base: dict[str, torch.Tensor] | None = None,
              to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Update:
    """A relative answer is a difference to the anchor (or to `base`: the answer's differences before it,
    applied in order as the syncer did), which cannot change meanwhile: the fragment has a push in flight,
    and its anchor moves only when this answer is merged."""
    p = header.fragment
    anchors = anchors if base is None else base
    relative = {t.name: t.relative for t in header.tensors}
    if base is None and any(relative.values()) and header.base_version != held_version:
        raise LostAnswer(f"an answer of fragment {p} applies to version {header.base_version}, the recipient "
                         f"holds {held_version}: an answer was lost")
    values = {}
    for name, encoded in tensors.items():
        value = to_device(decode(encoded))
        values[name] = anchors[name] + value if relative[name] else value  # fp32 adds round alike
    next_push_at = header.next_push_at if header.HasField("next_push_at") else None
    return Update(p, header.version, values, ack_seq=header.ack_seq, payload_bytes=nbytes - MESSAGE_HEADER_BYTES,
                  next_push_at=next_push_at)
