"""The work a snapshot puts on the training thread each step: one walk lays the state out (``place``: the same
skeleton, offsets and pickled skeleton as ``flatten``, ``layout`` and ``encode_meta`` one after the other), and
the background copies run on one thread that lives as long as the Checkpointer (no thread started per step): one
at a time, their errors raised at ``wait``, the thread ended by ``close``."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint_state import BackgroundCopy
from convoy.runtime.slots import encode_meta, flatten, layout, place


def state() -> dict:
    return {"step": 7, "model": {"w": torch.ones(3, 5), "b": torch.zeros(5, dtype=torch.bfloat16)},
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 5)}},
                      "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
            "rng": (3, tuple(range(10)), None), "empty": torch.empty(0)}


def test_one_walk_places_the_state_as_the_three_steps_did() -> None:
    live = state()
    moving = live["model"]["w"]
    placed = place(live, lambda t: t is moving)
    tensors: list[torch.Tensor] = []
    skeleton = flatten(live, tensors)
    offsets, data_len = layout(tensors)
    pending = frozenset(i for i, t in enumerate(tensors) if t is moving)
    assert placed.tensors == tensors and placed.offsets == offsets and placed.data_len == data_len
    assert placed.pending == pending == frozenset({0})
    assert pickle.loads(placed.meta()) == pickle.loads(encode_meta(skeleton, offsets, pending))
    assert pickle.loads(placed.meta())["optim"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]


def test_the_copies_run_one_at_a_time_on_one_thread_and_close_ends_it() -> None:
    copies = BackgroundCopy()
    ran: list[tuple[int, str]] = []
    before = set(threading.enumerate())
    for index in range(5):
        copies.start(lambda index=index: (time.sleep(0.01), ran.append((index, threading.current_thread().name))),
                     "convoy-snapshot")
        copies.wait()
    assert [index for index, _ in ran] == list(range(5)) and {name for _, name in ran} == {"convoy-snapshot"}
    started = set(threading.enumerate()) - before
    assert len(started) == 1, "one thread for every copy"
    copies.start(lambda: time.sleep(0.05), "convoy-restore")
    assert copies.settle(5.0), "settle waits for the copy in flight"
    copies.close()
    assert not any(thread.is_alive() for thread in started)


def test_a_failed_copy_is_raised_at_wait_once_and_the_next_one_runs() -> None:
    copies = BackgroundCopy()
    copies.start(lambda: (_ for _ in ()).throw(OSError("no space left on device")), "convoy-snapshot")
    with pytest.raises(CheckpointError, match="in-memory snapshot failed: no space left on device"):
        copies.wait()
    copies.wait()  # said once
    landed = threading.Event()
    copies.start(landed.set, "convoy-snapshot")
    copies.close()
    assert landed.is_set()


def test_a_guarded_copy_lets_the_gpu_wait_and_the_host_waits_at_the_next_wait() -> None:
    copies = BackgroundCopy()
    release, guarded = threading.Event(), []
    copies.start(release.wait, "convoy-snapshot", guard=lambda: guarded.append("the compute stream waits"))
    copies.before_change()  # returns at once: the guard, not the host, waits for the side stream's copies
    assert guarded == ["the compute stream waits"] and not copies.settle(0.01)
    release.set()
    copies.wait()
    copies.close()
