"""The strategy search's device plumbing, on a CPU build of torch: the device is the model's own (a model of fake
CUDA tensors is a CUDA model), and what follows from it: DDP bound to that GPU, batches moved there, autocast on
its type, the GPU's memory as the limit and ``torch.cuda``'s allocator counters as the peak (those calls faked
here, as no GPU is present); a CPU model keeps every CPU path (the host's limit, the resident high-water mark)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from convoy.strategy import device as where
from convoy.strategy.device import PeakMemory, autocast, ddp_options, memory_limit, model_device, on_device

CUDA0 = torch.device("cuda", 0)


class Net(nn.Module):
    def __init__(self, on: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4, device=on))
        self.register_buffer("scale", torch.ones(8, device=on))


def test_the_device_is_the_models_own_and_a_batch_follows_it() -> None:
    assert model_device(Net("cpu")) == torch.device("cpu") and ddp_options(torch.device("cpu")) == {}
    assert model_device(nn.ReLU()) == torch.device("cpu"), "a model without tensors trains where it is called"
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Net("cuda")
        assert model_device(model) == CUDA0
        batch = {"ids": torch.zeros(2, 4, dtype=torch.long), "rest": [torch.zeros(2), 3]}
        moved = on_device(batch, CUDA0)
        assert moved["ids"].device == CUDA0 and moved["rest"][0].device == CUDA0 and moved["rest"][1] == 3
        assert on_device(moved["ids"], CUDA0) is moved["ids"], "a tensor already there is not copied"
    assert ddp_options(CUDA0) == {"device_ids": [0], "output_device": 0}


def test_autocast_is_on_the_models_device_type_in_bfloat16_and_off_without_bf16() -> None:
    with autocast(torch.device("cpu"), bf16=True):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), bf16=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with pytest.warns(UserWarning, match="CUDA is not available"):  # on this build torch turns it off, as it says
        on_gpu = autocast(CUDA0, bf16=True)
    assert isinstance(on_gpu, torch.autocast) and on_gpu.device == "cuda" and on_gpu.fast_dtype == torch.bfloat16


class FakeCuda:
    """``torch.cuda``'s memory calls as a 80 GB GPU would answer them, recording what was asked."""

    def __init__(self) -> None:
        self.allocated, self.peak = 3 << 30, 0
        self.calls: list[tuple[str, Any]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def record(name: str, answer: Any = None) -> Any:
            def call(device: Any = None) -> Any:
                self.calls.append((name, device))
                return answer() if callable(answer) else answer
            return call

        monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", lambda: (70 << 30, 80 << 30)))
        monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
        monkeypatch.setattr(torch.cuda, "empty_cache", record("empty_cache"))
        monkeypatch.setattr(torch.cuda, "memory_allocated", record("memory_allocated", lambda: self.allocated))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset_peak_memory_stats"))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("max_memory_allocated", lambda: self.peak))


def test_on_a_gpu_the_limit_is_its_memory_and_the_peak_is_the_allocators(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()
    fake.install(monkeypatch)
    assert memory_limit(CUDA0, host_limit=8e9) == float(80 << 30), "the GPU's memory, not the host's limit"
    assert memory_limit(torch.device("cpu"), host_limit=8e9) == 8e9
    meter = PeakMemory(CUDA0)
    meter.baseline()
    meter.reset()
    fake.peak = (3 << 30) + (5 << 30)
    assert meter.peak() == 5 << 30, "the run's peak above what the process held before it"
    assert [name for name, _ in fake.calls] == ["mem_get_info", "synchronize", "empty_cache", "memory_allocated",
                                                "reset_peak_memory_stats", "synchronize", "max_memory_allocated"]
    assert {device for name, device in fake.calls if name != "empty_cache"} == {CUDA0}, "each names the model's GPU"


def test_on_the_cpu_the_peak_is_the_processs_resident_high_water_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: pytest.fail("a CPU run asks no GPU"))
    meter = PeakMemory(torch.device("cpu"))
    meter.baseline()
    meter.reset()
    held = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
    assert meter.peak() >= 60 << 20
    del held


def test_a_timed_span_waits_for_the_gpus_queued_work(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()
    fake.install(monkeypatch)
    with where.timed_on(torch.device("cpu")):
        pass
    assert fake.calls == []
    with where.timed_on(CUDA0):
        pass
    assert fake.calls == [("synchronize", CUDA0)]
