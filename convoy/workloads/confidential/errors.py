"""What confidential shared learning refuses: bad reports, bad messages, an enclave that is gone."""

from __future__ import annotations

from convoy.errors import ConvoyError


class ConfidentialError(ConvoyError):
    """Base class of this workload's errors; the enclave answers each with its class name and message."""


class AttestationError(ConfidentialError):
    """An attestation report failed verification (wrong measurement, stale nonce, bad signature or quote)."""


class HardwareUnavailableError(AttestationError):
    """The hardware backend was asked for, but this machine has no TEE device or no quote-verification library."""


class MessageError(ConfidentialError):
    """A message to or from the enclave was malformed, tampered with, replayed, or sent under the wrong name."""


class EnclaveError(ConfidentialError):
    """The enclave process could not be started, or stopped answering."""


ERROR_TYPES: dict[str, type[ConfidentialError]] = {
    cls.__name__: cls for cls in (ConfidentialError, AttestationError, HardwareUnavailableError, MessageError,
                                  EnclaveError)
}
"""By name, so the host can raise the same class the enclave refused a request with."""
