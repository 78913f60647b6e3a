"""What fuzzing a live shard found (tests/test_fuzz.py), one defect per test, as a minimal reproduction."""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager

import grpc
import pytest
import torch

from conftest import wait_for
from diloco.shard.server import SyncerShard
from diloco.transport.frames import data_frames, encode_fp32, tensor_header
from diloco.transport.stream_calls import syncer_stub as project_stub
from diloco.v1 import diloco_pb2 as pb

from fuzz_shard import REAL, U64, core_state, differences, learner_of, live_shard

pytestmark = pytest.mark.integration  # every test fuzzes a live shard over real gRPC


# ---------------------------------------------------------------- what fuzzing found, one by one


@contextmanager
def syncer_stub(address: str):
    channel = grpc.insecure_channel(address)
    try:
        yield project_stub(channel)
    finally:
        channel.close()


def rpc_code(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def test_a_join_asking_for_an_id_beyond_32_bits_is_refused_and_joins_nobody():
    """JoinRequest.learner is int64 and JoinReply.learner uint32: an id in between cannot be answered."""
    with live_shard("learners.count=1") as (shard, address), syncer_stub(address) as stub:
        code = rpc_code(lambda: stub.Join(pb.JoinRequest(learner=2**32, host="h"), timeout=10))
        assert code in ("INVALID_ARGUMENT", "OUT_OF_RANGE")
        assert 2**32 not in shard.joined and 2**32 not in shard.hosts


@pytest.mark.parametrize("codec, block, shape", [("fp32", 0, [0, 2**63]), ("int8", 1, [0, 2**63]),
                                                 ("bf16", 0, [0, U64]), ("fp32", 0, [2**63, 0])])
def test_a_push_whose_shape_overflows_is_refused_as_invalid(codec, block, shape):
    """An empty tensor (a zero dimension) whose other dimensions do not fit torch's int64 sizes."""
    with live_shard("learners.count=1") as (_, address), learner_of(address) as learner, \
            syncer_stub(address) as stub:
        name = learner.fragments[0].names[0]
        header = pb.PushHeader(learner=REAL, fragment=0, base_version=0, seq=learner.core.seq + 1, tokens=1, steps=1,
                               tensors=[pb.TensorHeader(name=name, codec=codec, block=block, shape=shape)])
        assert rpc_code(lambda: stub.Push(iter([pb.Frame(push=header)]), timeout=10)) == "INVALID_ARGUMENT"


def test_an_init_whose_shape_overflows_is_refused_as_invalid():
    with live_shard("learners.count=1") as (shard, address), syncer_stub(address) as stub:
        spec = pb.TensorSpec(name="w", shape=[0, 2**63])
        state = pb.StateHeader(layout=[pb.FragmentLayout(index=0, tensors=[spec]), pb.FragmentLayout(index=1)],
                               tensors=[pb.TensorHeader(name="w", codec="fp32", shape=[0, 2**63])])
        assert rpc_code(lambda: stub.Init(iter([pb.Frame(state=state)]), timeout=10)) == "INVALID_ARGUMENT"
        assert shard.core is None


def test_heartbeats_whose_tokens_add_up_beyond_64_bits_leave_heartbeat_and_status_working():
    """tokens_reported is uint64: the sum over learners must not make every later reply fail."""
    with live_shard("learners.count=1") as (_, address), syncer_stub(address) as stub:
        codes = [rpc_code(lambda m=m: stub.Heartbeat(pb.HeartbeatRequest(learner=m, tokens=U64), timeout=10))
                 for m in (7, 8)]
        assert codes == ["OK", "OK"]
        assert rpc_code(lambda: stub.Status(pb.StatusRequest(), timeout=10)) == "OK"


def test_a_leave_from_a_learner_that_never_joined_changes_no_membership():
    """Leave of an id the shard never saw (claiming it finished its share) must not add a learner that
    every later round's participation share counts as absent."""
    with live_shard("learners.count=1") as (shard, address), learner_of(address), syncer_stub(address) as stub:
        before = core_state(shard)
        request = pb.LeaveRequest(learner=12345)
        if "finished" in pb.LeaveRequest.DESCRIPTOR.fields_by_name:
            request.finished = True
        stub.Leave(request, timeout=10)
        assert differences(before, core_state(shard)) == []


@pytest.mark.parametrize("field, value", [("step_time_s", math.inf), ("step_time_s", 1e300),
                                          ("step_time_s", math.nan), ("sent_at", -math.inf),
                                          ("sent_at", -1e300), ("sent_at", math.nan), ("sent_at", math.inf)])
def test_a_push_with_absurd_timings_leaves_grace_windows_bounded(field, value):
    """A push whose step time or send time is not finite (or absurd) is refused, or taken without
    letting it into the estimates that size grace windows: a later round still closes on time and the
    timer thread lives. Learner 1 is configured but absent, so rounds close by their grace window."""
    with live_shard("learners.count=2") as (shard, address), learner_of(address) as learner, \
            syncer_stub(address) as stub:
        seq = learner.core.seq

        def push(p: int, **fields) -> str:
            nonlocal seq
            seq += 1
            names = learner.fragments[p].names
            encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in names})
            header = pb.PushHeader(learner=REAL, fragment=p, base_version=shard.core.version(p), seq=seq, tokens=16,
                                   steps=1, step_time_s=0.01, sent_at=time.time(),
                                   tensors=[tensor_header(n, encoded[n]) for n in names])
            for key, v in fields.items():
                setattr(header, key, v)
            frames = [pb.Frame(push=header), *data_frames(encoded.values())]
            return rpc_code(lambda: stub.Push(iter(frames), timeout=10))

        assert push(0, **{field: value}) in ("OK", "INVALID_ARGUMENT")

        def stalled() -> str:
            return (f"the round to close: step time {shard.core.step_time}, one-way {shard.core.one_way_s}, "
                    f"timer alive {shard.waker.is_alive()}")

        # Refused, or taken and merged once its grace window (if sane) is over: the timer is free for fragment 1.
        wait_for(lambda: not shard.core.fragments[0].pending, 5, stalled, poll_s=0.02)
        assert push(1) == "OK"  # a sound push: its round closes within its grace window (≤ 2 step times)
        wait_for(lambda: shard.core.version(1) == 1, 5, stalled, poll_s=0.02)
        assert shard.waker.is_alive()


def test_a_grace_window_that_ends_after_another_still_closes_its_round():
    """Two fragments' rounds wait out grace windows at once; the one that ends later must be timed too
    (the shard keeps one deadline: once the earlier fires, the later one must be armed again)."""
    with live_shard("learners.count=2") as (shard, address), learner_of(address) as learner, \
            syncer_stub(address) as stub:
        for i, (p, step_time) in enumerate([(0, 0.01), (1, 0.5)]):  # grace ≈ 0.02 s, then ≈ 0.3 s
            names = learner.fragments[p].names
            encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in names})
            header = pb.PushHeader(learner=REAL, fragment=p, base_version=0, seq=learner.core.seq + 1 + i, tokens=16,
                                   steps=1, step_time_s=step_time, sent_at=time.time(),
                                   tensors=[tensor_header(n, encoded[n]) for n in names])
            stub.Push(iter([pb.Frame(push=header), *data_frames(encoded.values())]), timeout=10)

        def open_rounds() -> str:
            with shard.lock:
                return "both rounds to close; open: " + str(
                    {p: (s.deadline, list(s.pending)) for p, s in shard.core.fragments.items() if s.pending})

        wait_for(lambda: (shard.core.version(0), shard.core.version(1)) == (1, 1), 3, open_rounds, poll_s=0.02)


def test_a_push_whose_stream_breaks_after_the_message_is_not_taken(monkeypatch):
    """A valid push followed by a message that does not parse: gRPC answers INTERNAL and ends the
    handler's request iterator as if the stream had ended cleanly. The client is told the push failed,
    so the shard must not have taken it."""
    handled = threading.Event()
    push = SyncerShard.Push

    def push_then_tell(self, request_iterator, context):
        try:
            return push(self, request_iterator, context)
        finally:
            handled.set()

    monkeypatch.setattr(SyncerShard, "Push", push_then_tell)  # before serving: gRPC takes the handler then
    with live_shard("learners.count=1") as (shard, address), learner_of(address) as learner:
        channel = grpc.insecure_channel(address)
        raw_push = channel.stream_unary("/diloco.v1.Syncer/Push", request_serializer=lambda b: b,
                                        response_deserializer=pb.PushReply.FromString)
        names = learner.fragments[0].names
        encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in names})
        header = pb.PushHeader(learner=REAL, fragment=0, base_version=0, seq=learner.core.seq + 1, tokens=16, steps=1,
                               tensors=[tensor_header(n, encoded[n]) for n in names])
        blobs = [pb.Frame(push=header).SerializeToString(),
                 *(f.SerializeToString() for f in data_frames(encoded.values())), b"\xff\xff"]
        try:
            code = rpc_code(lambda: raw_push(iter(blobs), timeout=10))
            assert handled.wait(10)  # the handler may still be at work after the client has its answer
            entry = shard.core.ledger[REAL]
            assert code == "INTERNAL"
            assert (entry.pushes, entry.last_seq, shard.core.version(0)) == (0, 0, 0)
        finally:
            channel.close()
