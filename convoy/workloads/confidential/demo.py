"""``convoy confidential demo``: three providers, one enclave, end to end, and what each of them saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from convoy.workloads.confidential.attacks import ATTACKS, describe, replayed_ciphertext
from convoy.workloads.confidential.attestation import (SIMULATED_NOTICE, TEE_DEVICES, HardwareBackend,
                                                       SimulatedRootOfTrust, detect_tee)
from convoy.workloads.confidential.config import EnclaveConfig, Party
from convoy.workloads.confidential.data import make_providers
from convoy.workloads.confidential.errors import HardwareUnavailableError
from convoy.workloads.confidential.host import EnclaveHost
from convoy.workloads.confidential.platform import Model, fit, pool, quality
from convoy.workloads.confidential.provider import Provider
from convoy.workloads.confidential.session import attest_and_connect

PROVIDER_NAMES = ("hospital-a", "hospital-b", "clinic-c")


def _hardware_line() -> str:
    found = detect_tee()
    if found:
        return f"TEE device(s) present: {', '.join(TEE_DEVICES[kind] for kind in found)} (this demo still simulates)"
    return f"no TEE device here ({', '.join(TEE_DEVICES.values())} absent)"


def run_demo(task: str = "logistic", mode: str = "data", rows: int = 1000, features: int = 8, rounds: int = 1,
             epochs: int = 30, seed: int = 0, attacks: bool = True, backend: str = "simulated",
             out: Callable[[str], None] = print) -> int:
    """Run the whole protocol and print each party's view; 0 on success. ``backend="hardware"`` refuses
    (HardwareUnavailableError) unless this machine is a TDX guest with dcap-qvl installed; the demo's
    enclave itself runs the simulated backend only."""
    started = time.perf_counter()
    if backend == "hardware":
        HardwareBackend()  # raises, saying why, on a machine without a usable TEE
        raise HardwareUnavailableError("a TEE is present, but the demo drives only the simulated backend: run "
                                       "the enclave inside the confidential VM with EnclaveConfig(backend="
                                       "'hardware') through EnclaveHost instead")
    datasets, (test_x, test_y) = make_providers(task, len(PROVIDER_NAMES), rows, features, seed)
    providers = [Provider(name, x, y) for name, (x, y) in zip(PROVIDER_NAMES, datasets, strict=True)]
    config = EnclaveConfig(task=task, mode=mode, features=features, rounds=rounds, epochs=epochs, seed=seed,
                           parties=tuple(Party(p.name, p.identity_key) for p in providers)).validate()
    root = SimulatedRootOfTrust()
    verifier = root.verifier()
    metric = "R^2" if task == "linear" else "accuracy"
    out(f"convoy confidential demo: {task} ({mode} mode, {rounds} round(s)), {len(providers)} providers x {rows} "
        f"rows x {features} features")
    out(f"backend: {SIMULATED_NOTICE}; {_hardware_line()}")
    with EnclaveHost(config, root) as host:
        out(f"enclave: pid {host.info['pid']}, {host.isolation}; interfaces it sees: {', '.join(host.info['network'])}")
        out(f"enclave measurement (SHA-256 of its code and configuration): {host.info['measurement']}")
        attest_and_connect(host, providers, config, verifier, allow_simulated=True)
        if attacks:
            _attack(host, providers, config, verifier, out)
        models = _train(host, providers, config, attacks, out)
        shared = models[providers[0].name]
        status = host.call("status")
        host_bytes = sum(size for _, _, size in host.frames)
        host_view = (f"{len(host.frames)} frames, {host_bytes / 1e6:.2f} MB: ciphertext and clear headers "
                     "(party, round, seq) only")
    code = host.proc.returncode if host.proc is not None else None
    pooled = fit(config, *pool(datasets))
    out("\nwhat each provider saw:")
    for provider in providers:
        for line in provider.seen:
            out(f"  [{provider.name}] {line}")
        local = quality(config, provider.local_model(config), test_x, test_y)
        mine = quality(config, models[provider.name], test_x, test_y)
        out(f"  [{provider.name}] {metric} on test rows from all providers: its local model {local:.3f}, "
            f"the shared model {mine:.3f}")
    out(f"\nwhat the platform host saw: {host_view}")
    out(f"what the enclave trained on: {status['trained_on']} (rows per provider and round; refused: "
        f"{status['rejected']})")
    if mode == "data":
        out(f"shared model vs the pooled plaintext fit: {metric} {quality(config, shared, test_x, test_y):.4f} vs "
            f"{quality(config, pooled, test_x, test_y):.4f}")
    out(f"enclave stopped (exit code {code}); demo took {time.perf_counter() - started:.1f} s")
    return 0 if code == 0 else 1


def _attack(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig, verifier: Any,
            out: Callable[[str], None]) -> None:
    """Every attack, each before any genuine submission, and what the enclave holds after them."""
    out("\nattacks, each before any genuine submission:")
    for name, attack in ATTACKS.items():
        out(f"  {name}: refused, {describe(attack(host, providers, config, verifier))}")
    status = host.call("status")
    out(f"  enclave still running: {host.alive()}; rows or models held after the attacks: "
        f"{status['pending'] or 'none'}; refused by the enclave: {status['rejected']} (the report attacks were "
        f"refused by the provider)")


def _train(host: EnclaveHost, providers: list[Provider], config: EnclaveConfig, attacks: bool,
           out: Callable[[str], None]) -> dict[str, Model]:
    """Every round: each provider submits its sealed rows (or its local model), the enclave trains, and each
    provider opens the shared model sealed for it; the models of the last round, by provider. With ``attacks``,
    the first submission is replayed once."""
    shared: Model | None = None
    models: dict[str, Model] = {}
    for round_id in range(config.rounds):
        for index, provider in enumerate(providers):
            message = provider.seal_data(round_id) if config.mode == "data" else provider.seal_model(
                round_id, provider.local_model(config, init=shared if config.task == "mlp" else None))
            host.call("submit", message=message)
            if attacks and round_id == 0 and index == 0:
                out(f"  replayed ciphertext: refused, {describe(replayed_ciphertext(host, message))}")
        sealed = host.call("train")["models"]
        models = {p.name: p.open_shared_model(sealed[p.name], round_id, config) for p in providers}
        shared = models[providers[0].name]
    return models
