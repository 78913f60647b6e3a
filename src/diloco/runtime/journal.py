"""The syncer shard's write-ahead journal: every event its core takes, on disk before it is answered.

The core is a sans-I/O state machine, so its state is a function of the events it took. A shard saves
its whole state now and then and journals each event since: after a crash it loads the saved state and
replays the journal through the same core, and ends where it was — a push that was acknowledged is
never lost, and one retried after the restart is recognised by its sequence number and counted once.

A record: sequence number (8 bytes), kind length (1), payload length (8), kind, payload, all
little-endian. A record cut short by the crash is the end of the journal. The records are the core's
own typed events (`core/events.py`): the kind is the event's type, the payload the time it was taken
(8 bytes) and its fields (a push as the frames it arrived in, anything else as JSON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from diloco.codecs import Encoded
from diloco.core.events import (HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived, PushArrived,
                                SyncerEvent, SyncerResumed, TimerFired)
from diloco.core.messages import Progress, Push
from diloco.transport.frames import decode, message_frames, read_message
from diloco.v1 import diloco_pb2 as pb

RECORD_HEADER = struct.Struct("<QBQ")
FRAME_LENGTH = struct.Struct("<I")


class Journal:
    def __init__(self, path: Path, last_seq: int = 0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.seq = last_seq
        self._file = open(path, "ab")

    def append(self, kind: str, payload: bytes, durable: bool = True) -> int:
        """Write one record, on disk before this returns when `durable` (a later durable record makes
        the earlier ones durable too); return its sequence number."""
        self.seq += 1
        name = kind.encode()
        self._file.write(RECORD_HEADER.pack(self.seq, len(name), len(payload)) + name + payload)
        self._file.flush()
        if durable:
            os.fsync(self._file.fileno())
        return self.seq

    def truncate(self) -> None:
        """Everything journaled so far is in the saved state: start an empty journal (numbers go on)."""
        self._file.truncate(0)
        self._file.seek(0)
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: Path) -> Iterator[tuple[int, str, bytes]]:
        """(sequence number, kind, payload) of every whole record, in order."""
        if not path.is_file():
            return
        data = path.read_bytes()
        offset = 0
        while offset + RECORD_HEADER.size <= len(data):
            seq, name_len, payload_len = RECORD_HEADER.unpack_from(data, offset)
            start = offset + RECORD_HEADER.size
            end = start + name_len + payload_len
            if end > len(data):
                return  # cut short by the crash
            yield seq, data[start:start + name_len].decode(), data[start + name_len:end]
            offset = end


NOW = struct.Struct("<d")
PLAIN_EVENTS = {cls.__name__: cls for cls in (HeartbeatArrived, TimerFired, LearnerLeft, LearnerRejoined,
                                              SyncerResumed)}
QUIET_EVENTS = (ProgressArrived, HeartbeatArrived)
"""Events that need not be on disk before they are answered: the next event that is (every event that
decides something) makes them durable too, being later in the same file."""


def encode_event(event: SyncerEvent, now: float, push_frames: bytes = b"") -> tuple[str, bytes]:
    """(kind, payload) of one event; a push travels as the frames it arrived in (`push_payload`)."""
    if isinstance(event, PushArrived):
        body = push_frames
    elif isinstance(event, ProgressArrived):
        body = json.dumps(dataclasses.asdict(event.report)).encode()
    else:
        body = json.dumps(dataclasses.asdict(event)).encode()
    return type(event).__name__, NOW.pack(now) + body


def decode_event(kind: str, payload: bytes) -> tuple[SyncerEvent, float]:
    (now,) = NOW.unpack_from(payload)
    body = payload[NOW.size:]
    if kind == "PushArrived":
        header, tensors = read_message(payload_frames(body), "push", limit=1 << 40)
        return PushArrived(push_of(header, tensors)), now
    fields = json.loads(body)
    if kind == "ProgressArrived":
        return ProgressArrived(Progress(**{**fields, "due_in_s": tuple(fields["due_in_s"])})), now
    if kind == "LearnerRejoined" and fields["fragments"] is not None:
        fields["fragments"] = tuple(fields["fragments"])
    if kind not in PLAIN_EVENTS:
        raise ValueError(f"unknown journal event {kind!r}")
    return PLAIN_EVENTS[kind](**fields), now


def push_of(header: pb.PushHeader, tensors: dict[str, Encoded], deltas: dict | None = None) -> Push:
    """A push as the core takes it, from its header and tensors as they travelled."""
    if deltas is None:
        deltas = {name: decode(e) for name, e in tensors.items()}
    return Push(learner=header.learner, fragment=header.fragment, base_version=header.base_version,
                seq=header.seq, deltas=deltas, tokens=header.tokens, steps=header.steps,
                step_time_s=header.step_time_s, sent_at=header.sent_at or None,
                payload_bytes=sum(e.wire_bytes() for e in tensors.values()), step=header.step, final=header.final)


def push_payload(header: pb.PushHeader, tensors: dict) -> bytes:
    """A push as it came off the wire: its frames, each length-prefixed."""
    return b"".join(FRAME_LENGTH.pack(len(b)) + b for b in
                    (f.SerializeToString() for f in message_frames(pb.Frame(push=header), tensors)))


def payload_frames(payload: bytes) -> Iterator[pb.Frame]:
    offset = 0
    while offset < len(payload):
        (size,) = FRAME_LENGTH.unpack_from(payload, offset)
        offset += FRAME_LENGTH.size
        frame = pb.Frame()
        frame.ParseFromString(payload[offset:offset + size])
        offset += size
        yield frame
