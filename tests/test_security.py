"""Who may talk to a syncer shard: the shared secret on every kind of call, TLS and mutual TLS, and
one-line errors for bad settings. Against the real service, served in this process."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
from concurrent import futures

import grpc
import pytest
import torch

from conftest import tiny_config
from diloco.errors import DilocoError
from diloco.shard.server import ShardPlan, SyncerShard
from diloco.transport.frames import encode_fp32, message_frames, tensor_header
from diloco.transport.security import (
    METADATA_KEY, REFUSED, SECRET_ENV, TransportSecurity, add_security_arguments, learner_security, load_security,
    make_channel, resolve_secret, secure_server_port, security_from_args, server_interceptors, with_run_secret)
from diloco.transport.stream_calls import add_syncer_to_server, syncer_stub
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

SECRET = b"correct horse battery staple"
TIMEOUT = 5


def start_server(security: TransportSecurity, *servicers, run: str | None = None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=server_interceptors(security, run=run))
    for add in servicers:
        add(server)
    port = secure_server_port(server, "127.0.0.1:0", security)
    assert port
    server.start()
    return server, port


@pytest.fixture
def serve_shard():
    """serve_shard(security) → (shard, address): the real SyncerShard behind the given settings."""
    started = []

    def serve(security: TransportSecurity):
        shard = SyncerShard(tiny_config("learners.count=1"), ShardPlan(0, 1, ("",)))
        server, port = start_server(security, lambda s: add_syncer_to_server(shard, s),
                                    run=shard.run_id)
        started.append((shard, server))
        return shard, f"127.0.0.1:{port}"

    yield serve
    for shard, server in started:
        shard.stop()
        server.stop(0)


def stub(address: str, security: TransportSecurity | None) -> pb_grpc.SyncerStub:
    return syncer_stub(make_channel(address, security))


def init_frames(shard: SyncerShard) -> list[pb.Frame]:
    values = {f"w{p}": torch.arange(3, dtype=torch.float32) + p for p in shard.owned}
    layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[3])]) for p in shard.owned]
    encoded = encode_fp32(values)
    header = pb.Frame(state=pb.StateHeader(layout=layout, tensors=[tensor_header(n, e) for n, e in encoded.items()]))
    return list(message_frames(header, encoded))


GARBAGE = [pb.Frame(data=b"\x00junk that is no header")]


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---------------------------------------------------------------- the shared secret


@pytest.mark.integration  # a live server over real gRPC
def test_with_the_secret_every_kind_of_call_reaches_the_shard(serve_shard):
    shard, address = serve_shard(TransportSecurity(secret=SECRET))
    syncer = stub(address, TransportSecurity(secret=SECRET))  # the run secret: joins, seeds, observes
    learner = stub(address, learner_security(TransportSecurity(secret=SECRET), 0))  # speaks for learner 0
    grpc.channel_ready_future(make_channel(address, TransportSecurity(secret=SECRET))).result(timeout=TIMEOUT)
    assert syncer.Status(pb.StatusRequest(), timeout=TIMEOUT).initialised is False           # unary
    assert code_of(lambda: list(syncer.Pull(pb.PullRequest(learner=0), timeout=TIMEOUT)))[0] \
        == grpc.StatusCode.FAILED_PRECONDITION                                              # server stream, unseeded
    assert code_of(lambda: syncer.Init(iter(GARBAGE), timeout=TIMEOUT))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert syncer.Init(iter(init_frames(shard)), timeout=TIMEOUT).accepted                   # client stream
    assert syncer.Join(pb.JoinRequest(learner=0), timeout=TIMEOUT).learner == 0
    frames = list(learner.Pull(pb.PullRequest(learner=0), timeout=TIMEOUT))
    assert frames[0].WhichOneof("body") == "state"
    code, details = code_of(lambda: learner.Push(iter(GARBAGE), timeout=TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bad push" in details                # the frames were read
    updates = learner.Updates(pb.UpdatesRequest(learner=0), timeout=0.3)
    assert code_of(lambda: list(updates))[0] == grpc.StatusCode.DEADLINE_EXCEEDED            # an open, idle stream
    assert learner.Heartbeat(pb.HeartbeatRequest(learner=0, tokens=5, steps=1), timeout=TIMEOUT).tokens_reported == 5
    learner.Leave(pb.LeaveRequest(learner=0), timeout=TIMEOUT)
    assert shard.left == {0}


@pytest.mark.integration  # a live server over real gRPC
@pytest.mark.parametrize("client_secret", [None, b"wrong secret"], ids=["no-secret", "wrong-secret"])
def test_without_the_right_secret_every_call_is_refused_clearly_and_changes_nothing(serve_shard, caplog,
                                                                                   client_secret):
    caplog.set_level(logging.WARNING, logger="diloco.security")
    shard, address = serve_shard(TransportSecurity(secret=SECRET))
    syncer = stub(address, TransportSecurity(secret=client_secret))
    calls = {
        "Join": lambda: syncer.Join(pb.JoinRequest(learner=0), timeout=TIMEOUT),
        "Init": lambda: syncer.Init(iter(init_frames(shard)), timeout=TIMEOUT),
        "Pull": lambda: list(syncer.Pull(pb.PullRequest(learner=0), timeout=TIMEOUT)),
        "Push": lambda: syncer.Push(iter(GARBAGE), timeout=TIMEOUT),
        "Updates": lambda: list(syncer.Updates(pb.UpdatesRequest(learner=0), timeout=TIMEOUT)),
        "Heartbeat": lambda: syncer.Heartbeat(pb.HeartbeatRequest(learner=0, tokens=99), timeout=TIMEOUT),
        "Leave": lambda: syncer.Leave(pb.LeaveRequest(learner=0), timeout=TIMEOUT),
        "Status": lambda: syncer.Status(pb.StatusRequest(), timeout=TIMEOUT),
    }
    for name, call in calls.items():
        assert code_of(call) == (grpc.StatusCode.UNAUTHENTICATED, REFUSED), name
    assert shard.core is None and not shard.joined and not shard.left
    assert not shard.streams and not shard.outboxes and shard.push_errors == 0
    refusals = [r.getMessage() for r in caplog.records if r.name == "diloco.security"]
    why = "no shared secret" if client_secret is None else "a wrong shared secret"
    for name in calls:  # (a client with a secret asks Status for the run identity first: refused too)
        assert [m for m in refusals if f"/diloco.v1.Syncer/{name} " in m and "127.0.0.1" in m and why in m]
    assert len(refusals) == len(calls) + (client_secret is not None)


@pytest.mark.integration  # a live server over real gRPC
def test_a_refused_request_is_never_parsed(serve_shard):
    _, address = serve_shard(TransportSecurity(secret=SECRET))
    channel = make_channel(address, TransportSecurity(secret=b"wrong"))
    raw_join = channel.unary_unary("/diloco.v1.Syncer/Join")  # bytes as they come, no serializer
    code, details = code_of(lambda: raw_join(b"\xff\xff\xff not a protobuf", timeout=TIMEOUT))
    assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, REFUSED)


@pytest.mark.integration  # a live server over real gRPC
def test_a_shard_without_a_secret_accepts_any_caller(serve_shard):
    _, address = serve_shard(TransportSecurity())
    for secret in (None, SECRET):
        assert stub(address, TransportSecurity(secret=secret)).Status(pb.StatusRequest(), timeout=TIMEOUT)


def echo_service(server):
    def unary(request, context):
        return request

    def streams(requests, context):
        return b"".join(requests)

    def fan_out(request, context):
        yield from (request, request)

    handlers = {"UU": grpc.unary_unary_rpc_method_handler(unary),
                "US": grpc.unary_stream_rpc_method_handler(fan_out),
                "SU": grpc.stream_unary_rpc_method_handler(streams),
                "SS": grpc.stream_stream_rpc_method_handler(lambda requests, context: iter(requests))}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", handlers),))


def echo_calls(channel: grpc.Channel, metadata=()) -> list:
    """One call of each kind, each returning what came back."""
    return [lambda: channel.unary_unary("/t.Echo/UU")(b"a", timeout=TIMEOUT, metadata=metadata),
            lambda: b"".join(channel.unary_stream("/t.Echo/US")(b"a", timeout=TIMEOUT, metadata=metadata)),
            lambda: channel.stream_unary("/t.Echo/SU")(iter([b"a", b"a"]), timeout=TIMEOUT, metadata=metadata),
            lambda: b"".join(channel.stream_stream("/t.Echo/SS")(iter([b"a", b"a"]), timeout=TIMEOUT,
                                                                  metadata=metadata))]


@pytest.mark.integration  # a live server over real gRPC
def test_the_secret_travels_and_is_checked_on_all_four_kinds_of_call():
    server, port = start_server(TransportSecurity(secret=SECRET), echo_service)
    address = f"127.0.0.1:{port}"
    try:
        # the right secret, even next to a forged secret header and other metadata the caller sets
        channel = make_channel(address, TransportSecurity(secret=SECRET))
        for metadata in ((), ((METADATA_KEY, "forged"), ("x-other", "1"))):
            assert [call() for call in echo_calls(channel, metadata)] == [b"a", b"aa", b"aa", b"aa"]
        channel.close()
        for secret in (None, b"wrong"):
            channel = make_channel(address, TransportSecurity(secret=secret))
            for call in echo_calls(channel):
                assert code_of(call) == (grpc.StatusCode.UNAUTHENTICATED, REFUSED)
            channel.close()
    finally:
        server.stop(0)


# ---------------------------------------------------------------- TLS and mutual TLS


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def issue(directory, name: str, ca: str, extensions: str) -> None:
    """A P-256 key and a certificate for `name`, signed by the CA `ca`."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    (directory / f"{name}.ext").write_text(extensions)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-set_serial", "1",
            "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA; a server certificate for 127.0.0.1 and localhost; one for another name only; a client one."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed: cannot make test certificates")
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=diloco test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=d)
    issue(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    issue(d, "named", "ca", "subjectAltName=DNS:syncer.internal\nextendedKeyUsage=serverAuth\n")
    issue(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    openssl("pkey", "-in", "client.key", "-aes256", "-passout", "pass:pw", "-out", "encrypted.key", cwd=d)
    return d


def status_of(address: str, security: TransportSecurity) -> pb.StatusReply:
    return stub(address, security).Status(pb.StatusRequest(), timeout=TIMEOUT)


@pytest.mark.integration  # a live server over real gRPC
def test_tls_clients_that_trust_the_ca_get_through_and_plaintext_ones_do_not(serve_shard, pki):
    server = load_security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), role="server")
    _, address = serve_shard(TransportSecurity(secret=SECRET, tls_cert=server.tls_cert, tls_key=server.tls_key))
    client = load_security(tls_ca=str(pki / "ca.pem"), role="client")
    assert status_of(address, TransportSecurity(secret=SECRET, tls_ca=client.tls_ca)).shard == 0
    assert status_of(f"localhost:{address.rsplit(':', 1)[1]}", TransportSecurity(secret=SECRET,
                                                                                tls_ca=client.tls_ca)).shard == 0
    assert code_of(lambda: status_of(address, TransportSecurity(secret=SECRET)))[0] == grpc.StatusCode.UNAVAILABLE
    code, details = code_of(lambda: status_of(address, TransportSecurity(secret=b"wrong", tls_ca=client.tls_ca)))
    assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, REFUSED)  # TLS is no substitute for the secret


@pytest.mark.integration  # a live server over real gRPC
def test_mutual_tls_needs_a_client_certificate_signed_by_the_ca(serve_shard, pki):
    server = load_security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                           tls_ca=str(pki / "ca.pem"), role="server")
    assert server.requires_client_certs and server.describe() == "mutual TLS, no shared secret"
    _, address = serve_shard(server)
    anonymous = load_security(tls_ca=str(pki / "ca.pem"), role="client")
    assert code_of(lambda: status_of(address, anonymous))[0] == grpc.StatusCode.UNAVAILABLE
    with_cert = load_security(tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"),
                              tls_key=str(pki / "client.key"), role="client")
    assert with_cert.describe("client") == "mutual TLS, no shared secret"
    assert status_of(address, with_cert).shard == 0


@pytest.mark.integration  # a live server over real gRPC
def test_a_server_name_override_verifies_a_certificate_made_for_another_name(serve_shard, pki):
    _, address = serve_shard(load_security(tls_cert=str(pki / "named.pem"), tls_key=str(pki / "named.key"),
                                           role="server"))
    plain = load_security(tls_ca=str(pki / "ca.pem"), role="client")
    assert code_of(lambda: status_of(address, plain))[0] == grpc.StatusCode.UNAVAILABLE
    named = load_security(tls_ca=str(pki / "ca.pem"), server_name="syncer.internal", role="client")
    assert status_of(address, named).shard == 0


# ---------------------------------------------------------------- settings and their errors


def one_line_error(fn) -> str:
    with pytest.raises(DilocoError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_secret_comes_from_the_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret(None) is None
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert resolve_secret(None) == b"from-env"
    (tmp_path / "secret").write_bytes(b"from-file\n")
    assert resolve_secret(str(tmp_path / "secret")) == b"from-file"
    monkeypatch.setenv(SECRET_ENV, "")
    assert SECRET_ENV in one_line_error(lambda: resolve_secret(None))


def test_a_bad_secret_file_is_a_one_line_error_naming_it(tmp_path):
    missing = tmp_path / "no-such-secret"
    assert str(missing) in one_line_error(lambda: resolve_secret(str(missing)))
    (tmp_path / "empty").write_bytes(b"\n")
    assert f"{tmp_path / 'empty'} is empty" in one_line_error(lambda: resolve_secret(str(tmp_path / "empty")))
    assert str(tmp_path) in one_line_error(lambda: resolve_secret(str(tmp_path)))  # a folder


def test_bad_certificate_files_are_one_line_errors_naming_them(tmp_path, pki):
    missing = str(tmp_path / "missing.pem")
    assert missing in one_line_error(lambda: load_security(tls_cert=missing, tls_key=str(pki / "server.key"),
                                                           role="server"))
    assert missing in one_line_error(lambda: load_security(tls_ca=missing, role="client"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    junk = str(tmp_path / "junk.pem")
    assert f"{junk} is not a PEM file" in one_line_error(lambda: load_security(tls_ca=junk, role="client"))
    mismatch = one_line_error(lambda: load_security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "client.key"),
                                                    role="server"))
    assert "client.key is not the key of --tls-cert" in mismatch
    assert "holds no PEM private key" in one_line_error(lambda: load_security(
        tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.pem"), role="server"))
    assert "encrypted.key is encrypted" in one_line_error(lambda: load_security(
        tls_cert=str(pki / "client.pem"), tls_key=str(pki / "encrypted.key"), role="client"))
    assert "go together" in one_line_error(lambda: load_security(tls_cert=str(pki / "server.pem"), role="server"))
    assert "needs TLS" in one_line_error(lambda: load_security(tls_ca=str(pki / "ca.pem"), role="server"))
    assert "needs --tls-ca" in one_line_error(lambda: load_security(
        tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), role="both"))


def test_command_line_options_build_the_settings_and_can_be_passed_on(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    (tmp_path / "secret").write_text("s3cret\n")
    parser = argparse.ArgumentParser()
    add_security_arguments(parser)
    args = parser.parse_args(["--secret-file", str(tmp_path / "secret")])
    security = security_from_args(args, role="server")
    assert security.secret == b"s3cret" and not security.serves_tls
    assert security.argv == ("--secret-file", str(tmp_path / "secret"))
    assert "s3cret" not in repr(security)
    assert security_from_args(parser.parse_args([])) == TransportSecurity()
    run_security, env = with_run_secret(security_from_args(parser.parse_args([])))
    assert env[SECRET_ENV].encode() == run_security.secret and len(run_security.secret) == 64
    assert with_run_secret(security) == (security, {})


def test_credentials_from_files(pki):
    from diloco.transport.security import channel_credentials, server_credentials

    assert isinstance(server_credentials(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem")),
                      grpc.ServerCredentials)
    assert isinstance(channel_credentials(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key")),
                      grpc.ChannelCredentials)
    assert "client.key" in one_line_error(lambda: server_credentials(str(pki / "server.pem"), str(pki / "client.key")))


@pytest.mark.integration  # a live server over real gRPC
def test_under_mutual_tls_a_certificate_naming_a_learner_speaks_for_that_learner_only(serve_shard, pki):
    issue(pki, "learner-3", "ca", "extendedKeyUsage=clientAuth\n")
    _, address = serve_shard(load_security(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                                           tls_ca=str(pki / "ca.pem"), role="server"))
    learner_3 = stub(address, load_security(tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "learner-3.pem"),
                                            tls_key=str(pki / "learner-3.key"), role="client"))
    assert not learner_3.Heartbeat(pb.HeartbeatRequest(learner=3), timeout=TIMEOUT).stop
    code, details = code_of(lambda: learner_3.Heartbeat(pb.HeartbeatRequest(learner=2), timeout=TIMEOUT))
    assert code == grpc.StatusCode.PERMISSION_DENIED and details == "learner 3 may not send a heartbeat as learner 2"
    shared = stub(address, load_security(tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"),
                                         tls_key=str(pki / "client.key"), role="client"))
    assert not shared.Heartbeat(pb.HeartbeatRequest(learner=2), timeout=TIMEOUT).stop  # names no learner: unchecked


def test_a_learner_token_from_the_command_line_is_one_line_and_derived_from_the_run_secret(tmp_path, capsys):
    from diloco.cli import main
    from diloco.transport.security import LearnerCredential

    (tmp_path / "secret").write_bytes(SECRET)
    assert main(["token", "--learner", "3", "--secret-file", str(tmp_path / "secret")]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and LearnerCredential.parse(line, "out") == LearnerCredential.of(SECRET, 3)
