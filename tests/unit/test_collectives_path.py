"""Which way an allreduce's in-group phases go (``host_memory.reduce_path``): shared memory only for CPU
tensors on gloo, the process group for CUDA tensors, a ConfigError saying what to do where the group's
backend can't reduce the tensor's device. Pure: no process group, no GPU."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.parallel.allreduce.host_memory import GROUP, HOST_MEMORY, device_backend, reduce_path


@pytest.mark.parametrize(("backend", "device", "path"), [
    ("gloo", "cpu", HOST_MEMORY),
    ("nccl", "cuda", GROUP),
    ("cpu:gloo,cuda:nccl", "cpu", HOST_MEMORY),
    ("cpu:gloo,cuda:nccl", "cuda", GROUP),
    ("cuda:nccl,cpu:gloo", "cuda", GROUP),
    ("mpi", "cpu", GROUP),
    ("mpi", "cuda", GROUP),
])
def test_host_memory_only_for_cpu_tensors_on_gloo(backend: str, device: str, path: str) -> None:
    assert reduce_path(backend, device) == path


def test_cuda_tensors_never_take_host_memory() -> None:
    for backend in ("nccl", "NCCL", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "ucc"):
        assert reduce_path(backend, "cuda") != HOST_MEMORY, backend


def test_cpu_tensor_under_nccl_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"nccl reduces CUDA tensors, not CPU ones: move the tensor to the GPU "
                                          r"\(tensor\.cuda\(\)\), or init the process group with backend "
                                          r"'cpu:gloo,cuda:nccl'"):
        reduce_path("nccl", "cpu")


def test_cuda_tensor_under_gloo_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"gloo reduces CPU tensors; this one is on cuda: move it with "
                                          r"tensor\.cpu\(\), or use backend 'nccl'"):
        reduce_path("gloo", "cuda")


def test_device_backend_reads_each_form_of_backend_name() -> None:
    assert device_backend("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert device_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert device_backend("cuda:nccl", "cpu") is None
    assert device_backend("nccl", "cpu") is None
    assert device_backend("gloo", "cuda") is None
