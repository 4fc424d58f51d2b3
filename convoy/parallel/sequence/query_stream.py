"""Query broadcast's forward and backward, streamed chunk by chunk so that a rank never holds more than its own
part of the sequence plus two chunks in flight (planning and the public API: ``query_broadcast.py``).

A chunk is a range of query heads and a range of positions, ``(h0, h1, lo, hi)``, whose heads are whole K/V head
groups or lie in one group (so a chunk reads the K/V heads ``kv_of`` names). Cutting by heads first keeps every
kernel call as long as the local part, where torch's fused CPU kernels run best, and makes a call's K/V gradients
a chunk's, not the whole part's. For chunk j a rank sends its rows to the ranks whose keys they need (``to``) and
receives the j-th chunk of the ranks that need its keys (``froms``). It attends its own rows, then each
source's, to its local K/V, sends every source its partial (output and log-sum-exp), and folds the partials it
gets back into its output as they come (``merge_into``: a running log-sum-exp, exact). Chunk j + 1's messages
are posted before chunk j computes, so they travel meanwhile; chunk j - 1's answers are collected after, so a
rank waits only on messages its peers could already send. Nothing of the whole sequence is ever held: no
received queries are kept for the backward.

The backward streams the same way: a chunk's queries, output gradient, log-sum-exp and ``rowsum(dout * out)``
go out in one message, each holder adds its K/V gradients in place and returns the chunk's query gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from convoy.parallel.sequence.attention import TRAFFIC, merge_into, partial, partial_backward

Chunks = list[tuple[int, int, int, int]]
"""``(h0, h1, lo, hi)``: query heads ``[h0, h1)``, positions ``[lo, hi)``."""


def kv_of(h0: int, h1: int, group: int) -> slice:
    """The K/V heads query heads ``[h0, h1)`` read, ``group`` query heads to a K/V head."""
    return slice(h0 // group, (h1 - 1) // group + 1)


def _post(group: dist.ProcessGroup | None, sends: list[tuple[torch.Tensor, int, int]],
          recvs: list[tuple[torch.Tensor, int, int]]) -> list[dist.Work]:
    """Start ``sends`` and ``recvs``, each ``(tensor, peer, tag)``, at once; the works to wait for
    (each exactly once: gloo requires it)."""
    ops = []
    for kind, messages in ((dist.isend, sends), (dist.irecv, recvs)):
        for tensor, peer, tag in messages:
            ops.append(dist.P2POp(kind, tensor, peer if group is None else dist.get_global_rank(group, peer),
                                  group, tag))
    for tensor, _, _ in sends:
        TRAFFIC.add(tensor)
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


class _Chunk:
    """One chunk's messages: this rank's ``block`` out to ``to``, the sources' blocks in from ``froms``
    (``arrived``), this rank's answers to them out (``answer``), and the holders' answers to ``block`` back
    (``collect``). Every work is waited for exactly once."""

    def __init__(self, block: torch.Tensor | None, shape: tuple[int, ...], to: list[int], froms: list[int],
                 answer_width: int, group: dist.ProcessGroup | None, tag: int, like: torch.Tensor) -> None:
        self.group, self.tag = group, tag
        self.inbox = {source: like.new_empty(shape) for source in froms}
        self.answers = {peer: like.new_empty((*shape[:-1], answer_width)) for peer in to}
        self.arrivals = _post(group, [], [(b, source, tag) for source, b in self.inbox.items()])
        sends = [(block, peer, tag) for peer in to] if block is not None else []
        self.pending = _post(group, sends, [(b, peer, tag + 1) for peer, b in self.answers.items()])
        self.block = block  # kept until its sends are done

    def arrived(self) -> dict[int, torch.Tensor]:
        _wait(self.arrivals)
        self.arrivals = []
        return self.inbox

    def answer(self, source: int, result: torch.Tensor) -> None:
        self.pending += _post(self.group, [(result.contiguous(), source, self.tag + 1)], [])

    def collect(self) -> list[torch.Tensor]:
        """Wait for every send and answer of the chunk; the answers to this rank's block."""
        _wait(self.pending)
        self.pending, self.inbox, self.block = [], {}, None
        return list(self.answers.values())


def _stream(chunks: Chunks, make: Any, to: list[int], froms: list[int], shape_of: Any, answer_width: int,
            group: dist.ProcessGroup | None, tag: int, like: torch.Tensor, work: Any, fold: Any) -> None:
    """Run the chunks: post j + 1, ``work(j, chunk)`` on chunk j, then ``fold(j - 1, answers)``."""
    def post(j: int) -> _Chunk:
        return _Chunk(make(j) if to else None, shape_of(j), to, froms, answer_width, group, tag + 2 * j, like)

    posted = {0: post(0)}
    for j in range(len(chunks)):
        if j + 1 < len(chunks):
            posted[j + 1] = post(j + 1)
        work(j, posted[j])
        if j > 0:
            fold(j - 1, posted.pop(j - 1).collect())
    last = len(chunks) - 1
    fold(last, posted.pop(last).collect())


class QueryBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                group: dist.ProcessGroup | None, causal: bool, chunks: Chunks, peers: tuple[list[int], list[int]],
                scale: float, tag: int) -> torch.Tensor:
        rank = dist.get_rank(group)
        local, width, g = q.shape[2], q.shape[3], q.shape[1] // k.shape[1]
        to, froms = peers
        k_pos = torch.arange(rank * local, (rank + 1) * local)
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3])

        def work(j: int, chunk: _Chunk) -> None:
            h0, h1, lo, hi = chunks[j]
            heads, kv = slice(h0, h1), kv_of(h0, h1, g)
            keys = slice(0, hi) if causal else slice(0, local)  # a causal row sees no later key of its own part
            mask = None if key_mask is None else key_mask[:, keys]
            out[:, heads, lo:hi], lse[:, heads, lo:hi] = partial(
                q[:, heads, lo:hi], k[:, kv, keys], v[:, kv, keys], k_pos[lo:hi], k_pos[keys], causal, mask, scale)
            for source, block in chunk.arrived().items():
                q_pos = torch.arange(source * local + lo, source * local + hi)
                part, part_lse = partial(block, k[:, kv], v[:, kv], q_pos, k_pos, causal, key_mask, scale)
                chunk.answer(source, torch.cat([part, part_lse[..., None]], dim=-1))

        def fold(j: int, answers: list[torch.Tensor]) -> None:
            h0, h1, lo, hi = chunks[j]
            for answer in answers:
                merge_into(out[:, h0:h1, lo:hi], lse[:, h0:h1, lo:hi], answer[..., :-1], answer[..., -1])

        _stream(chunks, lambda j: _rows(q, chunks[j]).contiguous(), to, froms, lambda j: _shape(q, chunks[j], width),
                width + 1, group, tag, q, work, fold)
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.settings = (group, causal, chunks, peers, scale, tag + 2 * len(chunks))
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        group, causal, chunks, (to, froms), scale, tag = ctx.settings
        rank = dist.get_rank(group)
        local, width, g = q.shape[2], q.shape[3], q.shape[1] // k.shape[1]
        k_pos = torch.arange(rank * local, (rank + 1) * local)
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)

        def pack(j: int) -> torch.Tensor:
            h0, h1, lo, hi = chunks[j]
            rows = (slice(None), slice(h0, h1), slice(lo, hi))
            return torch.cat([q[rows], dout[rows], lse[rows][..., None], delta[rows][..., None]], dim=-1)

        def work(j: int, chunk: _Chunk) -> None:
            h0, h1, lo, hi = chunks[j]
            heads, kv = slice(h0, h1), kv_of(h0, h1, g)
            keys = slice(0, hi) if causal else slice(0, local)
            mask = None if key_mask is None else key_mask[:, keys]
            dq[:, heads, lo:hi], dk_part, dv_part = partial_backward(
                q[:, heads, lo:hi], k[:, kv, keys], v[:, kv, keys], dout[:, heads, lo:hi], lse[:, heads, lo:hi],
                delta[:, heads, lo:hi], k_pos[lo:hi], k_pos[keys], causal, mask, scale)
            dk[:, kv, keys] += dk_part
            dv[:, kv, keys] += dv_part
            for source, block in chunk.arrived().items():
                q_pos = torch.arange(source * local + lo, source * local + hi)
                dq_part, dk_part, dv_part = partial_backward(
                    block[..., :width], k[:, kv], v[:, kv], block[..., width:2 * width], block[..., -2],
                    block[..., -1], q_pos, k_pos, causal, key_mask, scale)
                dk[:, kv] += dk_part
                dv[:, kv] += dv_part
                chunk.answer(source, dq_part)

        def fold(j: int, answers: list[torch.Tensor]) -> None:
            h0, h1, lo, hi = chunks[j]
            for answer in answers:
                dq[:, h0:h1, lo:hi] += answer

        _stream(chunks, pack, to, froms, lambda j: _shape(q, chunks[j], 2 * width + 2), width, group, tag, q, work,
                fold)
        return dq, dk, dv, None, None, None, None, None, None, None


def _rows(q: torch.Tensor, chunk: tuple[int, int, int, int]) -> torch.Tensor:
    h0, h1, lo, hi = chunk
    return q[:, h0:h1, lo:hi]


def _shape(q: torch.Tensor, chunk: tuple[int, int, int, int], width: int) -> tuple[int, ...]:
    h0, h1, lo, hi = chunk
    return (q.shape[0], h1 - h0, hi - lo, width)
