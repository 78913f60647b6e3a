"""A shard's bulk port: a pull's Θ gets exactly the bytes its ticket names, once, to its holder only; over TLS
where the run uses it; the same values a pull in gRPC frames gives. A push's data sent there is taken exactly
as the same push in frames, refused as it would be, and only for a header the shard checked first. A port
that cannot be reached leaves pulls and pushes on gRPC instead of failing them."""

from __future__ import annotations

import logging
import queue
import secrets
import socket
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
from diloco.transport.bulk import REFUSED, TAKEN, BulkServer, BulkTransferError, Upload, receive, send
from diloco.core.messages import Update
from diloco.shard.answer_slots import AnswerSlots
from diloco.transport.calls import ShardClient, SyncerUnavailable
from diloco.transport.frames import FrameError, read_message, tensor_header
from diloco.transport.wire_messages import update_frames
from diloco.v1 import diloco_pb2 as pb
from diloco.transport.security import PLAINTEXT, TransportSecurity, load_security
from test_security import pki  # noqa: F401 — the module's test certificates, as a fixture here too


def byte_views(*tensors: torch.Tensor) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B") for t in tensors]


@pytest.fixture
def server():
    started = BulkServer("127.0.0.1", PLAINTEXT)
    yield started
    started.close()


def test_a_ticket_gets_exactly_its_bytes_once_and_a_wrong_used_or_expired_one_gets_nothing(server, monkeypatch):
    values = [torch.randn(1000), torch.randn(3, 7), torch.randn(200_000)]
    ticket = server.ticket(byte_views(*values))
    received = [torch.empty_like(v) for v in values]
    receive("127.0.0.1", server.port, ticket, byte_views(*received), PLAINTEXT, "shard 0")
    assert all(torch.equal(a, b) for a, b in zip(received, values))
    for refused_ticket in (ticket, secrets.token_bytes(bulk.TICKET_BYTES)):  # used once already; never issued
        with pytest.raises(BulkTransferError, match="ended after 0 of 4000 bytes of value 0"):
            receive("127.0.0.1", server.port, refused_ticket, byte_views(torch.empty(1000)), PLAINTEXT, "shard 0")
    monkeypatch.setattr(bulk, "TICKET_TTL_S", 0.0)
    expired = server.ticket(byte_views(values[0]))
    with pytest.raises(BulkTransferError, match="ended after 0"):
        receive("127.0.0.1", server.port, expired, byte_views(torch.empty(1000)), PLAINTEXT, "shard 0")
    wait_for(lambda: server.refused == 3, 5, "three refusals counted")
    assert not server.tickets  # nothing held for a ticket nobody can use


def test_tickets_held_are_bounded_the_oldest_going_first(server, monkeypatch):
    monkeypatch.setattr(bulk, "MAX_TICKETS", 2)
    values = [torch.full((10,), float(i)) for i in range(3)]
    tickets = [server.ticket(byte_views(v)) for v in values]
    assert len(server.tickets) == 2
    out = torch.empty(10)
    with pytest.raises(BulkTransferError):
        receive("127.0.0.1", server.port, tickets[0], byte_views(out), PLAINTEXT, "shard 0")
    receive("127.0.0.1", server.port, tickets[2], byte_views(out), PLAINTEXT, "shard 0")
    assert torch.equal(out, values[2])


def test_claims_that_cannot_be_a_bulk_transfer_are_refused_before_connecting():
    for port, ticket in ((0, bytes(32)), (70_000, bytes(32)), (1234, b"short")):
        with pytest.raises(BulkTransferError, match="named bulk port"):
            receive("127.0.0.1", port, ticket, [], PLAINTEXT, "shard 0")


@pytest.mark.integration  # TLS handshakes on loopback
def test_with_tls_in_the_run_the_bulk_port_speaks_tls_only(pki):  # noqa: F811
    served = load_security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), role="server")
    server = BulkServer("127.0.0.1", TransportSecurity(tls_cert=served.tls_cert, tls_key=served.tls_key))
    try:
        value = torch.randn(5000)
        client = load_security(tls_ca=str(pki / "ca.pem"), role="client")
        out = torch.empty(5000)
        receive("127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out), client, "shard 0")
        assert torch.equal(out, value)
        with pytest.raises(BulkTransferError):  # a client that does not speak TLS gets nothing
            receive("127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out), PLAINTEXT, "shard 0")
        untrusting = TransportSecurity(tls_ca=(pki / "server.pem").read_bytes())  # trusts no CA that signed it
        with pytest.raises(BulkTransferError, match="failed"):
            receive("127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out), untrusting,
                    "shard 0")
    finally:
        server.close()


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
    values, versions, layout = over_bulk.pull(0, observer=True)
    framed, framed_versions, framed_layout = in_frames.pull(0, observer=True)
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
    expected, _, _ = _framed_pull(address)
    shard.bulk.close()  # tickets are still issued; nobody answers on the port
    with caplog.at_level(logging.WARNING, logger="diloco.learner"):
        values, _, _ = client.pull(0, observer=True)
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


def test_a_push_ticket_takes_exactly_its_bytes_once_and_answers_on_the_same_connection(server):
    taken: list[bytes] = []

    def take(data: memoryview) -> tuple[int, bytes]:
        taken.append(bytes(data))
        return TAKEN, b"reply"

    data = [torch.randn(1000), torch.randn(50_000)]
    ticket = server.ticket(Upload(sum(v.numel() * 4 for v in data), take))
    assert send("127.0.0.1", server.port, ticket, byte_views(*data), PLAINTEXT, "shard 0") == (TAKEN, b"reply")
    assert taken == [b"".join(bytes(v) for v in byte_views(*data))]
    with pytest.raises(BulkTransferError):  # used once already: the connection closes, nothing is taken
        send("127.0.0.1", server.port, ticket, byte_views(*data), PLAINTEXT, "shard 0")
    short = server.ticket(Upload(8000, take))  # a sender that stops short of what its header declared
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(short + bytes(40))
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(16) == b""  # closed with nothing taken and no reply
    assert len(taken) == 1 and server.received == 1
    wait_for(lambda: server.refused == 1, 5, "the used ticket refused")


def push_of_ones(client: ShardClient, reply: pb.JoinReply, fragment: int, seq: int, value: float = 1e-3):
    """A push of `fragment` from the client's learner, every element `value`, in the run's uplink codec."""
    codec = get_codec(reply.settings.codec_up, reply.settings.block or 0)
    layout = next(f for f in reply.layout if f.index == fragment)
    tensors = {t.name: codec.encode(torch.full(tuple(t.shape), value)) for t in layout.tensors}
    header = pb.PushHeader(learner=reply.learner, fragment=fragment, base_version=0, seq=seq, tokens=64, steps=1,
                           step_time_s=0.01, tensors=[tensor_header(n, e) for n, e in tensors.items()], step=seq)
    return header, tensors


@pytest.mark.integration  # a live shard over real gRPC
def test_a_push_over_the_bulk_port_is_taken_as_the_same_push_in_frames(bulk_shard, monkeypatch):
    shard, address = bulk_shard
    seen: list[tuple[bytes, list[bytes]]] = []
    take_push = PushIntake.take_push

    def recording(self, header, tensors, peer):
        seen.append((header.SerializeToString(), [bytes(e.payload) + bytes(e.scales) for e in tensors.values()]))
        return take_push(self, header, tensors, peer)

    monkeypatch.setattr(PushIntake, "take_push", recording)
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
        receive("127.0.0.1", header.bulk_port, header.bulk_ticket, targets, PLAINTEXT, "shard 0")

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
    receive("127.0.0.1", server.port, ticket, byte_views(torch.empty(250)), PLAINTEXT, "shard 0")
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
    assert client.push(*push_of_ones(client, reply, fragment=0, seq=1)) == pb.PushReply()
    sent = shard.bulk.served
    header, _ = stream.next()
    assert header.fragment == 0 and header.version >= 1 and header.bulk_ticket and shard.bulk.served > sent
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
