"""What a caller without the secret, or an insider with one learner's credential, can make a live shard
do: hold no thread, act as nobody else, starve nothing. Against the real shard served as `diloco
syncer` serves it (`serve`), with raw gRPC where a well-behaved client would not go."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from conftest import tiny_config, wait_for
from diloco.errors import DilocoError
from diloco.shard import serving as serving_module
from diloco.client.learner_client import Learner
from diloco.shard.waker import Waker
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.transport.calls import ShardClient
from diloco.transport.frames import encode_fp32, message_frames, tensor_header
from diloco.transport.security import (BUSY, REFUSED, ClientIdentity, LearnerCredential, TransportSecurity,
                                       learner_security, make_channel)
from diloco.transport.stream_calls import syncer_stub
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

SECRET = b"adversarial transport secret"
RUN = TransportSecurity(secret=SECRET)
SERVICE = "/diloco.v1.Syncer/"
METHODS = ("Join", "Init", "Pull", "Push", "Updates", "Heartbeat", "Leave", "Status")
TIMEOUT = 5


@pytest.fixture
def served():
    """served(learners) → (shard, address): the real shard, served with the run secret as `diloco syncer` does."""
    started = []

    def start(learners: int = 2) -> tuple[SyncerShard, str]:
        shard = SyncerShard(tiny_config(f"learners.count={learners}", "outer.fragments=2", "outer.H=4"),
                            ShardPlan(0, 1, ("",)))
        server, port = serve(shard, "127.0.0.1:0", security=RUN)
        shard.plan = ShardPlan(0, 1, (f"127.0.0.1:{port}",))
        started.append((shard, server))
        return shard, f"127.0.0.1:{port}"

    yield start
    for shard, server in started:
        shard.stop()
        server.stop(0)


def stub(address: str, security: TransportSecurity | None) -> pb_grpc.SyncerStub:
    return syncer_stub(make_channel(address, security))


def as_learner(address: str, m: int) -> pb_grpc.SyncerStub:
    """A stub holding learner m's own credential only."""
    return stub(address, learner_security(RUN, m))


def seed(shard: SyncerShard, address: str, learners: range) -> None:
    """Θ seeded by the run secret's holder; `learners` joined and holding Θ, each with its own credential."""
    operator = stub(address, RUN)
    values = {f"w{p}": torch.arange(4, dtype=torch.float32) + p for p in shard.owned}
    layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[4])]) for p in shard.owned]
    encoded = encode_fp32(values)
    header = pb.Frame(state=pb.StateHeader(layout=layout, tensors=[tensor_header(n, e) for n, e in encoded.items()]))
    assert operator.Init(iter(list(message_frames(header, encoded))), timeout=TIMEOUT).accepted
    for m in learners:
        learner = as_learner(address, m)
        assert learner.Join(pb.JoinRequest(learner=-1), timeout=TIMEOUT).learner == m  # its credential names it
        list(learner.Pull(pb.PullRequest(learner=m), timeout=TIMEOUT))


def push_frames(learner: int, seq: int, tokens: int = 16) -> list[pb.Frame]:
    encoded = encode_fp32({"w0": torch.full((4,), 1e-3)})
    header = pb.PushHeader(learner=learner, fragment=0, base_version=0, seq=seq, tokens=tokens, steps=1,
                           tensors=[tensor_header(n, e) for n, e in encoded.items()])
    return list(message_frames(pb.Frame(push=header), encoded))


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details()
    assert "\n" not in details
    return info.value.code(), details


def state_of(shard: SyncerShard) -> tuple:
    """What a refused call must leave as it was."""
    with shard.lock:
        core = shard.core
        ledger = {m: (e.last_seq, e.duplicates, dict(e.merged)) for m, e in core.ledger.items()} if core else {}
        return (sorted(shard.joined), sorted(shard.left), dict(shard.streams), dict(shard.steps), ledger,
                core.tokens_reported() if core else 0, sorted(core.alive) if core else [],
                {p: s.version for p, s in core.fragments.items()} if core else {})


def blocked_forever(release: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until released: the call's headers go out, never its body."""
    release.wait()
    return
    yield b""  # a generator


def half_open(channel: grpc.Channel, count: int, release: threading.Event) -> list[grpc.Future]:
    """`count` calls across every method, each sending headers and no body."""
    return [channel.stream_unary(SERVICE + METHODS[i % len(METHODS)]).future(blocked_forever(release), timeout=30)
            for i in range(count)]


def answered_within(call, limit_s: float) -> float:
    began = time.monotonic()
    call()
    took = time.monotonic() - began
    assert took < limit_s, f"took {took:.2f} s"
    return took


# ---------------------------------------------------------------- no thread for the unauthenticated


@pytest.mark.integration  # a live shard over real gRPC
def test_half_open_calls_and_64_update_streams_leave_heartbeats_answered(served, caplog):
    caplog.set_level(logging.WARNING, logger="diloco.security")
    shard, address = served(learners=64)
    seed(shard, address, range(64))
    release = threading.Event()
    learners = [as_learner(address, m) for m in range(64)]
    streams = [learners[m].Updates(pb.UpdatesRequest(learner=m), timeout=60) for m in range(64)]
    outsiders = [make_channel(address, None), make_channel(address, TransportSecurity(secret=b"wrong"))]
    try:
        wait_for(lambda: len(shard.streams) == 64, 10, lambda: f"64 update streams ({len(shard.streams)} open)")
        calls = [call for channel in outsiders for call in half_open(channel, 32, release)]
        wait_for(lambda: all(call.done() for call in calls), 2, "every half-open call refused at once")
        assert {call.exception().code() for call in calls} == {grpc.StatusCode.UNAUTHENTICATED}
        assert {call.exception().details() for call in calls} == {REFUSED}
        for m in (0, 63):
            answered_within(lambda: learners[m].Heartbeat(pb.HeartbeatRequest(learner=m), timeout=1), 1.0)
        assert all(stream.running() for stream in streams)  # nobody's stream was pushed out
        # one line per refusal, and one for the wrong secret's lookup of the run identity (Status)
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 64 + 1
    finally:
        release.set()
        for stream in streams:
            stream.cancel()


@pytest.mark.integration  # a live shard over real gRPC
def test_one_learner_holding_many_calls_is_refused_beyond_its_share_and_others_go_on(served):
    shard, address = served(learners=2)
    seed(shard, address, range(2))
    release = threading.Event()
    channel = make_channel(address, learner_security(RUN, 0))
    try:
        calls = [channel.stream_unary(SERVICE + "Heartbeat").future(blocked_forever(release), timeout=30)
                 for _ in range(40)]
        wait_for(lambda: sum(call.done() for call in calls) >= 35, 2, "the calls beyond learner 0's share refused")
        busy = [call.exception() for call in calls if call.done()]
        assert {e.code() for e in busy} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all(e.details().startswith(BUSY) for e in busy)
        answered_within(lambda: as_learner(address, 1).Heartbeat(pb.HeartbeatRequest(learner=1), timeout=1), 1.0)
    finally:
        release.set()
        channel.close()


# ---------------------------------------------------------------- nobody acts as another learner


@pytest.mark.integration  # a live shard over real gRPC
def test_acting_as_another_learner_is_refused_in_one_line_and_changes_nothing(served, caplog):
    caplog.set_level(logging.WARNING, logger="diloco.syncer")
    shard, address = served(learners=3)
    seed(shard, address, range(3))
    victim = as_learner(address, 1)
    victim_stream = victim.Updates(pb.UpdatesRequest(learner=1), timeout=60)
    wait_for(lambda: 1 in shard.streams, 5, "learner 1's update stream")
    before = state_of(shard)
    insiders = {"learner 0": as_learner(address, 0), "the run secret": stub(address, RUN)}
    try:
        for who, insider in insiders.items():
            attempts = {
                "push": lambda: insider.Push(iter(push_frames(1, seq=2**64 - 1)), timeout=TIMEOUT),
                "heartbeat": lambda: insider.Heartbeat(pb.HeartbeatRequest(learner=1, tokens=10**9), timeout=TIMEOUT),
                "leave": lambda: insider.Leave(pb.LeaveRequest(learner=1, finished=True), timeout=TIMEOUT),
                "updates": lambda: next(iter(insider.Updates(pb.UpdatesRequest(learner=1), timeout=TIMEOUT))),
                "pull": lambda: list(insider.Pull(pb.PullRequest(learner=1, after_seq=10), timeout=TIMEOUT)),
            }
            for what, attempt in attempts.items():
                code, details = refusal(attempt)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (who, what)
                assert "learner 1" in details, (who, what)
                assert state_of(shard) == before, (who, what)
        joined_as_other = refusal(lambda: insiders["learner 0"].Join(pb.JoinRequest(learner=1), timeout=TIMEOUT))
        assert joined_as_other[0] == grpc.StatusCode.PERMISSION_DENIED
        assert victim_stream.running() and shard.streams[1] == before[2][1]  # the victim's stream lives on
        refusals = [r.getMessage() for r in caplog.records if r.name == "diloco.syncer" and "refused" in r.getMessage()]
        assert len(refusals) == 2 * 5 + 1 and all("learner 1" in line for line in refusals)
        # learner 1 itself is not refused, and its pushes count as before
        assert not victim.Push(iter(push_frames(1, seq=1)), timeout=TIMEOUT).duplicate
    finally:
        victim_stream.cancel()


@pytest.mark.integration  # a live shard over real gRPC
def test_leave_for_everyone_is_refused_and_the_run_goes_on(served):
    shard, address = served(learners=4)
    seed(shard, address, range(4))
    before = state_of(shard)
    for insider in (as_learner(address, 3), stub(address, RUN)):
        for m in range(3):
            assert refusal(lambda: insider.Leave(pb.LeaveRequest(learner=m, finished=True),
                                                 timeout=TIMEOUT))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert state_of(shard) == before and not shard.finished and not shard.left


def test_a_learner_with_only_its_own_credential_cannot_become_another(monkeypatch):
    own = learner_security(RUN, 2)
    assert own.secret is None and own.learner == LearnerCredential.of(SECRET, 2)
    identity = ClientIdentity(own)
    identity.act_as(2)
    with pytest.raises(DilocoError, match="holds learner 2's credential, not learner 5's"):
        identity.act_as(5)
    credential = LearnerCredential.parse(own.learner.text() + "\n", "test")
    assert credential == own.learner and credential.token not in repr(credential)
    with pytest.raises(DilocoError, match="does not hold a learner credential"):
        LearnerCredential.parse("2:not-hex", "test")
    monkeypatch.delenv("DILOCO_SECRET", raising=False)
    monkeypatch.setenv("DILOCO_LEARNER_TOKEN", own.learner.text())
    assert ShardClient("127.0.0.1:1").own_learner == 2  # the Learner API picks it up from the environment


# ---------------------------------------------------------------- the update stream


@pytest.mark.integration  # a live shard over real gRPC
def test_a_learner_whose_update_stream_is_ended_opens_it_again(served):
    shard, address = served(learners=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    learner = Learner(model, syncer=address, security=RUN, tokens_per_step=8)
    try:
        assert learner.id == 0
        wait_for(lambda: shard.streams.get(0) == 1, 5, "the learner's update stream")
        with shard.lock:
            shard.streams[0] += 1  # what a newer stream does to the old one: the server ends it
        wait_for(lambda: shard.streams.get(0) == 3, 5, lambda: f"the learner to reconnect ({shard.streams})")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(8):  # updates still reach it
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            learner.step(tokens=8)
        wait_for(lambda: len(learner.link.arrivals) > 0 or learner.merges > 0, 10, "an update over the new stream")
    finally:
        learner.close()


# ---------------------------------------------------------------- the waker and the Init bound


def test_the_waker_survives_a_failed_save_and_a_failed_wake(caplog):
    caplog.set_level(logging.ERROR, logger="diloco.syncer")
    condition = threading.Condition(threading.RLock())
    saves, wakes = [], []
    failures = {"save": 1, "wake": 1}

    def flaky(kind: str, done: list):
        def work(now: float) -> None:
            if failures[kind]:
                failures[kind] -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            done.append(now)
        return work

    waker = Waker(condition, flaky("wake", wakes), flaky("save", saves), save_every_s=0.05)
    waker.start()
    try:
        with condition:
            waker.wake_at(time.time())
        wait_for(lambda: len(saves) >= 2 and wakes, 5, lambda: f"saves {len(saves)}, wakes {len(wakes)} after failing")
        with condition:
            waker.wake_at(time.time())  # and it still detects on time
        wait_for(lambda: len(wakes) >= 2, 5, "a later wake")
        assert waker.is_alive() and waker.failures == 2
    finally:
        waker.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("Too many open files" in line and "\n" not in line for line in lines)


@pytest.mark.integration  # a live shard over real gRPC
def test_an_init_larger_than_the_host_can_hold_is_refused_from_its_header(served, monkeypatch):
    assert serving_module.init_limit_bytes() <= serving_module.available_memory_bytes() // 2
    monkeypatch.setattr(serving_module, "available_memory_bytes", lambda: 64 << 20)  # a host with 64 MiB to spare
    shard, address = served()
    release = threading.Event()

    def declared_then_nothing() -> Iterator[pb.Frame]:
        yield pb.Frame(state=pb.StateHeader(tensors=[pb.TensorHeader(name="w0", codec="fp32", shape=[1 << 28],
                                                                      payload_bytes=1 << 30)]))
        release.wait()  # the gigabyte it declared never comes

    try:
        code, details = refusal(lambda: stub(address, RUN).Init(declared_then_nothing(), timeout=TIMEOUT))
    finally:
        release.set()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bad Init" in details
    assert shard.core is None


def init_stream(shard: SyncerShard, fill: float) -> Iterator[pb.Frame]:
    values = {f"w{p}": torch.full((4,), fill) for p in shard.owned}
    layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[4])]) for p in shard.owned]
    encoded = encode_fp32(values)
    header = pb.Frame(state=pb.StateHeader(layout=layout, tensors=[tensor_header(n, e) for n, e in encoded.items()]))
    return iter(list(message_frames(header, encoded)))


@pytest.mark.integration  # a live server over real gRPC
def test_theta_cannot_be_seeded_with_values_no_model_has(served):
    shard, address = served()
    learner = as_learner(address, 0)
    learner.Join(pb.JoinRequest(learner=-1), timeout=TIMEOUT)
    code, details = refusal(lambda: learner.Init(init_stream(shard, 3e38), timeout=TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "RMS" in details and shard.core is None
    assert learner.Init(init_stream(shard, 0.02), timeout=TIMEOUT).accepted  # an honest seed still goes in


@pytest.mark.integration  # a live server over real gRPC
def test_with_operator_seeds_only_the_run_secret_seeds_theta(served):
    shard, address = served()
    shard.operator_seeds = True
    learner = as_learner(address, 0)
    learner.Join(pb.JoinRequest(learner=-1), timeout=TIMEOUT)
    code, details = refusal(lambda: learner.Init(init_stream(shard, 0.02), timeout=TIMEOUT))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "--operator-seeds" in details and shard.core is None
    assert stub(address, RUN).Init(init_stream(shard, 0.02), timeout=TIMEOUT).accepted


@pytest.mark.integration  # two live runs over real gRPC
def test_a_push_recorded_in_one_run_is_refused_by_a_fresh_run_with_the_same_secret(served, monkeypatch):
    recorded = []
    push = SyncerShard.Push

    def recording(self, request_iterator, context):
        recorded.append(tuple((k, v) for k, v in context.invocation_metadata() if k.startswith("x-diloco")))
        return push(self, request_iterator, context)
    monkeypatch.setattr(SyncerShard, "Push", recording)
    first, first_address = served()
    seed(first, first_address, range(1))
    as_learner(first_address, 0).Push(iter(push_frames(0, 1)), timeout=TIMEOUT)
    assert first.core.ledger[0].last_seq == 1
    fresh, fresh_address = served()
    seed(fresh, fresh_address, range(1))
    before = state_of(fresh)
    replayed = syncer_stub(grpc.insecure_channel(fresh_address))
    code, _ = refusal(lambda: replayed.Push(iter(push_frames(0, 1)), metadata=recorded[0], timeout=TIMEOUT))
    assert code == grpc.StatusCode.UNAUTHENTICATED and state_of(fresh) == before
    as_learner(fresh_address, 0).Push(iter(push_frames(0, 1)), timeout=TIMEOUT)  # its own calls go through
    assert fresh.core.ledger[0].last_seq == 1
