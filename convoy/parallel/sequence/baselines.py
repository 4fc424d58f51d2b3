"""Three exact sequence-parallel attention baselines, built on the block math in ``attention``.

Every function takes this rank's shard of the sequence, ``q (B, H, l, D)``, ``k, v (B, Hkv, l, D)``
and ``key_mask (B, l)`` (True = real key), where rank ``r`` of the ``n`` ranks in ``group`` holds
the global positions ``[r*l, (r+1)*l)`` and every rank has the same ``l``. It returns this rank's
``(B, H, l, D)`` output, equal to single-device attention over the whole sequence, and it is
differentiable w.r.t. q, k and v. Every call must be made by all ranks of the group, in the same
order, with the same ``causal``/``scale`` and either all or no key masks. Bytes below are what one
rank sends per call (``e`` = element size, ``Dv`` = v's head dim, masks are bools of 1 byte);
each send is counted in ``attention.TRAFFIC`` once per destination peer.

``allgather_kv_attention``: one all_gather of K and V (packed into one buffer) and one of the key
mask; every rank then holds the whole K/V (kept for the backward: ``n`` times the K/V memory) and
attends its queries to each key block, skipping blocks causality hides. The backward computes dK/dV
for every block locally and sums each block at its owner with one reduce_scatter; dq stays local.
Forward ``(n-1) * B*l*(Hkv*(D+Dv)*e + 1)``; backward ``(n-1) * B*Hkv*l*(D+Dv)*e``.

``ring_attention``: ``n-1`` steps pass the K/V block and its key mask to the next rank
(``r -> r+1``) with isend/irecv posted before the current block's compute, so the transfer overlaps
it; the block's position offset is not sent, it follows from the step (the block held at step
``s`` started on rank ``r-s``). Partials are merged into the running output and log-sum-exp; blocks
causality hides skip the compute but keep travelling. The backward passes K/V around the ring
again, with a dK/dV accumulator that travels with its block, picks up each rank's contribution and
takes one more hop at the end to arrive home (its send overlaps the next block's compute).
Forward ``(n-1) * B*l*(Hkv*(D+Dv)*e + 1)``; backward that plus ``n * B*Hkv*l*(D+Dv)*e``.

``ulysses_attention``: an all-to-all turns the sequence shard of all heads into the whole sequence
of ``H/n`` query heads and the matching K/V heads; each rank runs full attention on its heads and a
second all-to-all returns the output to sequence shards (the backward is the same two all-to-alls
in reverse). The key mask is all-gathered. It needs ``H % n == 0`` (Ulysses' head-count limit: at
most ``H`` ranks). When ``Hkv % n != 0`` the K/V heads are repeated, before the exchange, to the
least ``Hkv'`` that is a multiple of ``Hkv``, divides ``H`` and is divisible by ``n`` (at worst
``H``), which costs the repeated heads' bytes. With ``Hkv'`` that way:
forward ``(n-1)/n * B*l*(H*D + Hkv'*(D+Dv) + H*Dv)*e + (n-1)*B*l``; backward the same without the mask.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.parallel.sequence.attention import (
    TRAFFIC, check_inputs, default_scale, fully_masked, merge, partial, partial_backward, reference,
)

Group = dist.ProcessGroup | None
_TAG_FORWARD, _TAG_BACKWARD = 0x5E10000, 0x5E20000
"""Ring tags: base + 4 * step + (0 K/V, 1 key mask, 2 dK/dV accumulator)."""


def _positions(rank: int, length: int) -> torch.Tensor:
    return torch.arange(rank * length, (rank + 1) * length)


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, *shapes: torch.Size) -> list[torch.Tensor]:
    parts = flat.split([math.prod(shape) for shape in shapes])
    return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]


# -- all-gather K/V --------------------------------------------------------------------------------
class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool,
                key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        rank, n, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        packed = _pack(k, v)
        blocks = [torch.empty_like(packed) for _ in range(n)]
        dist.all_gather(blocks, packed, group=group)
        TRAFFIC.add(packed, n - 1)
        masks: list[torch.Tensor | None] = [None] * n
        if key_mask is not None:
            masks = [torch.empty_like(key_mask) for _ in range(n)]
            dist.all_gather(masks, key_mask.contiguous(), group=group)
            TRAFFIC.add(key_mask, n - 1)
        q_pos, outs, lses = _positions(rank, length), [], []
        for j in range(n):
            k_pos = _positions(j, length)
            if not fully_masked(q_pos, k_pos, causal):
                kj, vj = _unpack(blocks[j], k.shape, v.shape)
                out, lse = partial(q, kj, vj, q_pos, k_pos, causal, masks[j], scale)
                outs.append(out)
                lses.append(lse)
        out, lse = merge(outs, lses)
        ctx.save_for_backward(q, out, lse, *blocks)
        ctx.masks, ctx.shapes = masks, (k.shape, v.shape)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, *blocks = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, n, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        delta = (dout * out).sum(-1)
        q_pos, dq = _positions(rank, length), torch.zeros_like(q)
        grads = []
        for j in range(n):
            k_pos = _positions(j, length)
            if fully_masked(q_pos, k_pos, causal):
                grads.append(torch.zeros_like(blocks[j]))
                continue
            kj, vj = _unpack(blocks[j], *ctx.shapes)
            dqj, dkj, dvj = partial_backward(q, kj, vj, dout, lse, delta, q_pos, k_pos, causal, ctx.masks[j], scale)
            dq += dqj
            grads.append(_pack(dkj, dvj))
        mine = torch.empty_like(blocks[rank])
        dist.reduce_scatter(mine, grads, group=group)
        TRAFFIC.add(mine, n - 1)
        dk, dv = _unpack(mine, *ctx.shapes)
        return dq, dk, dv, None, None, None, None


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None,
                           causal: bool = False, key_mask: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Sequence-parallel attention that all-gathers K/V (see the module docstring)."""
    check_inputs(q, k, v, key_mask)
    return _AllGatherKV.apply(q, k, v, group, causal, key_mask, default_scale(q, scale))


# -- ring ------------------------------------------------------------------------------------------
def _ring_pass(pairs: list[tuple[torch.Tensor, torch.Tensor, int]], group: Group) -> list[Any]:
    """Send each ``(outgoing, incoming, tag)`` to the next rank, receive from the previous; returns the works."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    if group is not None:
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    ops = []
    for outgoing, incoming, tag in pairs:
        TRAFFIC.add(outgoing)
        ops += [dist.P2POp(dist.isend, outgoing, nxt, group, tag), dist.P2POp(dist.irecv, incoming, prev, group, tag)]
    return dist.batch_isend_irecv(ops)


def _pass_block(kv: torch.Tensor, mask: torch.Tensor | None, tag: int, group: Group
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[Any]]:
    """Start passing a K/V block (and its mask) on; returns the buffers it arrives in and the works."""
    kv_in = torch.empty_like(kv)
    pairs = [(kv, kv_in, tag)]
    mask_in = None
    if mask is not None:
        mask_in = torch.empty_like(mask)
        pairs.append((mask, mask_in, tag + 1))
    return kv_in, mask_in, _ring_pass(pairs, group)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool,
                key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        rank, n, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        q_pos = _positions(rank, length)
        kv, mask = _pack(k, v), None if key_mask is None else key_mask.contiguous()
        out = lse = None
        for step in range(n):
            works: list[Any] = []
            if step < n - 1:
                kv_in, mask_in, works = _pass_block(kv, mask, _TAG_FORWARD + 4 * step, group)
            k_pos = _positions((rank - step) % n, length)
            if not fully_masked(q_pos, k_pos, causal):
                kj, vj = _unpack(kv, k.shape, v.shape)
                o, s = partial(q, kj, vj, q_pos, k_pos, causal, mask, scale)
                out, lse = (o, s) if out is None else merge([out, o], [lse, s])
            for work in works:
                work.wait()
            if step < n - 1:
                kv, mask = kv_in, mask_in
        ctx.save_for_backward(q, k, v, key_mask, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, key_mask, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, n, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        q_pos, dq = _positions(rank, length), torch.zeros_like(q)
        delta = (dout * out).sum(-1)
        kv, mask = _pack(k, v), None if key_mask is None else key_mask.contiguous()
        acc: torch.Tensor | None = None  # the dK/dV accumulator that arrived with the block at hand
        acc_works: list[Any] = []
        for step in range(n):
            tag = _TAG_BACKWARD + 4 * step
            kv_works: list[Any] = []
            if step < n - 1:
                kv_in, mask_in, kv_works = _pass_block(kv, mask, tag, group)
            k_pos = _positions((rank - step) % n, length)
            mine = None
            if not fully_masked(q_pos, k_pos, causal):
                kj, vj = _unpack(kv, k.shape, v.shape)
                dqj, dkj, dvj = partial_backward(q, kj, vj, dout, lse, delta, q_pos, k_pos, causal, mask, scale)
                dq += dqj
                mine = _pack(dkj, dvj)
            for work in acc_works:  # the accumulator of this block (and our last send) finish here
                work.wait()
            if acc is None:
                acc = mine if mine is not None else torch.zeros_like(kv)
            elif mine is not None:
                acc = acc + mine
            if n > 1:  # send it on: after the last step that hop takes it home
                acc_in = torch.empty_like(acc)
                acc_works = _ring_pass([(acc, acc_in, tag + 2)], group)
                acc = acc_in
            for work in kv_works:
                work.wait()
            if step < n - 1:
                kv, mask = kv_in, mask_in
        for work in acc_works:
            work.wait()
        dk, dv = _unpack(acc, k.shape, v.shape)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None, causal: bool = False,
                   key_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Ring attention: K/V blocks travel around the ring (see the module docstring)."""
    check_inputs(q, k, v, key_mask)
    return _Ring.apply(q, k, v, group, causal, key_mask, default_scale(q, scale))


# -- Ulysses ---------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i``."""
    x = x.contiguous()
    result = torch.empty_like(x)
    dist.all_to_all_single(result, x, group=group)
    TRAFFIC.add(x[0], x.shape[0] - 1)
    return result


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_to_all(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, n: int, group: Group) -> torch.Tensor:
    """(B, h, l, D) sequence shard of all heads -> (B, h/n, n*l, D) whole sequence of this rank's heads."""
    b, h, length, d = x.shape
    chunks = x.reshape(b, n, h // n, length, d).permute(1, 0, 2, 3, 4)
    got = _AllToAll.apply(chunks, group)  # (n source ranks, B, h/n, l, D)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, d)


def _heads_to_seq(x: torch.Tensor, n: int, group: Group) -> torch.Tensor:
    """(B, h/n, n*l, D) whole sequence of this rank's heads -> (B, h, l, D) sequence shard of all heads."""
    b, hn, total, d = x.shape
    chunks = x.reshape(b, hn, n, total // n, d).permute(2, 0, 1, 3, 4)
    got = _AllToAll.apply(chunks, group)  # (n source ranks = head groups, B, h/n, l, D)
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * hn, total // n, d)


def ulysses_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    """The K/V head count Ulysses exchanges for ``heads`` query heads on ``n`` ranks: the least
    multiple of ``kv_heads`` that divides ``heads`` and is divisible by ``n``."""
    for repeat in range(1, heads // kv_heads + 1):
        count = kv_heads * repeat
        if heads % count == 0 and count % n == 0:
            return count
    raise ConfigError(f"{heads} query heads can't be split over {n} ranks; Ulysses needs the number of query heads "
                      "to be divisible by the number of ranks (use fewer ranks or ring/all-gather attention)")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None, causal: bool = False,
                      key_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses attention: all-to-all from sequence to head shards and back (see the module docstring)."""
    check_inputs(q, k, v, key_mask)
    n = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % n:
        raise ConfigError(f"{heads} query heads can't be split over {n} ranks; Ulysses needs the number of query "
                          "heads to be divisible by the number of ranks (use fewer ranks or ring/all-gather attention)")
    wanted = ulysses_kv_heads(heads, kv_heads, n)
    if wanted != kv_heads:  # each K/V head repeated in place, so query head h still reads head h // (H / Hkv)
        k, v = k.repeat_interleave(wanted // kv_heads, dim=1), v.repeat_interleave(wanted // kv_heads, dim=1)
    full_mask = None
    if key_mask is not None:
        masks = [torch.empty_like(key_mask) for _ in range(n)]
        dist.all_gather(masks, key_mask.contiguous(), group=group)
        TRAFFIC.add(key_mask, n - 1)
        full_mask = torch.cat(masks, dim=1)
    out = reference(_seq_to_heads(q, n, group), _seq_to_heads(k, n, group), _seq_to_heads(v, n, group), causal,
                    full_mask, default_scale(q, scale))
    return _heads_to_seq(out, n, group)
