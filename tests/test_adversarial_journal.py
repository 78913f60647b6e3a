"""The shard's journal and state files, and learners' checkpoints, under attack: full disks, flipped
bytes, bad lengths, missing or foreign files. Nothing is taken that is not durable, nothing stays on
disk that was refused, damage is found (never skipped), and every refusal is one line, not a traceback."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from diloco.core.events import PushArrived, TimerFired
from diloco.core.refusals import ProtocolError
from diloco.errors import DilocoError
from diloco.shard import journal as journal_module
from diloco.shard.journal import RECORD_HEADER, Journal, JournalCorrupt, JournalHalted, JournalWriteFailed
from diloco.transport.wire_messages import push_of, push_payload

from shard_on_disk import SeededShard, _no_shard_left, flip  # noqa: F401 (an autouse fixture)

integration = pytest.mark.integration  # live shards over real gRPC, or diloco as a process


# ---------------------------------------------------------------- the journal alone


def journal_with(path: Path, count: int) -> list[int]:
    """A journal of `count` records; the byte offset where each begins."""
    journal = Journal(path)
    offsets = []
    for i in range(count):
        offsets.append(journal.size)
        journal.append("TimerFired", f"record {i}".encode() * 8)
    journal.close()
    return offsets


def failing_write(fd: int, data: bytes) -> None:
    """A disk that fills up half-way through a record."""
    os.write(fd, data[:len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_record_that_cannot_be_written_leaves_no_bytes_and_no_leftovers(tmp_path, monkeypatch):
    path = tmp_path / "j"
    journal = Journal(path)
    journal.append("TimerFired", b"first")
    size = path.stat().st_size
    monkeypatch.setattr(journal_module, "_write_all", failing_write)
    with pytest.raises(JournalWriteFailed, match="No space left"):
        journal.append("TimerFired", b"refused" * 100)
    assert path.stat().st_size == size and journal.seq == 1  # cut back: as if never written
    monkeypatch.undo()
    journal.append("TimerFired", b"second")  # nothing of the failed record rides along with it
    assert [(r.seq, r.payload) for r in Journal.scan(path).records] == [(1, b"first"), (2, b"second")]


def test_a_record_whose_fsync_fails_is_cut_back_off(tmp_path, monkeypatch):
    path = tmp_path / "j"
    journal = Journal(path)
    journal.append("TimerFired", b"first")
    size = path.stat().st_size

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DilocoError):
        journal.append("TimerFired", b"refused")
    monkeypatch.undo()
    assert path.stat().st_size == size


def test_a_journal_that_cannot_even_be_cut_back_stops_taking_records(tmp_path, monkeypatch):
    journal = Journal(tmp_path / "j")
    journal.append("TimerFired", b"first")

    def stuck(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal_module, "_write_all", failing_write)
    monkeypatch.setattr(os, "ftruncate", stuck)
    with pytest.raises(JournalHalted, match="takes no more events"):
        journal.append("TimerFired", b"refused")
    monkeypatch.undo()
    with pytest.raises(JournalHalted):  # fail-stop: nothing is written, nothing answered
        journal.append("TimerFired", b"next")


def test_a_flipped_byte_in_the_middle_stops_the_resume_naming_file_and_offset(tmp_path):
    path = tmp_path / "j"
    offsets = journal_with(path, 3)
    flip(path, offsets[1] + RECORD_HEADER.size + 5)  # the payload of record 2; record 3 is whole
    with pytest.raises(JournalCorrupt) as caught:
        Journal.scan(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and f"byte {offsets[1]}" in message


def test_a_flipped_byte_in_the_last_record_is_a_torn_tail_dropped_and_reported(tmp_path):
    path = tmp_path / "j"
    offsets = journal_with(path, 3)
    flip(path, offsets[2] + RECORD_HEADER.size + 5)
    contents = Journal.scan(path)
    assert [r.seq for r in contents.records] == [1, 2]  # what came before is intact
    assert contents.whole_bytes == offsets[2] and contents.torn_bytes == path.stat().st_size - offsets[2]


def test_a_bad_length_field_is_caught_and_does_not_drop_the_records_after_it(tmp_path):
    path = tmp_path / "j"
    offsets = journal_with(path, 3)
    data = bytearray(path.read_bytes())
    data[offsets[1] + 17:offsets[1] + 25] = (10**9).to_bytes(8, "little")  # record 2's payload length
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="header checksum"):
        Journal.scan(path)  # (read as a torn tail, records 2 and 3 — acknowledged — would be gone)


def test_sequence_numbers_that_skip_are_corruption(tmp_path):
    path = tmp_path / "j"
    journal = Journal(path)
    journal.append("TimerFired", b"a")
    journal.seq += 1  # as if record 2 had vanished
    journal.append("TimerFired", b"c")
    with pytest.raises(JournalCorrupt, match="missing or out of order"):
        Journal.scan(path)


# ---------------------------------------------------------------- a real shard


@integration
def test_a_push_refused_for_a_full_disk_is_not_taken_and_is_counted_once_after_a_restart(tmp_path, monkeypatch):
    """ENOSPC on the journal's write during a served Push: the learner sees an error; what was
    acknowledged survives a kill; the learner's resends after the restart are each counted once."""
    first = SeededShard(tmp_path)
    sent = [first.push_message(seq) for seq in (1, 2)]
    first.client.push(*sent[0])  # acknowledged
    journal = tmp_path / "shard-0.journal"
    size = journal.stat().st_size
    monkeypatch.setattr(journal_module, "_write_all", failing_write)
    with pytest.raises(DilocoError):
        first.client.push(*sent[1])  # the disk is full: refused, to be sent again
    monkeypatch.undo()
    assert journal.stat().st_size == size
    assert first.shard.core.ledger[0].pushes == 1  # not taken
    first.kill()

    second = SeededShard(tmp_path, resume=True)
    try:
        entry = second.shard.core.ledger[0]
        assert entry.pushes == 1 and entry.last_seq == 1  # the acknowledged push survived
        for header, encoded in sent:  # the learner sends again what it has no answer for
            second.client.push(header, encoded)
        entry = second.shard.core.ledger[0]
        assert entry.pushes == 2 and entry.duplicates == 1
        assert entry.merged.get(0, 0) + entry.stale.get(0, 0) == 16  # two pushes of 8 tokens, once each
    finally:
        second.kill()


def refused_push(seeded: SeededShard):
    """A push the core refuses: based on a version of Θ that does not exist yet."""
    return seeded.push_message(1, base_version=99)


@integration
def test_an_event_the_core_refuses_leaves_no_journal_record(tmp_path):
    seeded = SeededShard(tmp_path)
    try:
        journal = tmp_path / "shard-0.journal"
        size, before = journal.stat().st_size, [r.seq for r in Journal.scan(journal).records]
        header, tensors = refused_push(seeded)
        with seeded.shard.lock, pytest.raises(ProtocolError):
            seeded.shard.apply(PushArrived(push_of(header, tensors)), seeded.shard.clock.now(),
                               push_payload(header, tensors))
        assert journal.stat().st_size == size
        seeded.client.push(*seeded.push_message(1))  # and the journal goes on, numbered on
        records = Journal.scan(journal).records
        pushed = records[len(before)]  # (then the answer its round closed with, taken by the learner's stream)
        assert [r.seq for r in records[:len(before) + 1]] == [*before, len(before) + 1] and pushed.kind == "PushArrived"
    finally:
        seeded.kill()


def journal_a_refused_push(seeded: SeededShard, then_more: bool) -> None:
    """The journal as a shard leaves it that died between writing a refused record and taking it back
    (`then_more`: and, impossibly, went on journaling after it)."""
    header, tensors = refused_push(seeded)
    with seeded.shard.lock:
        seeded.shard.store.record(PushArrived(push_of(header, tensors)), seeded.shard.clock.now(),
                                  push_payload(header, tensors))
        if then_more:
            seeded.shard.store.record(TimerFired(), seeded.shard.clock.now())


@integration
def test_a_refused_last_record_on_replay_is_dropped(tmp_path, caplog):
    from diloco.shard.server import ShardPlan, SyncerShard

    seeded = SeededShard(tmp_path)
    journal_a_refused_push(seeded, then_more=False)
    seeded.kill()
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        resumed = SyncerShard(seeded.config, ShardPlan(0, 1, ("",)), state_dir=tmp_path, resume=True)
    try:
        assert "refused on replay" in caplog.text and resumed.core.ledger[0].pushes == 0
        records = Journal.scan(tmp_path / "shard-0.journal").records  # cut off; the journal goes on after it
        assert "PushArrived" not in [r.kind for r in records] and records[-1].kind == "SyncerResumed"
        assert [r.seq for r in records] == list(range(1, len(records) + 1))
    finally:
        resumed.stop()


@integration
def test_a_refused_record_in_the_middle_of_a_replay_stops_the_resume(tmp_path):
    from diloco.shard.server import ShardPlan, SyncerShard

    seeded = SeededShard(tmp_path)
    journal_a_refused_push(seeded, then_more=True)
    seeded.kill()
    with pytest.raises(JournalCorrupt, match="refused on replay"):
        SyncerShard(seeded.config, ShardPlan(0, 1, ("",)), state_dir=tmp_path, resume=True)


@integration
def test_a_torn_journal_tail_is_reported_and_what_was_acknowledged_is_kept(tmp_path, caplog):
    from diloco.shard.server import ShardPlan, SyncerShard

    seeded = SeededShard(tmp_path)
    seeded.client.push(*seeded.push_message(1))
    journal = tmp_path / "shard-0.journal"
    whole = Journal.scan(journal).records
    with open(journal, "ab") as file:
        file.write(b"DJR2" + b"\0" * 10)  # a record the crash cut short in its header
    seeded.kill()
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        resumed = SyncerShard(seeded.config, ShardPlan(0, 1, ("",)), state_dir=tmp_path, resume=True)
    try:
        assert "torn tail of 14 bytes" in caplog.text and f"from sequence number {whole[-1].seq + 1}" in caplog.text
        assert resumed.core.ledger[0].pushes == 1
    finally:
        resumed.stop()
