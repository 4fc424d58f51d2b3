"""TLS for the role services of a job that runs with TLS. The job has a certificate only for its master, so each
service makes its own: an ephemeral self-signed one, made when it starts listening. No CA vouches for it; the
handshake does (handshake.py): both proofs cover the SHA-256 of the certificate the caller saw, so a caller accepts
the certificate only from a service that also proves it holds the job's secret, and a relay that shows a
certificate of its own fails the proof. TLS 1.3 only: both ends are convoy."""

from __future__ import annotations

import datetime
import functools
import hashlib
import socket
import ssl
import tempfile
from pathlib import Path

from convoy.errors import ConfigError

CERTIFICATE_DAYS = 30
"""How long a service's certificate is valid (it lives as long as the service process)."""


def service_context() -> tuple[ssl.SSLContext, bytes]:
    """A server context with a fresh key and self-signed certificate, and the certificate's SHA-256."""
    key_pem, cert_pem, der = _self_signed()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="convoy-tls-") as folder:  # ssl loads keys from files only; mode 0700
        key, cert = Path(folder) / "key.pem", Path(folder) / "cert.pem"
        key.touch(mode=0o600)
        key.write_bytes(key_pem)
        cert.write_bytes(cert_pem)
        context.load_cert_chain(cert, key)
    return context, hashlib.sha256(der).digest()


@functools.cache
def caller_context() -> ssl.SSLContext:
    """A client context that takes any certificate at the TLS layer: the handshake's proofs check it. One per
    process (making one takes about half a millisecond; it holds no state of a connection)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def seen_certificate(sock: ssl.SSLSocket) -> bytes:
    """The SHA-256 of the certificate the peer showed (what the caller's proof covers)."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError("the service showed no certificate")
    return hashlib.sha256(der).digest()


def wrap_caller(sock: socket.socket) -> tuple[ssl.SSLSocket, bytes]:
    wrapped = caller_context().wrap_socket(sock)
    return wrapped, seen_certificate(wrapped)


def _self_signed() -> tuple[bytes, bytes, bytes]:
    """(key PEM, certificate PEM, certificate DER) of a new P-256 key and a certificate it signed itself."""
    # imported here: an optional dependency that only a job with TLS needs (and slow to import for the others)
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise ConfigError("this job runs with TLS and its role services make their own certificates with the "
                          "'cryptography' package, which is not installed: pip install cryptography") from exc
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "convoy role service")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS)).sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, certificate.public_bytes(serialization.Encoding.PEM), \
        certificate.public_bytes(serialization.Encoding.DER)
