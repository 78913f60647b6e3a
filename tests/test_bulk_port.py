"""A shard's bulk port in a shard: a pull over it gives the values a pull in gRPC frames gives; a push's data
sent there is taken exactly as the same push in frames, refused as it would be, and only for a header the
shard checked first; an answer over it reads as the same answer in frames. A port that cannot be reached
leaves pulls, pushes and answers on gRPC instead of failing them. (Transfer by transfer:
`test_bulk_transfers.py`.)"""

from __future__ import annotations

import logging
import queue
import threading

import pytest
import torch

from conftest import tiny_config, wait_for
from diloco.client.learner_client import Learner
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.transport import bulk, calls
from diloco.codecs import Encoded, get_codec
from diloco.errors import DilocoError
from diloco.shard.push_intake import PushIntake
from diloco.core.messages import Update
from diloco.shard.answer_slots import AnswerSlots
from diloco.transport.calls import ShardClient, SyncerUnavailable
from diloco.transport.frames import FrameError, read_message, tensor_header
from diloco.transport.wire_messages import update_frames
from diloco.v1 import diloco_pb2 as pb
from diloco.transport.security import PLAINTEXT
from test_bulk_transfers import byte_views, receive_once, server  # noqa: F401 — `server`: a fixture here too


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))


@pytest.fixture
def bulk_shard():
    shard = SyncerShard(tiny_config("learners.count=2", "outer.fragments=2", "outer.H=4"), ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0", bulk_port=True)
    shard.plan = ShardPlan(0, 1, (f"127.0.0.1:{port}",))
    address = f"127.0.0.1:{port}"
    seeder = Learner(tiny_model(), syncer=address, learner=0)  # seeds Θ; closed even when a test fails, else
    yield shard, address  # its update stream would call the stopped shard for minutes, into later tests' logs
    seeder.close()
    shard.stop()
    server.stop(0)


@pytest.mark.integration  # a live shard over real gRPC
def test_a_pull_over_the_bulk_port_gives_what_a_pull_in_frames_gives_and_a_learner_joins_through_it(bulk_shard):
    shard, address = bulk_shard
    over_bulk = ShardClient(address)
    in_frames = ShardClient(address)
    in_frames.bulk_failed = True  # as a client whose bulk pull failed: frames only
    values, versions, layout, _ = over_bulk.pull(0, observer=True)
    framed, framed_versions, framed_layout, _ = in_frames.pull(0, observer=True)
    assert versions == framed_versions and layout == framed_layout and list(values) == list(framed)
    assert all(torch.equal(values[n], framed[n]) for n in values) and not over_bulk.bulk_failed
    assert not shard.bulk.tickets and shard.bulk.refused == 0  # each ticket used once
    second = Learner(tiny_model(), syncer=address, learner=1)  # its join pulls Θ over the bulk port
    with shard.lock:
        theta = {n: shard.core.theta[n].clone() for n in values}
    assert all(torch.equal(second.params[n].detach(), theta[n]) for n in theta)
    # Three joins' or pulls' worth over the port (the first learner's, ours, the second learner's), no refusal.
    wait_for(lambda: shard.report()["bulk"]["sent"] >= 3, 5, "the bulk transfers counted")
    assert shard.report()["bulk"]["refused"] == 0
    second.close()
    over_bulk.close()
    in_frames.close()


@pytest.mark.integration  # a live shard over real gRPC
def test_a_bulk_port_that_cannot_be_reached_leaves_pulls_on_grpc(bulk_shard, caplog):
    shard, address = bulk_shard
    client = ShardClient(address)
    expected = _framed_pull(address).values
    shard.bulk.close()  # tickets are still issued; nobody answers on the port
    with caplog.at_level(logging.WARNING, logger="diloco.learner"):
        values = client.pull(0, observer=True).values
    assert client.bulk_failed and "pulling over gRPC from now on" in caplog.text
    assert all(torch.equal(values[n], expected[n]) for n in expected)
    client.close()


def _framed_pull(address: str):
    client = ShardClient(address)
    client.bulk_failed = True
    try:
        return client.pull(0, observer=True)
    finally:
        client.close()


def push_of_ones(client: ShardClient, reply: pb.JoinReply, fragment: int, seq: int, value: float = 1e-3):
    """A push of `fragment` from the client's learner, every element `value`, in the run's uplink codec."""
    codec = get_codec(reply.settings.codec_up, reply.settings.block or 0)
    layout = next(f for f in reply.layout if f.index == fragment)
    tensors = {t.name: codec.encode(torch.full(tuple(t.shape), value)) for t in layout.tensors}
    header = pb.PushHeader(learner=reply.learner, fragment=fragment, base_version=0, seq=seq, tokens=64, steps=1,
                           step_time_s=0.01, tensors=[tensor_header(n, e) for n, e in tensors.items()], step=seq)
    return header, tensors


def recording_pushes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, list[bytes]]]:
    """Every push a shard takes, as (its header's bytes, each tensor's bytes), however its data came."""
    seen: list[tuple[bytes, list[bytes]]] = []
    take_push = PushIntake.take_push

    def recording(self, header, tensors, peer):
        seen.append((header.SerializeToString(), [bytes(e.payload) + bytes(e.scales) for e in tensors.values()]))
        return take_push(self, header, tensors, peer)

    monkeypatch.setattr(PushIntake, "take_push", recording)
    return seen


@pytest.mark.integration  # a live shard over real gRPC
def test_a_push_over_the_bulk_port_is_taken_as_the_same_push_in_frames(bulk_shard, monkeypatch):
    shard, address = bulk_shard
    seen = recording_pushes(monkeypatch)
    over_bulk, in_frames = ShardClient(address), ShardClient(address)
    reply = over_bulk.join(1)
    in_frames.join(1)
    assert reply.bulk_pushes and over_bulk.bulk_pushes
    in_frames.bulk_failed = True
    header, tensors = push_of_ones(over_bulk, reply, fragment=0, seq=1)
    assert over_bulk.push(header, tensors) == pb.PushReply()
    assert in_frames.push(header, tensors).duplicate  # the same seq again: counted once
    assert seen[0] == seen[1] and shard.bulk.received == 1 and not shard.bulk.tickets
    with shard.lock:
        assert shard.core.ledger[1].pushed(0) == 1
    for client in (over_bulk, in_frames):
        client.close()


@pytest.mark.integration  # a live shard over real gRPC
def test_a_bulk_push_is_checked_before_a_ticket_and_refused_as_in_frames(bulk_shard):
    shard, address = bulk_shard
    client = ShardClient(address)
    reply = client.join(1)
    with shard.lock:
        theta = {n: v.clone() for n, v in shard.core.theta.items()}
    header, tensors = push_of_ones(client, reply, fragment=0, seq=1)
    header.fragment = 7  # not a fragment of this run: refused from the header, before any ticket
    with pytest.raises(DilocoError, match="fragment 7 is not held"):
        client.push(header, tensors)
    assert not shard.bulk.tickets
    header, tensors = push_of_ones(client, reply, fragment=0, seq=1)
    nan = {n: Encoded("fp32", e.shape, 0, memoryview(torch.full(e.shape, float("nan")).numpy()).cast("B"))
           for n, e in tensors.items()}  # no codec encodes NaN: its bytes by hand
    header = pb.PushHeader(learner=1, fragment=0, seq=1, tokens=64, steps=1, step=1,
                           tensors=[tensor_header(n, e) for n, e in nan.items()])
    with pytest.raises(DilocoError, match="refused push.*NaN"):  # its data is refused once read off the port
        client.push(header, nan)
    assert shard.bulk.received == 1
    framed = pb.Frame(push=header)
    framed.push.bulk = True  # a bulk header with its data in frames after all
    frames = iter([framed, pb.Frame(data=b"\0" * 16)])
    with pytest.raises(Exception, match="bulk port, not in frames"):
        client.stub.Push(frames, timeout=10)
    with shard.lock:
        assert all(torch.equal(shard.core.theta[n], theta[n]) for n in theta)  # nothing of them changed Θ
        assert 1 not in shard.core.ledger or shard.core.ledger[1].pushed(0) == 0
    client.close()


@pytest.mark.integration  # a live shard over real gRPC
def test_a_bulk_port_that_cannot_be_reached_leaves_pushes_on_grpc(bulk_shard, caplog):
    shard, address = bulk_shard
    client = ShardClient(address)
    reply = client.join(1)
    shard.bulk.close()  # tickets are still issued; nobody answers on the port
    with caplog.at_level(logging.WARNING, logger="diloco.learner"):
        for seq in range(1, calls.BULK_TRIES + 1):  # each sent in frames; the port given up after the last
            assert not client.bulk_failed
            assert not client.push(*push_of_ones(client, reply, fragment=1, seq=seq)).duplicate
    assert client.bulk_failed and "pushing and pulling over gRPC from now on" in caplog.text
    with shard.lock:
        assert shard.core.ledger[1].pushed(1) == calls.BULK_TRIES and shard.bulk.received == 0
    shard.bulk = None  # a shard restarted without its port: the header alone gets no ticket, and frames follow
    client.bulk_failed = False
    assert client.push(*push_of_ones(client, reply, fragment=1, seq=calls.BULK_TRIES + 1)) == pb.PushReply()
    with shard.lock:
        assert shard.core.ledger[1].pushed(1) == calls.BULK_TRIES + 1
    client.close()


def test_an_answer_over_the_bulk_port_reads_as_the_same_answer_in_frames(server):
    codec = get_codec("int4", 64)
    whole = Update(0, 3, {}, ack_seq=5, next_push_at=12.5,
                   wire=({"w": codec.encode(torch.randn(300, 7)), "b": get_codec("fp32").encode(torch.randn(9))},))
    released: list[bool] = []
    over_bulk = list(update_frames(whole, server, lambda: released.append(True)))
    assert len(over_bulk) == 1 and over_bulk[0].update.bulk_ticket and not released  # the header alone

    def from_port(header, targets):
        receive_once("127.0.0.1", header.bulk_port, header.bulk_ticket, targets, PLAINTEXT, "shard 0")

    header, tensors = read_message(iter(over_bulk), "update", limit=1 << 30, bulk=from_port)
    framed_header, framed = read_message(update_frames(whole), "update", limit=1 << 30)
    header.ClearField("bulk_port")
    header.ClearField("bulk_ticket")
    assert header == framed_header
    wait_for(lambda: released == [True], 5, "the issuer told, once the bytes were sent (on the port's thread)")
    assert all(bytes(tensors[n].payload) + bytes(tensors[n].scales) == bytes(e.payload) + bytes(e.scales)
               for n, e in framed.items())
    with pytest.raises(FrameError, match="did not ask for"):  # a reader that asked for frames takes no ticket
        read_message(iter(list(update_frames(whole, server))), "update", limit=1 << 30)


def test_a_whole_answer_holds_its_slot_until_its_ticket_is_used_or_void(server, monkeypatch):
    slots = AnswerSlots(1)
    slot = slots.take(lambda: True)
    slot.hold_until_sent(1000, lambda: None)
    value = torch.randn(250)
    ticket = server.ticket(byte_views(value), slot.pass_on())
    slot.release()  # the stream sent the header: the bytes still wait at the port
    assert slots.take(lambda: not server.tickets) is None  # no slot free while the ticket is held
    receive_once("127.0.0.1", server.port, ticket, byte_views(torch.empty(250)), PLAINTEXT, "shard 0")
    second = slots.take(lambda: True)
    assert second is not None  # used: the slot came back
    monkeypatch.setattr(bulk, "TICKET_TTL_S", 0.0)
    server.ticket(byte_views(value), second.pass_on())
    server.ticket(byte_views(value))  # issuing another forgets the void one, and tells its issuer
    assert slots.take(lambda: True) is not None


@pytest.mark.integration  # a live shard over real gRPC
def test_answers_come_over_the_bulk_port_and_over_grpc_once_it_cannot_be_reached(bulk_shard, monkeypatch):
    monkeypatch.setattr(calls, "BULK_TRIES", 1)
    shard, address = bulk_shard
    client = ShardClient(address)
    reply = client.join(1)
    client.pull(1)
    stream = UpdateReader(client, {})
    sent = shard.bulk.served
    assert client.push(*push_of_ones(client, reply, fragment=0, seq=1)) == pb.PushReply()
    header, _ = stream.next()
    assert header.fragment == 0 and header.version >= 1 and header.bulk_ticket
    wait_for(lambda: shard.bulk.served > sent, 5, "the answer's bytes counted as sent over the port")
    shard.bulk.close()  # tickets are still issued; nobody answers on the port
    # Pushed in frames, so that only the stream's reader (on its own thread, maybe already reading
    # the answer to this push) tries the port and finds it unreachable.
    client.bulk_pushes = False
    client.push(*push_of_ones(client, reply, fragment=1, seq=2))
    with pytest.raises(SyncerUnavailable, match="not fetched"):
        stream.next()
    assert client.bulk_failed
    again = UpdateReader(client, {0: header.version, 1: 0})  # opened again, saying what it holds (as the link does)
    header, tensors = again.next()  # the answer it lost, made again, in frames
    assert header.fragment == 1 and not header.bulk_ticket and tensors
    client.close()


class UpdateReader:
    """An update stream read on a thread of its own: `next` gives its next message (or raises what the
    stream raised), failing the test if none comes in time."""

    def __init__(self, client: ShardClient, holds: dict[int, int]) -> None:
        self.out: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(client, holds), daemon=True).start()

    def _read(self, client: ShardClient, holds: dict[int, int]) -> None:
        try:
            for message in client.updates(1, holds):
                self.out.put(message)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            self.out.put(exc)

    def next(self, within_s: float = 20.0):
        try:
            got = self.out.get(timeout=within_s)
        except queue.Empty:
            raise AssertionError(f"no answer within {within_s} s") from None
        if isinstance(got, Exception):
            raise got
        return got


class _StreamContext:
    """What `SyncerShard.Updates` asks of its RPC's context, for a stream driven in this process."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback) -> None:
        pass

    def peer(self) -> str:
        return "test"

    def cancel(self) -> None:
        self.active = False


@pytest.mark.integration  # a live shard's bulk port
def test_a_stream_makes_its_next_relative_answer_only_once_the_last_ones_data_was_fetched(bulk_shard, monkeypatch):
    """A relative answer holds no slot (its differences are shared), so a stream could make answers, and the
    port's tickets for their data, faster than its learner fetches them; past the port's MAX_TICKETS the
    oldest, some learner's answer, would be dropped. The stream waits for each answer's tickets instead."""
    shard, _ = bulk_shard
    monkeypatch.setattr(shard, "sink", True)  # answers that carry their bytes (`_sink_push`): no round needed
    wire = {"w": get_codec("int4", 64).encode(torch.randn(4096))}
    nbytes = sum(e.wire_bytes() for e in wire.values())
    learner, outbox = 1, queue.Queue()
    with shard.lock:
        shard.outboxes[learner] = outbox
        for p in (0, 1):
            notice = Update(p, 0, {}, ack_seq=p + 1, wire=(wire,), relative=True, payload_bytes=nbytes)
            shard.last_updates.setdefault(learner, {})[p] = notice
            outbox.put(notice)
    context = _StreamContext()
    stream = shard.Updates(pb.UpdatesRequest(learner=learner, bulk=True), context)
    first = next(stream)
    assert first.update.fragment == 0 and first.update.bulk_ticket
    second: list[pb.Frame] = []
    reader = threading.Thread(target=lambda: second.append(next(stream)), daemon=True)
    reader.start()
    reader.join(1.5)
    assert not second  # the first answer's data is still at the port: no second ticket yet
    targets = [memoryview(bytearray(len(e.payload))) for e in wire.values()] + \
        [memoryview(bytearray(len(e.scales))) for e in wire.values()]
    receive_once("127.0.0.1", first.update.bulk_port, first.update.bulk_ticket, targets, PLAINTEXT, "shard 0")
    reader.join(10)
    assert [f.update.fragment for f in second] == [1] and second[0].update.bulk_ticket
    context.active = False
    stream.close()
