"""The shared secret, each learner's identity and TLS on the wire: the syncer's interceptor and its
listening port (the learners' channels are `client_identity.py`). What the settings are, and how they
are read, is `security_settings.py`.

Nothing untrusted touches state or holds a thread: with a secret configured, the syncer's interceptor
checks the call's metadata in constant time from its headers alone, before any body is read. A refused
call is answered UNAUTHENTICATED with a one-line reason by a request-streaming handler that never waits
for the body (a unary handler would hold a pool thread until the body came), and the refusal is logged
with the caller's address.

Who the caller is (`Caller`, read by the shard's handlers with `current_caller()`):
  * `x-diloco-secret` = the run token, no `x-diloco-learner`: the operator (join, seed, observe, status);
    it speaks for no learner;
  * `x-diloco-learner: m` with learner m's own token: learner m, and only m;
  * under mutual TLS, a client certificate whose CN or a DNS SAN is `learner-m` makes the caller learner
    m (a credential in the metadata must then name the same learner);
  * with no secret and no learner certificate (plaintext development runs, or mutual TLS with a shared
    certificate): `UNCHECKED`, identity is not enforced.
Accepted calls are admitted under per-caller limits (`CallLimits`) before their body is read: excess
calls are refused at once with RESOURCE_EXHAUSTED ("busy: ...") and the client retries.
"""

from __future__ import annotations

import collections
import contextvars
import hmac
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from diloco.errors import DilocoError
from diloco.transport.security_settings import (  # the settings are also found here, next to their enforcement
    LEARNER_TOKEN_ENV, MAX_LEARNER_ID, PLAINTEXT, SECRET_ENV, LearnerCredential, TransportSecurity,
    add_security_arguments, call_token, check_ca, check_cert_and_key, default_security, learner_token, load_security,
    read_pem, resolve_secret, secret_token, security_from_args, with_run_secret)
from diloco.transport.client_identity import (  # the learners' end, found here too
    LEARNER_KEY, METADATA_KEY, STATUS_METHOD, UNBOUND_METHODS, ClientIdentity, CredentialClientInterceptor,
    channel_tls, learner_security, make_channel)

__all__ = ["BUSY", "Caller", "CallLimits", "ClientIdentity", "CredentialInterceptor", "LEARNER_KEY",
           "LEARNER_TOKEN_ENV", "LearnerCredential", "METADATA_KEY", "PLAINTEXT", "REFUSED", "SECRET_ENV",
           "TransportSecurity", "UNCHECKED", "add_security_arguments", "channel_credentials", "current_caller",
           "default_security", "learner_security", "learner_token", "load_security", "make_channel",
           "resolve_secret", "secret_token", "secure_server_port", "security_from_args", "server_credentials",
           "server_interceptors", "server_tls", "channel_tls", "with_run_secret", "CredentialClientInterceptor"]

log = logging.getLogger("diloco.security")

REFUSED = "missing or wrong shared secret: set DILOCO_SECRET or --secret-file to the syncer's"
BUSY = "busy: "
"""How a refusal for want of capacity starts: the client waits and tries again."""
_LEARNER_NAME = re.compile(r"learner-(\d{1,10})")


# ---------------------------------------------------------------- credentials


def _canonical_id(text: str) -> bool:
    """A learner id as the client writes it: decimal digits, no sign, no leading zero ("01" is no id)."""
    return text.isascii() and text.isdigit() and text == str(int(text)) and int(text) <= MAX_LEARNER_ID


def server_tls(security: TransportSecurity) -> grpc.ServerCredentials:
    """The syncer's TLS; with a CA in the settings, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials([(security.tls_key, security.tls_cert)], root_certificates=security.tls_ca,
                                       require_client_auth=security.tls_ca is not None)


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


@dataclass(frozen=True)
class Caller:
    """Who a call comes from, as authenticated: `learner` is the one learner it may speak for."""

    kind: str  # "learner", "operator" or "unchecked"
    learner: int | None = None

    def may_speak_for(self, learner: int) -> bool:
        return self.kind == "unchecked" or (self.kind == "learner" and self.learner == learner)

    def __str__(self) -> str:
        return f"learner {self.learner}" if self.kind == "learner" else \
            "the run secret's holder" if self.kind == "operator" else "an unauthenticated caller"


UNCHECKED = Caller("unchecked")
OPERATOR = Caller("operator")
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("diloco_caller", default=UNCHECKED)


def current_caller() -> Caller:
    """The caller of the call this handler serves. gRPC runs the interceptor's admission and the
    handler (a streaming one's every step too) in one context per call, so this is the call's own."""
    return _CALLER.get()


@dataclass(frozen=True)
class CallLimits:
    """How many calls may run at once: per learner (its update stream, a push, a heartbeat, a retired
    stream still winding down, one spare), for the run secret's holder (joins, seeding, observers)."""

    per_learner: int = 5
    operator: int = 16


def _refusal(code: grpc.StatusCode, message: str, method: str, why: str, response_serializer
             ) -> grpc.RpcMethodHandler:
    """A handler that refuses at once. Request-streaming whatever the method's kind: gRPC then runs it
    without waiting for the body, which may never come."""

    def refuse(_requests, context: grpc.ServicerContext):
        log.warning("refused %s from %s: %s", method, context.peer(), why)
        context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=None,
                                                response_serializer=response_serializer)


class CredentialInterceptor(grpc.ServerInterceptor):
    """Authenticates every call from its metadata before its body is read, admits it under `limits`,
    and makes its `Caller` known to the handler."""

    def __init__(self, secret: bytes | None, learner_certificates: bool = False,
                 limits: CallLimits | None = None, run: str | None = None) -> None:
        """`run`: the shard's run identity, which every call but Join and Status must be bound to."""
        if secret is not None and not secret:
            raise ValueError("an empty shared secret")
        self._secret, self._run = secret, run
        self._run_token = secret_token(secret) if secret is not None else None
        self._learner_certificates = learner_certificates
        self._limits = limits
        self._active: dict[Caller, int] = collections.Counter()
        self._active_lock = threading.Lock()

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None, method: str = STATUS_METHOD
                 ) -> tuple[Caller | None, str]:
        """The caller the metadata of a call to `method` proves, or None and why not."""
        if self._secret is None:
            return UNCHECKED, ""
        given = [v if isinstance(v, bytes) else v.encode("utf-8", "replace")
                 for k, v in (metadata or ()) if k == METADATA_KEY]
        names = [v if isinstance(v, str) else v.decode("ascii", "replace") for k, v in (metadata or ())
                 if k == LEARNER_KEY]
        if not given:
            return None, "no shared secret"
        if len(given) > 1:  # one credential per call: a wrong one next to a right one is not a right one
            return None, "several credentials in one call"
        if len(names) > 1 or (names and not _canonical_id(names[0])):
            return None, "a malformed learner id"
        learner = int(names[0]) if names else None
        token = self._run_token if learner is None else learner_token(self._secret, learner)
        run = None if self._run is None or method.endswith(UNBOUND_METHODS) else self._run
        if not hmac.compare_digest(given[0], call_token(token, run).encode("ascii")):
            return None, "a wrong shared secret" if learner is None else f"a wrong credential for learner {learner}"
        return (OPERATOR if learner is None else Caller("learner", learner)), ""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED and runs nothing
            return None
        method = handler_call_details.method
        caller, why = self.identify(handler_call_details.invocation_metadata, method)
        if caller is None:
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, REFUSED, method, why, handler.response_serializer)
        return self._admitted(handler, caller, method)

    def _certified(self, caller: Caller, context: grpc.ServicerContext) -> Caller | str:
        """Under mutual TLS, the learner a client certificate names; a refusal's reason if the metadata
        names another."""
        if not self._learner_certificates:
            return caller
        auth = context.auth_context() or {}
        names = {n.decode("utf-8", "replace") for key in ("x509_common_name", "x509_subject_alternative_name")
                 for n in auth.get(key, ())}
        learners = {int(m.group(1)) for n in names if (m := _LEARNER_NAME.fullmatch(n))}
        if not learners:
            return caller
        if len(learners) > 1:
            return f"a client certificate naming several learners {sorted(learners)}"
        learner = learners.pop()
        if caller.kind == "learner" and caller.learner != learner:
            return f"a credential for learner {caller.learner} with a certificate for learner {learner}"
        return Caller("learner", learner)

    def _admit(self, caller: Caller) -> bool:
        limits = self._limits
        if limits is None or caller.kind == "unchecked":
            return True
        limit = limits.per_learner if caller.kind == "learner" else limits.operator
        with self._active_lock:
            if self._active[caller] >= limit:
                return False
            self._active[caller] += 1
        return True

    def _release(self, caller: Caller) -> None:
        with self._active_lock:
            self._active[caller] -= 1
            if not self._active[caller]:
                del self._active[caller]

    def active_calls(self) -> dict[Caller, int]:
        with self._active_lock:
            return dict(self._active)

    def _admitted(self, handler: grpc.RpcMethodHandler, caller: Caller, method: str) -> grpc.RpcMethodHandler:
        """`handler` as a request-streaming handler: admission runs as soon as the headers are in, and
        only then is the (one, for a unary method) request read."""
        unary_request = not handler.request_streaming
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

        def admitted(requests, context: grpc.ServicerContext):
            who = self._certified(caller, context)
            if isinstance(who, str):
                log.warning("refused %s from %s: %s", method, context.peer(), who)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"refused: {who}")
            if not self._admit(who):
                log.warning("refused %s from %s: %s has too many calls open", method, context.peer(), who)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{BUSY}{who} has too many calls open")
            if self._limits is not None and who.kind != "unchecked" and not context.add_callback(
                    lambda: self._release(who)):
                self._release(who)  # the call ended already
            _CALLER.set(who)
            if not unary_request:
                return behaviour(requests, context)
            request = next(requests, None)
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request message")
            return behaviour(request, context)

        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming \
            else grpc.stream_unary_rpc_method_handler
        return make(admitted, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def server_interceptors(security: TransportSecurity, limits: CallLimits | None = None, run: str | None = None
                        ) -> list[grpc.ServerInterceptor]:
    """For `grpc.server(..., interceptors=...)`; `run`: the run identity calls are bound to."""
    if security.secret is None and not security.requires_client_certs and limits is None:
        return []
    return [CredentialInterceptor(security.secret, security.requires_client_certs, limits, run)]


def secure_server_port(server: grpc.Server, bind: str, security: TransportSecurity) -> int:
    """Listen on `bind` with TLS when the settings have a certificate, else in plaintext; the port, as
    add_insecure_port returns it (0, or RuntimeError, when the address cannot be bound)."""
    if security.serves_tls:
        return server.add_secure_port(bind, server_tls(security))
    return server.add_insecure_port(bind)
