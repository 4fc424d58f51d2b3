"""Trainer 0's weights over the role transport, for rollouts on another host: each version arrives bit for bit and
only newer ones are sent; a copy torn by the trainer writing the same slot meanwhile is never kept (the reader asks
again); a caller without the job's secret gets nothing; a model that does not match is refused by name; a rollout
finds the board by its id, and reads over the transport where the path holds none or another job's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Connection, Credentials, Identity, Message, Refused
from convoy.shm import SHM_DIR
from convoy.workloads.rlhf.buckets import Manifest
from convoy.workloads.rlhf.rollout import WeightFetcher
from convoy.workloads.rlhf.weight_board import WeightBoard
from convoy.workloads.rlhf.weight_service import RemoteBoard, WeightService

JOB = Credentials.fresh()
ROLLOUT = JOB.as_process(Identity("rollout", 0, 1))


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 64, generator=gen), "norm": torch.randn(64, generator=gen).to(torch.bfloat16),
            **{f"block{i}.w": torch.randn(64, 64, generator=gen) for i in range(8)}}


def blank() -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in model().items()}


class Held:
    """A rollout's shadow model as the weight thread sees it: its named parameters."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self.named = named

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.named.items())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.fixture
def board() -> Iterator[WeightBoard]:
    made = WeightBoard.create(SHM_DIR / f"convoy-test{uuid.uuid4().hex[:8]}-weights", Manifest.of(model()))
    yield made
    made.remove()


@pytest.fixture
def service(board: WeightBoard) -> Iterator[WeightService]:
    served = WeightService(board, credentials=JOB)
    yield served
    served.close()


def test_each_newer_version_arrives_bit_for_bit_and_nothing_is_sent_twice(board: WeightBoard,
                                                                          service: WeightService) -> None:
    remote = RemoteBoard(lambda: service.address, ROLLOUT)
    shadow = blank()
    assert remote.read_into(shadow, -1) is None, "nothing published yet"
    hashed = board.publish(3, model(seed=3))
    assert remote.read_into(shadow, -1) == 3 and same(shadow, model(seed=3))
    assert remote.read_digest == hashed == remote.digest_of(shadow)
    pulled = remote.pulled_bytes
    assert pulled == board.manifest.nbytes and remote.read_into(shadow, 3) is None
    assert remote.pulled_bytes == pulled, "a caller holding the newest version is sent nothing"
    board.publish(4, model(seed=4))
    assert remote.read_into(shadow, 3) == 4 and same(shadow, model(seed=4)) and service.served == 2
    packed = board.manifest.pack(model(seed=4))
    assert all(torch.equal(landed, bucket) for landed, bucket in zip(remote.landing.values(), packed, strict=True)), \
        "each version is received into the same buffers"
    remote.close()


def test_a_copy_torn_by_the_trainer_writing_its_slot_is_never_kept(board: WeightBoard, service: WeightService) -> None:
    board.publish(1, model(seed=1))
    served = service.handle
    torn: list[int] = []

    def writes_twice_while_sending(message: Message, caller: Identity) -> Message:
        reply = served(message, caller)
        if reply.op == "weights" and not torn:  # versions 2 and 3 land before these views are sent: 3 in slot 1
            torn.append(int(reply.meta["version"]))
            board.publish(2, model(seed=2))
            board.publish(3, model(seed=3))
        return reply

    service.listener.handler = writes_twice_while_sending
    remote = RemoteBoard(lambda: service.address, ROLLOUT)
    shadow = blank()
    assert remote.read_into(shadow, -1) == 3, "version 1's views held version 3's bytes: asked again"
    assert torn == [1] and same(shadow, model(seed=3)) and remote.read_digest == remote.digest_of(shadow)
    assert remote.pulled_bytes == 2 * board.manifest.nbytes and remote.torn == 1
    remote.close()


def test_a_caller_without_the_jobs_secret_gets_nothing(board: WeightBoard, service: WeightService) -> None:
    board.publish(1, model(seed=1))
    with pytest.raises(Refused, match="did not prove it holds this job's secret"):
        Connection(service.address, credentials=Credentials.fresh().as_process(Identity("rollout", 0, 1)))
    assert service.served == 0


def test_bad_requests_and_a_model_that_does_not_match_are_refused_by_name(board: WeightBoard,
                                                                          service: WeightService) -> None:
    board.publish(1, model(seed=1))
    link = Connection(service.address, credentials=ROLLOUT)
    with pytest.raises(ConfigError, match="unknown weights op 'push'"):
        link.request(Message("push", {}))
    with pytest.raises(ConfigError, match="as an integer, got '0'"):
        link.request(Message("newer", {"have": "0"}))
    with pytest.raises(ConfigError, match="a slot \\(0 or 1\\) and its sequence number, got 2 and 0"):
        link.request(Message("intact", {"slot": 2, "seq": 0}))
    link.close()
    other = blank()
    other["block3.w"] = torch.zeros(64, 32)
    remote = RemoteBoard(lambda: service.address, ROLLOUT)
    with pytest.raises(ConfigError, match="block3.w"):
        remote.read_into(other, -1)
    remote.close()


def test_a_rollout_maps_the_board_of_the_published_id_and_otherwise_reads_over_the_transport(
        board: WeightBoard, service: WeightService, tmp_path: Path) -> None:
    board.publish(5, model(seed=5))
    where = {"board": str(board.path), "board_id": board.board_id, "weights_at": service.address}
    said: list[str] = []
    cases = {"same host": (board.path, where, False), "no board here": (tmp_path / "none", where, False),
             "another job's board": (board.path, {**where, "board_id": "00" * 16}, False),
             "weights = transport": (board.path, where, True)}
    sources = {}
    for case, (path, located, transport) in cases.items():
        fetcher = WeightFetcher(path, Held(blank()), lambda located=located: located, transport, said.append, ROLLOUT)
        fetcher.start()
        while fetcher.ready is None and fetcher.failure is None:
            fetcher.handed.wait(0.01)
        assert fetcher.failure is None, (case, fetcher.failure)
        version, theirs, mine = fetcher.ready
        assert version == 5 and theirs == mine, case
        sources[case] = type(fetcher.source).__name__
        fetcher.stopping.set()
        fetcher.join(5)
        fetcher.source.close()
    assert sources == {"same host": "WeightBoard", "no board here": "RemoteBoard",
                       "another job's board": "RemoteBoard", "weights = transport": "RemoteBoard"}
    assert said[0] == f"weights from trainer 0's board {board.path} (this host's shared memory)"
    assert said[1] == f"weights from trainer 0's weight service at {service.address} (its board is not on this host)"
    assert said[3].endswith("(weights = transport)")
