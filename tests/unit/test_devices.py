"""The GPU path's CPU-testable parts: the backend and device a worker takes, NCCL's settings, which snapshot
tensors go by CUDA copies, and a guard that lets the GPU (not the host) wait for them."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from convoy.errors import ConfigError
from convoy.runtime.checkpoint_state import BackgroundCopy
from convoy.runtime.cuda_copy import has_cuda, split_by_device, staging_extent
from convoy.runtime.devices import CUDA_BACKEND, BackendChoice, choose_backend, nccl_environment
from convoy.runtime.slots import layout


@pytest.mark.parametrize(("requested", "gpus", "local_rank", "expected"), [
    (None, 0, 3, BackendChoice("gloo", "cpu")),
    ("gloo", 4, 1, BackendChoice("gloo", "cpu")),
    (None, 4, 2, BackendChoice(CUDA_BACKEND, "cuda:2", 2)),
    ("nccl", 2, 1, BackendChoice("nccl", "cuda:1", 1)),
    (CUDA_BACKEND, 1, 0, BackendChoice(CUDA_BACKEND, "cuda:0", 0)),
])
def test_each_worker_takes_the_gpu_of_its_local_rank(requested: str | None, gpus: int, local_rank: int,
                                                      expected: BackendChoice) -> None:
    assert choose_backend(requested, gpus, local_rank) == expected
    assert expected.uses_nccl == (expected.device != "cpu")


@pytest.mark.parametrize(("requested", "gpus", "local_rank", "visible", "named"), [
    ("nccl", 0, 0, None, "needs a CUDA device, and torch sees none"),
    (CUDA_BACKEND, 0, 0, "", "(CUDA_VISIBLE_DEVICES=)"),
    (None, 2, 2, "0,1", "LOCAL_RANK 2 has no GPU of its own: torch sees 2 CUDA device(s) on this node "
                        "(CUDA_VISIBLE_DEVICES=0,1); start at most 2 worker(s) per node (--nproc-per-node 2)"),
    ("mpi", 1, 0, None, "backend 'mpi' is not one convoy runs"),
])
def test_a_backend_this_node_cannot_honour_is_named_with_what_to_do(requested: str | None, gpus: int,
                                                                     local_rank: int, visible: str | None,
                                                                     named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        choose_backend(requested, gpus, local_rank, visible)
    assert named in str(refused.value)


def test_nccl_settings_are_defaults_the_jobs_environment_overrides() -> None:
    added = nccl_environment({})
    assert added["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in added
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})


def test_init_on_a_cpu_node_refuses_nccl_before_making_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import convoy

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        convoy.init(backend="nccl")
    assert not torch.distributed.is_initialized()


def test_snapshot_tensors_on_a_gpu_are_told_apart_from_host_ones() -> None:
    with FakeTensorMode():  # CUDA tensors as torch describes them, on a machine without a GPU
        on_gpu = [torch.empty(3, 5, device="cuda"), torch.empty(7, dtype=torch.float16, device="cuda")]
    host = [torch.zeros(2), torch.zeros(4, dtype=torch.int64)]
    tensors = [host[0], on_gpu[0], host[1], on_gpu[1]]
    assert split_by_device(tensors, [0, 1, 2, 3]) == ([0, 2], [1, 3])
    assert split_by_device(tensors, [3, 2]) == ([2], [3])
    assert has_cuda({"model": {"w": host[0]}, "optim": [(1, on_gpu[1])]})
    assert not has_cuda({"model": {"w": host[0]}, "step": 3, "rng": [host[1]]})
    offsets, _ = layout(tensors)  # where each lands in a slot; the staging buffer mirrors it
    assert staging_extent([on_gpu[0]], [offsets[1]]) == offsets[1] + 60
    assert staging_extent([on_gpu[1]], [offsets[3]]) == offsets[3] + 14, "the later batch needs the farther end"
    assert offsets[1] + 60 <= offsets[3], "two batches of one snapshot, staged at their slot offsets, never overlap"


def test_a_guarded_copy_lets_the_gpu_wait_and_the_host_joins_it_later() -> None:
    copies, release, guarded = BackgroundCopy(), threading.Event(), []
    copies.start(lambda: release.wait(5), "copy", guard=lambda: guarded.append("stream waits"))
    copies.before_change()  # optimizer.step(): the copy is still in flight, the host does not wait for it
    assert guarded == ["stream waits"] and not copies.settle(0.05)
    release.set()
    copies.before_change()  # another change before the next snapshot: the guard is spent, so the host joins
    assert guarded == ["stream waits"] and copies.settle(0)


def test_a_failed_guarded_copy_is_raised_in_the_training_thread() -> None:
    copies = BackgroundCopy()

    def broken() -> None:
        raise OSError("segment gone")

    copies.start(broken, "copy", guard=lambda: None)
    copies.settle(5)
    with pytest.raises(Exception, match="in-memory snapshot failed: segment gone"):
        copies.before_change()


def test_an_unguarded_copy_is_joined_before_the_state_changes() -> None:
    copies, landed = BackgroundCopy(), []
    copies.start(lambda: landed.append(1), "copy")
    copies.before_change()
    assert landed == [1] and copies.settle(0)
