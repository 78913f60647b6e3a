"""The syncer shard's write-ahead journal: every event its core takes, on disk before it is answered.

The core is a sans-I/O state machine, so its state is a function of the events it took. A shard saves
its whole state now and then and journals each event since: after a crash it loads the saved state and
replays the journal through the same core, and ends where it was — a push that was acknowledged is
never lost, and one retried after the restart is recognised by its sequence number and counted once.

A record, all little-endian: a header of 29 bytes — marker `DJR2` (4), CRC-32 of the rest of the
header (4), sequence number (8), kind length (1), payload length (8), CRC-32 of kind and payload (4) —
then the kind, then the payload. The header's own checksum covers the lengths, so a damaged length is
caught before it is trusted. Sequence numbers go up by one from record to record (a gap is damage).
The records are the core's own typed events (`core/events.py`): the kind is the event's type, the
payload the time it was taken (8 bytes) and its fields (a push as the frames it arrived in, anything
else as JSON).

Writing: one unbuffered write per record, then fsync (heartbeats and progress reports, which decide
nothing, ride on the next record's fsync). A record is whole on disk before its event is answered, or
gone: if the write or the fsync fails (a full disk), the file is cut back to where the record began
and the caller is told (`JournalWriteFailed`); a record whose event the core then refuses is taken
back the same way (`rollback`). If even cutting back fails, the journal stops taking records
(`JournalHalted`): the shard must not answer anything it could not journal.

Reading (`scan`): a record that fails its checks with no good record after it is the tail a crash
cut short: it is dropped and reported. A bad record with good ones after it is damage in the middle:
`JournalCorrupt`, naming the file and the byte offset, never a silent skip.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco.core.events import (AnswerTaken, HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived,
                                PushArrived, PushesArrived, StreamLost, StreamOpened, SyncerEvent, SyncerResumed,
                                TimerFired)
from diloco.core.messages import Progress
from diloco.errors import DilocoError
from diloco.transport.frames import read_message
from diloco.transport.wire_messages import payload_frames, push_of

RECORD_MARK = b"DJR2"
RECORD_HEADER = struct.Struct("<4sIQBQI")
"""Marker, header CRC (over the 21 bytes after it), sequence number, kind length, payload length,
CRC of kind + payload."""
HEADER_CHECKED_FROM = 8


class JournalError(DilocoError):
    """The journal cannot be written or trusted; the message says which file and why."""


class JournalWriteFailed(JournalError):
    """A record could not be made durable (a full disk, an I/O error) and was cut back off the file:
    its event was not taken, and the sender may try again."""


class JournalHalted(JournalError):
    """A failed record could not even be cut back off: the shard takes no more events."""


class JournalCorrupt(JournalError):
    """A record in the middle of the journal is damaged, or records are missing: resuming from it
    would not rebuild the state the shard had."""


@dataclass(frozen=True)
class JournalRecord:
    seq: int
    kind: str
    payload: bytes
    offset: int
    """Where the record begins in the file: the file cut here holds exactly the records before it."""


@dataclass(frozen=True)
class JournalContents:
    records: list[JournalRecord]
    whole_bytes: int
    """Where the last whole record ends."""
    torn_bytes: int = 0
    """Bytes after it that are no record: a tail the crash cut short (or damaged), dropped."""
    torn_problem: str = ""


def encode_record(seq: int, kind: str, payload: bytes) -> bytes:
    name = kind.encode()
    body_crc = zlib.crc32(payload, zlib.crc32(name))
    checked = RECORD_HEADER.pack(RECORD_MARK, 0, seq, len(name), len(payload), body_crc)[HEADER_CHECKED_FROM:]
    return RECORD_MARK + struct.pack("<I", zlib.crc32(checked)) + checked + name + payload


def _write_all(fd: int, data: bytes) -> None:
    """All of `data`, unbuffered: nothing is left behind in a buffer to reach the file later."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "the write made no progress")
        view = view[written:]


class Journal:
    def __init__(self, path: Path, last_seq: int = 0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.seq = last_seq
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.size = os.fstat(self._fd).st_size
        self._before_last: tuple[int, int] | None = None
        """(file size, sequence number) before the last record: what `rollback` returns to."""
        self.halted: str | None = None
        """Why the journal takes no more records, once a failed record could not be cut back off."""

    def append(self, kind: str, payload: bytes, durable: bool = True) -> int:
        """Write one record, on disk before this returns when `durable` (a later durable record makes
        the earlier ones durable too); return its sequence number. On failure the file is as before."""
        if self.halted is not None:
            raise JournalHalted(self.halted)
        seq, start = self.seq + 1, self.size
        record = encode_record(seq, kind, payload)
        try:
            _write_all(self._fd, record)
            if durable:
                os.fsync(self._fd)
        except OSError as exc:
            self._cut_back(start, f"record {seq} failed ({exc.strerror or exc})")
            raise JournalWriteFailed(f"journal {self.path}: could not write record {seq} "
                                     f"({exc.strerror or exc}); the event was not taken") from None
        self.seq, self.size, self._before_last = seq, start + len(record), (start, self.seq)
        return seq

    def rollback(self) -> None:
        """Take back the last record (its event was refused): the file and numbering are as before it."""
        if self._before_last is None:
            raise JournalError(f"journal {self.path}: no record to take back")
        size, seq = self._before_last
        self._cut_back(size, f"record {self.seq} was refused")
        self.seq, self._before_last = seq, None

    def _cut_back(self, size: int, why: str) -> None:
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as exc:
            self.halted = (f"journal {self.path}: {why} and could not be cut back to byte {size} "
                           f"({exc.strerror or exc}); this shard takes no more events: restart it with --resume")
            raise JournalHalted(self.halted) from None
        self.size = size

    def truncate(self) -> None:
        """Everything journaled so far is in the saved state: start an empty journal (numbers go on)."""
        self._before_last = None
        try:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
        except OSError as exc:  # the saved state holds these records: a replay skips them
            raise JournalError(f"journal {self.path}: could not empty it after a save "
                               f"({exc.strerror or exc}); its records are in the saved state") from None
        finally:
            self.size = os.fstat(self._fd).st_size

    def close(self) -> None:
        os.close(self._fd)

    @staticmethod
    def scan(path: Path) -> JournalContents:
        """Every whole record, checked, and what was dropped from the tail; JournalCorrupt for damage
        that is not at the tail, or sequence numbers that do not go up by one."""
        data = path.read_bytes() if path.is_file() else b""
        view = memoryview(data)
        records: list[JournalRecord] = []
        offset = 0
        while offset < len(data):
            record, problem = _record_at(view, offset)
            if record is None:
                later = _next_header(view, offset + 1)
                if later is not None:
                    after = f"after sequence number {records[-1].seq}" if records else "its first record"
                    raise JournalCorrupt(f"journal {path} is damaged at byte {offset} ({after}: {problem}) and "
                                         f"whole records follow at byte {later}: refusing to resume from it")
                return JournalContents(records, offset, len(data) - offset, problem)
            if records and record.seq != records[-1].seq + 1:
                raise JournalCorrupt(f"journal {path}: the record at byte {offset} has sequence number "
                                     f"{record.seq} after {records[-1].seq}: records are missing or out of order")
            records.append(record)
            offset += RECORD_HEADER.size + len(record.kind.encode()) + len(record.payload)
        return JournalContents(records, offset)

    @staticmethod
    def read(path: Path) -> Iterator[tuple[int, str, bytes]]:
        """(sequence number, kind, payload) of every whole record, in order."""
        for record in Journal.scan(path).records:
            yield record.seq, record.kind, record.payload


def _header_at(view: memoryview, offset: int) -> tuple[tuple | None, str]:
    """The header at `offset` if it is whole and its checksum holds, else why not."""
    if len(view) - offset < RECORD_HEADER.size:
        return None, f"{len(view) - offset} bytes, less than a record header"
    fields = RECORD_HEADER.unpack_from(view, offset)
    if fields[0] != RECORD_MARK:
        return None, "no record marker"
    if zlib.crc32(view[offset + HEADER_CHECKED_FROM:offset + RECORD_HEADER.size]) != fields[1]:
        return None, "header checksum mismatch"
    return fields, ""


def _record_at(view: memoryview, offset: int) -> tuple[JournalRecord | None, str]:
    fields, problem = _header_at(view, offset)
    if fields is None:
        return None, problem
    _, _, seq, name_len, payload_len, body_crc = fields
    start = offset + RECORD_HEADER.size
    end = start + name_len + payload_len
    if end > len(view):
        return None, f"record {seq} is cut short ({len(view) - offset} of {end - offset} bytes)"
    if zlib.crc32(view[start:end]) != body_crc:
        return None, f"record {seq}: payload checksum mismatch"
    try:
        kind = bytes(view[start:start + name_len]).decode()
    except UnicodeDecodeError:
        return None, f"record {seq}: its kind is not text"
    return JournalRecord(seq, kind, bytes(view[start + name_len:end]), offset), ""


def _next_header(view: memoryview, start: int) -> int | None:
    """The offset of the next whole, checked header at or after `start`, if any."""
    data = view.obj
    offset = data.find(RECORD_MARK, start)
    while offset != -1:
        if _header_at(view, offset)[0] is not None:
            return offset
        offset = data.find(RECORD_MARK, offset + 1)
    return None


NOW = struct.Struct("<d")
GROUP_LENGTH = struct.Struct("<Q")
PLAIN_EVENTS = {cls.__name__: cls for cls in (HeartbeatArrived, TimerFired, LearnerLeft, LearnerRejoined,
                                              AnswerTaken, StreamOpened, StreamLost, SyncerResumed)}
QUIET_EVENTS = (ProgressArrived, HeartbeatArrived)
"""Events that need not be on disk before they are answered: the next event that is (every event that
decides something) makes them durable too, being later in the same file."""


def encode_event(event: SyncerEvent, now: float, push_frames: bytes = b"") -> tuple[str, bytes]:
    """(kind, payload) of one event; a push travels as the frames it arrived in (`push_payload`)."""
    if isinstance(event, (PushArrived, PushesArrived)):  # a group: `group_payload` of its pushes' frames
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
    if kind == "PushesArrived":
        pushes = []
        for frames in group_members(body):
            header, tensors = read_message(payload_frames(frames), "push", limit=1 << 40)
            pushes.append(push_of(header, tensors))
        return PushesArrived(tuple(pushes)), now
    fields = json.loads(body)
    if kind == "ProgressArrived":
        return ProgressArrived(Progress(**{**fields, "due_in_s": tuple(fields["due_in_s"])})), now
    if kind == "LearnerRejoined" and fields["fragments"] is not None:
        fields["fragments"] = tuple(fields["fragments"])
    if kind == "StreamOpened":
        fields["holds"] = tuple((int(p), int(v)) for p, v in fields["holds"])
    if kind not in PLAIN_EVENTS:
        raise ValueError(f"unknown journal event {kind!r}")
    return PLAIN_EVENTS[kind](**fields), now


def group_payload(pushes: list[bytes]) -> bytes:
    """One journal record for a group of pushes (`PushesArrived`): each push's frames, length-prefixed.
    Replaying the group as one event takes the same decisions the live shard took."""
    return b"".join(GROUP_LENGTH.pack(len(p)) + p for p in pushes)


def group_members(body: bytes) -> Iterator[bytes]:
    offset = 0
    while offset < len(body):
        (size,) = GROUP_LENGTH.unpack_from(body, offset)
        offset += GROUP_LENGTH.size
        yield body[offset:offset + size]
        offset += size
