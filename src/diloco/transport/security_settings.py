"""Who may talk to a syncer shard: the settings (a shared secret, TLS or mutual TLS), read and checked.

A shared secret that every call carries (the syncer refuses a call without it before reading it);
TLS (server certificate) encrypts the link and lets learners verify the syncer; mutual TLS (a CA
given to the syncer) also makes every learner present a certificate signed by that CA.

The secret comes from `--secret-file FILE` or the environment variable DILOCO_SECRET, never from the
command line (where other users could read it). What travels is not the secret itself but a token
derived from it (HMAC-SHA256), so any bytes make a valid secret; without TLS the token can still be
sniffed and replayed, so use TLS on networks you do not trust.

Each learner also has an identity of its own: learner m's credential is `m:` followed by
HMAC-SHA256(secret, "diloco-learner:m"), and the syncer binds every call that speaks for a learner
(push, heartbeat, leave, updates, pull) to the learner its credential names. Calls carry neither the run
token nor a credential itself but `call_token` of it: bound to the shard's run identity (a random id the
shard keeps with its state, announced by Status), except for Join and Status, which carry a form of
their own. A call recorded in one run is therefore refused by any other run with the same secret. A holder of the run secret
can derive every credential; a learner given only its own (`--learner-token-file` or
DILOCO_LEARNER_TOKEN, printed by `diloco token --learner m`) can act as nobody else.

The same options serve both ends:

    syncer:  --tls-cert/--tls-key  serve TLS     --tls-ca  require client certificates signed by it
    learner: --tls-ca  verify the syncer with it  --tls-cert/--tls-key  present them (mutual TLS)

No gRPC here: the command line builds its parser (and `diloco --help` runs) without loading it;
`security.py` enforces these settings on the wire.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import ssl
from dataclasses import dataclass, field, replace

from diloco.errors import DilocoError

SECRET_ENV = "DILOCO_SECRET"
LEARNER_TOKEN_ENV = "DILOCO_LEARNER_TOKEN"
_TOKEN_CONTEXT = b"diloco.v1 shared secret"
_LEARNER_CONTEXT = b"diloco-learner:"
_JOIN_CONTEXT = b"diloco-call:join"
_RUN_CONTEXT = b"diloco-call:run:"
MAX_LEARNER_ID = 2**32 - 1
"""Learner ids travel as uint32."""


# ---------------------------------------------------------------- reading the configuration


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DilocoError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return data


def resolve_secret(secret_file: str | None) -> bytes | None:
    """The shared secret: the contents of `secret_file` (less a trailing newline), else $DILOCO_SECRET;
    None when neither is set (no authentication). A missing, unreadable or empty file is a one-line error."""
    if secret_file is not None:
        secret = _read(secret_file, "--secret-file").rstrip(b"\r\n")
        if not secret:
            raise DilocoError(f"--secret-file {secret_file} is empty: put the shared secret in it")
        return secret
    value = os.environ.get(SECRET_ENV)
    if value is None:
        return None
    if not value.strip("\r\n"):
        raise DilocoError(f"{SECRET_ENV} is set but empty: set it to the shared secret, or unset it")
    return value.rstrip("\r\n").encode("utf-8")


def secret_token(secret: bytes) -> str:
    """What a call carries in `x-diloco-secret`: printable, whatever bytes the secret holds."""
    return hmac.new(secret, _TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def learner_token(secret: bytes, learner: int) -> str:
    """Learner `learner`'s own token: only the run secret's holder can make it, and it names one learner."""
    return hmac.new(secret, _LEARNER_CONTEXT + str(learner).encode("ascii"), hashlib.sha256).hexdigest()


def call_token(token: str, run: str | None) -> str:
    """What a call carries, made from a credential `token` (the run token, or a learner's own): bound to
    the shard's `run` identity, or (None) the form for Join and Status, made before the run is known. The
    credential itself never travels: a call recorded in one run is refused by another, and nobody who
    saw a call can make the form another run needs."""
    context = _JOIN_CONTEXT if run is None else _RUN_CONTEXT + run.encode("ascii")
    return hmac.new(token.encode("ascii"), context, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class LearnerCredential:
    """What a learner holds when it is given only its own identity: its id and its token."""

    learner: int
    token: str = field(repr=False)

    @classmethod
    def of(cls, secret: bytes, learner: int) -> LearnerCredential:
        return cls(learner, learner_token(secret, learner))

    def text(self) -> str:
        """The form `diloco token` prints and `--learner-token-file` reads: `ID:TOKEN`."""
        return f"{self.learner}:{self.token}"

    @classmethod
    def parse(cls, text: str, where: str) -> LearnerCredential:
        learner, sep, token = text.strip().partition(":")
        if not sep or not learner.isdigit() or int(learner) > MAX_LEARNER_ID or len(token) != 64 \
                or any(c not in "0123456789abcdef" for c in token):
            raise DilocoError(f"{where} does not hold a learner credential (ID:64 hex digits, as printed by "
                              f"`diloco token --learner ID`)")
        return cls(int(learner), token)


def resolve_learner_credential(token_file: str | None) -> LearnerCredential | None:
    """A learner's own credential: the contents of `token_file`, else $DILOCO_LEARNER_TOKEN; None when
    neither is set."""
    if token_file is not None:
        return LearnerCredential.parse(_read(token_file, "--learner-token-file").decode("utf-8", "replace"),
                                       f"--learner-token-file {token_file}")
    value = os.environ.get(LEARNER_TOKEN_ENV)
    return LearnerCredential.parse(value, LEARNER_TOKEN_ENV) if value is not None else None


_PEM_MARKERS = {"--tls-cert": (b"-----BEGIN CERTIFICATE-----", "certificate"),
                "--tls-ca": (b"-----BEGIN CERTIFICATE-----", "certificate"),
                "--tls-key": (b"PRIVATE KEY-----", "private key")}


def read_pem(path: str, option: str) -> bytes:
    data = _read(path, option)
    if b"-----BEGIN" not in data:
        raise DilocoError(f"{option} {path} is not a PEM file (no -----BEGIN line)")
    marker, what = _PEM_MARKERS[option]
    if marker not in data:
        raise DilocoError(f"{option} {path} holds no PEM {what}")
    return data


def _refuse_password(*_) -> bytes:
    raise _EncryptedKey()


class _EncryptedKey(Exception):
    pass


def check_cert_and_key(cert_file: str, key_file: str) -> None:
    """A one-line error for a key that is encrypted or does not belong to the certificate, now rather
    than at the first handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert_file, key_file, password=_refuse_password)
    except _EncryptedKey:
        raise DilocoError(f"--tls-key {key_file} is encrypted: gRPC needs an unencrypted key") from None
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "MISMATCH" in reason.upper():
            raise DilocoError(f"--tls-key {key_file} is not the key of --tls-cert {cert_file}") from None
        raise DilocoError(f"cannot load --tls-cert {cert_file} with --tls-key {key_file}: {reason}") from None
    except OSError as exc:
        raise DilocoError(f"cannot read --tls-cert {cert_file} / --tls-key {key_file}: {exc.strerror}") from None


def check_ca(ca_file: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise DilocoError(f"--tls-ca {ca_file} holds no usable CA certificate ({exc.reason or exc})") from None
    except OSError as exc:
        raise DilocoError(f"cannot read --tls-ca {ca_file}: {exc.strerror}") from None



# ---------------------------------------------------------------- one process's settings


@dataclass(frozen=True)
class TransportSecurity:
    """What one process uses on its gRPC links. PEM contents, not paths: read once, at startup."""

    secret: bytes | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)
    server_name: str | None = None
    """The name to expect in the syncer's certificate, when it differs from the address's host."""
    argv: tuple[str, ...] = ()
    """The options as given (files, never the secret itself), to pass on to child processes."""
    learner: LearnerCredential | None = None
    """A learner given only its own credential, not the run secret."""

    @property
    def authenticates(self) -> bool:
        """Whether calls carry a credential at all (a syncer: whether it demands one)."""
        return self.secret is not None or self.learner is not None

    @property
    def serves_tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None

    @property
    def requires_client_certs(self) -> bool:
        return self.serves_tls and self.tls_ca is not None

    @property
    def connects_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def describe(self, role: str = "server") -> str:
        """One line for logs: what this process enforces or uses."""
        parts = []
        tls = self.serves_tls if role == "server" else self.connects_tls
        mutual = self.requires_client_certs if role == "server" else self.tls_cert is not None
        parts.append(("mutual TLS" if mutual else "TLS") if tls else "plaintext")
        parts.append("shared secret" if self.secret is not None else
                     f"learner {self.learner.learner}'s credential" if self.learner is not None else
                     "no shared secret")
        return ", ".join(parts)


PLAINTEXT = TransportSecurity()


def load_security(*, secret_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                  tls_ca: str | None = None, server_name: str | None = None, role: str = "both",
                  learner_token_file: str | None = None) -> TransportSecurity:
    """Read and check everything now, with one-line errors naming the file. `role`: "server" (a syncer),
    "client" (a learner, or anything calling a syncer) or "both" (`diloco run`, which hands the same
    options to its syncers and learners)."""
    if role not in ("server", "client", "both"):
        raise ValueError(f"role must be server, client or both, got {role!r}")
    if (tls_cert is None) != (tls_key is None):
        raise DilocoError("--tls-cert and --tls-key go together: give both, or neither")
    if tls_ca is not None and tls_cert is None and role in ("server", "both"):
        raise DilocoError("--tls-ca makes the syncer require client certificates, which needs TLS: "
                          "give it --tls-cert and --tls-key too")
    if tls_cert is not None and tls_ca is None and role == "both":
        raise DilocoError("with --tls-cert, diloco run needs --tls-ca too: the learners it starts verify the "
                          "syncer with it (and present the same certificate, so it must allow client use)")
    cert = key = ca = None
    if tls_cert is not None:
        cert, key = read_pem(tls_cert, "--tls-cert"), read_pem(tls_key, "--tls-key")
        check_cert_and_key(tls_cert, tls_key)
    if tls_ca is not None:
        ca = read_pem(tls_ca, "--tls-ca")
        check_ca(tls_ca)
    argv: list[str] = []
    for option, value in (("--secret-file", secret_file), ("--tls-cert", tls_cert), ("--tls-key", tls_key),
                          ("--tls-ca", tls_ca), ("--tls-server-name", server_name)):
        if value is not None:
            argv += [option, str(value)]
    secret = resolve_secret(secret_file)
    learner = resolve_learner_credential(learner_token_file) if role == "client" else None
    if learner_token_file is not None and role != "client":
        raise DilocoError("--learner-token-file is for `diloco learner`: a syncer and `diloco run` need the run "
                          "secret (--secret-file or DILOCO_SECRET)")
    if learner is not None and secret is not None:
        learner = None  # the run secret derives every learner's credential: the learner's own adds nothing
    return TransportSecurity(secret=secret, tls_cert=cert, tls_key=key, tls_ca=ca,
                             server_name=server_name or None, argv=tuple(argv), learner=learner)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (syncer and learners must agree)")
    group.add_argument("--secret-file", metavar="FILE",
                       help="file holding the shared secret every call must carry (default: $DILOCO_SECRET; "
                            "neither: no authentication)")
    group.add_argument("--learner-token-file", metavar="FILE",
                       help="a learner only: file holding its own credential (ID:TOKEN, from `diloco token "
                            "--learner ID`) instead of the run secret (default: $DILOCO_LEARNER_TOKEN)")
    group.add_argument("--tls-cert", metavar="PEM",
                       help="certificate (chain): a syncer serves TLS with it; a learner presents it to a syncer "
                            "that requires client certificates (mutual TLS). Needs --tls-key")
    group.add_argument("--tls-key", metavar="PEM", help="the unencrypted private key of --tls-cert")
    group.add_argument("--tls-ca", metavar="PEM",
                       help="CA certificate(s): a learner connects over TLS and verifies the syncer with them; "
                            "a syncer requires every client to present a certificate they signed")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help="the name to expect in the syncer's certificate, when it differs from the host "
                            "in the address")


def security_from_args(args: argparse.Namespace, role: str = "both") -> TransportSecurity:
    return load_security(secret_file=getattr(args, "secret_file", None), tls_cert=getattr(args, "tls_cert", None),
                         tls_key=getattr(args, "tls_key", None), tls_ca=getattr(args, "tls_ca", None),
                         server_name=getattr(args, "tls_server_name", None), role=role,
                         learner_token_file=getattr(args, "learner_token_file", None))


def default_security() -> TransportSecurity:
    """For callers given no settings (the `diloco.Learner` API): the secret in $DILOCO_SECRET, else the
    learner's own credential in $DILOCO_LEARNER_TOKEN, if any."""
    secret = resolve_secret(None)
    return TransportSecurity(secret=secret, learner=None if secret is not None else resolve_learner_credential(None))


def with_run_secret(security: TransportSecurity) -> tuple[TransportSecurity, dict[str, str]]:
    """For a launcher whose children all run on this machine: when no secret is configured, make a fresh
    one for the run, so other local users cannot talk to its syncers. Returns the settings to use and
    the environment to give the children (empty when a secret was configured: they get it as given)."""
    if security.secret is not None:
        return security, {}
    token = secrets.token_hex(32)
    return replace(security, secret=token.encode()), {SECRET_ENV: token}
