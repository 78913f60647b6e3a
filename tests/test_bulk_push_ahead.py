"""Tickets ahead: a push taken off a shard's bulk port is answered with a ticket for its learner's next push,
which then sends header and data together, one round trip. The push is taken exactly as the same push
sent the two-step way; the ticket is its learner's alone and good once; a header refused on the port, a
ticket void, or a port gone leaves that push to the two-step way, counted once."""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import Encoded
from diloco.errors import DilocoError
from diloco.transport import bulk
from diloco.transport.bulk import AHEAD_HEADER, BulkTransferError
from diloco.transport.bulk_client import BulkConnections, send
from diloco.transport.calls import ShardClient
from diloco.transport.frames import data_views, tensor_header
from diloco.transport.security import PLAINTEXT
from diloco.v1 import diloco_pb2 as pb
from test_bulk_port import bulk_shard, push_of_ones, recording_pushes  # noqa: F401 — `bulk_shard`: a fixture

pytestmark = pytest.mark.integration  # a live shard over real gRPC


def counting_tickets(shard, monkeypatch) -> list[int]:
    """The two-step tickets the shard hands out (one per push whose header came over gRPC), counted."""
    issued: list[int] = []
    ticket = shard.bulk.ticket
    monkeypatch.setattr(shard.bulk, "ticket", lambda what, done=None: issued.append(1) or ticket(what, done))
    return issued


def say_ahead(address: str, port: int, ticket: bytes, head: bytes, data: list[memoryview]) -> None:
    """A push said on the bulk port with a ticket ahead, by hand: `head` (a length and a header) and `data`."""
    connections = BulkConnections(PLAINTEXT)
    try:
        send(connections, "127.0.0.1", port, ticket, [memoryview(head), *data], address)
    finally:
        connections.close()


def framed(header: pb.PushHeader) -> bytes:
    raw = header.SerializeToString()
    return AHEAD_HEADER.pack(len(raw)) + raw


def test_later_pushes_go_in_one_round_trip_and_are_taken_as_the_two_step_way_takes_them(bulk_shard, monkeypatch):
    shard, address = bulk_shard
    seen = recording_pushes(monkeypatch)
    issued = counting_tickets(shard, monkeypatch)
    client, two_step = ShardClient(address), ShardClient(address)
    reply = client.join(1)
    two_step.join(1)
    for seq, fragment in ((1, 0), (2, 1), (3, 0)):
        assert client.push(*push_of_ones(client, reply, fragment, seq)) == pb.PushReply()  # no ticket shows
    assert len(issued) == 1 and client.ahead is not None  # only the first push's header went over gRPC
    assert shard.bulk.received == 3 and shard.bulk.refused == 0
    with shard.lock:
        assert shard.core.ledger[1].pushes == 3 and shard.core.ledger[1].duplicates == 0
    assert two_step.push(*push_of_ones(two_step, reply, 0, 3)).duplicate  # the same push the two-step way
    assert seen[2] == seen[3]  # header and data taken alike
    for c in (client, two_step):
        c.close()


def test_a_ticket_ahead_is_its_learners_alone_and_good_once(bulk_shard):
    shard, address = bulk_shard
    client = ShardClient(address)
    reply = client.join(1)
    client.push(*push_of_ones(client, reply, 0, 1))
    port, ticket = client.ahead
    with shard.lock:
        theta = {n: v.clone() for n, v in shard.core.theta.items()}
    header, tensors = push_of_ones(client, reply, 1, 2)
    header.learner = 0  # another learner's push with learner 1's ticket
    refused = shard.bulk.refused
    with pytest.raises(BulkTransferError):
        say_ahead(address, port, ticket, framed(header), data_views(tensors.values()))
    assert shard.bulk.refused == refused + 1
    header.learner = 1
    with pytest.raises(BulkTransferError):  # the ticket went with its first use
        say_ahead(address, port, ticket, framed(header), data_views(tensors.values()))
    with shard.lock:
        assert all(torch.equal(shard.core.theta[n], theta[n]) for n in theta)
        assert shard.core.ledger[1].pushes == 1 and (0 not in shard.core.ledger or not shard.core.ledger[0].pushed(1))
    client.ahead = (port, ticket)  # the learner still holds the used ticket: its push goes the two-step way
    assert client.push(header, tensors) == pb.PushReply()
    with shard.lock:
        assert shard.core.ledger[1].pushes == 2 and shard.core.ledger[1].pushed(1) == 2
    client.close()


@pytest.mark.parametrize("case", ["garbage", "too long", "fragment not held", "more than the limit", "NaN data"])
def test_a_bad_push_with_a_ticket_ahead_is_refused_and_changes_nothing(bulk_shard, case):
    shard, address = bulk_shard
    client = ShardClient(address)
    reply = client.join(1)
    client.push(*push_of_ones(client, reply, 0, 1))
    (port, ticket), client.ahead = client.ahead, None
    with shard.lock:
        theta = {n: v.clone() for n, v in shard.core.theta.items()}
    header, tensors = push_of_ones(client, reply, 1, 2)
    data = data_views(tensors.values())
    if case == "garbage":
        head = AHEAD_HEADER.pack(5) + b"\xff\xff\xff\xff\xff"
    elif case == "too long":
        head = AHEAD_HEADER.pack(bulk.MAX_AHEAD_HEADER_BYTES + 1)
    elif case == "fragment not held":
        header.fragment = 7
        head = framed(header)
    elif case == "more than the limit":
        header.tensors[0].shape[0] = 1 << 30
        head = framed(header)
    if case == "NaN data":  # the header passes; the data is refused as the two-step way refuses it
        nan = {n: Encoded("fp32", e.shape, 0, memoryview(torch.full(e.shape, float("nan")).numpy()).cast("B"))
               for n, e in tensors.items()}  # no codec encodes NaN: its bytes by hand
        header = pb.PushHeader(learner=1, fragment=1, seq=2, tokens=64, steps=1, step=2,
                               tensors=[tensor_header(n, e) for n, e in nan.items()])
        client.ahead = (port, ticket)
        with pytest.raises(DilocoError, match="refused push.*NaN"):
            client.push(header, nan)
    else:
        with pytest.raises(BulkTransferError):
            say_ahead(address, port, ticket, head, data)
    with shard.lock:
        assert all(torch.equal(shard.core.theta[n], theta[n]) for n in theta)
        assert shard.core.ledger[1].pushed(1) == 0
    assert client.push(*push_of_ones(client, reply, 1, 3)) == pb.PushReply()  # the learner goes on
    client.close()


def test_a_void_ticket_or_a_gone_port_leaves_the_push_to_the_two_step_way(bulk_shard, monkeypatch):
    shard, address = bulk_shard
    issued = counting_tickets(shard, monkeypatch)
    client = ShardClient(address)
    reply = client.join(1)
    monkeypatch.setattr(bulk, "AHEAD_TTL_S", 0.0)  # every ticket ahead void as soon as it is given
    client.push(*push_of_ones(client, reply, 0, 1))
    assert client.ahead is not None
    client.push(*push_of_ones(client, reply, 0, 2))  # its ticket was void: sent the two-step way
    client.ahead = (1, bytes(bulk.TICKET_BYTES))  # a port where nothing listens (a restarted shard's old one)
    client.push(*push_of_ones(client, reply, 0, 3))
    assert len(issued) == 3 and client.bulk_misses == 0 and not client.bulk_failed
    with shard.lock:
        assert shard.core.ledger[1].pushes == 3 and shard.core.ledger[1].duplicates == 0
    client.close()


def test_a_shard_with_pushes_waiting_hands_out_no_ticket_ahead(bulk_shard, monkeypatch):
    """Pushes back to back took the CPU a saturated shard's answers needed (docs/benchmarks.md): while a push
    waits for the shard, the reply gives no ticket ahead, and the learner's next push asks by a gRPC call."""
    shard, address = bulk_shard
    client = ShardClient(address)
    reply = client.join(1)
    monkeypatch.setattr(shard.push_queue, "waiting", lambda: 1)
    client.push(*push_of_ones(client, reply, 0, 1))
    assert client.ahead is None and not shard.bulk.ahead
    monkeypatch.undo()
    client.push(*push_of_ones(client, reply, 0, 2))
    assert client.ahead is not None and len(shard.bulk.ahead) == 1
    client.close()
