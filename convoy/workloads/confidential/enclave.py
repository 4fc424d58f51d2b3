"""The enclave: a separate process whose only channel is one socket to the platform host.

``python -m convoy.workloads.confidential.enclave --fd N`` serves length-prefixed JSON requests on the
inherited socket ``N`` (the host starts it under ``unshare -n`` where permitted, so it has no network
but that socket). ``EnclaveService`` is the request handler as plain code: every bad request becomes an
error reply (its class name and message), is counted, and leaves the state as it was, so the enclave
keeps serving and nothing is trained on what it refused.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from convoy.errors import ConvoyError
from convoy.workloads.confidential.attestation import (
    NONCE_BYTES, AttestationBackend, HardwareBackend, SimulatedBackend, make_report, measure,
)
from convoy.workloads.confidential.channel import (
    TO_ENCLAVE, TO_PROVIDER, Header, ReplayGuard, Sealed, SessionOffer, check_offer, derive_session_key, open_sealed,
    public_bytes, seal,
)
from convoy.workloads.confidential.config import EnclaveConfig
from convoy.workloads.confidential.errors import ConfidentialError, EnclaveError, MessageError
from convoy.workloads.confidential.platform import Model, check_data, check_model, fit, pool, weighted_average
from convoy.workloads.confidential.wire import (
    b64, field, pack_arrays, recv_frame, send_frame, unb64, unhex, unpack_arrays,
)

MAX_OUTSTANDING_NONCES = 1024


def network_interfaces() -> list[str]:
    """The interfaces this process can see: only ``lo`` inside a fresh network namespace."""
    return sorted(name for _, name in socket.if_nameindex())


class EnclaveService:
    """The enclave's state and its answer to each request (no I/O: the serving loop feeds it)."""

    def __init__(self, config: EnclaveConfig, backend: AttestationBackend | None, measurement: str) -> None:
        self.config, self.backend, self.measurement = config, backend, measurement
        self.identities = {party.name: party.identity_key for party in config.parties}
        self.key = X25519PrivateKey.generate()
        self.public_key = public_bytes(self.key)
        self.outstanding_nonces: dict[str, None] = {}
        self.sessions: dict[str, bytes] = {}
        self.guard = ReplayGuard()
        self.out_seq: dict[str, int] = {}
        self.round = 0
        self.pending: dict[str, tuple[Any, ...]] = {}
        self.trained_on: list[dict[str, int]] = []
        self.rejections: list[str] = []
        self.stopping = False
        self.ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "attest": self._attest, "open_session": self._open_session, "submit": self._submit,
            "submit_plain": self._submit_plain, "train": self._train, "status": self._status,
            "shutdown": self._shutdown,
        }

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One reply per request: ``{"ok": true, ...}`` or ``{"ok": false, "error_type", "error"}``."""
        try:
            op = field(request, "op", str)
            if op not in self.ops:
                raise MessageError(f"unknown op {op!r}; the enclave serves {', '.join(sorted(self.ops))}")
            return {"ok": True, **self.ops[op](request)}
        except ConfidentialError as exc:
            return self.refuse(exc)

    def refuse(self, exc: Exception) -> dict[str, Any]:
        self.rejections.append(f"{type(exc).__name__}: {exc}")
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc)}

    def _secure_only(self) -> None:
        if self.config.plaintext_baseline or self.backend is None:
            raise MessageError("this enclave runs the plaintext benchmark baseline: it neither attests nor "
                               "decrypts; start one with plaintext_baseline=False")

    def _attest(self, request: dict[str, Any]) -> dict[str, Any]:
        self._secure_only()
        assert self.backend is not None
        nonce = unhex(field(request, "nonce", str), "nonce", NONCE_BYTES).hex()
        report = make_report(self.backend, self.measurement, self.public_key, nonce)
        self.outstanding_nonces[nonce] = None
        while len(self.outstanding_nonces) > MAX_OUTSTANDING_NONCES:  # forget the oldest unanswered challenge
            del self.outstanding_nonces[next(iter(self.outstanding_nonces))]
        return {"report": report.to_json()}

    def _open_session(self, request: dict[str, Any]) -> dict[str, Any]:
        self._secure_only()
        offer = SessionOffer.from_json(request.get("offer"))
        if offer.party not in self.identities:
            raise MessageError(f"party {offer.party!r} is not in this enclave's configuration "
                               f"({', '.join(self.identities)}); it cannot open a session")
        if offer.enclave_key != self.public_key.hex() or offer.measurement != self.measurement:
            raise MessageError(f"session offer from {offer.party!r} names another enclave key or measurement; "
                               "attest this enclave again")
        check_offer(offer, self.identities[offer.party])
        if offer.nonce not in self.outstanding_nonces:
            raise MessageError(f"session offer from {offer.party!r} uses a nonce this enclave never issued or "
                               "already used: a replayed offer; ask for a fresh report")
        provider_key = unhex(offer.provider_key, "provider_key", 32)
        self.sessions[offer.party] = derive_session_key(self.key, provider_key, offer.party, offer.nonce,
                                                        self.measurement)
        del self.outstanding_nonces[offer.nonce]
        for direction in (TO_ENCLAVE, TO_PROVIDER):  # a new key: old ciphertexts cannot authenticate any more
            self.guard.last_seq.pop((offer.party, direction), None)
        self.out_seq[offer.party] = 0
        return {"party": offer.party}

    def _check_header(self, party: str, round_id: int) -> None:
        if party not in self.identities:
            raise MessageError(f"party {party!r} is not in this enclave's configuration")
        if self.round >= self.config.rounds:
            raise MessageError(f"all {self.config.rounds} configured rounds are trained; nothing more is accepted")
        if round_id != self.round:
            raise MessageError(f"message from {party!r} is for round {round_id}, the enclave is in round "
                               f"{self.round}; it was dropped")
        if party in self.pending:
            raise MessageError(f"{party!r} already submitted for round {self.round}; one submission per round")

    def _submit(self, request: dict[str, Any]) -> dict[str, Any]:
        self._secure_only()
        sealed = Sealed.from_json(request.get("message"))
        header = sealed.header
        expected_kind = "data" if self.config.mode == "data" else "model"
        if header.direction != TO_ENCLAVE or header.kind != expected_kind:
            raise MessageError(f"expected a {expected_kind!r} message to the enclave, got {header.kind!r} "
                               f"{header.direction!r}")
        if header.party not in self.sessions:
            raise MessageError(f"no session for {header.party!r}: attest and open a session first")
        self.guard.check(header)
        self._check_header(header.party, header.round)
        payload = open_sealed(self.sessions[header.party], sealed)
        self.guard.accept(header)  # authentic: from now on this exact message counts as seen
        return self._accept(header.party, unpack_arrays(payload))

    def _submit_plain(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.config.plaintext_baseline:
            raise MessageError("plaintext submissions are refused: this enclave takes only sealed messages")
        party, round_id = field(request, "party", str), field(request, "round", int)
        self._check_header(party, round_id)
        return self._accept(party, unpack_arrays(unb64(request.get("payload"), "payload")))

    def _accept(self, party: str, arrays: dict) -> dict[str, Any]:
        if self.config.mode == "data":
            x, y = check_data(self.config, arrays)
            self.pending[party] = (x, y)
            return {"party": party, "rows": len(x)}
        model, rows = check_model(self.config, arrays)
        self.pending[party] = (model, rows)
        return {"party": party, "rows": int(rows)}

    def _train(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.round >= self.config.rounds:
            raise MessageError(f"all {self.config.rounds} configured rounds are trained")
        missing = [name for name in self.identities if name not in self.pending]
        if missing:
            raise MessageError(f"round {self.round} still waits for {', '.join(missing)}; nothing was trained")
        order = list(self.identities)
        if self.config.mode == "data":
            model = fit(self.config, *pool([self.pending[name] for name in order]))
            rows = {name: len(self.pending[name][0]) for name in order}
        else:
            model = weighted_average([self.pending[name][0] for name in order],
                                     [self.pending[name][1] for name in order])
            rows = {name: int(self.pending[name][1]) for name in order}
        replies = {name: self._seal_model(name, model) for name in order}
        self.trained_on.append(rows)
        self.pending.clear()
        self.round += 1
        return {"round": self.round - 1, "models": replies}

    def _seal_model(self, party: str, model: Model) -> dict[str, Any]:
        payload = pack_arrays(model)
        if self.config.plaintext_baseline:
            return {"payload": b64(payload)}
        header = Header(party=party, round=self.round, seq=self.out_seq[party], kind="shared-model",
                        direction=TO_PROVIDER)
        self.out_seq[party] += 1
        return seal(self.sessions[party], header, payload).to_json()

    def _status(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"round": self.round, "sessions": sorted(self.sessions),
                "pending": {name: int(len(v[0]) if self.config.mode == "data" else v[1])
                            for name, v in self.pending.items()},
                "trained_on": self.trained_on, "rejected": len(self.rejections),
                "last_rejection": self.rejections[-1] if self.rejections else "",
                "network": network_interfaces(), "pid": os.getpid()}

    def _shutdown(self, request: dict[str, Any]) -> dict[str, Any]:
        self.stopping = True
        return {}


def start_service(init: dict[str, Any]) -> tuple[EnclaveService, dict[str, Any]]:
    """Build the service from the host's first frame: configuration, backend and (simulated) root key."""
    if init.get("op") != "init":
        raise MessageError("the first frame must be op 'init' with the enclave configuration")
    config = EnclaveConfig.from_json(field(init, "config", dict))
    backend: AttestationBackend | None = None
    if config.plaintext_baseline:
        backend = None
    elif config.backend == "simulated":
        backend = SimulatedBackend(trust_anchor=unhex(field(init, "root_public", str), "root_public", 32),
                                   signing_key=unhex(field(init, "root_key", str), "root_key", 32))
    else:
        backend = HardwareBackend()
    measurement = measure(config)
    service = EnclaveService(config, backend, measurement)
    return service, {"measurement": measurement, "backend": "plaintext" if backend is None else backend.name,
                     "simulated": backend is None or backend.simulated, "network": network_interfaces(),
                     "pid": os.getpid()}


def serve(sock: socket.socket) -> None:
    """Answer frames until the host says shutdown or closes the channel."""
    try:
        init = recv_frame(sock)
        if init is None:
            return
        service, info = start_service(init)
    except ConvoyError as exc:  # a bad configuration, or no hardware for the hardware backend: refuse, exit
        send_frame(sock, {"ok": False, "error_type": type(exc).__name__, "error": str(exc)})
        return
    send_frame(sock, {"ok": True, **info})
    while not service.stopping:
        try:
            request = recv_frame(sock)
        except MessageError as exc:
            send_frame(sock, service.refuse(exc))
            continue
        if request is None:
            return
        try:
            reply = service.handle(request)
        except Exception as exc:  # noqa: BLE001 - a fault while training must not take the enclave down
            reply = service.refuse(EnclaveError(f"internal error handling {request.get('op')!r}: "
                                                f"{type(exc).__name__}: {exc}"))
        send_frame(sock, reply)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="convoy confidential enclave (started by the platform host)")
    parser.add_argument("--fd", type=int, required=True, help="the inherited socket to the host")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sock = socket.socket(fileno=args.fd)
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # the host went away: nothing left to serve
        return 0
    except KeyboardInterrupt:  # Ctrl-C reaches the whole foreground group; the host stops too
        return 130
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
