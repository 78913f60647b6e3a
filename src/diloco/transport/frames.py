"""Tensors on a stream: one header frame, then the tensors' raw bytes in data frames.

The header lists each tensor's name, encoding, shape, block and byte counts; the data that follows is
each tensor's payload then scales, in the header's order, cut into frames of at most `FRAME_BYTES`.
A reader checks every header field and the running byte count before it keeps anything, so a
malformed, oversized or truncated message is refused whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import torch

from diloco.codecs import CODEC_NAMES, DEFAULT_BLOCK, Encoded, get_codec
from diloco.codecs.blockwise import BlockCodec
from diloco.codecs.cast import CastCodec
from diloco.codecs.coded_blocks import CodedBlocks, coded_blocks
from diloco.codecs.fp32_view import Fp32View, fp32_view
from diloco.codecs.encoded import MAX_NDIM
from diloco.errors import DilocoError
from diloco.v1 import diloco_pb2 as pb

FRAME_BYTES = 1 << 20
"""Data per frame: large enough that per-message costs vanish, small enough to interleave streams."""

MAX_DIM = 1 << 63
"""torch's sizes are signed 64-bit: no dimension, nor product of dimensions, reaches this."""


class FrameError(DilocoError):
    """A stream that does not follow the framing: nothing of it is used."""


def tensor_header(name: str, encoded: Encoded, relative: bool = False) -> pb.TensorHeader:
    return pb.TensorHeader(name=name, codec=encoded.codec, shape=list(encoded.shape), block=encoded.block,
                           payload_bytes=len(encoded.payload), scale_bytes=len(encoded.scales), relative=relative)


class DataFrame:
    """A data frame as it travels: protobuf's own encoding of `Frame(data=...)` (the tag of field 4, the
    length as a varint, the bytes), made with one copy of the bytes and read with none. A peer using
    protobuf's generated code sends and reads the very same bytes: the wire protocol is unchanged."""

    __slots__ = ("wire", "start")

    def __init__(self, wire: bytes, start: int) -> None:
        self.wire = wire
        self.start = start

    @property
    def data(self) -> memoryview:
        return memoryview(self.wire)[self.start:]

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - as pb.Frame names it
        return "data"

    def SerializeToString(self) -> bytes:  # noqa: N802 - as pb.Frame names it
        return self.wire


Frame = Union[pb.Frame, DataFrame]
DATA_TAG = b"\x22"
"""Field 4 (`data`), wire type 2 (length-delimited)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def data_frame(pieces: list[bytes | memoryview], size: int) -> DataFrame:
    """One data frame of `pieces` (`size` bytes in all), joined straight into its wire bytes."""
    prefix = DATA_TAG + _varint(size)
    return DataFrame(b"".join([prefix, *pieces]), len(prefix))


def serialize_frame(frame: Frame) -> bytes:
    """A frame's wire bytes (the stream calls' serializer)."""
    return frame.SerializeToString()


def parse_frame(raw: bytes) -> Frame:
    """A frame off the wire (the stream calls' deserializer): a frame that is one data field is read as a
    view of `raw`, any other by protobuf (a malformed one raises its DecodeError, as before)."""
    if raw[:1] == DATA_TAG:
        size, shift, at = 0, 0, 1
        while at < len(raw) and at <= 10:
            byte = raw[at]
            size |= (byte & 0x7F) << shift
            at += 1
            if not byte & 0x80:
                if at + size == len(raw):
                    return DataFrame(raw, at)
                break
            shift += 7
    return pb.Frame.FromString(raw)


def data_frames(tensors: Iterable[Encoded]) -> Iterator[DataFrame]:
    """The tensors' bytes, coalesced into frames of about FRAME_BYTES."""
    pending: list[bytes | memoryview] = []
    size = 0
    for encoded in tensors:
        for blob in (encoded.payload, encoded.scales):
            view = memoryview(blob)
            while view.nbytes:
                piece = view[: FRAME_BYTES - size]
                pending.append(piece)
                size += piece.nbytes
                view = view[piece.nbytes:]
                if size == FRAME_BYTES:
                    yield data_frame(pending, size)
                    pending, size = [], 0
    if size:
        yield data_frame(pending, size)


def data_views(tensors: Iterable[Encoded]) -> list[memoryview]:
    """The tensors' data as byte views, in order (what frames would carry), none empty: for a bulk port."""
    return [memoryview(blob).cast("B") for e in tensors for blob in (e.payload, e.scales) if len(blob)]


def message_frames(header: pb.Frame, tensors: dict[str, Encoded]) -> Iterator[Frame]:
    """A whole message: `header` (its tensor list must follow `tensors`' order), then the data."""
    yield header
    yield from data_frames(tensors.values())


def checked_header(header: pb.TensorHeader) -> tuple[int, int]:
    """(element count, data bytes) of a tensor header whose fields are all consistent; else FrameError."""
    if header.codec not in CODEC_NAMES:
        raise FrameError(f"tensor {header.name!r}: unknown codec {header.codec!r}")
    if len(header.shape) > MAX_NDIM:
        raise FrameError(f"tensor {header.name!r}: {len(header.shape)} dimensions, at most {MAX_NDIM}")
    if any(d >= MAX_DIM for d in header.shape) or math.prod(d for d in header.shape if d) >= MAX_DIM:
        raise FrameError(f"tensor {header.name!r}: shape {list(header.shape)} is larger than any tensor can be")
    numel = math.prod(header.shape)
    codec = get_codec(header.codec, header.block or DEFAULT_BLOCK)
    if not codec.valid_block(header.block):
        raise FrameError(f"tensor {header.name!r}: block size {header.block} is not one {header.codec} uses")
    want = (codec.payload_bytes(numel), codec.scale_bytes(numel, header.block))
    got = (header.payload_bytes, header.scale_bytes)
    if got != want:
        raise FrameError(f"tensor {header.name!r} of shape {list(header.shape)} in {header.codec}: declares "
                         f"{got[0]}+{got[1]} bytes, its encoding takes {want[0]}+{want[1]}")
    return numel, sum(want)


BulkSource = Callable[[Any, list[memoryview]], None]
"""Fills the byte views of a message's values, in its header's order, from where its header says (a
shard's bulk port: `transport/bulk.py`)."""


def read_message(frames: Iterator[Frame], kind: str, limit: int, bulk: BulkSource | None = None
                 ) -> tuple[object, dict[str, Encoded]] | None:
    """The next message of `kind` from `frames`: its header and tensors, or None when the stream ended
    cleanly before one began. At most `limit` data bytes are accepted. A header that names a bulk ticket
    has its data filled by `bulk` instead of frames (refused where the caller gave none)."""
    opened = open_message(frames, kind, limit)
    if opened is None:
        return None
    header, total = opened
    if not getattr(header, "bulk_ticket", b""):
        return header, buffered(frames, header, total)
    if bulk is None:
        raise FrameError("the data was sent over a bulk port this reader did not ask for")
    data = bytearray(total)
    bulk(header, [memoryview(data)])
    return header, tensors_of(header, memoryview(data).toreadonly())


def read_values(frames: Iterator[Frame], kind: str, limit: int, bulk: BulkSource | None = None
                ) -> tuple[object, dict[str, torch.Tensor]] | None:
    """`read_message` decoded, for a message the caller keeps as values (Θ as a pull sends it): fp32 tensors
    are read straight into new tensors as their frames come (one copy, where a buffer and a decode would
    make two more and zero a third), then checked finite as a decode would. A header that names a bulk
    ticket has its values filled by `bulk` instead of frames (refused where the caller gave none)."""
    opened = open_message(frames, kind, limit)
    if opened is None:
        return None
    header, total = opened
    from_bulk = bool(getattr(header, "bulk_ticket", b""))
    if from_bulk and (bulk is None or any(t.codec != "fp32" for t in header.tensors)):
        raise FrameError("the values were sent over a bulk port this reader did not ask for, or not in fp32")
    if any(t.codec != "fp32" for t in header.tensors):
        return header, {n: decode(e) for n, e in buffered(frames, header, total).items()}
    values = {t.name: torch.empty(tuple(int(d) for d in t.shape), dtype=torch.float32) for t in header.tensors}
    targets = [memoryview(v.numpy()).cast("B") for v in values.values() if v.numel()]
    if from_bulk:
        bulk(header, targets)
    else:
        _fill(frames, targets, total)
    for name, value in values.items():
        if value.numel() and not all(math.isfinite(float(x)) for x in torch.aminmax(value.reshape(-1))):
            raise FrameError(f"tensor {name!r} holds NaN or Inf")
    return header, values


def open_message(frames: Iterator[Frame], kind: str, limit: int) -> tuple[object, int] | None:
    """The header of the next message of `kind`, every tensor header checked, and its data bytes in all."""
    first = next(frames, None)
    if first is None:
        return None
    if first.WhichOneof("body") != kind:
        raise FrameError(f"expected a {kind} header, got {first.WhichOneof('body') or 'an empty frame'}")
    header = getattr(first, kind)
    total, names = 0, set()
    for t in header.tensors:
        if t.name in names:
            raise FrameError(f"tensor {t.name!r} appears twice in one message")
        names.add(t.name)
        total += checked_header(t)[1]
    if total > limit:
        raise FrameError(f"message declares {total} bytes of tensors, more than the {limit} allowed")
    return header, total


def _fill(frames: Iterator[Frame], targets: list[memoryview], total: int) -> None:
    """Copy the message's `total` data bytes from `frames` into `targets` in order (byte views whose sizes add
    up to `total`); a frame may span targets. Anything but exactly `total` bytes of data frames is refused."""
    rest = iter(targets)
    filled, at, into, room = 0, 0, memoryview(b""), 0
    while filled < total:
        frame = next(frames, None)
        if frame is None:
            raise FrameError(f"stream ended after {filled} of {total} bytes: the message is truncated")
        if frame.WhichOneof("body") != "data":
            raise FrameError(f"expected data, got a {frame.WhichOneof('body') or 'empty'} frame mid-message")
        chunk = memoryview(frame.data)  # read once: a protobuf message copies its bytes on every read
        if filled + chunk.nbytes > total:
            raise FrameError(f"message carries more than the {total} bytes its header declares")
        while chunk.nbytes:
            if not room:
                into, at = next(rest), 0
                room = into.nbytes
            n = min(room, chunk.nbytes)
            into[at:at + n] = chunk[:n]
            at, room, chunk, filled = at + n, room - n, chunk[n:], filled + n


def buffered(frames: Iterator[Frame], header: Any, total: int) -> dict[str, Encoded]:
    """The message's data read into one buffer of its declared size (checked: filled in place, never
    regrown), each tensor a view of it: no copy per tensor."""
    data = bytearray(total)
    _fill(frames, [memoryview(data)], total)
    return tensors_of(header, memoryview(data).toreadonly())


def tensors_of(header: Any, blob: memoryview) -> dict[str, Encoded]:
    """A message's tensors as views of `blob`, its data in the header's order (as `open_message` checked
    it: `blob` holds exactly the bytes the header declares)."""
    tensors, offset = {}, 0
    for t in header.tensors:
        end = offset + t.payload_bytes
        tensors[t.name] = Encoded(t.codec, tuple(int(d) for d in t.shape), t.block, blob[offset:end],
                                  blob[end:end + t.scale_bytes])
        offset = end + t.scale_bytes
    return tensors


def decode(encoded: Encoded) -> torch.Tensor:
    """An fp32 CPU tensor of the encoded shape; FrameError if the bytes do not decode to finite values
    (every codec's `decode` checks that as it goes: no pass of its own here)."""
    try:
        return get_codec(encoded.codec, encoded.block or DEFAULT_BLOCK).decode(encoded).reshape(encoded.shape)
    except (DilocoError, RuntimeError, ValueError) as exc:
        raise FrameError(str(exc)) from None


def coded(encoded: Encoded, complain: Callable[[str], Exception]) -> CodedBlocks | Fp32View | None:
    """`encoded` readable without decoding it, where its codec and this host allow: from its codes
    (`codecs.coded_blocks`), or fp32 in place (`codecs.fp32_view`); None: decode it. Bytes that do not fit
    are refused through `complain`."""
    try:
        codec = get_codec(encoded.codec, encoded.block or DEFAULT_BLOCK)
    except DilocoError as exc:
        raise complain(str(exc)) from None
    if isinstance(codec, CastCodec) and codec.name == "fp32":
        return fp32_view(codec, encoded, complain)
    return coded_blocks(codec, encoded, complain) if isinstance(codec, BlockCodec) else None


def encode_fp32(values: dict[str, torch.Tensor]) -> dict[str, Encoded]:
    """Exact values (Θ, a model's initial parameters) as they travel."""
    codec = get_codec("fp32")
    return {name: codec.encode(v.detach().to(torch.float32)) for name, v in values.items()}


def encode_snapshot(values: dict[str, torch.Tensor]) -> dict[str, Encoded]:
    """Θ as the shard holds it, sent as views of its own memory: no copy. Only for fp32 CPU tensors nobody
    writes to again (a shard's Θ is replaced by new tensors on every commit, never changed in place, and
    only finite values are committed); anything else is encoded by copy, as `encode_fp32` does."""
    out = {}
    for name, v in values.items():
        t = v.detach()
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
            out.update(encode_fp32({name: t}))
            continue
        out[name] = Encoded("fp32", tuple(t.shape), 0, memoryview(t.reshape(-1).numpy()).cast("B").toreadonly())
    return out
