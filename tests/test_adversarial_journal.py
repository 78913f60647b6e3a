"""The shard's journal and state files, and learners' checkpoints, under attack: full disks, flipped
bytes, bad lengths, missing or foreign files. Nothing is taken that is not durable, nothing stays on
disk that was refused, damage is found (never skipped), and every refusal is one line, not a traceback."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, retire_update_stream, tiny_config
from diloco.core.events import PushArrived, TimerFired
from diloco.core.rounds import ProtocolError
from diloco.errors import DilocoError
from diloco.shard import journal as journal_module
from diloco.client.checkpoints import read_checkpoint
from diloco.shard.journal import (RECORD_HEADER, Journal, JournalCorrupt, JournalHalted, JournalWriteFailed,
                                    push_of, push_payload)
from diloco.state_files import TRAILER, save_checked

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


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


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


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


class SeededShard:
    """A shard with a state folder, served, its Θ seeded by a learner that only sends by hand."""

    running: list[SeededShard] = []
    """Not killed yet: a test that fails half-way leaves no server behind (`_no_shard_left`)."""

    def __init__(self, state_dir: Path, resume: bool = False, address: str | None = None) -> None:
        from diloco.client.learner_client import Learner
        from diloco.shard.server import ShardPlan, SyncerShard, serve
        from diloco.transport.calls import ShardClient

        self.config = tiny_config("learners.count=1", "outer.fragments=1", "outer.H=4")
        self.shard = SyncerShard(self.config, ShardPlan(0, 1, ("",)), state_dir=state_dir, resume=resume)
        self.server, port = serve(self.shard, address or "127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.shard.plan = ShardPlan(0, 1, (self.address,))
        self.learner = None
        if not resume:
            self.learner = Learner(tiny_model(), syncer=self.address, learner=0)
            self.learner._halt.set()  # this learner only sends by hand here, and takes no answers:
            retire_update_stream(self.shard, 0)
        self.client = ShardClient(self.address)
        SeededShard.running.append(self)

    def push_message(self, seq: int, value: float = 0.01, base_version: int | None = None):
        from diloco.transport.frames import encode_fp32, tensor_header
        from diloco.v1 import diloco_pb2 as pb

        names = [n for n in self.shard.core.theta]
        encoded = encode_fp32({n: torch.full_like(self.shard.core.theta[n], value * seq) for n in names})
        version = self.shard.core.version(0) if base_version is None else base_version
        header = pb.PushHeader(learner=0, fragment=0, base_version=version, seq=seq, tokens=8, steps=1, step=seq,
                               step_time_s=0.1, tensors=[tensor_header(n, encoded[n]) for n in names])
        return header, encoded

    def kill(self) -> None:
        """As SIGKILL: nothing more is saved (the journal is what is on disk)."""
        self.client.close()
        self.shard.stop()
        self.server.stop(0)
        if self in SeededShard.running:
            SeededShard.running.remove(self)


@pytest.fixture(autouse=True)
def _no_shard_left():
    yield
    for shard in list(SeededShard.running):
        shard.kill()


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
        assert [r.seq for r in Journal.scan(tmp_path / "shard-0.journal").records] == []  # cut off, state saved
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


# ---------------------------------------------------------------- the state file


@pytest.fixture
def saved_state(tmp_path) -> tuple[Path, object]:
    """A state folder holding a seeded shard's saved state (and the config it ran with)."""
    seeded = SeededShard(tmp_path)
    seeded.client.push(*seeded.push_message(1))
    seeded.shard.save_state()
    seeded.kill()
    return tmp_path, seeded.config


def resume_error(state_dir: Path, config, shards: int = 1) -> str:
    from diloco.shard.server import ShardPlan, SyncerShard

    with pytest.raises(DilocoError) as caught:
        SyncerShard(config, ShardPlan(0, shards, ("",) * shards), state_dir=state_dir, resume=True)
    message = str(caught.value)
    assert "\n" not in message
    return message


@integration
def test_a_flipped_byte_in_the_state_file_is_refused(saved_state):
    state_dir, config = saved_state
    path = state_dir / "shard-0.state.pt"
    flip(path, path.stat().st_size // 2)
    assert "is damaged" in resume_error(state_dir, config) and str(path) in resume_error(state_dir, config)


@integration
def test_a_cut_short_or_unchecked_state_file_is_refused(saved_state):
    state_dir, config = saved_state
    path = state_dir / "shard-0.state.pt"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - TRAILER.size])  # as an older diloco wrote it, or cut short
    assert "has no checksum" in resume_error(state_dir, config)
    path.write_bytes(data[:100])
    assert "state of shard 0" in resume_error(state_dir, config)


@integration
def test_a_state_file_holding_pickled_objects_is_refused_in_one_line(saved_state):
    state_dir, config = saved_state
    save_checked({"format": 2, "journal_seq": 0, "payload": Path("/etc/passwd")}, state_dir / "shard-0.state.pt")
    assert "refused to unpickle" in resume_error(state_dir, config)


@integration
def test_a_state_file_with_non_finite_theta_or_wrong_shapes_is_refused(saved_state):
    state_dir, config = saved_state
    path = state_dir / "shard-0.state.pt"
    state = torch.load(path, weights_only=True)
    name = next(iter(state["core"]["theta"]))
    good = state["core"]["theta"][name]
    state["core"]["theta"][name] = torch.full_like(good, 1e38) * 10  # overflows to Inf
    save_checked(state, path)
    assert "NaN or Inf" in resume_error(state_dir, config)
    state["core"]["theta"][name] = torch.zeros(good.numel() + 1)
    save_checked(state, path)
    assert "shape" in resume_error(state_dir, config)


@integration
def test_a_state_file_rewritten_with_a_huge_theta_and_its_checksum_recomputed_is_refused(saved_state):
    state_dir, config = saved_state  # no run secret: the checksum is unkeyed, so the values are checked
    path = state_dir / "shard-0.state.pt"
    state = torch.load(path, weights_only=True)
    name = next(iter(state["core"]["theta"]))
    state["core"]["theta"][name] = torch.full_like(state["core"]["theta"][name], 3e38)
    save_checked(state, path)
    assert "RMS" in resume_error(state_dir, config)


@integration
def test_a_state_file_of_another_config_or_shard_count_is_refused(saved_state):
    state_dir, _ = saved_state
    other = tiny_config("learners.count=2", "outer.fragments=1", "outer.H=4")
    message = resume_error(state_dir, other)
    assert "other settings" in message and "learners differ" in message
    two_shards = tiny_config("learners.count=1", "outer.fragments=2", "outer.H=4")
    assert "with shards 1, but this one has 2" in resume_error(state_dir, two_shards, shards=2)


@integration
def test_resume_with_nothing_to_resume_is_an_error_but_a_shard_never_seeded_starts_fresh(tmp_path):
    from diloco.shard.server import ShardPlan, SyncerShard

    config = tiny_config("learners.count=1", "outer.fragments=1")
    assert "holds no saved state" in resume_error(tmp_path / "empty", config)
    SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path / "early").stop()  # killed before Init
    early = SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path / "early", resume=True)
    assert early.core is None
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "shard-0.journal").write_bytes(b"x" * 40)
    assert "cannot be replayed" in resume_error(tmp_path / "orphan", config)


# ---------------------------------------------------------------- through the CLI: one line, no traceback


def diloco_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), done.stderr[-2000:]


@integration
def test_syncer_resume_without_state_says_so_in_one_line(tmp_path):
    done = diloco_cli("syncer", "--out", str(tmp_path), "--resume", "--bind", "127.0.0.1:0")
    assert_one_line_error(done, "--resume", "no saved state")


@integration
def test_syncer_resume_from_a_damaged_state_file_says_so_in_one_line(saved_state):
    state_dir, _ = saved_state
    out = state_dir.parent / "run"
    (out / "syncer").mkdir(parents=True)
    path = out / "syncer" / "shard-0.state.pt"
    path.write_bytes((state_dir / "shard-0.state.pt").read_bytes())
    flip(path, 200)
    done = diloco_cli("syncer", *[x for o in ["learners.count=1", "outer.fragments=1", "outer.H=4"]
                                  for x in ("--set", o)], "--out", str(out), "--resume", "--bind", "127.0.0.1:0")
    assert_one_line_error(done, str(path), "damaged")


def learner_checkpoint(out: Path, **changes) -> Path:
    path = out / "checkpoints" / "learner-0.pt"
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": []}, "data": {"learner": 0, "epoch": 0,
                                                                                   "index": 0}, "steps": 3}
    state.update(changes)
    save_checked(state, path)
    return path


@integration
@pytest.mark.parametrize("damage, words", [
    ("flipped", ["learner-0.pt", "damaged"]),
    ("pickled", ["learner-0.pt", "refused to unpickle"]),
    ("steps", ["learner-0.pt", "1000000000000 steps"]),
])
def test_a_bad_learner_checkpoint_is_one_line_through_the_cli(tmp_path, damage, words):
    if damage == "flipped":
        path = learner_checkpoint(tmp_path)
        flip(path, 64)
    elif damage == "pickled":
        learner_checkpoint(tmp_path, data=Path("/etc/passwd"))
    else:
        learner_checkpoint(tmp_path, steps=10**12)
    done = diloco_cli("learner", "--no-sync", "--id", "0", "--out", str(tmp_path), "-q",
                      *[x for o in TINY for x in ("--set", o)])
    assert_one_line_error(done, *words)


def test_a_learner_checkpoint_for_other_parameters_is_refused(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(3)
    path = learner_checkpoint(tmp_path, optimizer=saved)
    with pytest.raises(DilocoError, match="shape"):
        read_checkpoint(path, 100, optimizer)
    saved["state"][0]["exp_avg"] = torch.full((8, 4), float("nan"))
    path = learner_checkpoint(tmp_path, optimizer=saved)
    with pytest.raises(DilocoError, match="NaN"):
        read_checkpoint(path, 100, optimizer)
