"""The store's service over the real role transport: rollouts lease prompts and put whole groups, a trainer takes
them under the staleness rule and publishes versions; a stopped rollout's prompts go to another when its lease
runs out and its late group is refused; malformed groups and publishing by a rollout are refused by name."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Connection, Credentials, Identity, Message
from convoy.workloads.rlhf.prompts import PromptQueue
from convoy.workloads.rlhf.store import SampleStore
from convoy.workloads.rlhf.store_service import StoreService

JOB = Credentials.fresh()
GROUP = 4


@pytest.fixture
def service() -> Iterator[StoreService]:
    prompts = PromptQueue(lease_s=1.0)
    prompts.add(list(range(10)))
    served = StoreService(SampleStore(capacity=8, max_lag=1), prompts, GROUP, credentials=JOB,
                          say=lambda line: None)
    yield served
    served.close()


def caller(service: StoreService, role: str, rank: int = 0, incarnation: int = 1) -> Connection:
    return Connection(service.address, credentials=JOB.as_process(Identity(role, rank, incarnation)))


def group(length: int, reward: float = 1.0) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(100, (GROUP, length)), "mask": torch.ones(GROUP, length),
            "logprobs": -torch.rand(GROUP, length), "rewards": torch.full((GROUP,), reward)}


def test_groups_flow_from_rollouts_to_the_trainer_under_the_staleness_rule(service: StoreService) -> None:
    rollout, trainer = caller(service, "rollout"), caller(service, "trainer")
    trainer.request(Message("publish", {"version": 1, "digest": "aa"}))
    leased = rollout.request(Message("lease", {"count": 3})).meta["prompts"]
    assert leased == [0, 1, 2]
    for prompt, length in zip(leased, (5, 7, 6), strict=True):
        reply = rollout.request(Message("put", {"prompt": prompt, "version": 1}, group(length, float(prompt))))
        assert reply.meta["outcome"] == "kept"
    trainer.request(Message("publish", {"version": 3, "digest": "bb"}))
    assert trainer.request(Message("take", {"count": 2, "current": 3})).op == "empty", "version 1 is 2 behind"
    stats = service.stats()
    assert stats["by_version"]["1"]["dropped_stale"] == 3 and service.digests == {1: "aa", 3: "bb"}
    fresh = rollout.request(Message("lease", {"count": 2})).meta["prompts"]
    for prompt in fresh:
        rollout.request(Message("put", {"prompt": prompt, "version": 2}, group(4 + prompt, 1.0)))
    taken = trainer.request(Message("take", {"count": 5, "current": 3}))
    assert taken.meta["groups"] == 2 and taken.meta["prompts"] == fresh
    assert taken.tensors["tokens"].shape == (2 * GROUP, 4 + max(fresh)), "padded to the longest"
    assert torch.equal(taken.tensors["versions"], torch.tensor([2, 2]))


def test_a_stopped_rollouts_prompts_go_to_another_and_its_late_group_is_refused(service: StoreService) -> None:
    trainer = caller(service, "trainer")
    trainer.request(Message("publish", {"version": 1}))
    stopped, live = caller(service, "rollout", 0), caller(service, "rollout", 1)
    taken = stopped.request(Message("lease", {"count": 2})).meta["prompts"]
    deadline = time.monotonic() + 10
    while service.stats()["prompts_requeued"] < 2:
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.1)
    assert live.request(Message("lease", {"count": 2})).meta["prompts"] == taken
    late = stopped.request(Message("put", {"prompt": taken[0], "version": 1}, group(5)))
    assert late.op == "refused" and "no longer leased to this rollout" in late.meta["why"]
    assert live.request(Message("put", {"prompt": taken[0], "version": 1}, group(5))).meta["outcome"] == "kept"
    assert service.stats()["late_groups"] == 1


def test_bad_input_is_refused_by_name(service: StoreService) -> None:
    rollout, trainer = caller(service, "rollout"), caller(service, "trainer")
    trainer.request(Message("publish", {"version": 1}))
    prompt = rollout.request(Message("lease", {"count": 1})).meta["prompts"][0]
    wrong = group(5)
    wrong["rewards"] = torch.ones(GROUP - 1)
    with pytest.raises(ConfigError, match="a group is 4 responses"):
        rollout.request(Message("put", {"prompt": prompt, "version": 1}, wrong))
    bad = group(5)
    bad["rewards"][0] = float("nan")
    with pytest.raises(ConfigError, match="must be finite"):
        rollout.request(Message("put", {"prompt": prompt, "version": 1}, bad))
    missing = group(5)
    del missing["logprobs"]
    with pytest.raises(ConfigError, match="missing \\['logprobs'\\]"):
        rollout.request(Message("put", {"prompt": prompt, "version": 1}, missing))
    future = rollout.request(Message("put", {"prompt": prompt, "version": 9}, group(5)))
    assert future.meta["outcome"] == "unknown version"
    assert prompt in service.prompts.waiting, "a group not kept gives its prompt back"
    with pytest.raises(ConfigError, match="may not publish versions"):
        rollout.request(Message("publish", {"version": 2}))
    with pytest.raises(ConfigError, match="lease at least one"):
        rollout.request(Message("lease", {"count": 0}))
    assert service.stats()["refused_malformed"] == 3


def test_a_group_needs_two_responses() -> None:
    with pytest.raises(ConfigError, match=">= 2 responses"):
        StoreService(SampleStore(4, 0), PromptQueue(1.0), 1, credentials=JOB)


@pytest.mark.parametrize("max_lag", [0, 1])
def test_new_prompts_are_issued_only_k_steps_ahead_of_the_trainers(max_lag: int) -> None:
    """Two groups a step: with k = 0 a version gets exactly its step's prompts (synchronous), with k = 1 the rollouts
    may make one step more while the trainers train; a rollout whose weights are too old gets none."""
    served = StoreService(SampleStore(capacity=64, max_lag=max_lag), PromptQueue(lease_s=30.0), GROUP, per_step=2,
                          credentials=JOB, say=lambda line: None)
    try:
        rollout, trainer = caller(served, "rollout"), caller(served, "trainer")
        first = rollout.request(Message("lease", {"count": 10, "version": 0})).meta["prompts"]
        assert first == list(range(2 * (1 + max_lag)))
        assert rollout.request(Message("lease", {"count": 10, "version": 0})).meta["prompts"] == []
        for prompt in first:
            rollout.request(Message("put", {"prompt": prompt, "version": 0}, group(5)))
        assert trainer.request(Message("take", {"count": 2, "current": 0})).meta["groups"] == 2
        trainer.request(Message("publish", {"version": 1}))
        assert rollout.request(Message("lease", {"count": 10, "version": 0})).meta["prompts"] == [], \
            "step 1's groups are made: a group of version 0 would be taken at step 2, beyond k"
        more = rollout.request(Message("lease", {"count": 10, "version": 1})).meta["prompts"]
        assert more == list(range(2 * (1 + max_lag), 2 * (2 + max_lag)))
        trainer.request(Message("publish", {"version": 3}))
        assert rollout.request(Message("lease", {"count": 10, "version": 2 - max_lag})).meta["prompts"] == [], \
            "weights older than k versions: take the newer ones first"
    finally:
        served.close()


def test_a_rollout_a_version_behind_makes_only_what_is_taken_before_its_version_falls_out_of_k() -> None:
    """k = 1, two groups a step: at version 1 with nothing made yet, a rollout still holding version 0 may make
    step 1's two groups (taken at version 1, within k) but not step 2's (taken at version 2: dropped as stale);
    one holding version 1 may make step 2's but, once step 1 has taken its groups, not step 3's. Prompts held by a
    rollout count as groups in the making."""
    served = StoreService(SampleStore(capacity=64, max_lag=1), PromptQueue(lease_s=30.0), GROUP, per_step=2,
                          credentials=JOB, say=lambda line: None)
    try:
        old, new, trainer = caller(served, "rollout", 0), caller(served, "rollout", 1), caller(served, "trainer")
        trainer.request(Message("publish", {"version": 1}))
        assert old.request(Message("lease", {"count": 10, "version": 0})).meta["prompts"] == [0, 1]
        assert old.request(Message("lease", {"count": 10, "version": 0})).meta["prompts"] == []
        assert new.request(Message("lease", {"count": 10, "version": 1})).meta["prompts"] == [2, 3]
        for prompt in (0, 1):
            assert old.request(Message("put", {"prompt": prompt, "version": 0}, group(5))).meta["outcome"] == "kept"
        assert old.request(Message("lease", {"count": 1, "version": 0})).meta["prompts"] == []
        assert trainer.request(Message("take", {"count": 2, "current": 1})).meta["groups"] == 2
        assert new.request(Message("lease", {"count": 10, "version": 1})).meta["prompts"] == [], \
            "step 1 took its groups and step 2's are in the making: one more of version 1 would be taken at step 3"
        for prompt in (2, 3):
            assert new.request(Message("put", {"prompt": prompt, "version": 1}, group(5))).meta["outcome"] == "kept"
        trainer.request(Message("publish", {"version": 2}))
        assert trainer.request(Message("take", {"count": 2, "current": 2})).meta["groups"] == 2
        assert served.stats()["dropped_stale"] == 0
    finally:
        served.close()


def test_a_dropped_prompt_is_done_counted_and_replaced_by_a_new_one() -> None:
    served = StoreService(SampleStore(capacity=64, max_lag=0), PromptQueue(lease_s=30.0), GROUP, per_step=2,
                          credentials=JOB, say=lambda line: None)
    try:
        rollout = caller(served, "rollout")
        assert rollout.request(Message("lease", {"count": 5, "version": 0})).meta["prompts"] == [0, 1]
        assert rollout.request(Message("drop", {"prompt": 1, "why": "reward function raised"})).op == "dropped"
        assert rollout.request(Message("lease", {"count": 5, "version": 0})).meta["prompts"] == [2]
        assert caller(served, "rollout", rank=1).request(Message("drop", {"prompt": 0})).op == "refused", \
            "not its lease"
        stats = served.stats()
        assert stats["dropped_prompts"] == {"reward function raised": 1} and stats["issued"] == 3
    finally:
        served.close()


def test_a_rollout_that_goes_silent_is_said_stopped_once_with_or_without_prompts_and_again_when_it_answers() -> None:
    said: list[str] = []
    served = StoreService(SampleStore(capacity=64, max_lag=1), PromptQueue(lease_s=0.6), GROUP, per_step=2,
                          credentials=JOB, say=said.append)
    try:
        idle, busy = caller(served, "rollout", rank=0), caller(served, "rollout", rank=1)
        idle.request(Message("renew", {}))
        leased = busy.request(Message("lease", {"count": 2, "version": 0})).meta["prompts"]
        deadline = time.monotonic() + 10
        while len([line for line in said if "presumed stopped" in line]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = sorted(line for line in said if "presumed stopped" in line)
        assert stopped == [f"store: rollout:{rank}:1 renewed no lease for 0.6 s: presumed stopped, its {held} "
                           "prompt(s) go to the other rollouts" for rank, held in ((0, 0), (1, 2))]
        assert list(served.prompts.waiting) == leased, "the silent one's prompts wait for another"
        time.sleep(1.0)
        assert len([line for line in said if "presumed stopped" in line]) == 2, "said once"
        idle.request(Message("renew", {}))
        assert said[-1] == "store: rollout:0:1 answers again; the groups it makes for prompts that went to others " \
                           "are refused"
    finally:
        served.close()
