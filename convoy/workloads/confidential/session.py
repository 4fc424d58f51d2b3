"""One shared-learning run, end to end: providers attest the enclave, send sealed rows or models through
the host, and open the shared model; and the same run in plaintext (the benchmark's peer)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from convoy.workloads.confidential.attestation import AttestationBackend
from convoy.workloads.confidential.config import EnclaveConfig
from convoy.workloads.confidential.host import EnclaveHost
from convoy.workloads.confidential.platform import Model
from convoy.workloads.confidential.provider import Provider
from convoy.workloads.confidential.wire import b64, pack_arrays, unb64, unpack_arrays


def attest_and_connect(host: EnclaveHost, providers: Sequence[Provider], config: EnclaveConfig,
                       verifier: AttestationBackend, allow_simulated: bool = False) -> None:
    """Each provider challenges the enclave, verifies its report and opens its own session."""
    for provider in providers:
        reply = host.call("attest", nonce=provider.challenge())
        provider.accept_report(reply["report"], verifier, config, allow_simulated)
        host.call("open_session", offer=provider.session_offer())


def _local_update(provider: Provider, config: EnclaveConfig, shared: Model | None) -> Model:
    """Model mode: the provider's model for this round (an MLP continues from the last shared model)."""
    return provider.local_model(config, init=shared if config.task == "mlp" else None)


def run_secure(host: EnclaveHost, providers: Sequence[Provider], config: EnclaveConfig,
               verifier: AttestationBackend, allow_simulated: bool = False) -> dict[str, Model]:
    """Attest, then every round: sealed submissions, training in the enclave, a sealed model back to each."""
    attest_and_connect(host, providers, config, verifier, allow_simulated)
    shared: Model | None = None
    models: dict[str, Model] = {}
    for round_id in range(config.rounds):
        for provider in providers:
            message = provider.seal_data(round_id) if config.mode == "data" else \
                provider.seal_model(round_id, _local_update(provider, config, shared))
            host.call("submit", message=message)
        sealed = host.call("train")["models"]
        models = {p.name: p.open_shared_model(sealed[p.name], round_id, config) for p in providers}
        shared = models[providers[0].name]
    return models


def run_plaintext(host: EnclaveHost, providers: Sequence[Provider], config: EnclaveConfig) -> dict[str, Model]:
    """The same rounds with no attestation and no encryption (``config.plaintext_baseline``): the peer that
    the overhead of attestation and encryption is measured against."""
    shared: Model | None = None
    models: dict[str, Model] = {}
    for round_id in range(config.rounds):
        for provider in providers:
            arrays = {"x": provider.x, "y": provider.y} if config.mode == "data" else \
                {**_local_update(provider, config, shared), "n_samples": np.asarray(len(provider.x))}
            host.call("submit_plain", party=provider.name, round=round_id, payload=b64(pack_arrays(arrays)))
        payloads = host.call("train")["models"]
        models = {p.name: unpack_arrays(unb64(payloads[p.name]["payload"], "payload")) for p in providers}
        shared = models[providers[0].name]
    return models
