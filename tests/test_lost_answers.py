"""An answer lost on the way (a stream that broke mid-answer, or one ended for not reading) is made
again from what the learner says it holds; a claim of more than it was sent changes nothing; whole
answers in flight are bounded per shard, and a reader that does not read gives its slot back."""

import threading
import time

import pytest
import torch

from conftest import tiny_config
from diloco.core import Push, ProtocolError
from diloco.core.events import StreamOpened
from diloco.shard import answer_slots
from diloco.transport import wire_messages as wire_module
from diloco.shard.answer_slots import AnswerSlots
from diloco.shard.journal import decode_event, encode_event
from diloco.client.learner_client import Learner
from diloco.shard.serving import serve
from diloco.shard.ownership import ShardPlan
from diloco.shard.server import SyncerShard
from test_syncer_memory import SIZE, anchors_checked, core_with, settle, tiny_model, train


def pushed(core, m, seq, now, p=0):
    push = Push(m, p, core.held_versions[m][p], seq, {n: torch.full((SIZE,), 1e-3) for n in ("a", "b")},
                tokens=64, steps=1, step=seq)
    return [u for a in core.on_push(push, now) for u in getattr(a, "updates", {}).values()]


# ---------------------------------------------------------------- the core


def test_a_learner_that_lost_its_answer_gets_it_again_from_the_version_it_holds():
    core = core_with(2, "int4", "weighted")
    (first,) = pushed(core, 0, 1, 1.0)
    (lost,) = pushed(core, 0, 2, 2.0)  # sent, never received: learner 0 still holds version 1
    assert core.held_versions[0][0] == 2
    actions = core.handle(StreamOpened(0, ((0, 1), (1, 0))), 3.0)
    (again,) = [u for a in actions for u in getattr(a, "updates", {}).values()]
    assert core.held_versions[0][0] == 2 and again.version == 2 and again.ack_seq == 2
    assert again.relative and again.base_version == 1 and len(again.wire) == 1  # one difference, from version 1
    assert torch.equal(again.values["a"], lost.values["a"])
    holding_all = core.handle(StreamOpened(0, ((0, 2), (1, 0))), 4.0)  # what it was sent: nothing is owed
    assert not [a for a in holding_all if getattr(a, "updates", None)]


def test_a_learner_far_behind_after_a_loss_gets_the_values_whole():
    core = core_with(2, "int4", "weighted")
    for seq in range(1, 40):
        pushed(core, 0, seq, float(seq))
    (again,) = [u for a in core.handle(StreamOpened(0, ((0, 0),)), 50.0) for u in getattr(a, "updates", {}).values()]
    assert not again.relative and torch.equal(again.values["a"], core.held_values(0, 0)["a"])


@pytest.mark.parametrize("holds, reason", [
    (((0, 5),), "claims version 5 of fragment 0; it was sent version 1"),
    (((0, 0), (7, 0)), "claims fragment 7, which is not held here"),
])
def test_a_claim_of_more_than_was_sent_is_refused_and_changes_nothing(holds, reason):
    core = core_with(2, "int4", "weighted")
    pushed(core, 0, 1, 1.0)
    before = {m: dict(v) for m, v in core.held_versions.items()}
    with pytest.raises(ProtocolError, match=reason):
        core.handle(StreamOpened(0, holds), 2.0)
    assert core.held_versions == before


def test_a_learner_with_nothing_pushed_in_this_life_is_owed_no_answer():
    core = core_with(2, "int4", "weighted")
    pushed(core, 1, 1, 1.0)
    actions = core.handle(StreamOpened(0, ((0, 0),)), 2.0)
    assert not [a for a in actions if getattr(a, "updates", None)]


def test_the_claim_is_journaled_and_read_back_as_it_was():
    event = StreamOpened(3, ((0, 4), (2, 9)))
    kind, payload = encode_event(event, 12.5)
    assert decode_event(kind, payload) == (event, 12.5)


# ---------------------------------------------------------------- the slots


def test_whole_answers_in_flight_are_bounded_and_a_slot_is_freed_once():
    slots = AnswerSlots(2)
    first, second = slots.take(lambda: True), slots.take(lambda: True)
    waited = []
    assert slots.take(lambda: not waited.append(1) and len(waited) < 3) is None  # full: waits, gives up
    first.release()
    first.release()  # a second release (the RPC's end after the stream's own) frees nothing more
    third = slots.take(lambda: True)
    assert third is not None and slots.take(lambda: False) is None
    second.release(), third.release()


def test_a_whole_answer_past_its_deadline_ends_its_stream_and_frees_its_slot(monkeypatch):
    monkeypatch.setattr(answer_slots, "MIN_SEND_S", 0.05)
    slots = AnswerSlots(1)
    ended = threading.Event()
    slot = slots.take(lambda: True)
    slot.hold_until_sent(0, ended.set)
    assert ended.wait(5)
    assert slots.take(lambda: True) is not None


# ---------------------------------------------------------------- over real gRPC


@pytest.mark.integration  # a live shard; its update streams break mid-answer
@pytest.mark.parametrize("down", ["fp32", "int4"])
def test_answers_lost_when_streams_break_come_again_and_anchors_stay_exact(tmp_path, monkeypatch, down):
    config = tiny_config("learners.count=2", "outer.H=2", "outer.tau=1", f"codec.down={down}", "strategy=async")
    shard = SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path)
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    breaks = {"left": 4}
    frames = wire_module.message_frames

    def breaking(header, tensors):
        if header.HasField("update") and breaks["left"] > 0:  # taken (journaled), then lost on the way
            breaks["left"] -= 1
            raise ConnectionResetError("the stream broke mid-answer")
        return frames(header, tensors)

    monkeypatch.setattr(wire_module, "message_frames", breaking)
    learners = [Learner(tiny_model(), syncer=address, learner=m) for m in range(2)]
    optimizers = [torch.optim.SGD(lr.model.parameters(), lr=0.05) for lr in learners]
    resumed = None
    try:
        def train_until(done, timeout_s=60.0):
            deadline = time.monotonic() + timeout_s
            while not done() and time.monotonic() < deadline:
                train(learners, optimizers, 1)
                time.sleep(0.02)  # answers take real time to come back
            assert done()

        train_until(lambda: breaks["left"] == 0)
        pushes = {m: shard.core.ledger[m].pushes for m in range(2)}
        # no fragment stays stuck waiting for an answer that never came
        train_until(lambda: all(shard.core.ledger[m].pushes >= pushes[m] + 8 for m in range(2)))
        settle(learners)
        for learner in learners:  # both ends agree on what each learner holds...
            assert learner.core.anchor_versions == [shard.core.held_versions[learner.id][p]
                                                    for p in range(len(learner.fragments))]
        assert anchors_checked(shard, learners) >= 1  # ...bit for bit where the shard still has it
        for learner in learners:  # while the shard still answers: a learner leaving a dead one waits out its bound
            learner.close()
        shard.stop()
        server.stop(0)
        resumed = SyncerShard(config, ShardPlan(0, 1, (address,)), state_dir=tmp_path, resume=True)
        assert resumed.core.held_versions == shard.core.held_versions  # the claims were journaled
    finally:
        for learner in learners:
            learner.close()
        shard.stop()
        server.stop(0)
