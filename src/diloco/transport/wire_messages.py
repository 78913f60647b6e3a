"""Every conversion between the core's messages and what travels: protobuf headers and encoded tensors.

The cores speak `Push`, `Update` and `Progress` (`core/messages.py`); the wire speaks `pb.*Header`s
followed by tensor frames (`frames.py`). Both ends of every call (learner, regional uplink, shard,
journal) convert here, so a field added to a message is added in one place. The run's settings too:
the syncer's config is the one that counts, told to each learner at Join, from which it rebuilds the
strategy's spec and takes its core.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.codecs import Encoded, get_codec
from diloco.codecs.coded_blocks import CodedBlocks
from diloco.codecs.fp32_view import Fp32View
from diloco.config import Config
from diloco.core.messages import MESSAGE_HEADER_BYTES, Progress, Push, Update
from diloco.core.refusals import ProtocolError
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.strategies import StrategySpec, Wiring, build_strategy
from diloco.transport.bulk import BulkServer
from diloco.transport.frames import (Frame, FrameError, coded, data_frames, data_views, decode, encode_fp32,
                                     encode_snapshot, message_frames, tensor_header)
from diloco.v1 import diloco_pb2 as pb

FRAME_LENGTH = struct.Struct("<I")


# ------------------------------------------------------------ pushes


class DecodedOnUse(Mapping):
    """A push's tensors, decoded to fp32 when first read and dropped again by `release`: a group of pushes
    waits encoded and is decoded one push at a time as the core takes it in (`SyncerCore._on_pushes`), so
    the shard holds one decoded push at a time whatever the group's size. A tensor that does not decode is
    a ProtocolError, raised by the core's checks before anything changed."""

    def __init__(self, tensors: dict[str, Encoded]) -> None:
        self.tensors = tensors
        self.decoded: dict[str, torch.Tensor] = {}
        self._coded: dict[str, CodedBlocks | Fp32View | None] = {}

    def coded(self, name: str) -> CodedBlocks | Fp32View | None:
        """The tensor readable without decoding it (from its codes, `codecs.coded_blocks`, or fp32 in place,
        `codecs.fp32_view`), where its codec and this host allow and it was not decoded already; None: read it
        as a tensor."""
        if name in self.decoded:
            return None
        if name not in self._coded:
            self._coded[name] = coded(self.tensors[name], _bad_push)
        return self._coded[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.decoded:
            try:
                self.decoded[name] = decode(self.tensors[name])
            except FrameError as exc:
                raise _bad_push(str(exc)) from None
        return self.decoded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def release(self) -> None:
        """The core took the push in: its decoded values are no longer needed here."""
        self.decoded, self._coded = {}, {}


def _bad_push(why: str) -> ProtocolError:
    return ProtocolError(f"bad push: {why}")


def push_header(sender: int, push: Push, encoded: dict[str, Encoded]) -> pb.PushHeader:
    """A push as it leaves `sender` (a learner, or a region speaking as one), its tensors encoded."""
    return pb.PushHeader(learner=sender, fragment=push.fragment, base_version=push.base_version, seq=push.seq,
                         tokens=push.tokens, steps=push.steps, step_time_s=push.step_time_s,
                         sent_at=push.sent_at or clock.now(), tensors=[tensor_header(n, e) for n, e in encoded.items()],
                         step=push.step, final=push.final, unanswered=not push.answered)


def message_bytes(tensors: dict[str, Encoded]) -> int:
    """What one message carrying `tensors` puts on the (emulated) link, its header included."""
    return MESSAGE_HEADER_BYTES + sum(e.wire_bytes() for e in tensors.values())


def push_of(header: pb.PushHeader, tensors: dict[str, Encoded], deltas: Mapping | None = None) -> Push:
    """A push as the core takes it, from its header and tensors as they travelled: by default decoded on use
    (`DecodedOnUse`), as a shard takes it live and as its journal's replay takes it again, so that replay
    makes the same arithmetic and refuses what was refused (a push that does not decode, in a group that is
    journaled whole, is refused by the core again, not a journal that cannot be read back)."""
    if deltas is None:
        deltas = DecodedOnUse(tensors)
    return Push(learner=header.learner, fragment=header.fragment, base_version=header.base_version,
                seq=header.seq, deltas=deltas, tokens=header.tokens, steps=header.steps,
                step_time_s=header.step_time_s, sent_at=header.sent_at or None,
                payload_bytes=sum(e.wire_bytes() for e in tensors.values()), step=header.step, final=header.final,
                answered=not header.unanswered)


def push_payload(header: pb.PushHeader, tensors: dict) -> bytes:
    """A push as it came off the wire: its frames, each length-prefixed (how the journal keeps it)."""
    return b"".join(FRAME_LENGTH.pack(len(b)) + b for b in
                    (f.SerializeToString() for f in message_frames(pb.Frame(push=header), tensors)))


def payload_frames(payload: bytes) -> Iterator[pb.Frame]:
    """`push_payload` read back into frames."""
    offset = 0
    while offset < len(payload):
        (size,) = FRAME_LENGTH.unpack_from(payload, offset)
        offset += FRAME_LENGTH.size
        frame = pb.Frame()
        frame.ParseFromString(payload[offset:offset + size])
        offset += size
        yield frame


# ------------------------------------------------------------ answers


class LostAnswer(ValueError):
    """An answer's differences apply to another version than the one held: an answer was lost."""


def update_frames(update: Update, bulk: BulkServer | None = None, done: Callable[[], None] | None = None
                  ) -> Iterator[pb.Frame]:
    """An answer on the stream: one message per encoded difference (or one whole), in order. Its own
    generator, so that what it references is let go as soon as the last frame is sent. With `bulk`, each
    message is its header alone, naming the port and a ticket for its data (`done`: told once the last
    one is used, void or dropped)."""
    for index, message in enumerate(update.wire):
        last = index == len(update.wire) - 1
        header = pb.UpdateHeader(
            fragment=update.fragment, version=update.version, ack_seq=update.ack_seq,
            tensors=[tensor_header(n, e, update.relative) for n, e in message.items()],
            next_push_at=update.next_push_at, continued=not last, base_version=update.base_version + index)
        if bulk is None:
            yield from message_frames(pb.Frame(update=header), message)
            continue
        header.bulk_port = bulk.port
        header.bulk_ticket = bulk.ticket(data_views(message.values()), done if last else None)
        yield pb.Frame(update=header)


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


# ------------------------------------------------------------ progress, state, versions


def heartbeat_request(sender: int, tokens: int, steps: int, step_time_s: float = 0.0,
                      due_in_s: tuple[float, ...] = ()) -> pb.HeartbeatRequest:
    """A heartbeat; with `due_in_s`, a progress report too."""
    return pb.HeartbeatRequest(learner=sender, tokens=tokens, steps=steps, step_time_s=step_time_s, due_in_s=due_in_s)


def progress_of(request: pb.HeartbeatRequest) -> Progress:
    return Progress(request.learner, request.steps, request.tokens, request.step_time_s, tuple(request.due_in_s))


def fragment_versions(versions: dict[int, int], push_in_s: Mapping[int, float] | None = None
                      ) -> list[pb.FragmentVersion]:
    push_in_s = push_in_s or {}
    return [pb.FragmentVersion(fragment=p, version=v, push_in_s=push_in_s.get(p)) for p, v in versions.items()]


def versions_of(entries: list[pb.FragmentVersion]) -> dict[int, int]:
    return {v.fragment: v.version for v in entries}


MAX_PUSH_IN_S = 24 * 3600.0
"""The longest first-push delay a shard may name (a day): a sync period is seconds to minutes."""


def push_in_of(entries: list[pb.FragmentVersion]) -> dict[int, float]:
    """Per fragment the shard named one for, seconds until the learner's first push of it: a claim, so only a
    finite delay from 0 to `MAX_PUSH_IN_S` is taken (any other, the learner's steps decide)."""
    return {v.fragment: v.push_in_s for v in entries
            if v.HasField("push_in_s") and math.isfinite(v.push_in_s) and 0.0 <= v.push_in_s <= MAX_PUSH_IN_S}


def fragment_layout(fragment: Fragment, params: dict[str, torch.Tensor]) -> pb.FragmentLayout:
    """What a fragment holds, tensor by tensor: how the first learner seeds a shard, and what later ones check."""
    return pb.FragmentLayout(index=fragment.index, tensors=[
        pb.TensorSpec(name=n, shape=list(params[n].shape), embedding=fragment.embedding) for n in fragment.names])


def state_frames(values: dict[str, torch.Tensor], layout: list[pb.FragmentLayout],
                 versions: dict[int, int] | None = None, snapshot: bool = False,
                 push_in_s: Mapping[int, float] | None = None) -> Iterator[Frame]:
    """Exact values of Θ (a seeding, or a pull's answer) with their layout and versions (and for a joining
    learner, when to push first: `push_in_s`). `snapshot`: the shard's own Θ, never written again, sent
    without a copy (`frames.encode_snapshot`)."""
    encoded = encode_snapshot(values) if snapshot else encode_fp32(values)
    header = pb.StateHeader(versions=fragment_versions(versions or {}, push_in_s), layout=layout,
                            tensors=[tensor_header(n, e) for n, e in encoded.items()])
    return message_frames(pb.Frame(state=header), encoded)


def bulk_state_frame(values: dict[str, torch.Tensor], layout: list[pb.FragmentLayout], versions: dict[int, int],
                     bulk: BulkServer, push_in_s: Mapping[int, float] | None = None) -> pb.Frame:
    """A pull's answer whose values follow over the shard's bulk port: the header `state_frames` sends, with
    the port and a ticket for exactly the bytes it declares (Θ's own memory, as a snapshot)."""
    encoded = encode_snapshot(values)
    views = data_views(encoded.values())
    return pb.Frame(state=pb.StateHeader(versions=fragment_versions(versions, push_in_s), layout=layout,
                                         tensors=[tensor_header(n, e) for n, e in encoded.items()],
                                         bulk_port=bulk.port, bulk_ticket=bulk.ticket(views)))


def seed_frames(values: Mapping[str, Any], layout: list[pb.FragmentLayout]) -> Iterator[Frame]:
    """The first learner's Θ seeding a shard, as `state_frames` sends it (the same bytes), made lazily:
    the header from the shapes alone (fp32's bytes follow from a shape), then each value taken
    (`.detach()`), encoded and framed only as its data is due. So a sharded learner's rank 0 gathers
    one tensor at a time, on the caller's request thread, and lets it go once encoded."""
    codec = get_codec("fp32")
    headers = [pb.TensorHeader(name=n, codec="fp32", shape=list(v.shape), payload_bytes=codec.payload_bytes(
        math.prod(v.shape))) for n, v in values.items()]
    yield pb.Frame(state=pb.StateHeader(layout=layout, tensors=headers))

    def encoded() -> Iterator[Encoded]:
        for header, (name, value) in zip(headers, values.items()):
            out = encode_fp32({name: value})[name]
            if len(out.payload) != header.payload_bytes or tuple(out.shape) != tuple(header.shape):
                raise DilocoError(f"tensor {name!r} changed shape while it was sent")
            yield out

    yield from data_frames(encoded())


# ------------------------------------------------------------ the run's settings


def settings_of(config: Config) -> pb.Settings:
    spec = build_strategy(config)
    if spec.exchange != "outer":
        raise DilocoError(f"strategy {spec.name!r} all-reduces gradients every step; the real runtime runs the "
                          f"strategies that sync through a syncer (diloco, streaming, async, async-dn, decoupled). "
                          f"Use `diloco sim` for {spec.name}, or torch DDP itself")
    codec = config.codec
    return pb.Settings(strategy=spec.name, fragments=spec.fragments, period=spec.H,
                       learner_periods=list(spec.learner_H), tau=spec.tau, alpha=spec.alpha,
                       wait_for_updates=spec.wait_for_updates, codec_up=codec.up, codec_down=codec.down,
                       block=codec.block, error_feedback=codec.error_feedback, learners=len(config.speeds()),
                       token_budget=config.token_budget(), shared_budget=spec.shared_budget,
                       keep_progress=spec.keep_progress)


def spec_of(settings: pb.Settings) -> StrategySpec:
    """The learner's side of the strategy, as the syncer's settings give it."""
    return StrategySpec(name=settings.strategy, exchange="outer", H=settings.period,
                        learner_H=tuple(settings.learner_periods), fragments=settings.fragments, tau=settings.tau,
                        alpha=settings.alpha, wait_for_updates=settings.wait_for_updates,
                        keep_progress=settings.keep_progress, shared_budget=settings.shared_budget,
                        wiring=Wiring(codec_up=settings.codec_up, codec_down=settings.codec_down,
                                      block=settings.block, error_feedback=settings.error_feedback,
                                      budget=settings.token_budget))
