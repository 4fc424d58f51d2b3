"""The planning side of query-broadcast attention and the block math, in one process."""

from __future__ import annotations

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.sequence import attention
from convoy.parallel.sequence.query_broadcast import (
    auto_chunks, chunk_bounds, peers, plan_chunks, query_broadcast_bytes, shard_sequence,
)


def test_micro_sequences_cover_the_local_part_evenly() -> None:
    assert chunk_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(5, 1) == [(0, 5)]
    with pytest.raises(ConfigError, match="micro=9 micro-sequences but each rank holds only 8 positions"):
        chunk_bounds(8, 9)
    with pytest.raises(ConfigError, match="at least 1"):
        chunk_bounds(8, 0)


def test_auto_chunks_cut_heads_first_then_positions_of_at_least_768() -> None:
    # 128 heads of 64 floats over 128 K/V heads, 2048 positions on each of 4 ranks: 32 chunks of 4 heads
    assert auto_chunks(2048, 128, 128, 4) == [(h, h + 4, 0, 2048) for h in range(0, 128, 4)]
    # 64 heads over 8 K/V heads: 32 chunks of 2 query heads, each within one K/V head's group of 8
    assert auto_chunks(4096, 64, 8, 4) == [(h, h + 2, 0, 4096) for h in range(0, 64, 2)]
    # 2 heads over 1 K/V head: a head each, and each head's positions cut in 4 to make the 8 chunks
    chunks = auto_chunks(32768, 2, 1, 4)
    assert chunks == [(h, h + 1, lo, lo + 8192) for h in range(2) for lo in range(0, 32768, 8192)]
    # but never into pieces under 768 positions: 6 chunks wanted, 2 made
    assert auto_chunks(1536, 1, 1, 4, head_bytes=8192) == [(0, 1, 0, 768), (0, 1, 768, 1536)]
    # a small part: no chunk under 2 MiB of queries (d = 512 at 2048 positions: 4 MiB, so 2 chunks of 4 heads)
    assert auto_chunks(2048, 8, 8, 4) == [(0, 4, 0, 2048), (4, 8, 0, 2048)]
    assert auto_chunks(512, 8, 2, 4) == [(0, 8, 0, 512)]
    # micro cuts the positions only, every head in each; None asks auto_chunks (the least bytes at its default)
    q = torch.zeros(1, 6, 8, 4)
    assert plan_chunks(q, 3, 4, 2) == [(0, 6, 0, 4), (0, 6, 4, 8)]
    assert plan_chunks(q, 3, 4, None) == [(0, 6, 0, 8)]


def test_causal_queries_only_travel_to_earlier_ranks() -> None:
    assert peers(2, 4, causal=False) == ([0, 1, 3], [0, 1, 3])
    assert peers(2, 4, causal=True) == ([0, 1], [3])
    assert peers(0, 4, causal=True) == ([], [1, 2, 3])
    assert peers(3, 4, causal=True) == ([0, 1, 2], [])
    # every query micro-sequence a rank sends is answered by exactly the ranks it went to
    for causal in (False, True):
        for rank in range(4):
            to, _ = peers(rank, 4, causal)
            assert all(rank in peers(other, 4, causal)[1] for other in to)


def test_bytes_are_twice_the_queries_to_every_other_rank() -> None:
    # 2 L d (n - 1) / n, plus one log-sum-exp per head and position
    assert query_broadcast_bytes(4096, 512, 4) == 2 * 4096 * 512 * 3 // 4 * 4
    assert query_broadcast_bytes(4096, 512, 4, heads=8) == 3 * 1024 * (1024 + 8) * 4


def test_sequences_not_divisible_by_the_ranks_are_refused() -> None:
    x = torch.arange(10)
    assert shard_sequence(torch.arange(12), 0, 1, 4).tolist() == [3, 4, 5]
    with pytest.raises(ConfigError, match="sequence length 10 is not a multiple of the 4 ranks; pad"):
        shard_sequence(x, 0, 0, 4)


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_merged_and_back_propagated_equal_whole_attention(causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False  # with causal, the first queries of sample 1 see no key: output and gradient 0
    want = attention.reference(q, k, v, causal, mask)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(grad)
    pos, blocks = torch.arange(12), [slice(0, 4), slice(4, 8), slice(8, 12)]
    with torch.no_grad():
        merged = [attention.merge(*zip(*[attention.partial(q[:, :, a], k[:, :, b], v[:, :, b], pos[a], pos[b],
                                                            causal, mask[:, b]) for b in blocks], strict=True))
                  for a in blocks]
        out = torch.cat([o for o, _ in merged], dim=2)
        lse = torch.cat([s for _, s in merged], dim=2)
        assert (out - want).abs().max() < 1e-12
        delta = (grad * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a in blocks:
            for b in blocks:
                if attention.fully_masked(pos[a], pos[b], causal):
                    continue
                gq, gk, gv = attention.partial_backward(q[:, :, a], k[:, :, b], v[:, :, b], grad[:, :, a],
                                                        lse[:, :, a], delta[:, :, a], pos[a], pos[b], causal,
                                                        mask[:, b])
                dq[:, :, a] += gq
                dk[:, :, b] += gk
                dv[:, :, b] += gv
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (mine - theirs).abs().max() < 1e-12
    if causal:
        assert out[1, :, :5].abs().max() == 0 and q.grad[1, :, :5].abs().max() == 0
