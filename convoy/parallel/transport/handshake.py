"""Who may talk to a role service: on connect, caller and service each prove they hold the job's secret by an
HMAC-SHA256 over both sides' fresh nonces, both identities and the TLS certificate in use (the secret never crosses
the wire, a proof is good for that one connection only, and a relay with a certificate of its own breaks it). The
caller proves first, so a service hands no proof to a stranger; the service proves second, so a caller knows it
talks to the job's service and not to whatever took the port.

    caller -> service   hello      {protocol, role, rank, incarnation, nonce}
    service -> caller   challenge  {role, rank, incarnation, nonce}
    caller -> service   proof      {proof: HMAC(secret, "caller" | transcript)}
    service -> caller   welcome    {proof: HMAC(secret, "service" | transcript)}   or an error reply naming why
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from convoy.errors import ConfigError
from convoy.parallel.transport.errors import REFUSALS, BadMessage, Refused, TransportError
from convoy.parallel.transport.wire import HANDSHAKE_LIMITS, Message, recv_header, recv_message, send_message
from convoy.worker.role_env import SERVICE_SECRET_ENV, SERVICE_TLS_ENV, role

PROTOCOL = 1
NONCE_BYTES = 32
SECRET_BYTES = 32
MAX_ROLE_CHARS = 64
CALLER, SERVICE = b"caller", b"service"


@dataclass(frozen=True)
class Identity:
    """Which process a side of a connection is: its role, its rank in it, and which launch of that rank."""

    role: str
    rank: int
    incarnation: int

    def describe(self) -> str:
        return f"{self.role} {self.rank} (incarnation {self.incarnation})"

    def to_meta(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "incarnation": self.incarnation}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Identity:
        role, rank, incarnation = meta.get("role"), meta.get("rank"), meta.get("incarnation")
        if not (isinstance(role, str) and 0 < len(role) <= MAX_ROLE_CHARS and type(rank) is int and rank >= 0
                and type(incarnation) is int and incarnation >= 0):
            raise BadMessage(f"the hello does not say who is calling (role, rank, incarnation): {dict(meta)}"[:300])
        return cls(role, rank, incarnation)

    def canonical(self) -> bytes:
        return f"{len(self.role)}:{self.role}/{self.rank}/{self.incarnation}".encode()


@dataclass(frozen=True)
class Credentials:
    """What one process presents to the job's role services: the job's secret, whether the job speaks TLS, and
    who the process is."""

    secret: bytes = field(repr=False)
    identity: Identity
    tls: bool = False

    def __post_init__(self) -> None:
        if len(self.secret) < SECRET_BYTES:
            raise ConfigError(f"a role-service secret must be at least {SECRET_BYTES} bytes (got "
                              f"{len(self.secret)}); use the job's ({SERVICE_SECRET_ENV}) or Credentials.fresh()")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """This process's, as its agent set them (``CONVOY_ROLE_SECRET``, ``CONVOY_ROLE_TLS``, its role)."""
        env = os.environ if env is None else env
        raw = env.get(SERVICE_SECRET_ENV, "")
        if not raw:
            raise ConfigError(f"{SERVICE_SECRET_ENV} is not set: a role service and its callers are the processes "
                              "of a convoy job of roles, whose agent sets it; outside a job pass the same "
                              "Credentials(secret=...) to both sides")
        try:
            secret = bytes.fromhex(raw)
        except ValueError as exc:
            raise ConfigError(f"{SERVICE_SECRET_ENV} is not hex digits; it is set by the convoy agent") from exc
        info = role(env)
        return cls(secret, Identity(info.name, info.rank, info.incarnation), env.get(SERVICE_TLS_ENV) == "1")

    @classmethod
    def fresh(cls, identity: Identity | None = None, tls: bool = False) -> Credentials:
        """A new random secret, for a service and callers made in one program (tests, benchmarks)."""
        return cls(secrets.token_bytes(SECRET_BYTES), identity or Identity("client", 0, 0), tls)

    def as_process(self, identity: Identity) -> Credentials:
        """The same secret presented by another process."""
        return replace(self, identity=identity)


Admit = Callable[[Identity], None]
"""Raises ``Refused`` (e.g. ``StaleIncarnation``) for a caller the service must not serve."""


def transcript(caller_nonce: bytes, service_nonce: bytes, caller: Identity, service: Identity,
               certificate: bytes) -> bytes:
    """What both proofs cover: the fresh nonces, both identities and the SHA-256 of the TLS certificate in use."""
    return b"|".join((b"convoy-role-service/%d" % PROTOCOL, caller_nonce, service_nonce, caller.canonical(),
                      service.canonical(), certificate))


def proof(secret: bytes, side: bytes, covered: bytes) -> bytes:
    """One side's proof (its name first: a caller's proof is never a valid service's, nor the other way)."""
    return hmac.new(secret, side + b"|" + covered, hashlib.sha256).digest()


def caller_handshake(sock: Any, credentials: Credentials, certificate: bytes) -> Identity:
    """Run the caller's side; the service's identity once it has proven itself, else ``Refused``."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    send_message(sock, Message("hello", {"protocol": PROTOCOL, **credentials.identity.to_meta(), "nonce": nonce.hex()}))
    challenge = _expect(sock, "challenge")
    service = Identity.from_meta(challenge.meta)
    covered = transcript(nonce, _hex(challenge.meta, "nonce", NONCE_BYTES), credentials.identity, service,
                         certificate)
    send_message(sock, Message("proof", {"proof": proof(credentials.secret, CALLER, covered).hex()}))
    welcome = _expect(sock, "welcome")
    if not hmac.compare_digest(_hex(welcome.meta, "proof", 32), proof(credentials.secret, SERVICE, covered)):
        raise Refused("the service did not prove it holds this job's secret: another job's service or another "
                      "program took its port (or a relay stands between); not using it")
    return service


def service_handshake(sock: Any, credentials: Credentials, certificate: bytes, admit: Admit | None) -> Identity:
    """Run the service's side; the caller's identity once it has proven itself and ``admit`` let it in, else
    ``Refused`` naming why (the caller is then told, and the connection closed)."""
    hello = recv_header(sock, HANDSHAKE_LIMITS)
    if hello.op != "hello" or hello.entries:
        raise Refused(f"this is a convoy role service: a connection starts with the transport's handshake, not "
                      f"{hello.op[:40]!r}; connect with convoy.parallel.transport and the job's secret "
                      f"({SERVICE_SECRET_ENV})")
    if hello.meta.get("protocol") != PROTOCOL:
        raise Refused(f"the caller speaks handshake protocol {hello.meta.get('protocol')!r}, this service "
                      f"{PROTOCOL}; run the same convoy on both sides")
    caller = Identity.from_meta(hello.meta)
    nonce = secrets.token_bytes(NONCE_BYTES)
    send_message(sock, Message("challenge", {**credentials.identity.to_meta(), "nonce": nonce.hex()}))
    covered = transcript(_hex(hello.meta, "nonce", NONCE_BYTES), nonce, caller, credentials.identity, certificate)
    answer = recv_message(sock, HANDSHAKE_LIMITS)
    if answer.op != "proof" or not hmac.compare_digest(_hex(answer.meta, "proof", 32),
                                                       proof(credentials.secret, CALLER, covered)):
        raise Refused(f"{caller.describe()} did not prove it holds this job's secret ({SERVICE_SECRET_ENV}): "
                      "only the job's own processes may use its role services")
    if admit is not None:
        admit(caller)
    send_message(sock, Message("welcome", {"proof": proof(credentials.secret, SERVICE, covered).hex()}))
    return caller


def _expect(sock: Any, op: str) -> Message:
    reply = recv_message(sock, HANDSHAKE_LIMITS)
    if reply.op == "error":
        raise refusal(reply)
    if reply.op != op:
        raise TransportError(f"the peer is not a convoy role service (it answered {reply.op[:40]!r} to the "
                             f"handshake, not {op!r})")
    return reply


def refusal(reply: Message) -> Refused:
    """The exception an ``error`` reply of kind Refused (or one of its kinds) stands for."""
    return REFUSALS.get(str(reply.meta.get("kind")), Refused)(str(reply.meta.get("message", "refused")))


def _hex(meta: Mapping[str, Any], key: str, size: int) -> bytes:
    value = meta.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise BadMessage(f"the handshake's {key!r} is not {size} bytes in hex")
    return raw
