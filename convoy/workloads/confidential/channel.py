"""The provider <-> enclave session: X25519 + HKDF-SHA256 key, AES-GCM messages, replay refusal.

A provider that accepted the enclave's report makes a fresh X25519 key, signs a session offer with its
Ed25519 identity key (pinned in the enclave's measured configuration) and both sides derive one AES-256
key from the shared secret, salted with the report's nonce and bound to the party and measurement.

Each message is AES-GCM with a random 96-bit nonce; its header (party, round, sequence number, kind,
direction) is the associated data, so a ciphertext moved to another party, round, position or direction
fails authentication. Sequence numbers only grow per party and direction, so a replayed ciphertext is
refused even where it would decrypt.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from convoy.workloads.confidential.errors import MessageError
from convoy.workloads.confidential.wire import b64, canonical_json, field, unb64, unhex

VERSION = 1
SESSION_INFO = b"convoy-confidential/v1 session key"
TO_ENCLAVE, TO_PROVIDER = "to-enclave", "to-provider"
KINDS = ("data", "model", "shared-model")
AES_NONCE_BYTES = 12


def public_bytes(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def derive_session_key(own_key: X25519PrivateKey, peer_public: bytes, party: str, nonce: str,
                       measurement: str) -> bytes:
    """The 32-byte AES key both ends compute: HKDF-SHA256 over the X25519 shared secret, salted with the
    report's nonce, its info naming the party and the measurement."""
    try:
        shared = own_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise MessageError(f"peer key for {party!r} is not a valid X25519 public key ({exc})") from exc
    info = SESSION_INFO + b"|" + party.encode() + b"|" + bytes.fromhex(measurement)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=bytes.fromhex(nonce), info=info).derive(shared)


@dataclass(frozen=True)
class Header:
    """Who sent what, when, which way: authenticated (AES-GCM associated data), not encrypted."""

    party: str
    round: int
    seq: int
    kind: str
    direction: str

    def associated_data(self) -> bytes:
        return canonical_json({"v": VERSION, **asdict(self)})


@dataclass(frozen=True)
class Sealed:
    """One encrypted message: its header in the clear, the AES-GCM nonce, and ciphertext with tag."""

    header: Header
    nonce: bytes
    ciphertext: bytes

    def to_json(self) -> dict:
        return {**asdict(self.header), "nonce": self.nonce.hex(), "ciphertext": b64(self.ciphertext)}

    @classmethod
    def from_json(cls, data: object) -> Sealed:
        """Parse and type-check a sealed message from the wire; MessageError names the first bad field."""
        if not isinstance(data, dict):
            raise MessageError(f"sealed message must be a JSON object (got {type(data).__name__})")
        header = Header(party=field(data, "party", str), round=field(data, "round", int), seq=field(data, "seq", int),
                        kind=field(data, "kind", str), direction=field(data, "direction", str))
        if header.kind not in KINDS or header.direction not in (TO_ENCLAVE, TO_PROVIDER):
            raise MessageError(f"sealed message has kind {header.kind!r} / direction {header.direction!r}; kinds "
                               f"are {', '.join(KINDS)}, directions {TO_ENCLAVE}, {TO_PROVIDER}")
        if header.round < 0 or header.seq < 0:
            raise MessageError(f"round and seq must be >= 0 (got {header.round}, {header.seq})")
        return cls(header, unhex(data.get("nonce"), "nonce", AES_NONCE_BYTES),
                   unb64(data.get("ciphertext"), "ciphertext"))


def seal(key: bytes, header: Header, payload: bytes) -> Sealed:
    """Encrypt ``payload`` under ``key`` with a fresh random nonce, authenticating ``header``."""
    nonce = os.urandom(AES_NONCE_BYTES)
    return Sealed(header, nonce, AESGCM(key).encrypt(nonce, payload, header.associated_data()))


def open_sealed(key: bytes, sealed: Sealed) -> bytes:
    """Decrypt and authenticate; a changed byte anywhere (header included) or another party's key is refused."""
    try:
        return AESGCM(key).decrypt(sealed.nonce, sealed.ciphertext, sealed.header.associated_data())
    except InvalidTag as exc:
        raise MessageError(
            f"message from {sealed.header.party!r} (round {sealed.header.round}, seq {sealed.header.seq}) failed "
            "authentication: its ciphertext or header was tampered with, or it was sealed under another party's "
            "key; it was dropped") from exc


class ReplayGuard:
    """Sequence numbers must grow per (party, direction): a message seen once is refused the second time."""

    def __init__(self) -> None:
        self.last_seq: dict[tuple[str, str], int] = {}

    def check(self, header: Header) -> None:
        last = self.last_seq.get((header.party, header.direction), -1)
        if header.seq <= last:
            raise MessageError(f"message from {header.party!r} has seq {header.seq}, but seq {last} was already "
                               "accepted: a replayed or reordered message; it was dropped")

    def accept(self, header: Header) -> None:
        """Record ``header`` as seen; call only after it authenticated."""
        self.check(header)
        self.last_seq[(header.party, header.direction)] = header.seq


@dataclass(frozen=True)
class SessionOffer:
    """A provider's request for a session, signed with its identity key: the enclave knows who it is."""

    party: str
    provider_key: str
    nonce: str
    enclave_key: str
    measurement: str
    signature: str = ""

    def body(self) -> bytes:
        fields = asdict(self)
        del fields["signature"]
        return canonical_json(fields)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> SessionOffer:
        if not isinstance(data, dict):
            raise MessageError(f"session offer must be a JSON object (got {type(data).__name__})")
        names = ("party", "provider_key", "nonce", "enclave_key", "measurement", "signature")
        return cls(**{name: field(data, name, str) for name in names})


def sign_offer(identity: Ed25519PrivateKey, offer: SessionOffer) -> SessionOffer:
    return SessionOffer(**{**asdict(offer), "signature": identity.sign(offer.body()).hex()})


def check_offer(offer: SessionOffer, identity_key: str) -> None:
    """Raise MessageError unless ``offer`` carries a valid signature by the party's pinned identity key."""
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(identity_key)).verify(
            unhex(offer.signature, "offer signature", 64), offer.body())
    except InvalidSignature as exc:
        raise MessageError(f"session offer for {offer.party!r} is not signed by that party's identity key: a "
                           "provider cannot open a session under another's name") from exc
