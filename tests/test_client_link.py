"""The client link alone, over fake shards that fail on purpose: pushes delivered once each and in order
through unavailable shards, refusals handed back, update streams reopened after a break claiming what
was received whole, answers in several messages put back together, and a bounded give-up at close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco.client import link as link_module
from diloco.client.joining import ShardLink
from diloco.client.link import ClientLink, HeartbeatOut, LeaveOut, LinkHandlers, ProgressOut, PushOut, ShardWays
from diloco.codecs import get_codec
from diloco.core.messages import Progress, Push
from diloco.errors import DilocoError
from diloco.transport.calls import SyncerUnavailable
from diloco.transport.frames import encode_fp32, tensor_header
from diloco.v1 import diloco_pb2 as pb

ANCHOR = {"w": torch.zeros(4)}


class FakeShard:
    """A shard client that records what it is told; `unavailable` calls fail before one gets through;
    `sessions`: per update stream opened, the messages it yields, then None (it ends) or an exception."""

    def __init__(self, unavailable: int = 0, refuse: set[int] = frozenset(), sessions: list | None = None,
                 beats_hang: threading.Event | None = None) -> None:
        self.unavailable, self.refuse = unavailable, set(refuse)
        self.beats_hang = beats_hang
        """Set: a heartbeat call hangs until it is (a partitioned shard: the call waits for its deadline)."""
        self.pushes: list[int] = []
        self.leaves: list[bool] = []
        self.reports: list[tuple] = []
        self.claims: list[dict[int, int]] = []
        self.sessions = list(sessions or [])
        self.cancelled = threading.Event()
        self.idle = threading.Event()
        """Set once a stream has handed over all its messages (the reader has taken each in turn)."""
        self.lock = threading.Lock()
        self.link_up = threading.Event()
        """Whether the channel holds a connection (`ShardClient.connected`): set, calls fail over a standing one."""
        self.link_up.set()

    @property
    def connected(self) -> bool:
        return self.link_up.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self.link_up.wait(timeout_s)

    def push(self, header: pb.PushHeader, tensors: dict) -> pb.PushReply:
        with self.lock:
            if self.unavailable:
                self.unavailable -= 1
                raise SyncerUnavailable("the shard is restarting")
            if header.seq in self.refuse:
                raise DilocoError("refused push: an outlier")
            self.pushes.append(header.seq)
        return pb.PushReply()

    def heartbeat(self, learner: int, tokens: int, steps: int, step_time_s: float = 0.0,
                  due_in_s: tuple = ()) -> pb.HeartbeatReply:
        if self.beats_hang is not None:
            self.beats_hang.wait(30)
        self.reports.append((tokens, steps, tuple(due_in_s)))
        return pb.HeartbeatReply(stop=tokens >= 1000)

    def leave(self, learner: int, finished: bool = False) -> None:
        self.leaves.append(finished)

    def updates(self, learner: int, holds: dict[int, int]):
        self.claims.append(dict(holds))
        self.cancelled.clear()
        session = self.sessions.pop(0) if self.sessions else []
        for item in session:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, threading.Event):  # the test lets the rest of the stream come
                item.wait(30)
                continue
            yield item
        if not session or session[-1] is not None:  # an idle stream: open until cancelled
            self.idle.set()
            self.cancelled.wait(30)

    def cancel_updates(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        self.cancelled.set()


def answer(fragment: int, version: int, value: float, *, relative: bool = False, base_version: int = 0,
           continued: bool = False, ack_seq: int = 0):
    encoded = encode_fp32({"w": torch.full((4,), value)})
    header = pb.UpdateHeader(fragment=fragment, version=version, ack_seq=ack_seq, continued=continued,
                             base_version=base_version, tensors=[tensor_header("w", encoded["w"], relative)])
    return header, encoded


def push(seq: int, fragment: int = 0) -> Push:
    return Push(0, fragment, 0, seq, {"w": torch.full((4,), float(seq))}, tokens=8, steps=1, step=seq)


def open_link(*shards: FakeShard, **handlers) -> tuple[ClientLink, dict]:
    seen = {"refused": [], "stop": 0, "failed": []}
    links = [ShardLink(i, shard, [i]) for i, shard in enumerate(shards)]
    link = ClientLink(0, "learner 0", links, {p: 0 for p in range(len(shards))},
                      ShardWays([None], per_shard=False), ShardWays([None], per_shard=False))
    codec = get_codec("fp32")
    given = dict(encode=lambda deltas: {n: codec.encode(d) for n, d in deltas.items()}, anchors=lambda p: ANCHOR,
                 refused=seen["refused"].append, stop=lambda: seen.__setitem__("stop", seen["stop"] + 1),
                 beat=lambda: [], failed=seen["failed"].append)
    link.start(LinkHandlers(**{**given, **handlers}), name="test")
    return link, seen


def wait_for(done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_pushes_reach_a_shard_that_is_unavailable_at_first_once_each_and_in_order():
    shard = FakeShard(unavailable=3)
    link, seen = open_link(shard)
    for seq in range(1, 6):
        link.send(PushOut(push(seq)))
    link.send(ProgressOut(Progress(0, 5, 40, 0.1, (0.5,))))
    link.send(LeaveOut(finished=True))
    link.close()
    assert shard.pushes == [1, 2, 3, 4, 5]
    assert shard.reports == [(40, 5, (0.5,))] and shard.leaves == [True]  # after the pushes, on the same link
    assert link.error is None and not seen["failed"]
    assert link.up.messages == 7


def test_a_refused_push_is_handed_back_and_the_next_ones_still_go():
    shard = FakeShard(refuse={2})
    link, seen = open_link(shard)
    for seq in (1, 2, 3):
        link.send(PushOut(push(seq)))
    link.close()
    assert shard.pushes == [1, 3]
    assert [p.seq for p in seen["refused"]] == [2]
    assert link.error is None


def test_a_report_answered_with_stop_tells_the_client():
    shard = FakeShard()
    link, seen = open_link(shard)
    link.send(HeartbeatOut(tokens=2000, step=3))
    link.close()
    assert seen["stop"] == 1 and shard.reports == [(2000, 3, ())]


def test_a_broken_update_stream_is_reopened_claiming_what_was_received_whole(monkeypatch):
    monkeypatch.setattr(link_module, "RECONNECT_S", 0.01)
    shard = FakeShard(sessions=[[answer(0, 1, 1.0), SyncerUnavailable("the stream broke")],
                                [answer(0, 2, 2.0)]])
    link, _ = open_link(shard)
    try:
        wait_for(lambda: len(link.arrivals) == 2)
        versions = [(a.update.version, float(a.update.values["w"][0])) for a in link.arrivals.ready()]
        assert versions == [(1, 1.0), (2, 2.0)]
        assert shard.claims[:2] == [{0: 0}, {0: 1}]
        assert link.received == {0: 2}
    finally:
        link.close()


def test_a_lost_answer_is_not_applied_and_the_reopened_stream_claims_the_version_held(monkeypatch):
    monkeypatch.setattr(link_module, "RECONNECT_S", 0.01)
    lost = answer(0, 3, 0.5, relative=True, base_version=2)  # the answer making version 2 never came
    shard = FakeShard(sessions=[[lost], [answer(0, 3, 3.0)]])
    link, _ = open_link(shard)
    try:
        wait_for(lambda: len(link.arrivals) == 1)
        (arrival,) = link.arrivals.ready()
        assert arrival.update.version == 3 and torch.equal(arrival.update.values["w"], torch.full((4,), 3.0))
        assert shard.claims[:2] == [{0: 0}, {0: 0}]
    finally:
        link.close()


def test_an_answer_in_several_messages_arrives_once_whole():
    parts = [answer(0, 2, 1.0, relative=True, base_version=0, continued=True),
             answer(0, 2, 0.25, relative=True, base_version=1, ack_seq=4)]
    shard = FakeShard(sessions=[parts])
    arrived = []
    link, _ = open_link(shard, answer=arrived.append)
    try:
        wait_for(lambda: arrived)
        (arrival,) = arrived
        assert arrival.update.version == 2 and arrival.update.ack_seq == 4
        assert torch.equal(arrival.update.values["w"], torch.full((4,), 1.25))  # anchor + both differences
        assert link.received == {0: 2}
    finally:
        link.close()


def test_answers_are_dropped_once_the_client_stops_taking_them_and_later_ones_are_not_decoded(monkeypatch):
    """A learner that has made its last pushes merges no answer: those held are let go, later ones are
    not decoded (a leaving learner would otherwise hold one whole fragment per last push)."""
    later = threading.Event()
    shard = FakeShard(sessions=[[answer(0, 1, 1.0), later, answer(0, 2, 2.0), answer(0, 3, 3.0)]])
    decoded = []
    original = link_module.update_of
    monkeypatch.setattr(link_module, "update_of", lambda *a, **k: decoded.append(a[0].version) or original(*a, **k))
    link, _ = open_link(shard)
    try:
        wait_for(lambda: len(link.arrivals) == 1)
        link.stop_answers()
        assert len(link.arrivals) == 0
        later.set()
        wait_for(shard.idle.is_set)  # the stream's last two answers have come and gone
        assert len(link.arrivals) == 0 and decoded == [1] and link.received == {0: 1}
    finally:
        link.close()


def test_close_gives_up_on_a_shard_that_never_answers(monkeypatch):
    monkeypatch.setattr(link_module, "CLOSE_BOUND_S", 0.2)
    shard = FakeShard(unavailable=10**9)
    link, seen = open_link(shard)
    link.send(PushOut(push(1)))
    link.close()  # returns: what is left unsent is lost
    assert shard.pushes == []
    assert isinstance(link.error, SyncerUnavailable) and seen["failed"] == [link.error]


def test_messages_for_every_shard_reach_each_and_a_push_only_its_own():
    shards = [FakeShard(), FakeShard()]
    link, _ = open_link(*shards)
    link.send(PushOut(push(1, fragment=1)))
    link.send(ProgressOut(Progress(0, 1, 8, 0.1, (1.0, 1.0))))
    link.send(LeaveOut(finished=False))
    link.close()
    assert [s.pushes for s in shards] == [[], [1]]
    assert all(len(s.reports) == 1 and s.leaves == [False] for s in shards)


def test_a_shard_that_is_down_holds_up_only_its_own_messages(monkeypatch):
    """Each shard's messages go on their own: a push retried while its shard is down does not keep the
    other shard's pushes and reports waiting behind it (a shard outage would stall the whole learner)."""
    monkeypatch.setattr(link_module, "CLOSE_BOUND_S", 0.5)
    down, up = FakeShard(unavailable=10**9), FakeShard()
    link, _ = open_link(down, up)
    link.send(PushOut(push(1, fragment=0)))
    link.send(PushOut(push(2, fragment=1)))
    link.send(ProgressOut(Progress(0, 2, 16, 0.1, (1.0, 1.0))))
    wait_for(lambda: up.pushes == [2] and len(up.reports) == 1)
    assert down.pushes == [] and down.reports == []
    link.close()  # gives up on the shard that never came back
    assert isinstance(link.error, SyncerUnavailable)


@pytest.mark.parametrize("ordered", [True, False])
def test_heartbeats_reach_the_shards_in_the_queue_or_beside_it(monkeypatch, ordered):
    monkeypatch.setattr(link_module, "HEARTBEAT_S", 0.01)
    shard = FakeShard()
    link, _ = open_link(shard, ordered_beats=ordered, beat=lambda: [HeartbeatOut(5, 1)])
    try:
        wait_for(lambda: len(shard.reports) >= 2)
    finally:
        link.close()
    assert shard.reports[0] == (5, 1, ())


def test_a_shard_that_does_not_answer_heartbeats_keeps_no_other_shard_from_hearing_them(monkeypatch):
    """A learner's heartbeats go to each shard on their own: while one shard's heartbeat call hangs (a
    partition: no reply until the call's deadline), the other shard hears every beat, so it does not take
    the learner for dead; the hanging shard gets the newest beat once it answers, not a backlog."""
    monkeypatch.setattr(link_module, "HEARTBEAT_S", 0.01)
    released = threading.Event()
    beats = iter(range(1, 10**6))
    hanging, answering = FakeShard(beats_hang=released), FakeShard()
    link, _ = open_link(hanging, answering, beat=lambda: [HeartbeatOut(next(beats), 1)])
    try:
        wait_for(lambda: len(answering.reports) >= 20)
        assert hanging.reports == []
        released.set()
        wait_for(lambda: len(hanging.reports) >= 2)
        first, second = hanging.reports[:2]
        assert second[0] - first[0] > 1  # beats sent meanwhile were replaced, not queued
    finally:
        released.set()
        link.close()


def test_a_push_is_let_go_once_encoded_and_drain_waits_until_it_is_delivered():
    """The link keeps a push's bytes, not its tensors, until it is delivered; `drain` returns once every
    push sent is delivered (a sharded learner leaving gathers its next push only then)."""
    import weakref

    shard = FakeShard(unavailable=2)  # delivered on the third try
    link, _ = open_link(shard)
    sent = push(1)
    freed = []
    weakref.finalize(sent.deltas["w"].untyped_storage(), freed.append, True)
    link.send(PushOut(sent))
    del sent
    assert link.drain(10.0) and shard.pushes == [1]
    assert freed == [True]
    link.close()
