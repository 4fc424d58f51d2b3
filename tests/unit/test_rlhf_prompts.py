"""The prompts' queue: a dead rollout's prompts go back to the head of the queue, a stopped one's once its lease
runs out, a live one renews its leases, and a late result for a prompt given to another rollout is refused."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rlhf.prompts import PromptQueue


def test_a_dead_rollouts_prompts_go_back_first_and_its_late_results_are_refused() -> None:
    queue = PromptQueue(lease_s=10)
    queue.add(list(range(6)))
    assert queue.lease("rollout:0:1", 2, now=0) == [0, 1]
    assert queue.lease("rollout:1:1", 2, now=0) == [2, 3]
    assert queue.finish("rollout:0:1", 0)
    assert queue.release("rollout:0:1") == [1]
    assert queue.lease("rollout:0:2", 3, now=1) == [1, 4, 5], "the replacement takes the dead one's prompt first"
    assert not queue.finish("rollout:0:1", 1), "the old incarnation's result comes too late"
    assert queue.finish("rollout:0:2", 1)
    assert (queue.done, queue.requeued, queue.late) == (2, 1, 1)


def test_a_stopped_rollouts_lease_runs_out_and_a_live_one_renews() -> None:
    queue = PromptQueue(lease_s=10)
    queue.add([0, 1, 2])
    queue.lease("rollout:0:1", 1, now=0)
    queue.lease("rollout:1:1", 1, now=0)
    assert queue.renew("rollout:1:1", now=8) == 1
    assert queue.expire(now=12) == ["rollout:0:1"], "stopped: no renewal in 10 s"
    assert queue.lease("rollout:2:1", 5, now=12) == [0, 2]
    assert queue.finish("rollout:1:1", 1), "the live rollout's lease was renewed"
    assert queue.expire(now=100) == ["rollout:2:1"]


def test_a_lease_must_last() -> None:
    with pytest.raises(ConfigError, match="lease"):
        PromptQueue(lease_s=0)
