"""The shared secret and TLS on the wire: the syncer's interceptor, its listening port, the learners'
channels. What the settings are, and how they are read, is `settings.py`.

Nothing untrusted touches state: with a secret configured, the syncer's interceptor checks the
`x-diloco-secret` metadata of every call (unary and streaming alike) in constant time before the
handler runs; a refused call is answered UNAUTHENTICATED with a one-line reason, its payload is never
parsed, and the refusal is logged with the caller's address.
"""

from __future__ import annotations

import collections
import hmac
import logging
from collections.abc import Sequence

import grpc

from diloco.errors import DilocoError
from diloco.transport.settings import (  # the settings are also found here, next to their enforcement
    PLAINTEXT, SECRET_ENV, TransportSecurity, add_security_arguments, check_ca, check_cert_and_key, default_security,
    load_security, read_pem, resolve_secret, secret_token, security_from_args, with_run_secret)

__all__ = ["METADATA_KEY", "PLAINTEXT", "REFUSED", "SECRET_ENV", "SecretClientInterceptor", "SecretInterceptor",
           "TransportSecurity", "add_security_arguments", "channel_credentials", "default_security",
           "load_security", "make_channel", "resolve_secret", "secret_token", "secure_server_port",
           "security_from_args", "server_credentials", "server_interceptors", "server_tls", "channel_tls",
           "with_run_secret"]

log = logging.getLogger("diloco.security")

METADATA_KEY = "x-diloco-secret"
REFUSED = "missing or wrong shared secret: set DILOCO_SECRET or --secret-file to the syncer's"


# ---------------------------------------------------------------- credentials


def server_tls(security: TransportSecurity) -> grpc.ServerCredentials:
    """The syncer's TLS; with a CA in the settings, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials([(security.tls_key, security.tls_cert)], root_certificates=security.tls_ca,
                                       require_client_auth=security.tls_ca is not None)


def channel_tls(security: TransportSecurity) -> grpc.ChannelCredentials:
    """A learner's TLS: verify the syncer with the settings' CA; present their certificate if any."""
    return grpc.ssl_channel_credentials(root_certificates=security.tls_ca, private_key=security.tls_key,
                                        certificate_chain=security.tls_cert)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS for a syncer; with `client_ca_file`, clients must present a certificate signed by it."""
    cert, key = read_pem(cert_file, "--tls-cert"), read_pem(key_file, "--tls-key")
    check_cert_and_key(cert_file, key_file)
    ca = None
    if client_ca_file is not None:
        ca = read_pem(client_ca_file, "--tls-ca")
        check_ca(client_ca_file)
    return server_tls(TransportSecurity(tls_cert=cert, tls_key=key, tls_ca=ca))


def channel_credentials(ca_file: str | None, cert_file: str | None = None,
                        key_file: str | None = None) -> grpc.ChannelCredentials:
    """TLS for a learner: verify the syncer with `ca_file` (the system's CAs when None); present
    `cert_file`/`key_file` when the syncer asks for a client certificate."""
    if (cert_file is None) != (key_file is None):
        raise DilocoError("--tls-cert and --tls-key go together")
    ca = None
    if ca_file is not None:
        ca = read_pem(ca_file, "--tls-ca")
        check_ca(ca_file)
    cert = key = None
    if cert_file is not None:
        cert, key = read_pem(cert_file, "--tls-cert"), read_pem(key_file, "--tls-key")
        check_cert_and_key(cert_file, key_file)
    return channel_tls(TransportSecurity(tls_cert=cert, tls_key=key, tls_ca=ca))


# ---------------------------------------------------------------- the server's end


def _handler_of_kind(handler: grpc.RpcMethodHandler, behaviour) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that runs `behaviour` on the raw, unparsed request."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(bool(handler.request_streaming), bool(handler.response_streaming))](
        behaviour, request_deserializer=None, response_serializer=handler.response_serializer)


class SecretInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `x-diloco-secret` is missing or wrong, before its handler runs."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("an empty shared secret")
        self._token = secret_token(secret).encode("ascii")

    def authorised(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool | None:
        """True for the right token, False for a wrong one, None when there is none."""
        values = [v for k, v in (metadata or ()) if k == METADATA_KEY]
        if not values:
            return None
        ok = False
        for value in values:  # compare every one: the time taken says nothing about which matched
            given = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
            ok |= hmac.compare_digest(given, self._token)
        return ok

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED and runs nothing
            return None
        verdict = self.authorised(handler_call_details.invocation_metadata)
        if verdict:
            return handler
        method = handler_call_details.method
        why = "no shared secret" if verdict is None else "a wrong shared secret"

        def refuse(_request, context: grpc.ServicerContext):
            log.warning("refused %s from %s: %s", method, context.peer(), why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        return _handler_of_kind(handler, refuse)


def server_interceptors(security: TransportSecurity) -> list[grpc.ServerInterceptor]:
    """For `grpc.server(..., interceptors=...)`."""
    return [SecretInterceptor(security.secret)] if security.secret is not None else []


def secure_server_port(server: grpc.Server, bind: str, security: TransportSecurity) -> int:
    """Listen on `bind` with TLS when the settings have a certificate, else in plaintext; the port, as
    add_insecure_port returns it (0, or RuntimeError, when the address cannot be bound)."""
    if security.serves_tls:
        return server.add_secure_port(bind, server_tls(security))
    return server.add_insecure_port(bind)


# ---------------------------------------------------------------- the client's end


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class SecretClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `x-diloco-secret` to every call, of all four kinds."""

    def __init__(self, secret: bytes) -> None:
        self._pair = (METADATA_KEY, secret_token(secret))

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != METADATA_KEY]
        metadata.append(self._pair)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def make_channel(address: str, security: TransportSecurity | None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to a syncer at `address`: TLS when the settings have a CA or a client certificate,
    every call carrying the shared secret when there is one."""
    security = security or PLAINTEXT
    options = list(options)
    if security.connects_tls:
        if security.server_name:
            options.append(("grpc.ssl_target_name_override", security.server_name))
        channel = grpc.secure_channel(address, channel_tls(security), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security.secret is not None:
        channel = grpc.intercept_channel(channel, SecretClientInterceptor(security.secret))
    return channel
