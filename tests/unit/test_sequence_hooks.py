"""convoy.attention and convoy.positions on one rank (the sequence strategy's cut runs them on 2 and 4 gloo ranks in
tests/fixtures/strategy_accelerate.py): torch's attention and positions from 0, and what ``recording`` sees."""

from __future__ import annotations

import torch

import convoy
from convoy.parallel.sequence.shard import recording


def test_outside_a_cut_the_hooks_are_torch_attention_and_positions_from_zero() -> None:
    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.equal(convoy.attention(q, k, v, causal=causal), want)
    assert torch.equal(convoy.positions(5), torch.arange(5))


def test_recording_sees_each_attention_call_and_the_positions_asked_for() -> None:
    q = torch.randn(1, 2, 6, 4)
    with recording() as record:
        convoy.positions(6)
        convoy.attention(q, q, q, causal=True)
        convoy.attention(q, q, q)
    assert record.attention == [((1, 2, 6, 4), True), ((1, 2, 6, 4), False)] and record.positions == 1
    convoy.attention(q, q, q)  # after: not recorded
    assert len(record.attention) == 2
