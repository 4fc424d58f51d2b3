"""The replay buffer's shared ring: a learner on the service's host gathers its samples from the ring itself (the
service sends only the slots), exactly the rows drawn; a row overwritten while it is copied is dropped, never kept
torn; a ring that is not the service's (another host, an old one, a wrong token) is refused and the samples come
over the transport; a restarted service's new ring is found again."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Credentials, Identity
from convoy.shm import SHM_DIR
from convoy.workloads.rl.buffer import Layout, ReplayBuffer
from convoy.workloads.rl.replay_client import ReplayClient
from convoy.workloads.rl.replay_service import ReplayService
from convoy.workloads.rl.ring import SharedRing

LAYOUT = Layout.for_dqn((4,))
JOB = Credentials.fresh()


def transitions(first: int, count: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(first, first + count)
    return {"obs": ids.float().unsqueeze(1).repeat(1, 4), "action": ids, "reward": ids.float(),
            "next_obs": ids.float().unsqueeze(1).repeat(1, 4) + 0.5, "discount": torch.full((count,), 0.9)}


@pytest.fixture
def ring_path() -> Iterator[Path]:
    path = SHM_DIR / f"convoy-test{uuid.uuid4().hex[:8]}-replay0-ring"
    yield path
    for leftover in SHM_DIR.glob(f"{path.name}*"):
        leftover.unlink()


def service_with_ring(path: Path, capacity: int = 1000) -> ReplayService:
    buffer = ReplayBuffer(LAYOUT, capacity, alpha=0.6)
    return ReplayService(buffer, credentials=JOB, ring=SharedRing.create(path, LAYOUT, capacity))


def client(service: ReplayService, role: str = "learner") -> ReplayClient:
    return ReplayClient(lambda: service.address, JOB.as_process(Identity(role, 0, 1)), find_s=5)


def test_a_learner_gathers_exactly_the_drawn_rows_from_the_ring(ring_path: Path) -> None:
    service = service_with_ring(ring_path)
    actor, learner = client(service, "actor"), client(service)
    actor.insert(transitions(0, 700))
    for _ in range(5):
        drawn = learner.sample(64)
        assert drawn is not None and drawn.meta["direct"], "the service sent only the slots"
        ids = drawn.tensors["action"]
        assert torch.equal(drawn.tensors["_written"], ids) and len(ids) == 64
        assert torch.equal(drawn.tensors["obs"][:, 3], ids.float())
        assert torch.equal(drawn.tensors["next_obs"][:, 0], ids.float() + 0.5)
        assert torch.equal(drawn.tensors["reward"], ids.float())
        learner.priorities(drawn.tensors["_slots"], drawn.tensors["_written"], torch.rand(64))
    assert learner.ring is not None and learner.torn == 0
    assert "gathered here from the shared ring" in learner.sample_route()
    assert service.stats()["sampled"] == 5 * 64
    for c in (actor, learner):
        c.close()
    service.close()
    assert not ring_path.exists()


def test_a_row_overwritten_while_it_is_copied_is_dropped(ring_path: Path) -> None:
    buffer = ReplayBuffer(LAYOUT, 10)
    ring = SharedRing.create(ring_path, LAYOUT, 10)
    buffer.share(ring.columns, ring.written)
    buffer.insert(transitions(0, 10))
    reader = SharedRing.open(ring_path, ring.token)
    drawn = buffer.sample(10, gather=False)
    buffer.insert(transitions(10, 3))  # the ring wraps over slots 0-2 between the draw and the copy
    got = reader.gather(drawn.slots, drawn.written)
    overwritten = drawn.slots < 3
    assert torch.equal(got.kept, ~overwritten)
    kept_ids = got.batch["action"][got.kept]
    assert torch.equal(kept_ids, drawn.written[got.kept]) and torch.equal(got.batch["reward"][got.kept],
                                                                          kept_ids.float())
    buffer.written[5] = -1  # mid-write, as the service leaves it between its two fenced stores
    assert not bool(reader.gather(torch.tensor([5]), torch.tensor([5])).kept[0])
    reader.close()
    ring.remove()


def test_a_ring_that_is_not_the_services_is_refused(ring_path: Path, tmp_path: Path) -> None:
    ring = SharedRing.create(ring_path, LAYOUT, 10)
    with pytest.raises(ConfigError, match="token differs"):
        SharedRing.open(ring_path, b"x" * 16)
    with pytest.raises(ConfigError, match="cannot open the replay ring"):
        SharedRing.open(SHM_DIR / "convoy-nosuchjob-replay0-ring", ring.token)
    with pytest.raises(ConfigError, match="slots out of the ring"):
        ring.gather(torch.tensor([10]), torch.tensor([0]))
    ring.remove()


def test_without_the_ring_on_this_host_the_samples_come_over_the_transport(ring_path: Path) -> None:
    service = service_with_ring(ring_path)
    assert service.ring is not None
    service.ring.path.rename(ring_path.with_name(ring_path.name + "-elsewhere"))  # as if on another host
    actor, learner = client(service, "actor"), client(service)
    actor.insert(transitions(0, 100))
    drawn = learner.sample(16)
    assert drawn is not None and not drawn.meta["direct"] and len(drawn.tensors["obs"]) == 16
    assert learner.ring is None and "cannot open the replay ring" in learner.ring_why
    ring_path.with_name(ring_path.name + "-elsewhere").unlink()
    for c in (actor, learner):
        c.close()
    service.close()


def test_a_restarted_service_has_its_new_ring_found(ring_path: Path) -> None:
    first = service_with_ring(ring_path)
    address = [first.address]
    learner = ReplayClient(lambda: address[0], JOB.as_process(Identity("learner", 0, 1)), find_s=5)
    actor = ReplayClient(lambda: address[0], JOB.as_process(Identity("actor", 0, 1)), find_s=5)
    actor.insert(transitions(0, 100))
    assert learner.sample(8) is not None and learner.ring is not None
    first.close()
    second_path = ring_path.with_name(ring_path.name + "2")
    second = service_with_ring(second_path)
    address[0] = second.address
    actor.insert(transitions(100, 100))
    drawn = learner.sample(8)  # asked of the old ring: answered whole, and the new ring looked for next
    assert drawn is not None and not drawn.meta["direct"] and len(drawn.tensors["obs"]) == 8
    drawn = learner.sample(8)
    assert drawn is not None and drawn.meta["direct"]
    assert learner.ring is not None and learner.ring.path == second_path
    for c in (actor, learner):
        c.close()
    second.close()
