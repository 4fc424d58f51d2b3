"""The enclave's request handling, in this process: every attack refused, the service still answering, and
nothing trained on refused input (the real process and channel are in tests/integration)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from convoy.workloads.confidential import attacks
from convoy.workloads.confidential.attestation import SimulatedRootOfTrust, measure
from convoy.workloads.confidential.channel import TO_ENCLAVE, Header, seal
from convoy.workloads.confidential.config import EnclaveConfig, Party
from convoy.workloads.confidential.data import make_providers
from convoy.workloads.confidential.enclave import EnclaveService
from convoy.workloads.confidential.errors import ERROR_TYPES, ConfidentialError, MessageError
from convoy.workloads.confidential.platform import fit, pool, weighted_average
from convoy.workloads.confidential.provider import Provider
from convoy.workloads.confidential.session import attest_and_connect
from convoy.workloads.confidential.wire import pack_arrays


class InProcessHost:
    """``EnclaveHost.call`` against an ``EnclaveService`` in this process (same replies, same errors raised)."""

    def __init__(self, service: EnclaveService, root: SimulatedRootOfTrust) -> None:
        self.service, self.root, self.reply_timeout_s = service, root, 10.0

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = self.service.handle({"op": op, **fields})
        if not reply["ok"]:
            raise ERROR_TYPES[reply["error_type"]](reply["error"])
        return reply


@dataclasses.dataclass
class World:
    config: EnclaveConfig
    root: SimulatedRootOfTrust
    service: EnclaveService
    host: InProcessHost
    providers: list[Provider]

    def submit_all_and_train(self) -> dict:
        for provider in self.providers:
            message = provider.seal_data(0) if self.config.mode == "data" else \
                provider.seal_model(0, provider.local_model(self.config))
            self.host.call("submit", message=message)
        sealed = self.host.call("train")["models"]
        return {p.name: p.open_shared_model(sealed[p.name], 0, self.config) for p in self.providers}


def make_world(mode: str = "data", task: str = "logistic", plaintext: bool = False, connect: bool = True) -> World:
    datasets, _ = make_providers(task, 3, 200, 4, seed=3)
    providers = [Provider(f"p{i}", x, y) for i, (x, y) in enumerate(datasets)]
    config = EnclaveConfig(task=task, mode=mode, features=4, plaintext_baseline=plaintext,
                           parties=tuple(Party(p.name, p.identity_key) for p in providers)).validate()
    root = SimulatedRootOfTrust()
    service = EnclaveService(config, None if plaintext else root.enclave_backend(), measure(config))
    world = World(config, root, service, InProcessHost(service, root), providers)
    if connect:
        attest_and_connect(world.host, providers, config, root.verifier(), allow_simulated=True)  # type: ignore[arg-type]
    return world


IN_PROCESS_ATTACKS = [name for name in attacks.ATTACKS if name not in ("wrong measurement",
                                                                       "malformed frame (not JSON)")]


@pytest.mark.parametrize("mode", ["data", "model"])
@pytest.mark.parametrize("name", IN_PROCESS_ATTACKS)
def test_each_attack_is_refused_and_nothing_is_trained_on_it(name: str, mode: str) -> None:
    world = make_world(mode)
    error = attacks.ATTACKS[name](world.host, world.providers, world.config, world.root.verifier())  # type: ignore[arg-type]
    assert isinstance(error, ConfidentialError) and str(error)
    status = world.host.call("status")
    assert status["pending"] == {} and status["round"] == 0 and status["trained_on"] == []
    models = world.submit_all_and_train()  # the enclave still serves, and trains on the genuine input only
    assert world.service.trained_on == [{p.name: 200 for p in world.providers}]
    if mode == "data":
        pooled = fit(world.config, *pool([(p.x, p.y) for p in world.providers]))
        assert all(np.array_equal(model["coef"], pooled["coef"]) for model in models.values())


def test_a_replayed_ciphertext_is_refused_after_the_genuine_one_was_accepted() -> None:
    world = make_world()
    message = world.providers[0].seal_data(0)
    world.host.call("submit", message=message)
    with pytest.raises(MessageError, match="already accepted: a replayed or reordered message"):
        world.host.call("submit", message=message)
    assert list(world.host.call("status")["pending"]) == ["p0"]


def test_sending_under_another_name_is_refused_before_the_victim_has_a_session() -> None:
    world = make_world(connect=False)
    attest_and_connect(world.host, world.providers[1:], world.config, world.root.verifier(), allow_simulated=True)  # type: ignore[arg-type]
    error = attacks.impersonation(world.host, world.providers, world.config, world.root.verifier())  # type: ignore[arg-type]
    assert isinstance(error, MessageError) and "no session for 'p0'" in str(error)
    assert world.service.pending == {}


def test_a_replayed_session_offer_is_refused() -> None:
    world = make_world(connect=False)
    provider = world.providers[0]
    reply = world.host.call("attest", nonce=provider.challenge())
    provider.accept_report(reply["report"], world.root.verifier(), world.config, allow_simulated=True)
    offer = provider.session_offer()
    world.host.call("open_session", offer=offer)
    with pytest.raises(MessageError, match="never issued or already used: a replayed offer"):
        world.host.call("open_session", offer=offer)


def test_a_party_outside_the_configuration_cannot_open_a_session() -> None:
    world = make_world(connect=False)
    stranger = Provider("stranger", world.providers[0].x, world.providers[0].y)
    reply = world.host.call("attest", nonce=stranger.challenge())
    stranger.accept_report(reply["report"], world.root.verifier(), world.config, allow_simulated=True)
    with pytest.raises(MessageError, match="'stranger' is not in this enclave's configuration"):
        world.host.call("open_session", offer=stranger.session_offer())


@pytest.mark.parametrize(("request_", "expected"), [
    ({}, "lacks the field 'op'"),
    ({"op": 5}, "field 'op' must be str"),
    ({"op": "fly"}, "unknown op 'fly'"),
    ({"op": "attest"}, "lacks the field 'nonce'"),
    ({"op": "attest", "nonce": "zz"}, "nonce is not valid hex"),
    ({"op": "attest", "nonce": "00"}, "nonce must be 32 bytes"),
    ({"op": "open_session"}, "session offer must be a JSON object"),
    ({"op": "open_session", "offer": {"party": "p0"}}, "lacks the field 'provider_key'"),
    ({"op": "submit"}, "sealed message must be a JSON object"),
    ({"op": "submit", "message": {"party": "p0", "round": 0, "seq": 9, "kind": "data", "direction": TO_ENCLAVE,
                                  "nonce": "00" * 12, "ciphertext": "@@"}}, "ciphertext is not valid base64"),
    ({"op": "submit_plain", "party": "p0", "round": 0, "payload": ""}, "plaintext submissions are refused"),
    ({"op": "train"}, "still waits for p0, p1, p2; nothing was trained"),
])
def test_a_malformed_request_is_refused_with_a_clear_error(request_: dict, expected: str) -> None:
    world = make_world()
    reply = world.service.handle(request_)
    assert reply["ok"] is False and reply["error_type"] == "MessageError" and expected in reply["error"]
    assert world.service.handle({"op": "status"})["ok"] is True
    assert world.service.pending == {} and world.service.trained_on == []


@pytest.mark.parametrize(("arrays", "expected"), [
    ({"x": np.zeros((5, 4)), "y": np.full(5, 0.5)}, "labels y in {0, 1}"),
    ({"x": np.zeros((5, 4)), "y": np.zeros(4)}, "x must be (rows, 4)"),
    ({"x": np.zeros((5, 4), dtype=np.int64), "y": np.zeros(5)}, "must be floating point"),
    ({"x": np.zeros((5, 4)), "y": np.zeros(5), "extra": np.zeros(1)}, "exactly the arrays x and y"),
    (None, "not a valid array archive"),
])
def test_authentic_but_malformed_content_is_refused(arrays: dict | None, expected: str) -> None:
    world = make_world()
    provider = world.providers[0]
    assert provider.session_key is not None
    payload = b"not an archive" if arrays is None else pack_arrays(arrays)
    sealed = seal(provider.session_key, Header("p0", 0, 0, "data", TO_ENCLAVE), payload)
    with pytest.raises(MessageError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        world.host.call("submit", message=sealed.to_json())
    assert world.service.pending == {}


def test_model_mode_averages_local_models_weighted_by_rows() -> None:
    world = make_world(mode="model", task="linear")
    world.providers[2].x, world.providers[2].y = world.providers[2].x[:50], world.providers[2].y[:50]
    models = world.submit_all_and_train()
    expected = weighted_average([p.local_model(world.config) for p in world.providers], [200, 200, 50])
    assert all(np.allclose(model["coef"], expected["coef"], rtol=0, atol=1e-12) for model in models.values())
    assert world.service.trained_on == [{"p0": 200, "p1": 200, "p2": 50}]


def test_nothing_is_accepted_after_the_configured_rounds() -> None:
    world = make_world()
    world.submit_all_and_train()
    with pytest.raises(MessageError, match="configured rounds are trained"):
        world.host.call("submit", message=world.providers[0].seal_data(1))


def test_a_provider_refuses_a_shared_model_sealed_for_another() -> None:
    world = make_world()
    for provider in world.providers:
        world.host.call("submit", message=provider.seal_data(0))
    sealed = world.host.call("train")["models"]
    with pytest.raises(MessageError, match="expected its round-0 shared model"):
        world.providers[0].open_shared_model(sealed["p1"], 0, world.config)
    relabelled = {**sealed["p1"], "party": "p0"}
    with pytest.raises(MessageError, match="failed authentication"):
        world.providers[0].open_shared_model(relabelled, 0, world.config)


def test_the_plaintext_baseline_neither_attests_nor_takes_sealed_messages() -> None:
    world = make_world(plaintext=True, connect=False)
    reply = world.service.handle({"op": "attest", "nonce": "00" * 32})
    assert not reply["ok"] and "plaintext benchmark baseline" in reply["error"]
    assert measure(world.config) != measure(dataclasses.replace(world.config, plaintext_baseline=False))
