"""Data frames made and read without a protobuf copy are protobuf's own bytes: a peer on the generated
stub and one on ours exchange the same messages, and a frame that is not one plain data field is read
by protobuf as before (a malformed one refused as before)."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError

from diloco.transport.frames import (DataFrame, data_frame, encode_fp32, message_frames, parse_frame, read_message,
                                     tensor_header)
from diloco.transport.stream_calls import METHODS, add_syncer_to_server, syncer_stub
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

SIZES = [0, 1, 127, 128, 16_383, 16_384, 1 << 20, (1 << 20) + 3]


@pytest.mark.parametrize("size", SIZES)
def test_a_data_frame_is_protobufs_own_bytes_both_ways(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    stock = pb.Frame(data=payload).SerializeToString()
    ours = data_frame([memoryview(payload)[: size // 2], payload[size // 2:]], size)
    assert ours.SerializeToString() == stock
    read = parse_frame(stock)
    assert isinstance(read, DataFrame) and read.WhichOneof("body") == "data" and bytes(read.data) == payload
    assert pb.Frame.FromString(ours.SerializeToString()).data == payload


def test_other_frames_are_read_by_protobuf_and_malformed_ones_refused_as_before():
    header = pb.Frame(push=pb.PushHeader(learner=3, fragment=1)).SerializeToString()
    assert parse_frame(header) == pb.Frame.FromString(header)
    # a data field followed by another field: not a plain data frame, protobuf decides (the last oneof wins)
    mixed = pb.Frame(data=b"abc").SerializeToString() + pb.Frame(push=pb.PushHeader(learner=2)).SerializeToString()
    assert parse_frame(mixed) == pb.Frame.FromString(mixed) and parse_frame(mixed).WhichOneof("body") == "push"
    for bad in (b"\x22\x05ab", b"\x22\xff", b"\x22\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"):
        with pytest.raises(DecodeError):
            pb.Frame.FromString(bad)
        with pytest.raises(DecodeError):
            parse_frame(bad)


def _message() -> tuple[pb.Frame, dict]:
    torch.manual_seed(0)
    encoded = encode_fp32({"a": torch.randn(300_000), "b": torch.randn(7)})
    header = pb.Frame(push=pb.PushHeader(learner=0, fragment=0, seq=1,
                                         tensors=[tensor_header(n, e) for n, e in encoded.items()]))
    return header, encoded


def test_read_message_reads_the_same_tensors_from_either_kind_of_frame():
    header, encoded = _message()
    ours = list(message_frames(header, encoded))
    stock = [pb.Frame.FromString(f.SerializeToString()) for f in ours]
    for frames in (ours, stock, [parse_frame(f.SerializeToString()) for f in ours]):
        _, tensors = read_message(iter(frames), "push", limit=1 << 30)
        assert {n: bytes(e.payload) for n, e in tensors.items()} == {n: bytes(e.payload) for n, e in encoded.items()}


class _Echo(pb_grpc.SyncerServicer):
    """Pull sends a fixed message; Push reads one and says (as `duplicate`) whether it holds the same bytes."""

    def __init__(self) -> None:
        self.header, self.encoded = _message()

    def Pull(self, request, context):  # noqa: N802
        yield from message_frames(self.header, self.encoded)

    def Push(self, request_iterator, context):  # noqa: N802
        _, tensors = read_message(iter(request_iterator), "push", limit=1 << 30)
        same = {n: bytes(e.payload) for n, e in tensors.items()} == {n: bytes(e.payload)
                                                                       for n, e in self.encoded.items()}
        return pb.PushReply(duplicate=same)


def test_the_generated_stub_and_ours_talk_to_our_server_alike():
    assert set(METHODS) == set(pb.DESCRIPTOR.services_by_name["Syncer"].methods_by_name)
    servicer = _Echo()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_syncer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        expected = {n: bytes(e.payload) for n, e in servicer.encoded.items()}
        stock, ours = pb_grpc.SyncerStub(channel), syncer_stub(channel)
        for stub, frames in ((stock, [pb.Frame.FromString(f.SerializeToString())
                                      for f in message_frames(*_message())]),
                             (ours, list(message_frames(*_message())))):
            _, tensors = read_message(iter(stub.Pull(pb.PullRequest(), timeout=30)), "push", limit=1 << 30)
            assert {n: bytes(e.payload) for n, e in tensors.items()} == expected
            assert stub.Push(iter(frames), timeout=30).duplicate
        channel.close()
    finally:
        server.stop(None)


def test_a_snapshot_of_theta_is_sent_from_its_own_memory_and_reads_back_exactly():
    from diloco.transport.frames import decode, encode_snapshot

    theta = {"w": torch.randn(3, 1000), "h": torch.randn(5, dtype=torch.float64), "g": torch.randn(4).requires_grad_()}
    encoded = encode_snapshot(theta)
    assert np.frombuffer(encoded["w"].payload, dtype=np.float32).ctypes.data == theta["w"].data_ptr()  # no copy
    assert {n: bytes(e.payload) for n, e in encoded.items()} == \
        {n: bytes(e.payload) for n, e in encode_fp32(theta).items()}  # the same bytes as the copying encoder
    for name, value in theta.items():
        assert torch.equal(decode(encoded[name]), value.detach().to(torch.float32))


def _layout(theta: dict) -> list:
    return [pb.FragmentLayout(index=0, tensors=[pb.TensorSpec(name=n, shape=list(t.shape)) for n, t in theta.items()])]


def test_seeding_sends_state_frames_bytes_taking_one_value_at_a_time():
    """Init's frames are made lazily (the header from shapes, each value taken as its data is due) and are
    the very bytes the eager encoder sends: `diloco.v1` is unchanged."""
    from diloco.transport.wire_messages import seed_frames, state_frames

    theta = {"a": torch.randn(300, 1000), "b": torch.randn(7, dtype=torch.bfloat16), "c": torch.randn(2, 3, 4)}
    layout = _layout(theta)
    taken: list[str] = []

    class Lazy:
        def __init__(self, name: str) -> None:
            self.name, self.shape = name, theta[name].shape

        def detach(self) -> torch.Tensor:
            taken.append(self.name)
            return theta[self.name]

    frames = seed_frames({n: Lazy(n) for n in theta}, layout)
    first = next(frames)
    assert taken == [] and [t.name for t in first.state.tensors] == list(theta)  # the header takes no value
    ours = [first.SerializeToString()]
    for frame in frames:
        ours.append(frame.SerializeToString())
        assert len(taken) <= 1 + len(ours)  # values are taken as their frames are made, not before
    assert taken == list(theta)
    assert ours == [f.SerializeToString() for f in state_frames(theta, layout)]


class _Seeded(pb_grpc.SyncerServicer):
    def __init__(self) -> None:
        self.tensors: dict = {}

    def Init(self, request_iterator, context):  # noqa: N802
        _, tensors = read_message(iter(request_iterator), "state", limit=1 << 30)
        self.tensors = {n: bytes(e.payload) for n, e in tensors.items()}
        return pb.InitReply(accepted=True)


def test_init_seeds_lazily_and_a_failure_taking_a_value_is_raised_as_itself():
    """`ShardClient.init` takes each value as its frames are made on gRPC's request thread (a sharded
    learner's rank 0 gathers it there); a value that cannot be taken ends the call with its own error,
    not gRPC's word for a cancelled call."""
    from diloco.errors import DilocoError
    from diloco.transport.calls import ShardClient

    theta = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    layout = _layout(theta)

    class Failing:
        shape = theta["b"].shape

        def detach(self) -> torch.Tensor:
            raise DilocoError("a rank of this learner stopped answering during sync (gone)")

    servicer = _Seeded()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_syncer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    client = ShardClient.__new__(ShardClient)
    client.address, client.stub = f"127.0.0.1:{port}", syncer_stub(channel)
    try:
        assert client.init(layout, theta)
        assert servicer.tensors == {n: bytes(e.payload) for n, e in encode_fp32(theta).items()}
        with pytest.raises(DilocoError, match="stopped answering during sync"):
            client.init(layout, {"a": theta["a"], "b": Failing()})
    finally:
        channel.close()
        server.stop(None)


def test_a_push_that_asks_for_no_answer_says_so_on_the_wire_and_an_older_peer_s_push_is_answered():
    from diloco.core.messages import Push
    from diloco.transport.wire_messages import push_header, push_of

    for answered in (True, False):
        push = Push(learner=3, fragment=1, base_version=2, seq=7, deltas={}, tokens=64, steps=2, final=True,
                    answered=answered)
        header = pb.PushHeader.FromString(push_header(3, push, {}).SerializeToString())
        assert header.unanswered is (not answered)
        assert push_of(header, {}).answered is answered
    older = pb.PushHeader(learner=3, fragment=1, seq=7, final=True)  # a learner from before the field
    assert push_of(older, {}).answered
