"""The syncer shard's write-ahead journal: every event its core takes, on disk before it is answered.

The core is a sans-I/O state machine, so its state is a function of the events it took. A shard saves
its whole state now and then and journals each event since: after a crash it loads the saved state and
replays the journal through the same core, and ends where it was — a push that was acknowledged is
never lost, and one retried after the restart is recognised by its sequence number and counted once.

A record: sequence number (8 bytes), kind length (1), payload length (8), kind, payload, all
little-endian. A record cut short by the crash is the end of the journal.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diloco.transport.frames import message_frames
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

    def append_event(self, kind: str, **fields: Any) -> int:
        return self.append(kind, json.dumps(fields).encode())

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
