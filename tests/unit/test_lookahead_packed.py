"""Linear layers on oneDNN-packed weights (convoy/workloads/lookahead/packed.py): same results as the stock
layers, patched only inside the block, packed again when a weight changes."""

from __future__ import annotations

import pytest
import torch

from convoy.workloads.lookahead.packed import PackedLinears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 40, bias=False))


def test_packed_layers_match_stock_for_any_row_count_and_layout() -> None:
    model = layers()
    packed = PackedLinears(model)
    assert len(packed.modules) == 2
    for shape in ((1, 48), (2, 48), (17, 48), (3, 5, 48)):
        x = torch.randn(shape)
        want = model(x)
        with torch.inference_mode(), packed:
            got = model(x)
            sliced = model(torch.randn(4, 9, 48)[:, 2:7])  # a non-contiguous view
        assert torch.allclose(got, want, atol=1e-5), (shape, (got - want).abs().max())
        assert sliced.shape == (4, 5, 40)


def test_patched_only_inside_the_block_even_on_error() -> None:
    model = layers()
    packed = PackedLinears(model)
    with pytest.raises(ValueError), torch.inference_mode(), packed:
        assert "forward" in model[0].__dict__
        with packed:  # nested: still patched after the inner block ends
            pass
        assert "forward" in model[0].__dict__
        raise ValueError("boom")
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__


def test_a_changed_or_replaced_weight_is_packed_again() -> None:
    model = layers()
    packed = PackedLinears.of(model)
    assert PackedLinears.of(model) is packed  # one set of copies per model
    x = torch.randn(3, 48)
    with torch.inference_mode(), packed:
        model(x)
    with torch.no_grad():
        model[0].weight.mul_(-2.0)  # in place: the tensor's version moves on
    model[2].weight = torch.nn.Parameter(torch.randn(40, 96))  # a new parameter object
    want = model(x)
    with torch.inference_mode(), packed:
        got = model(x)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # writes that bypass the version counter, as weight syncs often do
    model[0].weight.data.copy_(torch.randn(96, 48))
    model[2].weight.data = torch.randn(40, 96)
    want = model(x)
    with torch.inference_mode(), packed:
        got = model(x)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_other_dtypes_keep_their_own_kernels() -> None:
    model = torch.nn.Linear(8, 8).to(torch.float64)
    assert PackedLinears(model).modules == []


def test_each_weight_shape_is_timed_once_and_small_passes_below_its_crossover_run_the_stock_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import convoy.workloads.lookahead.packed as packed_module

    timed: list[tuple[int, ...]] = []

    def crossover(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> int:
        timed.append(tuple(weight.shape))
        return 4

    monkeypatch.setattr(packed_module, "stock_wins_up_to", crossover)
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Linear(48, 48), torch.nn.Linear(48, 40))
    packed = PackedLinears(model)
    stock_calls: list[int] = []
    linear = torch.nn.functional.linear

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        stock_calls.append(x.numel() // x.shape[-1])
        return linear(x, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    for rows in (1, 4, 5, 9):
        x = torch.randn(1, rows, 48)
        with torch.inference_mode():
            want = model(x)
            stock_calls.clear()
            with packed:
                got = model(x)
        assert torch.allclose(got, want, atol=1e-5), (rows, (got - want).abs().max())
        assert stock_calls == ([rows] * 3 if rows <= 4 else []), (rows, stock_calls)
    assert timed == [(48, 48), (40, 48)] and packed.stock_rows == {(48, 48): 4, (40, 48): 4}


def test_the_measured_crossover_is_a_row_count_it_tried() -> None:
    from convoy.workloads.lookahead.packed import CROSSOVER_ROWS, stock_wins_up_to

    weight = torch.randn(96, 48)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    assert stock_wins_up_to(weight, None, packed) in (0, *CROSSOVER_ROWS)
