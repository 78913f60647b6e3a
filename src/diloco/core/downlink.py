"""What the syncer sends back after a round, and what each learner then holds, without a copy per learner.

Learners anchor on exactly the values they receive, and the syncer must know those values bit for bit
to send the next answer. Keeping them per learner would make the syncer's memory grow with the fleet,
so every learner of a fragment at the same version holds the same values, kept once:

- Lossless downlink (fp32): the values are Θ of that version. An answer is Θ itself, encoded once per
  round and shared by its recipients: a read-only view of Θ's memory (`whole_fp32`), no copy.
- Lossy downlink: the syncer keeps one *published* copy of the fragment, moved each round by one encoded
  difference to Θ: published_v = published_{v-1} + decode(encode(Θ_v − published_{v-1})). Every
  learner at version v holds published_v. An answer to a learner at version u is the differences
  u+1..v, applied in order (each encoded once and shared), kept for a few versions back (at most
  CHAIN_SHARE of the fragment's fp32 size); a learner further behind, or one for whom the differences
  would weigh more, is sent published_v whole, in fp32. The rounding error of each difference is carried
  by the next one (published tracks Θ), so what learners hold stays within one difference's rounding.

A learner that (re)starts takes the values of the current version whole: Θ, or published.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from diloco.codecs import Codec, Encoded, get_codec
from diloco.core.undo import UndoLog
from diloco.outer.buffers import NewTensor, fp32_like

CHAIN_SHARE = 0.5
"""Encoded differences kept per fragment, in fp32 copies of it: answers further behind go whole."""

FP32 = get_codec("fp32")


class Message(dict):
    """One message's encoded tensors, by name (a dict that can be referenced weakly)."""


@dataclass(frozen=True)
class Step:
    """One version's encoded difference to the one before (lossy downlink)."""

    version: int
    wire: dict[str, Encoded]

    def nbytes(self) -> int:
        return sum(e.wire_bytes() for e in self.wire.values())


@dataclass(frozen=True)
class Answer:
    """What one learner is sent: `wire` as messages in order, each relative (a difference) or whole."""

    values: dict[str, torch.Tensor]
    """What the learner holds once it applied them all."""
    wire: tuple[dict[str, Encoded], ...]
    relative: bool

    @property
    def payload_bytes(self) -> int:
        return sum(e.wire_bytes() for message in self.wire for e in message.values())


class Downlink:
    """One fragment's downlink state: the published values (lossy codecs) and recent differences."""

    def __init__(self, codec: Codec, names: tuple[str, ...], theta: dict[str, torch.Tensor],
                 undo: UndoLog | None = None, new: NewTensor = fp32_like) -> None:
        self.undo = undo or UndoLog()
        """Where a change made in a transaction keeps what it replaced (`undo.py`)."""
        self.new = new
        """Where each round's published copy is written: the core's recycled buffers (`scratch.py`), which
        take no tensor that an answer in flight or the transaction's undo log still holds."""
        self.codec, self.names = codec, names
        self.lossless = codec.name == "fp32"
        self.published = {} if self.lossless else {n: theta[n].clone() for n in names}
        self.steps: list[Step] = []
        self._whole: Callable[[], Message | None] = lambda: None
        self._whole_version = -1
        """The current version encoded whole, shared by every answer that still holds it: it lasts only
        as long as one of them does (answers taken at about the same time share it)."""
        self.fp32_bytes = sum(FP32.wire_bytes(theta[n].numel()) for n in names)

    def values(self, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a learner at the current version holds."""
        return {n: theta[n] for n in self.names} if self.lossless else dict(self.published)

    def publish(self, version: int, theta: dict[str, torch.Tensor]) -> None:
        """The fragment moved to `version` (Θ is its new value): advance published by one difference, in one
        pass where the codec can (`encode_difference_onto`), into buffers from `new`."""
        if self.lossless:
            return
        self.undo.keep_attrs(self, "published", "steps")
        moved = {n: self.codec.encode_difference_onto(theta[n], self.published[n], self.new) for n in self.names}
        wire = {n: encoded for n, (encoded, _) in moved.items()}
        self.published = {n: published for n, (_, published) in moved.items()}
        steps = [*self.steps, Step(version, wire)]
        while sum(s.nbytes() for s in steps) > CHAIN_SHARE * self.fp32_bytes and len(steps) > 1:
            steps = steps[1:]
        self.steps = steps

    def answers(self, held: dict[int, int], version: int, theta: dict[str, torch.Tensor]) -> dict[int, Answer]:
        """Bring each learner from the version it holds (`held`, by learner) to the current `version`.
        Whatever is sent whole is encoded once for all of them."""
        values = self.values(theta)
        whole = self._whole() if self._whole_version == version else None
        out = {}
        for learner, version_held in held.items():
            steps = [s for s in self.steps if s.version > version_held]
            if not self.lossless and steps and steps[0].version == version_held + 1 \
                    and steps[-1].version == version and sum(s.nbytes() for s in steps) < self.fp32_bytes:
                out[learner] = Answer(values, tuple(s.wire for s in steps), relative=True)
                continue
            if whole is None:
                whole = Message({n: whole_fp32(values[n]) for n in self.names})
                self.undo.keep_attrs(self, "_whole", "_whole_version")
                self._whole, self._whole_version = weakref.ref(whole), version
            out[learner] = Answer(values, (whole,), relative=False)
        return out

    def forget_before(self, version: int) -> None:
        """No learner that may still be answered holds a version older than this."""
        self.undo.keep_attrs(self, "steps")
        self.steps = [s for s in self.steps if s.version > version]

    def nbytes(self) -> int:
        published = sum(t.numel() * t.element_size() for t in self.published.values())
        return published + sum(s.nbytes() for s in self.steps)

    def tensors(self) -> list[object]:
        """What a transaction's snapshot shares instead of copying (none of it changes in place)."""
        return [*self.published.values(), *self.steps]

    def plain(self) -> dict:
        return {"published": dict(self.published),
                "steps": [{"version": s.version, "wire": {n: plain_encoded(e) for n, e in s.wire.items()}}
                          for s in self.steps]}

    def load(self, plain: dict) -> None:
        self.published = {n: t.clone().to(torch.float32) for n, t in plain["published"].items()}
        self.steps = [Step(s["version"], {n: encoded_of(e) for n, e in s["wire"].items()}) for s in plain["steps"]]


def whole_fp32(values: torch.Tensor) -> Encoded:
    """Values a learner holds, as fp32 on the wire: a read-only view of their memory, not a copy. They are
    Θ or the published copy of a version, which are replaced, never written, while anyone holds them (the
    view holds them: `scratch.py` takes no tensor that is held), and checked finite when they were made."""
    if values.device.type != "cpu" or not values.is_contiguous():
        return FP32.encode(values)
    return Encoded(FP32.name, tuple(values.shape), 0, memoryview(values.detach().numpy()).cast("B").toreadonly())


def plain_encoded(encoded: Encoded) -> dict:
    """An encoded tensor as tensors and plain data (a state file is loaded with weights_only=True)."""
    return {"codec": encoded.codec, "shape": list(encoded.shape), "block": encoded.block,
            "payload": _bytes_tensor(encoded.payload), "scales": _bytes_tensor(encoded.scales)}


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def encoded_of(plain: dict) -> Encoded:
    return Encoded(plain["codec"], tuple(plain["shape"]), plain["block"], bytes(plain["payload"].numpy()),
                   bytes(plain["scales"].numpy()))
