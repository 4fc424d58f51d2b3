"""convoy.worker.measure, the script's side of the measuring iteration: the marked lines its agent reads, the shape they
carry, an iteration that raises left open, and the model state counted from a model's parameters (no torch)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest

import convoy
from convoy.worker.events import parse
from convoy.worker.measure import BASELINE, BEGIN, END, state_bytes_of


@dataclass
class Param:
    count: int
    width: int

    def numel(self) -> int:
        return self.count

    def element_size(self) -> int:
        return self.width


class Model:
    def parameters(self) -> list[Param]:
        return [Param(1000, 4), Param(10, 2)]


def events(err: str) -> list[tuple[str, str]]:
    return [event for event in map(parse, err.splitlines()) if event is not None]


def test_the_iteration_is_marked_with_its_shape_begin_and_end(capsys: pytest.CaptureFixture[str]) -> None:
    convoy.memory_baseline()
    with convoy.measure_iteration(batch_size=64, sample_bytes=512, state_bytes=4096, activation_bytes=777):
        print("training")
    seen = events(capsys.readouterr().err)
    assert [kind for kind, _ in seen] == [BASELINE, BEGIN, END]
    begin = json.loads(seen[1][1])
    assert {name: begin[name] for name in ("batch_size", "sample_bytes", "state_bytes")} == \
        {"batch_size": 64, "sample_bytes": 512, "state_bytes": 4096}
    for figures in (json.loads(seen[0][1]), begin["baseline"]):  # read by the process as it wrote the line
        assert 0 < figures["uss_bytes"] <= figures["rss_bytes"] and figures["pss_bytes"] > 0, figures
    assert json.loads(seen[2][1]) == {"activation_bytes": 777, "gpu_peak_bytes": None}, "no GPU in use here"


class FakeCuda:
    """What ``torch.cuda`` answers on a GPU process (this machine has none): the allocator's peak, reset on demand."""

    def __init__(self) -> None:
        self.peak, self.resets = 5 * 2**30, 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1
        self.peak = 0

    def max_memory_reserved(self) -> int:
        return self.peak


def test_on_a_gpu_the_iteration_reports_the_allocators_reserved_peak_of_that_iteration(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    with convoy.measure_iteration(batch_size=8, sample_bytes=16):
        cuda.peak = 3 * 2**30  # what this iteration reserved, after the reset at its start
    seen = events(capsys.readouterr().err)
    assert cuda.resets == 1 and json.loads(seen[-1][1])["gpu_peak_bytes"] == 3 * 2**30


def test_an_iteration_that_raises_is_not_ended(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError):
        with convoy.measure_iteration(batch_size=1, sample_bytes=1):
            raise RuntimeError("out of memory")
    assert [kind for kind, _ in events(capsys.readouterr().err)] == [BEGIN], "the agent sees it begun, never ended"


def test_the_state_is_counted_from_the_model_with_its_gradients_and_optimizer_slots() -> None:
    params = 1000 * 4 + 10 * 2
    assert state_bytes_of(Model()) == 2 * params, "parameters and their gradients"
    assert state_bytes_of(Model(), optimizer_slots=2) == 4 * params, "Adam's two moments too"
    marked = convoy.measure_iteration(batch_size=8, sample_bytes=16, model=Model(), optimizer_slots=1)
    assert marked.shape["state_bytes"] == 3 * params


@pytest.mark.parametrize("shape", [{"batch_size": 0, "sample_bytes": 1}, {"batch_size": 1, "sample_bytes": 0},
                                   {"batch_size": 1, "sample_bytes": 1, "state_bytes": -1}])
def test_an_impossible_shape_is_refused_at_once(shape: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="measure_iteration: batch_size"):
        convoy.measure_iteration(**shape)
