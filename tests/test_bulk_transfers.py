"""A shard's bulk port, transfer by transfer: a ticket gets exactly the bytes it names, once, to its holder only,
over TLS where the run uses it; a push's ticket takes exactly its bytes and answers on the same connection;
transfers to one port share a kept connection, which the shard bounds and a client never reuses once
closed."""

from __future__ import annotations

import logging
import secrets
import socket

import pytest
import torch

from conftest import wait_for
from diloco.transport import bulk, bulk_client, bulk_idle
from diloco.transport.bulk import TAKEN, BulkServer, BulkTransferError, Upload
from diloco.transport.bulk_client import BulkConnections
from diloco.transport.security import PLAINTEXT, TransportSecurity, load_security
from test_security import pki  # noqa: F401 — the module's test certificates, as a fixture here too


def receive_once(host: str, port: int, ticket: bytes, targets: list[memoryview], security: TransportSecurity,
                 address: str) -> None:
    """A receive on a connection of its own (none kept from an earlier transfer)."""
    connections = BulkConnections(security)
    try:
        bulk_client.receive(connections, host, port, ticket, targets, address)
    finally:
        connections.close()


def send_once(host: str, port: int, ticket: bytes, data: list[memoryview], security: TransportSecurity,
              address: str) -> tuple[int, bytes]:
    connections = BulkConnections(security)
    try:
        return bulk_client.send(connections, host, port, ticket, data, address)
    finally:
        connections.close()


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
    receive_once("127.0.0.1", server.port, ticket, byte_views(*received), PLAINTEXT, "shard 0")
    assert all(torch.equal(a, b) for a, b in zip(received, values))
    for refused_ticket in (ticket, secrets.token_bytes(bulk.TICKET_BYTES)):  # used once already; never issued
        with pytest.raises(BulkTransferError, match="ended after 0 of 4000 bytes of value 0"):
            receive_once("127.0.0.1", server.port, refused_ticket, byte_views(torch.empty(1000)), PLAINTEXT, "shard 0")
    monkeypatch.setattr(bulk, "TICKET_TTL_S", 0.0)
    expired = server.ticket(byte_views(values[0]))
    with pytest.raises(BulkTransferError, match="ended after 0"):
        receive_once("127.0.0.1", server.port, expired, byte_views(torch.empty(1000)), PLAINTEXT, "shard 0")
    wait_for(lambda: server.refused == 3, 5, "three refusals counted")
    assert not server.tickets  # nothing held for a ticket nobody can use


def test_tickets_held_are_bounded_the_oldest_going_first(server, monkeypatch):
    monkeypatch.setattr(bulk, "MAX_TICKETS", 2)
    values = [torch.full((10,), float(i)) for i in range(3)]
    tickets = [server.ticket(byte_views(v)) for v in values]
    assert len(server.tickets) == 2
    out = torch.empty(10)
    with pytest.raises(BulkTransferError):
        receive_once("127.0.0.1", server.port, tickets[0], byte_views(out), PLAINTEXT, "shard 0")
    receive_once("127.0.0.1", server.port, tickets[2], byte_views(out), PLAINTEXT, "shard 0")
    assert torch.equal(out, values[2])


def test_claims_that_cannot_be_a_bulk_transfer_are_refused_before_connecting():
    for port, ticket in ((0, bytes(32)), (70_000, bytes(32)), (1234, b"short")):
        with pytest.raises(BulkTransferError, match="named bulk port"):
            receive_once("127.0.0.1", port, ticket, [], PLAINTEXT, "shard 0")


def test_transfers_to_one_port_share_a_kept_connection_and_a_closed_one_is_never_reused(server, monkeypatch,
                                                                                        caplog):
    connections = BulkConnections(PLAINTEXT)
    value, out = torch.randn(70_000), torch.empty(70_000)
    taken: list[bytes] = []

    def take(data: memoryview) -> tuple[int, bytes]:
        taken.append(bytes(data))
        return TAKEN, b"ok"

    for _ in range(3):  # pulls and pushes in turn, on the one connection
        bulk_client.receive(connections, "127.0.0.1", server.port, server.ticket(byte_views(value)),
                            byte_views(out), "shard 0")
        assert bulk_client.send(connections, "127.0.0.1", server.port, server.ticket(Upload(280_000, take)),
                                byte_views(value), "shard 0") == (TAKEN, b"ok")
    assert torch.equal(out, value) and taken == [bytes(byte_views(value)[0])] * 3
    assert connections.opened == 1 and server.served == 3 and server.received == 3
    # A wrong ticket: the connection it was said on is closed, and so is the new one it is said again on (a
    # kept connection that answers nothing may have been closed by the shard as it was taken).
    with pytest.raises(BulkTransferError, match="ended after 0"):
        bulk_client.receive(connections, "127.0.0.1", server.port, secrets.token_bytes(bulk.TICKET_BYTES),
                            byte_views(out), "shard 0")
    assert connections.opened == 2
    wait_for(lambda: server.refused == 2, 5, "the wrong ticket refused on both")
    bulk_client.receive(connections, "127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out),
                        "shard 0")  # and the next transfer opens another
    assert connections.opened == 3
    monkeypatch.setattr(bulk_idle, "IDLE_S", 0.0)  # the shard closes what waits: the client sees it closed, opens anew
    wait_for(lambda: server.idle.dropped == 1, 5, "the idle connection closed by the shard")
    bulk_client.receive(connections, "127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out),
                        "shard 0")
    assert connections.opened == 4 and server.refused == 2  # only the wrong ticket was refused
    monkeypatch.setattr(bulk_idle, "IDLE_S", 60.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        bulk_client.receive(connections, "127.0.0.1", server.port, server.ticket(byte_views(value)),
                            byte_views(out), "shard 0")
        wait_for(lambda: len(server.idle.since) == 1, 5, "the connection kept by the shard")
        connections.close()  # the client's goodbye: closed quietly, nothing refused
        wait_for(lambda: not server.idle.since, 5, "the closed connection let go")
    assert server.refused == 2 and "bulk" not in caplog.text


def test_connections_kept_by_a_shard_are_bounded_the_longest_idle_closed_first(server, monkeypatch):
    monkeypatch.setattr(bulk_idle, "IDLE_CONNECTIONS", 2)
    clients = [BulkConnections(PLAINTEXT) for _ in range(3)]
    value, out = torch.randn(100), torch.empty(100)
    for opened, client in enumerate(clients, start=1):
        bulk_client.receive(client, "127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out),
                            "shard 0")
        # The server keeps a connection on its own thread once the transfer is sent: wait for it, so that
        # the connections are kept in the clients' order (on a busy host the next client can come first).
        wait_for(lambda: len(server.idle.since) + server.idle.dropped == opened, 5, "the connection kept")
    wait_for(lambda: server.idle.dropped == 1, 5, "the oldest kept connection closed")
    assert len(server.idle.since) == 2
    # The first client's connection was closed: it opens another, which, kept, closes the longest idle (the
    # second client's): each transfer still arrives, on a connection that is open.
    for turn, client in enumerate(clients[:2]):
        wait_for(lambda: server.idle.dropped == turn + 1, 5, "the longest idle connection closed")
        bulk_client.receive(client, "127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out),
                            "shard 0")
        assert torch.equal(out, value)
    assert [c.opened for c in clients] == [2, 2, 1] and server.refused == 0
    monkeypatch.setattr(bulk_client, "KEPT_IDLE_S", 0.0)  # kept past their time: closed by the next kept
    other = BulkServer("127.0.0.1", PLAINTEXT)  # as a restarted shard's new port
    try:
        bulk_client.receive(clients[0], "127.0.0.1", other.port, other.ticket(byte_views(value)), byte_views(out),
                            "shard 0")
        assert list(clients[0]._idle) == [("127.0.0.1", other.port)]  # nothing left kept for the old port
    finally:
        other.close()
    for client in clients:
        client.close()


@pytest.mark.integration  # TLS handshakes on loopback
def test_with_tls_in_the_run_the_bulk_port_speaks_tls_only(pki):  # noqa: F811
    served = load_security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), role="server")
    server = BulkServer("127.0.0.1", TransportSecurity(tls_cert=served.tls_cert, tls_key=served.tls_key))
    try:
        value = torch.randn(5000)
        client = load_security(tls_ca=str(pki / "ca.pem"), role="client")
        out = torch.empty(5000)
        connections = BulkConnections(client)
        for _ in range(2):  # the second on the kept connection, its TLS session and all
            bulk_client.receive(connections, "127.0.0.1", server.port, server.ticket(byte_views(value)),
                                byte_views(out), "shard 0")
            assert torch.equal(out, value)
        assert connections.opened == 1
        connections.close()
        with pytest.raises(BulkTransferError):  # a client that does not speak TLS gets nothing
            receive_once("127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out), PLAINTEXT,
                         "shard 0")
        untrusting = TransportSecurity(tls_ca=(pki / "server.pem").read_bytes())  # trusts no CA that signed it
        with pytest.raises(BulkTransferError, match="failed"):
            receive_once("127.0.0.1", server.port, server.ticket(byte_views(value)), byte_views(out), untrusting,
                    "shard 0")
    finally:
        server.close()


def test_a_push_ticket_takes_exactly_its_bytes_once_and_answers_on_the_same_connection(server):
    taken: list[bytes] = []

    def take(data: memoryview) -> tuple[int, bytes]:
        taken.append(bytes(data))
        return TAKEN, b"reply"

    data = [torch.randn(1000), torch.randn(50_000)]
    ticket = server.ticket(Upload(sum(v.numel() * 4 for v in data), take))
    assert send_once("127.0.0.1", server.port, ticket, byte_views(*data), PLAINTEXT, "shard 0") == (TAKEN, b"reply")
    assert taken == [b"".join(bytes(v) for v in byte_views(*data))]
    with pytest.raises(BulkTransferError):  # used once already: the connection closes, nothing is taken
        send_once("127.0.0.1", server.port, ticket, byte_views(*data), PLAINTEXT, "shard 0")
    short = server.ticket(Upload(8000, take))  # a sender that stops short of what its header declared
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(short + bytes(40))
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(16) == b""  # closed with nothing taken and no reply
    assert len(taken) == 1 and server.received == 1
    wait_for(lambda: server.refused == 1, 5, "the used ticket refused")
