"""What a syncer shard keeps on disk: its whole state now and then, and a journal of every event since.

The core's state is a function of the events it took, so saved state + journal = where it was. The
state file carries its own digest and is written atomically (`state_files.py`: a temporary file,
synced, then a rename); it is loaded with torch.load(weights_only=True) only once the digest matches,
so no code is ever unpickled from it. The journal's records are checked one by one (`journal.py`).

What `--resume` finds decides what happens, never silently:
- a saved state (and the journal after it): the shard continues from it; a state that is damaged,
  unreadable or saved by another shard or config is a one-line error;
- no saved state but the empty journal a shard creates when it starts, and no seeded mark: it was
  stopped before a learner seeded Θ, so there is nothing to lose and it starts fresh (saying so);
- nothing at all, a journal without the state it applies to, a state path that is not a file, or the
  seeded mark without a state: a one-line error.

How a shard knows it never seeded Θ: before its first state is saved (when Θ is seeded), it writes the
seeded mark `shard-N.seeded` next to it, synced, and never removes it. A journal is emptied at every
save, so an empty journal says nothing; the mark does. Only a folder without it can start fresh.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path


from diloco.core.events import SyncerEvent
from diloco.core.messages import Update
from diloco.errors import DilocoError
from diloco.clock import SYSTEM_CLOCK, Clock
from diloco.shard.journal import (QUIET_EVENTS, Journal, JournalCorrupt, JournalError, JournalHalted,
                                    JournalRecord, decode_event, encode_event)
from diloco.state_files import load_checked, save_checked, sync_folder

log = logging.getLogger("diloco.syncer")

RUN_ID_CHARS = 32
"""Hex digits of a run identity (128 random bits)."""
STATE_FORMAT = 2
"""Version of what a state file holds: 2 adds its digest and the identity of the shard that saved it."""


class ShardStore:
    def __init__(self, state_dir: Path, index: int, resume: bool, clock: Clock = SYSTEM_CLOCK,
                 key: bytes | None = None) -> None:
        """Refuses to overwrite another run's saved state unless asked to `resume` it, and refuses to
        `resume` from nothing (see the module's docstring for what starts fresh). `key` seals the state
        file (`state_files.file_key` of the run's secret)."""
        self.state_dir, self.index, self.key = state_dir, index, key
        self.state_path = state_dir / f"shard-{index}.state.pt"
        self.journal_path = state_dir / f"shard-{index}.journal"
        self.seeded_path = state_dir / f"shard-{index}.seeded"
        self.clock = clock
        self.saved = self.state_path.is_file()
        if self.state_path.exists() and not self.saved:
            raise DilocoError(f"{self.state_path} is not a file: the saved state of shard {index} cannot be there; "
                              f"remove what is there, or give another --out")
        journal_bytes = self.journal_path.stat().st_size if self.journal_path.is_file() else None
        if not resume:
            if self.saved:
                raise DilocoError(f"{state_dir} holds the saved state of shard {index}: pass --resume to continue "
                                  f"that run, or give another --out")
            if self.seeded_path.exists():
                raise DilocoError(f"{state_dir} holds {self.seeded_path.name}, the mark of a shard that seeded Θ: "
                                  f"give another --out")
            if journal_bytes:
                raise DilocoError(f"{self.journal_path} holds {journal_bytes} bytes of journal without a saved state: "
                                  f"give another --out, or remove it to start a new run here")
            try:
                self.journal_path.parent.mkdir(parents=True, exist_ok=True)
                self.journal_path.touch()  # the mark that this shard started here: see the module's docstring
            except OSError as exc:
                raise DilocoError(f"cannot keep the state of shard {index} in {state_dir} "
                                  f"({exc.strerror or exc}): give another --out") from None
        elif not self.saved:
            if self.seeded_path.exists():
                raise DilocoError(f"--resume: shard {index} had seeded Θ ({self.seeded_path.name} says so) but "
                                  f"{self.state_path.name} is missing from {state_dir}: restore the state file, or "
                                  f"start the run afresh in another --out")
            if journal_bytes is None:
                raise DilocoError(f"--resume: {state_dir} holds no saved state of shard {index} (no "
                                  f"{self.state_path.name}): nothing to resume; give the --out of the run to "
                                  f"continue, or start without --resume")
            if journal_bytes:
                raise DilocoError(f"--resume: {self.journal_path} holds {journal_bytes} bytes of journal but "
                                  f"{self.state_path.name} is missing, so its events cannot be replayed: restore "
                                  f"the state file, or start the run afresh in another --out")
            log.warning("shard %d: --resume found no saved state in %s, an empty journal and no seeded mark: it "
                        "stopped before Θ was seeded, so it starts fresh and a learner seeds Θ again", index, state_dir)
        self.run_id = self._run_identity(new_run=not resume)
        """The run this shard serves, kept across restarts: what callers' credentials are bound to."""
        self.journal: Journal | None = None
        self.saved_at: float | None = None
        self._cut_journal_at: int | None = None
        """Where the journal is cut before it is written again: a torn tail, or a refused last record."""

    @property
    def halted(self) -> str | None:
        """Why the journal takes no more events, if it stopped."""
        return self.journal.halted if self.journal is not None else None

    def load(self) -> dict | None:
        """The saved state, its digest checked (a one-line DilocoError for a file that cannot be used)."""
        if not self.saved:
            return None
        state = load_checked(self.state_path, f"the saved state of shard {self.index}",
                             "this shard cannot resume from it; restore a good copy, or start the run afresh "
                             "in another --out", self.key)
        if state.get("format") != STATE_FORMAT:
            raise DilocoError(f"the saved state of shard {self.index} {self.state_path} has format "
                              f"{state.get('format')!r}, not {STATE_FORMAT}: it was saved by another version of "
                              f"diloco; resume it with that version, or start afresh in another --out")
        seq = state.get("journal_seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise DilocoError(f"the saved state of shard {self.index} {self.state_path} has no valid journal "
                              f"position ({seq!r}): it cannot be resumed")
        return state

    def journaled_after(self, seq: int) -> list[tuple[JournalRecord, SyncerEvent, float]]:
        """Every journaled event after `seq`, in order, each checked and decoded. A torn tail is dropped
        (one warning); damage before the tail, or a gap after `seq`, is JournalCorrupt."""
        contents = Journal.scan(self.journal_path)
        if contents.torn_bytes:
            first = contents.records[-1].seq + 1 if contents.records else seq + 1
            log.warning("journal %s: dropped a torn tail of %d bytes at byte %d (%s), from sequence number %d "
                        "on: a write the crash cut short; %d whole records kept", self.journal_path,
                        contents.torn_bytes, contents.whole_bytes, contents.torn_problem, first,
                        len(contents.records))
            self._cut_journal_at = contents.whole_bytes
        later = [r for r in contents.records if r.seq > seq]
        if later and later[0].seq != seq + 1:
            raise JournalCorrupt(f"journal {self.journal_path} goes on at sequence number {later[0].seq} but the "
                                 f"saved state ends at {seq}: events {seq + 1}..{later[0].seq - 1} are missing")
        events = []
        for record in later:
            try:
                events.append((record, *decode_event(record.kind, record.payload)))
            except Exception as exc:  # noqa: BLE001 — checksummed yet unreadable: written by something else
                raise JournalCorrupt(f"journal {self.journal_path}: record {record.seq} at byte {record.offset} "
                                     f"({record.kind}) cannot be read back ({type(exc).__name__}: {exc})") from None
        return events

    def drop_from(self, record: JournalRecord) -> None:
        """Cut the journal before `record` when it is opened again (a refused last record)."""
        self._cut_journal_at = record.offset

    def open(self, last_seq: int) -> None:
        if self._cut_journal_at is not None and self.journal_path.is_file():
            with open(self.journal_path, "r+b") as file:
                file.truncate(self._cut_journal_at)
            self._cut_journal_at = None
        self.journal = Journal(self.journal_path, last_seq)

    def record(self, event: SyncerEvent, now: float, push_frames: bytes = b"") -> None:
        """On disk before the event is answered (reports and heartbeats: with the next one that is).
        Raises JournalWriteFailed (nothing written: the event must not be taken) or JournalHalted."""
        kind, payload = encode_event(event, now, push_frames)
        halted_before = self.journal.halted
        try:
            self.journal.append(kind, payload, durable=not isinstance(event, QUIET_EVENTS))
        except JournalHalted:
            if halted_before is None:
                log.critical("%s", self.journal.halted)  # the one line that says why; each event after is refused
            raise

    def rollback(self) -> None:
        """Take back the event just recorded: the core refused it."""
        try:
            self.journal.rollback()
        except JournalHalted:
            log.critical("%s", self.journal.halted)
            raise

    def halt(self, why: str) -> None:
        """Journal nothing more: every event from now on is refused (fail-stop), said in one line."""
        self.journal.halted = (f"journal {self.journal_path}: {why}; this shard takes no more events: restart it "
                               f"with --resume")
        log.critical("%s", self.journal.halted)

    def save(self, state: dict) -> None:
        """The whole state, with its digest, atomically; the journal then starts empty (its numbers go
        on). OSError (a full disk) leaves the old state and the journal as they were."""
        state = {**state, "journal_seq": self.journal.seq, "format": STATE_FORMAT}
        self._mark_seeded()
        save_checked(state, self.state_path, self.key)
        self.saved = True
        try:
            self.journal.truncate()
        except JournalError as exc:  # harmless: a replay skips records the state already holds
            log.warning("%s", exc)
        self.saved_at = self.clock.now()

    def _run_identity(self, new_run: bool) -> str:
        """The run identity in `shard-N.run`: kept when resuming, a new random one for a new run."""
        path = self.state_dir / f"shard-{self.index}.run"
        if not new_run and path.is_file():
            run = path.read_text(errors="replace").strip()
            if len(run) == RUN_ID_CHARS and all(c in "0123456789abcdef" for c in run):
                return run
        run = secrets.token_hex(RUN_ID_CHARS // 2)
        try:
            with open(path, "w") as file:
                file.write(run + "\n")
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:
            raise DilocoError(f"cannot keep the run identity of shard {self.index} in {path} "
                              f"({exc.strerror or exc}): give another --out") from None
        sync_folder(self.state_dir)
        return run

    def _mark_seeded(self) -> None:
        """The seeded mark, on disk before the first state is: from now on this shard cannot start fresh."""
        if self.seeded_path.exists():
            return
        with open(self.seeded_path, "wb") as file:
            file.write(b"this shard seeded its parameters: resume it only from its saved state\n")
            file.flush()
            os.fsync(file.fileno())
        sync_folder(self.state_dir)

    def age_s(self) -> float | None:
        return None if self.saved_at is None else self.clock.now() - self.saved_at


def plain_update(notice: Update) -> dict:
    """The notice of an answer not yet sent, as plain data, to save."""
    return {"fragment": notice.fragment, "version": notice.version, "ack_seq": notice.ack_seq,
            "next_push_at": notice.next_push_at}


def update_of(plain: dict) -> Update:
    return Update(plain["fragment"], plain["version"], {}, ack_seq=plain["ack_seq"],
                  next_push_at=plain["next_push_at"])
