"""The learners' end of the credentials: what every call to a shard carries, bound to the shard's run
identity (`security_settings.call_token`), and the channels that carry it (TLS when the settings say)."""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import replace

import grpc

from diloco.errors import DilocoError
from diloco.transport.security_settings import (PLAINTEXT, LearnerCredential, TransportSecurity, call_token,
                                                secret_token)
from diloco.v1 import diloco_pb2 as pb

METADATA_KEY = "x-diloco-secret"
LEARNER_KEY = "x-diloco-learner"
UNBOUND_METHODS = ("/Join", "/Status")
"""Calls made before a client knows the shard's run identity: they carry `call_token(..., None)`."""
STATUS_METHOD = "/diloco.v1.Syncer/Status"
RUN_LOOKUP_S = 30.0
_RUN_ID = re.compile(r"[0-9a-f]{0,64}")


def channel_tls(security: TransportSecurity) -> grpc.ChannelCredentials:
    """A learner's TLS: verify the syncer with the settings' CA; present their certificate if any."""
    return grpc.ssl_channel_credentials(root_certificates=security.tls_ca, private_key=security.tls_key,
                                        certificate_chain=security.tls_cert)



class ClientIdentity:
    """The credential a channel's calls carry; a learner that joined with the run secret switches to its
    own (`act_as`) once it has an id."""

    def __init__(self, security: TransportSecurity) -> None:
        self._secret, self._own = security.secret, security.learner
        self._learner: int | None = None
        self._token: str | None = None
        """The credential calls are made from (`call_token`): the run token, or a learner's own."""
        self.run: str | None = None
        """The run identity of the shard this identity's channel reaches, once learned ("": it binds none)."""
        if security.learner is not None:
            self._use(security.learner)
        elif security.secret is not None:
            self._token = secret_token(security.secret)

    @property
    def authenticates(self) -> bool:
        return self._token is not None

    def metadata(self, run: str | None) -> tuple[tuple[str, str], ...]:
        """What a call carries: the credential bound to `run` (None: Join and Status), and the learner id."""
        if self._token is None:
            return ()
        named = ((LEARNER_KEY, str(self._learner)),) if self._learner is not None else ()
        return ((METADATA_KEY, call_token(self._token, run)), *named)

    @property
    def learner(self) -> int | None:
        """The learner these calls speak for, if any."""
        return self._learner

    def _use(self, credential: LearnerCredential) -> None:
        self._learner, self._token = credential.learner, credential.token
        if not self.run:
            self.run = None  # "" may stand for the last credential's refusal: ask again with this one

    def act_as(self, learner: int) -> None:
        """Speak for `learner` from now on. A learner given only its own credential cannot be another."""
        if self._own is not None:
            if learner != self._own.learner:
                raise DilocoError(f"this learner holds learner {self._own.learner}'s credential, not learner "
                                  f"{learner}'s: run it with --id {self._own.learner}, or give it the run secret")
        elif self._secret is not None:
            self._use(LearnerCredential.of(self._secret, learner))


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class CredentialClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the identity's credential to every call, of all four kinds (replacing any the caller set),
    bound to the shard's run identity: learned with one Status call on `channel` before the first call
    that needs it."""

    def __init__(self, identity: ClientIdentity, channel: grpc.Channel) -> None:
        self.identity, self._channel = identity, channel

    def _run_for(self, method: str) -> str | None:
        if method.endswith(UNBOUND_METHODS):
            return None
        if self.identity.run is None:
            self.identity.run = self._learn_run()
        return self.identity.run or None

    def _learn_run(self) -> str:
        """The shard's run identity, from its Status; "" from a service without one (nothing to bind), or
        when the shard refuses this credential (the call goes out as it is, to be refused as itself)."""
        status = self._channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                           response_deserializer=pb.StatusReply.FromString)
        try:
            reply = status(pb.StatusRequest(), metadata=self.identity.metadata(None), timeout=RUN_LOOKUP_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ""
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return ""  # until the credential changes (`act_as`): no call of this one can get through
            raise
        if not _RUN_ID.fullmatch(reply.run):
            raise DilocoError(f"the syncer announced a run identity that is not one ({reply.run[:80]!r})")
        return reply.run

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = [m for m in (details.metadata or ()) if m[0] not in (METADATA_KEY, LEARNER_KEY)]
        metadata += self.identity.metadata(self._run_for(method) if self.identity.authenticates else None)
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


def learner_security(security: TransportSecurity, learner: int) -> TransportSecurity:
    """Settings that carry only learner `learner`'s own credential, derived from the run secret."""
    if security.secret is None:
        raise DilocoError("a learner's credential is derived from the run secret: set DILOCO_SECRET or "
                          "--secret-file")
    return replace(security, secret=None, learner=LearnerCredential.of(security.secret, learner))


def make_channel(address: str, security: TransportSecurity | None, options: Sequence[tuple[str, object]] = (),
                 identity: ClientIdentity | None = None) -> grpc.Channel:
    """A channel to a syncer at `address`: TLS when the settings have a CA or a client certificate,
    every call carrying the credential of `identity` (by default the settings' own), if any."""
    security = security or PLAINTEXT
    options = list(options)
    if security.connects_tls:
        if security.server_name:
            options.append(("grpc.ssl_target_name_override", security.server_name))
        channel = grpc.secure_channel(address, channel_tls(security), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    identity = identity or ClientIdentity(security)
    if identity.authenticates:
        channel = grpc.intercept_channel(channel, CredentialClientInterceptor(identity, channel))
    return channel
