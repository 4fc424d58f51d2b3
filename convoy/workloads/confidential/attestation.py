"""Attestation: what the enclave is (its measurement), and who vouches for it (a backend).

The measurement is the SHA-256 of the enclave's code files and its configuration. The enclave binds it,
its X25519 public key and the provider's fresh nonce into a report; a backend produces evidence over
that report (a signature or a hardware quote) and checks it on the provider's side.

Two backends share one interface:

- ``SimulatedBackend``: a local Ed25519 key stands in for the hardware root of trust. It proves nothing
  about hardware: whoever runs the host holds the key and can forge reports. Every report it makes says
  so (``simulated: true`` and the notice), and providers must opt in to accept it.
- ``HardwareBackend``: Intel TDX quotes through the kernel's configfs-tsm interface, verified with the
  ``dcap-qvl`` library. It refuses, with the reason, on a machine without a TEE device or the library.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import os
import secrets
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from convoy.workloads.confidential.config import EnclaveConfig
from convoy.workloads.confidential.errors import AttestationError, HardwareUnavailableError
from convoy.workloads.confidential.wire import canonical_json

CONVOY_DIR = Path(__file__).resolve().parents[2]
ENCLAVE_CODE = ("__init__.py", "errors.py", "workloads/__init__.py") + tuple(
    f"workloads/confidential/{name}" for name in ("__init__.py", "attestation.py", "channel.py", "config.py",
                                                  "enclave.py", "errors.py", "platform.py", "wire.py"))
"""The files (under the ``convoy`` package) whose bytes are the enclave's code in the measurement: every convoy
module the enclave process loads. Python, numpy, torch and cryptography are not measured (see README)."""
NONCE_BYTES = 32
SIMULATED_NOTICE = ("SIMULATED attestation: a local Ed25519 key stands in for the hardware root of trust; "
                    "no hardware protection")
TEE_DEVICES = {"tdx": "/dev/tdx_guest", "sev-snp": "/dev/sev-guest", "sgx": "/dev/sgx_enclave"}
TSM_REPORTS = Path("/sys/kernel/config/tsm/report")
TDX_REPORT_DATA = slice(568, 632)
"""Where a TDX v4 quote carries its 64 bytes of report data (48-byte header + 520 bytes into the TD report)."""


def measure(config: EnclaveConfig, code_root: Path = CONVOY_DIR) -> str:
    """SHA-256 (hex) of the enclave's code files, then its canonical configuration, each length-prefixed.

    A provider computes this itself from the package it installed and compares it with the report's.
    """
    digest = hashlib.sha256(b"convoy-confidential-measurement/v1\0")
    for name in ENCLAVE_CODE:
        data = (code_root / name).read_bytes()
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    canonical = config.canonical()
    digest.update(b"config\0" + len(canonical).to_bytes(8, "big") + canonical)
    return digest.hexdigest()


def fresh_nonce() -> str:
    """A provider's challenge: 32 random bytes, hex."""
    return secrets.token_hex(NONCE_BYTES)


@dataclass(frozen=True)
class Report:
    """The enclave's statement ``(measurement, public key, nonce)`` plus the backend's evidence over it."""

    backend: str
    simulated: bool
    measurement: str
    enclave_key: str
    nonce: str
    notice: str
    evidence: str

    def body(self) -> bytes:
        """Everything but the evidence, canonically: what the evidence vouches for."""
        fields = asdict(self)
        del fields["evidence"]
        return canonical_json(fields)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Report:
        """Parse a report from the wire; anything missing or of the wrong type is an AttestationError."""
        if not isinstance(data, dict):
            raise AttestationError(f"attestation report must be a JSON object (got {type(data).__name__})")
        kinds = {"backend": str, "simulated": bool, "measurement": str, "enclave_key": str, "nonce": str,
                 "notice": str, "evidence": str}
        if set(data) != set(kinds) or not all(isinstance(data[k], kind) for k, kind in kinds.items()):
            raise AttestationError(f"attestation report is malformed: expected the fields {sorted(kinds)} "
                                   f"with their types, got {sorted(data)}")
        return cls(**data)


class AttestationBackend(ABC):
    """Produces evidence over a report body inside the enclave, and checks it on a provider."""

    name: str
    simulated: bool
    notice: str

    @abstractmethod
    def produce(self, body: bytes) -> bytes:
        """Evidence binding ``body`` (enclave side)."""

    @abstractmethod
    def check(self, report: Report) -> None:
        """Raise AttestationError unless ``report.evidence`` is genuine for ``report.body()`` (provider side)."""


class SimulatedRootOfTrust:
    """Stands in for the CPU vendor's key: the enclave gets the private half, providers the public half."""

    def __init__(self, private_key: Ed25519PrivateKey | None = None) -> None:
        self.private_key = private_key or Ed25519PrivateKey.generate()

    @property
    def public_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def private_bytes(self) -> bytes:
        return self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def enclave_backend(self) -> SimulatedBackend:
        return SimulatedBackend(trust_anchor=self.public_bytes, signing_key=self.private_bytes)

    def verifier(self) -> SimulatedBackend:
        return SimulatedBackend(trust_anchor=self.public_bytes)


class SimulatedBackend(AttestationBackend):
    """Ed25519 signatures by a local key in place of a hardware quote. No hardware protection at all."""

    name = "simulated"
    simulated = True
    notice = SIMULATED_NOTICE

    def __init__(self, trust_anchor: bytes, signing_key: bytes | None = None) -> None:
        self.trust_anchor = Ed25519PublicKey.from_public_bytes(trust_anchor)
        self.signing_key = Ed25519PrivateKey.from_private_bytes(signing_key) if signing_key is not None else None

    def produce(self, body: bytes) -> bytes:
        assert self.signing_key is not None, "only the enclave's backend holds the simulated root key"
        return self.signing_key.sign(body)

    def check(self, report: Report) -> None:
        try:
            self.trust_anchor.verify(bytes.fromhex(report.evidence), report.body())
        except (InvalidSignature, ValueError) as exc:
            raise AttestationError("attestation report's signature does not verify against the simulated root "
                                   "of trust: the report was altered or signed by another key") from exc


def detect_tee(root: Path = Path("/")) -> list[str]:
    """The TEE kinds whose guest device exists under ``root``, e.g. ``["tdx"]``; empty on ordinary machines."""
    return [kind for kind, device in TEE_DEVICES.items() if (root / device.lstrip("/")).exists()]


class HardwareBackend(AttestationBackend):
    """Intel TDX quotes via configfs-tsm, verified with ``dcap-qvl``; refuses clearly where that cannot work.

    Not exercised on the machines this project runs on (none has a TEE): its refusals are tested, the quote
    path is written against the kernel's and dcap-qvl's documented interfaces.
    """

    name = "tdx"
    simulated = False
    notice = "hardware attestation: Intel TDX quote, verified with dcap-qvl"

    def __init__(self, root: Path = Path("/"), expected_mrtd: str | None = None) -> None:
        found = detect_tee(root)
        if not found:
            raise HardwareUnavailableError(
                "no TEE device on this machine (looked for " + ", ".join(TEE_DEVICES.values()) + "): there is no "
                "SGX/TDX/SEV-SNP hardware to attest with; use --backend simulated, which says it is simulated and "
                "gives no hardware protection")
        if "tdx" not in found:
            raise HardwareUnavailableError(
                f"found {', '.join(TEE_DEVICES[kind] for kind in found)}, but only TDX quotes are supported: SGX "
                "would need a library OS (e.g. Gramine) around this Python enclave, and no SEV-SNP report "
                "verification library is wired in; run in a TDX confidential VM or use --backend simulated")
        if importlib.util.find_spec("dcap_qvl") is None:
            raise HardwareUnavailableError("found /dev/tdx_guest but no quote-verification library: install "
                                           "dcap-qvl (pip install dcap-qvl), or use --backend simulated")
        self.root, self.expected_mrtd = root, expected_mrtd

    def produce(self, body: bytes) -> bytes:
        reports = self.root / TSM_REPORTS.relative_to("/")
        if not reports.is_dir():
            raise HardwareUnavailableError(f"{reports} is missing: the kernel lacks configfs-tsm (Linux 6.7+), "
                                           "so no TDX quote can be requested")
        entry = reports / f"convoy-{os.getpid()}-{secrets.token_hex(4)}"
        entry.mkdir()
        try:
            (entry / "inblob").write_bytes(hashlib.sha512(body).digest())
            return (entry / "outblob").read_bytes()
        finally:
            entry.rmdir()

    def check(self, report: Report) -> None:
        if report.backend != self.name:
            raise AttestationError(f"expected a {self.name} report, got a {report.backend} one")
        quote = bytes.fromhex(report.evidence)
        dcap_qvl = importlib.import_module("dcap_qvl")
        try:
            verified = asyncio.run(dcap_qvl.get_collateral_and_verify(quote))
        except Exception as exc:  # the library raises its own types for every way a quote can be bad
            raise AttestationError(f"TDX quote did not verify with dcap-qvl: {exc}") from exc
        status = getattr(verified, "status", "")
        if status != "UpToDate":
            raise AttestationError(f"TDX quote verified with TCB status {status!r}, not 'UpToDate': the platform "
                                   "needs a firmware/microcode update before it can be trusted")
        if quote[TDX_REPORT_DATA] != hashlib.sha512(report.body()).digest():
            raise AttestationError("TDX quote's report data does not bind this report (measurement, key, nonce)")
        if self.expected_mrtd is not None and quote[184:232].hex() != self.expected_mrtd:
            raise AttestationError(f"TDX quote's MRTD {quote[184:232].hex()} is not the expected "
                                   f"{self.expected_mrtd}: another VM image is running")


def make_report(backend: AttestationBackend, measurement: str, enclave_key: bytes, nonce: str) -> Report:
    """Enclave side: the report for one provider's nonce."""
    unsigned = Report(backend=backend.name, simulated=backend.simulated, measurement=measurement,
                      enclave_key=enclave_key.hex(), nonce=nonce, notice=backend.notice, evidence="")
    return Report(**{**asdict(unsigned), "evidence": backend.produce(unsigned.body()).hex()})


def verify_report(report: Report, verifier: AttestationBackend, expected_measurement: str, nonce: str,
                  allow_simulated: bool = False) -> Report:
    """Provider side: accept ``report`` only if its evidence is genuine, it runs the expected code and
    configuration, and it answers this provider's own fresh ``nonce``. Returns it; raises AttestationError."""
    if report.simulated and not allow_simulated:
        raise AttestationError("the enclave's report is SIMULATED (no hardware root of trust); refusing it. "
                               "Accept simulated reports explicitly (allow_simulated / --backend simulated) only "
                               "where no hardware protection is needed")
    if report.simulated != verifier.simulated or report.backend != verifier.name:
        raise AttestationError(f"report comes from the {report.backend!r} backend (simulated={report.simulated}), "
                               f"but this provider verifies {verifier.name!r} reports")
    verifier.check(report)
    if report.measurement != expected_measurement:
        raise AttestationError(f"enclave measurement {report.measurement[:16]}... is not the expected "
                               f"{expected_measurement[:16]}...: the enclave runs other code or another "
                               "configuration; do not send it data")
    if not secrets.compare_digest(report.nonce, nonce):
        raise AttestationError(f"report answers nonce {report.nonce[:16]}..., not this provider's fresh nonce "
                               f"{nonce[:16]}...: a replayed or stale report; ask the enclave again")
    if len(report.enclave_key) != 64:
        raise AttestationError("report's enclave key is not a 32-byte X25519 public key")
    return report
