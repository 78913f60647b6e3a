"""What a syncer shard keeps on disk: its whole state now and then, and a journal of every event since.

The core's state is a function of the events it took, so saved state + journal = where it was. The
state file is written atomically (a temporary file, then a rename) and loaded with
torch.load(weights_only=True): no code is ever unpickled from it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from diloco.codecs import Encoded
from diloco.core.events import SyncerEvent
from diloco.core.messages import Update
from diloco.errors import DilocoError
from diloco.clock import SYSTEM_CLOCK, Clock
from diloco.runtime.journal import QUIET_EVENTS, Journal, decode_event, encode_event


class ShardStore:
    def __init__(self, state_dir: Path, index: int, resume: bool, clock: Clock = SYSTEM_CLOCK) -> None:
        """Refuses to overwrite another run's saved state unless asked to `resume` it."""
        self.state_path = state_dir / f"shard-{index}.state.pt"
        self.journal_path = state_dir / f"shard-{index}.journal"
        self.clock = clock
        self.saved = self.state_path.is_file()  # none yet: killed before Θ was seeded, nothing to resume
        if self.saved and not resume:
            raise DilocoError(f"{state_dir} holds the saved state of shard {index}: pass --resume to continue "
                              f"that run, or give another --out")
        self.journal: Journal | None = None
        self.saved_at: float | None = None

    def load(self) -> dict | None:
        return torch.load(self.state_path, weights_only=True) if self.saved else None

    def events_after(self, seq: int) -> Iterator[tuple[int, SyncerEvent, float]]:
        """(number, event, time) of every journaled event after `seq`, in order."""
        for number, kind, payload in Journal.read(self.journal_path):
            if number > seq:
                yield (number, *decode_event(kind, payload))

    def open(self, last_seq: int) -> None:
        self.journal = Journal(self.journal_path, last_seq)

    def record(self, event: SyncerEvent, now: float, push_frames: bytes = b"") -> None:
        """On disk before the event is answered (reports and heartbeats: with the next one that is)."""
        kind, payload = encode_event(event, now, push_frames)
        self.journal.append(kind, payload, durable=not isinstance(event, QUIET_EVENTS))

    def save(self, state: dict) -> None:
        """The whole state, atomically; the journal then starts empty (its numbers go on)."""
        state = {**state, "journal_seq": self.journal.seq}
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)
        self.journal.truncate()
        self.saved_at = self.clock.now()

    def age_s(self) -> float | None:
        return None if self.saved_at is None else self.clock.now() - self.saved_at


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def plain_update(update: Update) -> dict:
    """An answer as tensors and plain data, to save."""
    return {"fragment": update.fragment, "version": update.version, "ack_seq": update.ack_seq,
            "payload_bytes": update.payload_bytes, "relative": update.relative, "next_push_at": update.next_push_at,
            "values": dict(update.values),
            "wire": {n: {"codec": e.codec, "shape": list(e.shape), "block": e.block,
                         "payload": _bytes_tensor(e.payload), "scales": _bytes_tensor(e.scales)}
                     for n, e in update.wire.items()}}


def update_of(plain: dict) -> Update:
    wire = {n: Encoded(w["codec"], tuple(w["shape"]), w["block"], bytes(w["payload"].numpy()),
                       bytes(w["scales"].numpy())) for n, w in plain["wire"].items()}
    return Update(plain["fragment"], plain["version"], dict(plain["values"]), ack_seq=plain["ack_seq"],
                  payload_bytes=plain["payload_bytes"], wire=wire, relative=plain["relative"],
                  next_push_at=plain["next_push_at"])
