"""The agent's local API on loopback, forwarding to a real JobMaster with the agent's own client: the token is
checked, a bad or oversized body gets a 4xx with a message, a report of a grant the process does not hold is a
409 (the agent goes on serving), and ``convoy.shards`` trains a whole dataset through it."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from convoy.agent.local_api import AGENT_TOKEN_ENV, AGENT_URL_ENV, MAX_BODY, ClientPool, LocalApi
from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.master import JobMaster
from convoy.control.protocol.client import MasterClient
from convoy.errors import ConfigError
from convoy.worker.shards import shards


@pytest.fixture
def master(tmp_path: Path) -> Iterator[JobMaster]:
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=tmp_path / "run", rendezvous=RendezvousConfig(1, 1, 0, 60))
    config.validate()
    started = JobMaster(config, console=lambda line: None)
    started.start()
    yield started
    started.stop()


@pytest.fixture
def local_api(master: JobMaster) -> Iterator[LocalApi]:
    host, port = master.api.address
    api = LocalApi(ClientPool(lambda: MasterClient(host, port, master.token, 5.0)).forward).start()
    yield api
    api.stop()


def post(api: LocalApi, path: str, body: bytes | dict[str, Any], token: str | None = None) -> tuple[int, Any]:
    host, port = api.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        conn.request("POST", f"/v1{path}", body=data,
                     headers={"Authorization": f"Bearer {api.token if token is None else token}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def worker(master: JobMaster, rank: int = 0) -> dict[str, Any]:
    return {"name": "train", "role": "default", "rank": rank, "incarnation": master.job.round_id}


def declare(master: JobMaster, size: int = 10, num_shards: int = 2) -> dict[str, Any]:
    return {**worker(master), "dataset": {"kind": "range", "size": size}, "num_shards": num_shards}


def test_the_token_is_checked_on_every_request(local_api: LocalApi, master: JobMaster) -> None:
    for token in ("", "not-the-token", local_api.token + "x"):
        status, body = post(local_api, "/shards/declare", declare(master), token=token)
        assert status == 401 and AGENT_TOKEN_ENV in body["error"], body
    status, body = post(local_api, "/shards/declare", declare(master))
    assert status == 200 and body == {"name": "train", "declared_by": "default:0:1", "first": True}
    assert local_api.env() == {AGENT_URL_ENV: local_api.url, AGENT_TOKEN_ENV: local_api.token}
    assert local_api.url.startswith("http://127.0.0.1:")


def test_bad_bodies_get_a_4xx_with_a_message(local_api: LocalApi, master: JobMaster) -> None:
    status, body = post(local_api, "/shards/declare", b"{not json")
    assert status == 400 and "bad request to /v1/shards/declare" in body["error"], body
    status, body = post(local_api, "/shards/declare", {**declare(master), "num_shards": 0})
    assert status == 400 and "num_shards" in body["error"], body
    status, body = post(local_api, "/shards/request", {**worker(master), "rank": -1})
    assert status == 400 and "rank" in body["error"], body
    status, body = post(local_api, "/shards/steal", worker(master))
    assert status == 404 and "/v1/shards/request" in body["error"], body
    status, body = post(local_api, "/shards/request", worker(master))
    assert status == 409 and "dataset 'train' is not declared" in body["error"], body


def test_an_oversized_body_is_refused_before_it_is_read(local_api: LocalApi, master: JobMaster) -> None:
    status, body = post(local_api, "/shards/declare", b" " * (MAX_BODY + 1))
    assert status == 413 and "over the limit" in body["error"], body
    assert post(local_api, "/shards/declare", declare(master))[0] == 200, "the API serves on after the refusal"


def test_a_report_of_a_grant_not_held_is_an_error_not_a_crash(local_api: LocalApi, master: JobMaster) -> None:
    assert post(local_api, "/shards/declare", declare(master))[0] == 200
    status, grant = post(local_api, "/shards/request", worker(master))
    assert status == 200 and (grant["status"], grant["start"], grant["stop"]) == ("assigned", 0, 5), grant
    status, body = post(local_api, "/shards/progress", {**worker(master), "grant_id": 999, "trained_through": 2})
    assert status == 409 and "reported grant 999" in body["error"], body
    status, body = post(local_api, "/shards/done", {**worker(master, rank=1), "grant_id": grant["grant_id"]})
    assert status == 409 and "holds no shard" in body["error"], body
    status, body = post(local_api, "/shards/progress", {**worker(master), "grant_id": grant["grant_id"],
                                                         "trained_through": 3})
    assert status == 200 and body == {"ok": True}, "the holder's own report still counts"
    assert master.shards.queues["train"].queue.held["default:0:1"].shard.start == 3


def test_a_process_of_an_earlier_round_is_refused(local_api: LocalApi, master: JobMaster) -> None:
    status, body = post(local_api, "/shards/declare", {**declare(master), "incarnation": 0})
    assert status == 409 and "ran in another round" in body["error"], body


def test_convoy_shards_trains_a_dataset_through_the_agent(local_api: LocalApi, master: JobMaster) -> None:
    env = {**local_api.env(), "ROLE_NAME": "default", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1",
           "CONVOY_ROUND": str(master.job.round_id)}
    stream = shards("train", num_samples=7, shard_size=3, epochs=2, env=env)
    trained = [item for shard in stream for batch in shard.batches(2) for item in batch]
    assert trained == [*range(7), *range(7)]
    assert master.shards.queues["train"].queue.finished
    with pytest.raises(ConfigError, match="was declared by default:0:1 as 7 sample indices in 3 shards, 2 "
                                          "epoch.s., in order, but default:0:1 declares it as 7 sample indices in "
                                          "7 shards"):
        shards("train", num_samples=7, num_shards=7, epochs=2, env=env)
