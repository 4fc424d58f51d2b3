"""Scripted attacks by a hostile host or provider, each of which must be refused (demo and tests).

Each function performs one attack against a running enclave whose providers have sessions, and returns
the error that refused it; it raises ``AttackNotRefused`` if the attack went through. None of them
leaves rows or a model in the enclave: its status afterwards shows nothing pending.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable

import numpy as np

from convoy.workloads.confidential.attestation import AttestationBackend, SimulatedRootOfTrust
from convoy.workloads.confidential.channel import TO_ENCLAVE, Header, seal
from convoy.workloads.confidential.config import EnclaveConfig, Party
from convoy.workloads.confidential.errors import ERROR_TYPES, ConfidentialError
from convoy.workloads.confidential.host import EnclaveHost
from convoy.workloads.confidential.provider import Provider
from convoy.workloads.confidential.wire import pack_arrays

Attack = Callable[[EnclaveHost, list[Provider], EnclaveConfig, AttestationBackend], ConfidentialError]


class AttackNotRefused(AssertionError):
    """An attack that should have been refused was accepted: a security bug."""


def _expect_refusal(action: Callable[[], object], what: str) -> ConfidentialError:
    try:
        action()
    except ConfidentialError as exc:
        return exc
    raise AttackNotRefused(f"{what} was accepted")


def wrong_measurement(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                      verifier: AttestationBackend) -> ConfidentialError:
    """The host starts a second enclave whose configuration adds a party of its own (same code, same root)
    and offers it to a provider, which expects the genuine configuration."""
    rogue_config = dataclasses.replace(config, parties=(*config.parties, Party("operator", "00" * 32)))
    root = host.root or SimulatedRootOfTrust()
    victim = providers[0]
    with EnclaveHost(rogue_config, root, reply_timeout_s=host.reply_timeout_s) as rogue:
        report = rogue.call("attest", nonce=victim.challenge())["report"]
        return _expect_refusal(lambda: victim.accept_report(report, verifier, config, allow_simulated=True),
                               "a report with another measurement")


def replayed_report(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                    verifier: AttestationBackend) -> ConfidentialError:
    """The host answers a provider's fresh challenge with a report it recorded earlier (an old nonce)."""
    victim = providers[0]
    old_report = host.call("attest", nonce=victim.challenge())["report"]
    victim.challenge()  # the provider's next session starts with a new nonce ...
    return _expect_refusal(lambda: victim.accept_report(old_report, verifier, config, allow_simulated=True),
                           "a replayed report")  # ... and the host replays the old report


def _kind(config: EnclaveConfig) -> str:
    return "data" if config.mode == "data" else "model"


def _arrays(provider: Provider, config: EnclaveConfig) -> dict[str, np.ndarray]:
    """What ``provider`` sends in this mode: its rows, or its local model and row count."""
    if config.mode == "data":
        return {"x": provider.x, "y": provider.y}
    return {**provider.local_model(config), "n_samples": np.asarray(len(provider.x), dtype=np.int64)}


def _seal_next(provider: Provider, party: str, config: EnclaveConfig, arrays: dict[str, np.ndarray]) -> dict:
    """``arrays`` sealed under ``provider``'s session key and next sequence number, labelled as ``party``."""
    if provider.session_key is None:
        raise AttackNotRefused(f"this attack needs {provider.name!r} to have a session")
    sealed = seal(provider.session_key, Header(party, 0, provider.seq, _kind(config), TO_ENCLAVE),
                  pack_arrays(arrays))
    provider.seq += 1
    return sealed.to_json()


def tampered_ciphertext(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                        verifier: AttestationBackend) -> ConfidentialError:
    """The host flips one bit of a provider's sealed message on the way to the enclave."""
    message = _seal_next(providers[0], providers[0].name, config, _arrays(providers[0], config))
    ciphertext = bytearray(base64.b64decode(message["ciphertext"]))
    ciphertext[len(ciphertext) // 2] ^= 0x01
    message["ciphertext"] = base64.b64encode(bytes(ciphertext)).decode()
    return _expect_refusal(lambda: host.call("submit", message=message), "a tampered ciphertext")


def replayed_ciphertext(host: EnclaveHost, message: dict) -> ConfidentialError:
    """The host sends a genuine sealed message a second time, after the enclave accepted it once."""
    return _expect_refusal(lambda: host.call("submit", message=message), "a replayed ciphertext")


def impersonation(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                  verifier: AttestationBackend) -> ConfidentialError:
    """Provider 1 sends its rows (or model) labelled as provider 0's, sealed under its own session key."""
    attacker, victim = providers[1], providers[0]
    forged = _seal_next(attacker, victim.name, config, _arrays(attacker, config))
    return _expect_refusal(lambda: host.call("submit", message=forged),
                           "a message sent under another provider's name")


def impersonated_session(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                         verifier: AttestationBackend) -> ConfidentialError:
    """Provider 1 tries to open a session as provider 0 (it cannot sign with provider 0's identity key)."""
    attacker, victim = providers[1], providers[0]
    impostor = Provider(victim.name, attacker.x, attacker.y)  # victim's name, attacker's own identity key
    report = host.call("attest", nonce=impostor.challenge())["report"]
    impostor.accept_report(report, verifier, config, allow_simulated=True)
    return _expect_refusal(lambda: host.call("open_session", offer=impostor.session_offer()),
                           "a session opened under another provider's name")


def malformed_frame(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                    verifier: AttestationBackend) -> ConfidentialError:
    """A frame that is not JSON at all."""
    return _expect_refusal(lambda: _raise_if_refused(host.send_raw(b"\x00\xffnot json{")), "a non-JSON frame")


def malformed_message(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                      verifier: AttestationBackend) -> ConfidentialError:
    """A submit whose sealed message has a string where the round number belongs and no ciphertext."""
    message = {"party": providers[0].name, "round": "zero", "seq": 1, "kind": "data", "direction": TO_ENCLAVE}
    return _expect_refusal(lambda: host.call("submit", message=message), "a malformed message")


def malformed_rows(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig,
                   verifier: AttestationBackend) -> ConfidentialError:
    """A genuine provider's authentic message whose content is broken: a NaN and one column short."""
    arrays = {name: value.copy() for name, value in _arrays(providers[0], config).items()}
    name = "x" if config.mode == "data" else min(arrays)
    arrays[name] = arrays[name][..., :-1].copy()
    arrays[name].flat[0] = np.nan
    bad = _seal_next(providers[0], providers[0].name, config, arrays)
    return _expect_refusal(lambda: host.call("submit", message=bad), "rows or a model of the wrong shape")


def _raise_if_refused(reply: dict) -> None:
    if not reply.get("ok"):
        raise ERROR_TYPES.get(reply.get("error_type", ""), ConfidentialError)(reply.get("error", ""))


ATTACKS: dict[str, Attack] = {
    "wrong measurement": wrong_measurement,
    "replayed report (old nonce)": replayed_report,
    "tampered ciphertext": tampered_ciphertext,
    "sending under another's name": impersonation,
    "opening a session under another's name": impersonated_session,
    "malformed frame (not JSON)": malformed_frame,
    "malformed message (bad field types)": malformed_message,
    "malformed content (NaN, wrong width)": malformed_rows,
}
"""Run before the genuine submissions of round 0; ``replayed_ciphertext`` runs after one was accepted."""


def describe(exc: ConfidentialError) -> str:
    """``ClassName: message``, as the demo prints a refusal."""
    return f"{type(exc).__name__}: {exc}"
