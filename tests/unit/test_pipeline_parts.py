"""The torch parts of the pipeline that need no processes: stage splitting, the injected linear
backward that keeps split forwards exact, and the activation meter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from convoy.errors import ScheduleError
from convoy.parallel.pipeline.memory import ActivationMeter
from convoy.parallel.pipeline.runtime import split_sequential
from convoy.parallel.tensor.blocks import MLPBlock, _Injected, split_blocks


def test_split_sequential_cuts_contiguous_near_equal_stages() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(7)])
    stages = split_sequential(model, 3)
    assert [len(s) for s in stages] == [3, 2, 2]
    assert [m for s in stages for m in s] == list(model)
    with pytest.raises(ScheduleError, match="8 stages but the model has 7 layers; use between 1 and 7"):
        split_sequential(model, 8)
    with pytest.raises(ScheduleError, match="no layers"):
        split_sequential(nn.Sequential(), 1)


def test_a_block_split_by_columns_gives_the_unsplit_values_and_gradients() -> None:
    torch.manual_seed(0)
    block = MLPBlock(6, 10)
    x = torch.randn(5, 6, requires_grad=True)
    want = block(x)
    want.square().sum().backward()
    want_grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    for p in block.parameters():
        p.grad = None
    x.grad = None
    cut = 4  # the owner's columns; a helper computed the rest and sent pre-activations and partial output
    w1, b1, w2 = block.fc1.weight, block.fc1.bias, block.fc2.weight
    with torch.no_grad():
        pre_h = F.linear(x, w1[cut:], b1[cut:])
        y_h = F.linear(F.gelu(pre_h), w2[:, cut:])
    own = F.linear(F.gelu(F.linear(x, w1[:cut], b1[:cut])), w2[:, :cut])
    pre = _Injected.apply(x, w1[cut:], b1[cut:], pre_h)
    got = own + _Injected.apply(F.gelu(pre), w2[:, cut:], None, y_h) + block.fc2.bias
    got.square().sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    for have, ref in zip([p.grad for p in block.parameters()] + [x.grad], want_grads, strict=True):
        assert torch.allclose(have, ref, atol=1e-5)


def test_only_mlp_blocks_can_be_split() -> None:
    assert len(split_blocks(nn.Sequential(MLPBlock(4), MLPBlock(4)), 0)) == 2
    with pytest.raises(ScheduleError, match="stage 2 can't be split"):
        split_blocks(nn.Sequential(nn.Linear(4, 4)), 2)


def test_activation_meter_counts_saved_bytes_until_backward_frees_them() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    meter = ActivationMeter(model.parameters())
    with meter:
        loss = model(torch.randn(32, 64)).sum()
    assert meter.live >= 2 * 32 * 64 * 4  # the input, the tanh output (the weights don't count)
    assert meter.live < 6 * 32 * 64 * 4
    peak = meter.peak
    loss.backward()
    del loss
    assert meter.live == 0 and meter.peak == peak
