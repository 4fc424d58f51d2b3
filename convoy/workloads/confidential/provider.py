"""A data provider: checks the enclave's report, opens a session, sends its rows or model sealed, and opens
the shared model sealed for it alone. ``seen`` records, in words, everything it saw and did."""

from __future__ import annotations

from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from convoy.workloads.confidential.attestation import (
    AttestationBackend, Report, fresh_nonce, measure, verify_report,
)
from convoy.workloads.confidential.channel import (
    TO_ENCLAVE, TO_PROVIDER, Header, ReplayGuard, Sealed, SessionOffer, derive_session_key, open_sealed,
    public_bytes, seal, sign_offer,
)
from convoy.workloads.confidential.config import EnclaveConfig
from convoy.workloads.confidential.errors import ConfidentialError, MessageError
from convoy.workloads.confidential.platform import Model, fit, model_shapes
from convoy.workloads.confidential.wire import pack_arrays, unpack_arrays


class Provider:
    """One institution: its rows stay here in the clear; only sealed messages leave."""

    def __init__(self, name: str, x: np.ndarray, y: np.ndarray) -> None:
        self.name, self.x, self.y = name, x, y
        self.identity = Ed25519PrivateKey.generate()
        self.nonce = ""
        self.report: Report | None = None
        self.session_key: bytes | None = None
        self.seq = 0
        self.guard = ReplayGuard()
        self.seen: list[str] = []

    @property
    def identity_key(self) -> str:
        """Hex of the Ed25519 public key the enclave's configuration pins for this provider."""
        return public_bytes(self.identity).hex()

    def local_model(self, config: EnclaveConfig, init: Model | None = None) -> Model:
        """This provider's own model, trained on its rows alone (the peer of the shared model)."""
        return fit(config, self.x, self.y, init)

    def challenge(self) -> str:
        """A fresh nonce for the enclave to bind into its report."""
        self.nonce = fresh_nonce()
        return self.nonce

    def accept_report(self, report_json: object, verifier: AttestationBackend, config: EnclaveConfig,
                      allow_simulated: bool = False) -> Report:
        """Verify the report against the measurement this provider computes itself from the installed
        package and ``config``, and against its own nonce; raises AttestationError otherwise."""
        expected = measure(config)
        try:
            report = verify_report(Report.from_json(report_json), verifier, expected, self.nonce, allow_simulated)
        except ConfidentialError as exc:
            self.seen.append(f"refused the enclave's report: {exc}")
            raise
        self.report = report
        label = "SIMULATED (no hardware protection)" if report.simulated else f"hardware ({report.backend})"
        self.seen.append(f"verified report: backend {label}, measurement {report.measurement[:16]}... equals the "
                         f"expected one, fresh nonce {self.nonce[:8]}... bound")
        return report

    def session_offer(self) -> dict[str, Any]:
        """A signed offer with a fresh X25519 key; derives the session key for the attested enclave."""
        if self.report is None:
            raise MessageError(f"{self.name}: verify the enclave's report before opening a session")
        ephemeral = X25519PrivateKey.generate()
        offer = sign_offer(self.identity, SessionOffer(
            party=self.name, provider_key=public_bytes(ephemeral).hex(), nonce=self.report.nonce,
            enclave_key=self.report.enclave_key, measurement=self.report.measurement))
        self.session_key = derive_session_key(ephemeral, bytes.fromhex(self.report.enclave_key), self.name,
                                              self.report.nonce, self.report.measurement)
        self.seq = 0
        self.guard = ReplayGuard()
        return offer.to_json()

    def _seal(self, kind: str, round_id: int, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        if self.session_key is None:
            raise MessageError(f"{self.name}: open a session before sending")
        payload = pack_arrays(arrays)
        sealed = seal(self.session_key, Header(self.name, round_id, self.seq, kind, TO_ENCLAVE), payload)
        self.seq += 1
        self.seen.append(f"round {round_id}: sent its {kind} sealed with AES-GCM ({len(sealed.ciphertext)} bytes "
                         f"of ciphertext, {len(self.x)} rows stay here)" if kind == "data" else
                         f"round {round_id}: sent its local model sealed with AES-GCM ({len(sealed.ciphertext)} "
                         "bytes of ciphertext)")
        return sealed.to_json()

    def seal_data(self, round_id: int = 0) -> dict[str, Any]:
        return self._seal("data", round_id, {"x": self.x, "y": self.y})

    def seal_model(self, round_id: int, model: Model) -> dict[str, Any]:
        return self._seal("model", round_id, {**model, "n_samples": np.asarray(len(self.x), dtype=np.int64)})

    def open_shared_model(self, sealed_json: object, round_id: int, config: EnclaveConfig) -> Model:
        """Decrypt the shared model sealed for this provider; refuses one for another party or round."""
        if self.session_key is None:
            raise MessageError(f"{self.name}: no session to open a shared model with")
        sealed = Sealed.from_json(sealed_json)
        header = sealed.header
        if (header.party, header.round, header.kind, header.direction) != (self.name, round_id, "shared-model",
                                                                           TO_PROVIDER):
            raise MessageError(f"{self.name}: expected its round-{round_id} shared model, got {header}")
        self.guard.check(header)
        arrays = unpack_arrays(open_sealed(self.session_key, sealed))
        self.guard.accept(header)
        shapes = model_shapes(config)
        if {name: value.shape for name, value in arrays.items()} != shapes:
            raise MessageError(f"{self.name}: the shared model has parameters {sorted(arrays)}, expected "
                               f"{sorted(shapes)}")
        self.seen.append(f"round {round_id}: received the shared model, sealed for it alone "
                         f"({len(sealed.ciphertext)} bytes), decrypted and authenticated")
        return arrays
