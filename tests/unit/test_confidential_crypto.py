"""Attestation, session keys, sealed messages and the wire format of confidential shared learning (no processes)."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from convoy.workloads.confidential.attestation import (
    CONVOY_DIR, ENCLAVE_CODE, HardwareBackend, Report, SimulatedRootOfTrust, fresh_nonce, make_report, measure,
    verify_report,
)
from convoy.workloads.confidential.channel import (
    TO_ENCLAVE, TO_PROVIDER, Header, ReplayGuard, Sealed, SessionOffer, check_offer, derive_session_key,
    open_sealed, public_bytes, seal, sign_offer,
)
from convoy.workloads.confidential.config import EnclaveConfig, Party
from convoy.workloads.confidential.errors import AttestationError, HardwareUnavailableError, MessageError
from convoy.workloads.confidential.wire import (
    pack_arrays, recv_frame, send_frame, send_raw_frame, unpack_arrays,
)


@pytest.fixture
def config() -> EnclaveConfig:
    return EnclaveConfig(task="linear", features=3, parties=(Party("a", "11" * 32), Party("b", "22" * 32)))


@pytest.fixture
def root() -> SimulatedRootOfTrust:
    return SimulatedRootOfTrust()


def report_for(root: SimulatedRootOfTrust, measurement: str, nonce: str) -> Report:
    return make_report(root.enclave_backend(), measurement, public_bytes(X25519PrivateKey.generate()), nonce)


def test_measurement_covers_code_and_configuration(config: EnclaveConfig, tmp_path: Path) -> None:
    assert measure(config) == measure(EnclaveConfig.from_json(config.to_json()))
    assert measure(config) != measure(dataclasses.replace(config, epochs=config.epochs + 1))
    assert measure(config) != measure(dataclasses.replace(config, parties=config.parties[:1]))
    for name in ENCLAVE_CODE:  # a copy of the code measures the same; one changed byte does not
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CONVOY_DIR / name, tmp_path / name)
    assert measure(config, tmp_path) == measure(config)
    platform = tmp_path / "workloads/confidential/platform.py"
    platform.write_text(platform.read_text() + "\n# changed\n")
    assert measure(config, tmp_path) != measure(config)


def test_a_genuine_simulated_report_verifies_and_says_it_is_simulated(config: EnclaveConfig,
                                                                       root: SimulatedRootOfTrust) -> None:
    nonce = fresh_nonce()
    report = report_for(root, measure(config), nonce)
    assert report.simulated and "SIMULATED" in report.notice and "no hardware protection" in report.notice
    assert verify_report(Report.from_json(report.to_json()), root.verifier(), measure(config), nonce,
                         allow_simulated=True) == report


def test_a_simulated_report_is_refused_unless_the_provider_opts_in(config: EnclaveConfig,
                                                                    root: SimulatedRootOfTrust) -> None:
    nonce = fresh_nonce()
    with pytest.raises(AttestationError, match="SIMULATED .*refusing it"):
        verify_report(report_for(root, measure(config), nonce), root.verifier(), measure(config), nonce)


def test_wrong_measurement_is_refused(config: EnclaveConfig, root: SimulatedRootOfTrust) -> None:
    nonce = fresh_nonce()
    rogue = measure(dataclasses.replace(config, parties=(*config.parties, Party("operator", "33" * 32))))
    with pytest.raises(AttestationError, match="is not the expected .*other code or another configuration"):
        verify_report(report_for(root, rogue, nonce), root.verifier(), measure(config), nonce, allow_simulated=True)


def test_a_report_for_an_old_nonce_is_refused(config: EnclaveConfig, root: SimulatedRootOfTrust) -> None:
    old = report_for(root, measure(config), fresh_nonce())
    with pytest.raises(AttestationError, match="replayed or stale report"):
        verify_report(old, root.verifier(), measure(config), fresh_nonce(), allow_simulated=True)


@pytest.mark.parametrize("change", [
    {"measurement": "00" * 32}, {"enclave_key": "ab" * 32}, {"nonce": "cd" * 32}, {"simulated": True, "notice": "x"},
])
def test_an_altered_report_fails_its_signature(config: EnclaveConfig, root: SimulatedRootOfTrust,
                                               change: dict) -> None:
    nonce = fresh_nonce()
    altered = dataclasses.replace(report_for(root, measure(config), nonce), **change)
    with pytest.raises(AttestationError, match="signature does not verify"):
        verify_report(altered, root.verifier(), altered.measurement, altered.nonce, allow_simulated=True)


def test_a_report_signed_by_another_root_is_refused(config: EnclaveConfig, root: SimulatedRootOfTrust) -> None:
    nonce = fresh_nonce()
    forged = report_for(SimulatedRootOfTrust(), measure(config), nonce)
    with pytest.raises(AttestationError, match="signature does not verify"):
        verify_report(forged, root.verifier(), measure(config), nonce, allow_simulated=True)


@pytest.mark.parametrize("data", [None, [], {"backend": "simulated"}, {**dict.fromkeys(
    ("backend", "measurement", "enclave_key", "nonce", "notice", "evidence"), "x"), "simulated": "yes"}])
def test_a_malformed_report_is_refused(data: object) -> None:
    with pytest.raises(AttestationError, match="report"):
        Report.from_json(data)


def test_hardware_backend_refuses_without_a_tee_device(tmp_path: Path) -> None:
    with pytest.raises(HardwareUnavailableError, match="no TEE device.*/dev/tdx_guest.*--backend simulated"):
        HardwareBackend(root=tmp_path)


@pytest.mark.parametrize(("device", "expected"), [
    ("tdx_guest", "no quote-verification library: install dcap-qvl"),
    ("sev-guest", "only TDX quotes are supported"),
    ("sgx_enclave", "only TDX quotes are supported"),
])
def test_hardware_backend_refuses_what_it_cannot_verify(tmp_path: Path, device: str, expected: str) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / device).write_bytes(b"")
    if device == "tdx_guest" and importlib.util.find_spec("dcap_qvl") is not None:
        pytest.skip("dcap-qvl is installed here, so the TDX case goes on to request a quote")
    with pytest.raises(HardwareUnavailableError, match=expected):
        HardwareBackend(root=tmp_path)


def keys_for(party: str = "a") -> tuple[bytes, bytes]:
    """(provider's key, enclave's key) derived from one exchange, as both ends compute them."""
    provider, enclave = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    nonce, measurement = "ab" * 32, "cd" * 32
    return (derive_session_key(provider, public_bytes(enclave), party, nonce, measurement),
            derive_session_key(enclave, public_bytes(provider), party, nonce, measurement))


def test_both_ends_derive_the_same_session_key_and_it_depends_on_the_party() -> None:
    provider_key, enclave_key = keys_for()
    assert provider_key == enclave_key and len(provider_key) == 32
    provider, enclave = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    assert derive_session_key(provider, public_bytes(enclave), "a", "ab" * 32, "cd" * 32) != \
        derive_session_key(provider, public_bytes(enclave), "b", "ab" * 32, "cd" * 32)


def test_sealed_message_round_trips_and_any_change_is_refused() -> None:
    key, _ = keys_for()
    header = Header("a", 0, 0, "data", TO_ENCLAVE)
    sealed = Sealed.from_json(seal(key, header, b"rows").to_json())
    assert open_sealed(key, sealed) == b"rows"
    flipped = bytearray(sealed.ciphertext)
    flipped[0] ^= 1
    other_key, _ = keys_for("b")
    for bad in (dataclasses.replace(sealed, ciphertext=bytes(flipped)),
                dataclasses.replace(sealed, header=dataclasses.replace(header, round=1)),
                dataclasses.replace(sealed, header=dataclasses.replace(header, party="b")),
                dataclasses.replace(sealed, header=dataclasses.replace(header, direction=TO_PROVIDER))):
        with pytest.raises(MessageError, match="failed authentication"):
            open_sealed(key, bad)
    with pytest.raises(MessageError, match="sealed under another party's key"):
        open_sealed(other_key, sealed)


def test_replay_guard_refuses_a_sequence_number_seen_before() -> None:
    guard = ReplayGuard()
    guard.accept(Header("a", 0, 0, "data", TO_ENCLAVE))
    guard.accept(Header("b", 0, 0, "data", TO_ENCLAVE))  # per party
    for seq in (0, -1):
        with pytest.raises(MessageError, match="replayed or reordered"):
            guard.check(Header("a", 0, seq, "data", TO_ENCLAVE))
    guard.accept(Header("a", 0, 5, "data", TO_ENCLAVE))


def test_a_session_offer_needs_the_partys_own_identity_key() -> None:
    identity, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    offer = sign_offer(identity, SessionOffer("a", "01" * 32, "02" * 32, "03" * 32, "04" * 32))
    check_offer(SessionOffer.from_json(offer.to_json()), public_bytes(identity).hex())
    with pytest.raises(MessageError, match="not signed by that party's identity key"):
        check_offer(offer, public_bytes(other).hex())
    with pytest.raises(MessageError, match="not signed"):
        check_offer(dataclasses.replace(offer, provider_key="05" * 32), public_bytes(identity).hex())


@pytest.mark.parametrize("data", [None, {"party": "a"}, {"party": "a", "round": 0, "seq": 0, "kind": "data",
                                                          "direction": TO_ENCLAVE, "nonce": "00", "ciphertext": ""},
                                  {"party": "a", "round": True, "seq": 0, "kind": "data", "direction": TO_ENCLAVE},
                                  {"party": "a", "round": 0, "seq": 0, "kind": "spam", "direction": TO_ENCLAVE},
                                  {"party": "a", "round": 0, "seq": 0, "kind": "data", "direction": TO_ENCLAVE,
                                   "nonce": "00" * 12, "ciphertext": "not base64!"}])
def test_a_malformed_sealed_message_is_refused_by_name(data: object) -> None:
    with pytest.raises(MessageError):
        Sealed.from_json(data)


def test_frames_survive_garbage_and_oversized_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("convoy.workloads.confidential.wire.MAX_FRAME_BYTES", 16)
    left, right = socket.socketpair()
    with left, right:
        send_raw_frame(left, b"\xff\xfe not json")
        send_raw_frame(left, b"[1, 2]")
        send_raw_frame(left, b"x" * 40)
        send_frame(left, {"op": "status"})
        with pytest.raises(MessageError, match="not valid JSON"):
            recv_frame(right)
        with pytest.raises(MessageError, match="not an object"):
            recv_frame(right)
        with pytest.raises(MessageError, match="over the 16-byte limit; it was skipped"):
            recv_frame(right)
        assert recv_frame(right) == {"op": "status"}  # still in step
        left.close()
        assert recv_frame(right) is None


def test_array_payloads_round_trip_and_refuse_pickles_and_garbage() -> None:
    arrays = {"x": np.arange(6.0).reshape(2, 3), "n_samples": np.asarray(7, dtype=np.int64)}
    back = unpack_arrays(pack_arrays(arrays))
    assert back["x"].tolist() == arrays["x"].tolist() and back["n_samples"].shape == () and int(back["n_samples"]) == 7
    with pytest.raises(MessageError, match="not a valid array archive"):
        unpack_arrays(pack_arrays({"x": np.array([{"evil": 1}], dtype=object)}))
    with pytest.raises(MessageError, match="not a valid array archive"):
        unpack_arrays(b"PK\x03\x04 garbage")
