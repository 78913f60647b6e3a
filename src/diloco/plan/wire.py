"""The bytes of each message a learner and the syncer exchange, from the project's own byte functions
(codec `wire_bytes`, message and tensor headers, `Progress.wire_bytes`), so that the planner counts
what the simulator counts, byte for byte."""

from __future__ import annotations

from collections.abc import Sequence

from diloco.codecs import get_codec
from diloco.core.messages import MESSAGE_HEADER_BYTES, Progress

LEAVE_BYTES = MESSAGE_HEADER_BYTES
"""A learner's announcement that it leaves (its run is over)."""


def tensors_bytes(tensors: Sequence[int], codec: str, block: int) -> int:
    """One message carrying these tensors (element counts) encoded with `codec`, headers included."""
    c = get_codec(codec, block)
    return MESSAGE_HEADER_BYTES + sum(c.wire_bytes(n) for n in tensors)


def push_bytes(tensors: Sequence[int], codec_up: str, block: int) -> int:
    """A push of one fragment: its outer gradients, encoded with the uplink codec."""
    return tensors_bytes(tensors, codec_up, block)


def update_bytes(tensors: Sequence[int], codec_down: str, block: int) -> int:
    """An answer with one fragment's new version, to a learner one version behind: fp32 sends the values
    themselves, any other codec their encoded difference to what the learner holds. Both are one tensor
    of the codec per tensor of the fragment. (A learner several versions behind, which synchronous runs
    never have, may get more: the planner's steady state has every learner in every round.)"""
    return tensors_bytes(tensors, codec_down, block)


def progress_bytes(fragments: int) -> int:
    """The report a learner sends after every inner step: header and one due time per fragment."""
    return Progress(0, 0, 0, 0.0, (0.0,) * fragments).wire_bytes()


def all_reduce_share(grad_bytes: int, learners: int) -> int:
    """Data-parallel: what each learner sends (and receives) per step in a ring all-reduce."""
    return 2 * (learners - 1) * grad_bytes // learners if learners >= 2 else 0
