"""The real enclave process: attacks over its socket, isolation, clean exits; and ``convoy confidential demo``."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import CONSOLE_SCRIPT, ProcessScope, gone, one_error_line, wait_for

from convoy.workloads.confidential import attacks
from convoy.workloads.confidential.attestation import SimulatedRootOfTrust
from convoy.workloads.confidential.config import EnclaveConfig, Party
from convoy.workloads.confidential.data import make_providers
from convoy.workloads.confidential.host import EnclaveHost, unshare_permitted
from convoy.workloads.confidential.platform import fit, pool
from convoy.workloads.confidential.provider import Provider
from convoy.workloads.confidential.session import attest_and_connect

pytestmark = pytest.mark.slow


def test_every_attack_on_the_enclave_process_is_refused_and_it_trains_on_genuine_rows_only() -> None:
    datasets, _ = make_providers("logistic", 3, 300, 4, seed=7)
    providers = [Provider(f"p{i}", x, y) for i, (x, y) in enumerate(datasets)]
    config = EnclaveConfig(task="logistic", features=4, parties=tuple(Party(p.name, p.identity_key)
                                                                       for p in providers)).validate()
    root = SimulatedRootOfTrust()
    verifier = root.verifier()
    with EnclaveHost(config, root, reply_timeout_s=60) as host:
        if unshare_permitted():
            assert host.info["network"] == ["lo"], "the enclave should see no network but loopback"
        attest_and_connect(host, providers, config, verifier, allow_simulated=True)
        refusals = {}
        for name, attack in attacks.ATTACKS.items():
            refusals[name] = attack(host, providers, config, verifier)
            assert host.alive(), f"the enclave died after the attack {name!r}"
        assert "is not the expected" in str(refusals["wrong measurement"])
        assert "replayed or stale report" in str(refusals["replayed report (old nonce)"])
        assert "failed authentication" in str(refusals["tampered ciphertext"])
        assert "another party's key" in str(refusals["sending under another's name"])
        assert "not signed by that party's identity key" in str(refusals["opening a session under another's name"])
        assert "not valid JSON" in str(refusals["malformed frame (not JSON)"])
        assert "field 'round' must be int" in str(refusals["malformed message (bad field types)"])
        assert "x must be (rows, 4)" in str(refusals["malformed content (NaN, wrong width)"])
        status = host.call("status")
        assert status["pending"] == {} and status["trained_on"] == [] and status["rejected"] == 6
        first = providers[0].seal_data(0)
        host.call("submit", message=first)
        assert "replayed or reordered" in str(attacks.replayed_ciphertext(host, first))
        for provider in providers[1:]:
            host.call("submit", message=provider.seal_data(0))
        sealed = host.call("train")["models"]
        models = {p.name: p.open_shared_model(sealed[p.name], 0, config) for p in providers}
        assert host.call("status")["trained_on"] == [{"p0": 300, "p1": 300, "p2": 300}]
    assert host.proc is not None and host.proc.returncode == 0
    pooled = fit(config, *pool(datasets))
    assert all(np.array_equal(model["coef"], pooled["coef"]) for model in models.values())


HOLDER = textwrap.dedent("""
    import sys, time
    from convoy.workloads.confidential.attestation import SimulatedRootOfTrust
    from convoy.workloads.confidential.config import EnclaveConfig, Party
    from convoy.workloads.confidential.host import EnclaveHost
    config = EnclaveConfig(parties=(Party("a", "11" * 32),))
    with EnclaveHost(config, SimulatedRootOfTrust()) as host:
        print("enclave", host.info["pid"], flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("how", ["sigkill-host", "ctrl-c"])
def test_the_enclave_never_outlives_its_host(procs: ProcessScope, how: str) -> None:
    holder = procs.start(["-c", HOLDER], command=[sys.executable])
    enclave_pid = int(holder.wait_output(r"^enclave (\d+)$", timeout=60).group(1))
    if how == "sigkill-host":
        os.kill(holder.pid, signal.SIGKILL)  # no chance to clean up: the enclave must die with it
    else:
        os.killpg(holder.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    wait_for(lambda: gone(enclave_pid), 15, "the enclave process to exit")
    holder.wait(15)


def test_demo_runs_end_to_end_from_the_command_line(procs: ProcessScope) -> None:
    result = procs.run(["confidential", "demo"], command=[str(CONSOLE_SCRIPT)], timeout=60)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert "SIMULATED attestation" in out and "no hardware protection" in out
    assert out.count(": refused, ") == len(attacks.ATTACKS) + 1  # + the replayed ciphertext
    for name in ("hospital-a", "hospital-b", "clinic-c"):
        assert f"[{name}] verified report: backend SIMULATED" in out
        assert f"[{name}] round 0: received the shared model, sealed for it alone" in out
    assert "rows or models held after the attacks: none" in out
    assert "what the enclave trained on: [{'hospital-a': 1000, 'hospital-b': 1000, 'clinic-c': 1000}]" in out
    assert "enclave stopped (exit code 0)" in out


def test_demo_model_sharing_mode_with_the_mlp(procs: ProcessScope) -> None:
    result = procs.run(["confidential", "demo", "--task", "mlp", "--mode", "model", "--rounds", "2", "--epochs",
                        "2", "--rows", "200", "--no-attacks"], timeout=60)
    assert result.returncode == 0, result.explain()
    assert result.stdout.count("received the shared model") == 3 * 2
    assert "enclave stopped (exit code 0)" in result.stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["--backend", "hardware"], "no TEE device on this machine"),
    (["--rounds", "3"], "--rounds 3: data mode trains once"),
    (["--rows", "1"], "--rows 1 is too small"),
])
def test_demo_refuses_bad_requests_in_one_line(procs: ProcessScope, tmp_path: Path, args: list[str],
                                               expected: str) -> None:
    if args[:2] == ["--backend", "hardware"] and any(Path(d).exists() for d in ("/dev/tdx_guest", "/dev/sev-guest",
                                                                                  "/dev/sgx_enclave")):
        pytest.skip("this machine has a TEE device")
    assert expected in one_error_line(procs.run(["confidential", "demo", *args], timeout=60))


def test_ctrl_c_during_the_demo_stops_it_and_its_enclave(procs: ProcessScope) -> None:
    demo = procs.start(["confidential", "demo", "--task", "mlp", "--epochs", "2000", "--no-attacks"],
                       env={"PYTHONUNBUFFERED": "1"})
    enclave_pid = int(demo.wait_output(r"^enclave: pid (\d+)", timeout=60).group(1))
    os.killpg(demo.pid, signal.SIGINT)
    result = demo.wait(30)
    assert result.returncode == 130, result.explain()
    assert "demo interrupted; the enclave was stopped" in result.stderr
    assert gone(enclave_pid)
