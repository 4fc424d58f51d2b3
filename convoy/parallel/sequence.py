"""Sequence-parallel attention by query broadcast: keys and values stay put, queries travel.

n ranks hold consecutive parts of the sequence (rank r: global positions ``[r l, (r + 1) l)``)
and map them to their own Q, K, V. Each rank cuts its queries into ``micro`` micro-sequences.
In round j every rank sends its j-th query micro-sequence to the ranks whose keys it needs
(all others; with a causal mask only the earlier ranks), each rank attends the queries it got
to its own K and V (keeping the log-sum-exp), the partial outputs go back to their owner, and
the owner merges them exactly with its own partial. The next round's queries are in flight
while this round computes. The backward goes the same way: a rank sends its output gradient
and log-sum-exp (the holders of keys kept its queries from the forward), each holder adds its
K and V gradients locally and returns the query gradient. Per rank a forward sends about
``2 L d (n - 1) / n`` bytes and so does a backward (half that with a causal mask, on average),
independent of the K/V width, which is why it pays when K and V are larger than Q (long cached
context, many K/V heads) and never limits the degree by the head count.

Baselines with the same signature live in ``sequence_baselines.py`` (all-gather K/V, ring
pass-K/V, Ulysses all-to-all); ``attention.py`` has the block math all of them share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError
from convoy.parallel import even_bounds
from convoy.parallel.attention import TRAFFIC, check_inputs, default_scale, merge, partial, partial_backward

SCHEMES = ("query_broadcast", "allgather_kv", "ring", "ulysses")
_TAG = 7000


# -- planning (pure) -------------------------------------------------------------------------
def chunk_bounds(local_len: int, micro: int) -> list[tuple[int, int]]:
    """Where each of the ``micro`` query micro-sequences starts and ends (as even as possible)."""
    if micro < 1:
        raise ConfigError(f"micro must be at least 1, got {micro}")
    if micro > local_len:
        raise ConfigError(f"micro={micro} micro-sequences but each rank holds only {local_len} positions; "
                          f"use micro <= {local_len}")
    return even_bounds(local_len, micro)


def peers(rank: int, world: int, causal: bool) -> tuple[list[int], list[int]]:
    """(ranks whose keys this rank's queries need, ranks whose queries need this rank's keys),
    self excluded. Causal: queries only look back, so earlier ranks and later ranks."""
    others = [r for r in range(world) if r != rank]
    if not causal:
        return others, others
    return [r for r in others if r < rank], [r for r in others if r > rank]


def query_broadcast_bytes(seq_len: int, d_model: int, world: int, itemsize: int = 4, heads: int = 0) -> int:
    """Analytic bytes one rank sends in a forward, non-causal: its queries to n - 1 ranks and
    n - 1 partial outputs (plus one log-sum-exp per head and position) back."""
    local = seq_len // world
    return (world - 1) * local * (2 * d_model + heads) * itemsize


def shard_sequence(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim``; ``ConfigError`` unless ``world`` divides it."""
    if x.shape[dim] % world:
        raise ConfigError(f"sequence length {x.shape[dim]} is not a multiple of the {world} ranks; pad the batch "
                          f"to a multiple of {world} and mark the padding with key_mask")
    return x.narrow(dim, rank * (x.shape[dim] // world), x.shape[dim] // world)


def check_across_ranks(group: dist.ProcessGroup | None, **settings: object) -> None:
    """``ConfigError`` on every rank, before any data moves, if ranks disagree on ``settings``."""
    everyone: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, settings, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != settings:
            diff = {key: (settings[key], theirs[key]) for key in settings if settings[key] != theirs[key]}
            raise ConfigError(f"ranks disagree on sequence-parallel attention: this rank vs rank {rank}: {diff}; "
                              f"every rank must hold the same-shaped part of the sequence")


# -- query broadcast --------------------------------------------------------------------------
class _Exchange:
    """Posts one round's messages (sends to ``to``, receives of given shapes from ``froms``)."""

    def __init__(self, group: dist.ProcessGroup | None, tag: int) -> None:
        self.group, self.tag, self.sends, self.recvs, self.ops = group, tag, [], [], []

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        TRAFFIC.add(tensor)
        self.ops.append(dist.P2POp(dist.isend, tensor, self._global(peer), self.group, self.tag))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        self.ops.append(dist.P2POp(dist.irecv, buffer, self._global(peer), self.group, self.tag))
        return buffer

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start(self) -> _Exchange:
        works = dist.batch_isend_irecv(self.ops) if self.ops else []
        for op, work in zip(self.ops, works, strict=True):
            (self.recvs if op.op is dist.irecv else self.sends).append((work, op.tensor))
        self.ops = []
        return self

    def wait_recvs(self) -> None:
        for work, _ in self.recvs:  # a gloo receive must be waited for exactly once
            work.wait()
        self.recvs = []

    def wait(self) -> None:
        self.wait_recvs()
        for work, _ in self.sends:
            work.wait()
        self.sends = []


def _rounds(q_parts: list[torch.Tensor], to: list[int], froms: list[int], group, tag: int, width: int):
    """Yield (j, {source: its j-th message}) with round j+1's messages already in flight."""
    def post(j: int) -> tuple[_Exchange, dict[int, torch.Tensor]]:
        ex = _Exchange(group, tag + 2 * j)
        mine = q_parts[j]
        for peer in to:
            ex.send(mine, peer)
        got = {peer: ex.recv((*mine.shape[:-1], width), mine.dtype, peer) for peer in froms}
        return ex.start(), got

    done: list[_Exchange] = []
    pending = post(0)
    for j in range(len(q_parts)):
        ex, got = pending
        if j + 1 < len(q_parts):
            pending = post(j + 1)
        ex.wait_recvs()
        done.append(ex)
        yield j, got
    for ex in done:
        ex.wait()


class _QueryBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, group, causal, micro, scale):  # noqa: ANN001, ANN205
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local, width = q.shape[2], q.shape[3]
        bounds = chunk_bounds(local, micro)
        to, froms = peers(rank, world, causal)
        k_pos = torch.arange(rank * local, (rank + 1) * local)
        q_parts = [q[:, :, lo:hi].contiguous() for lo, hi in bounds]
        outs, lses, kept = [], [], []
        for j, got in _rounds(q_parts, to, froms, group, _TAG, width):
            lo, hi = bounds[j]
            reply = _Exchange(group, _TAG + 2 * j + 1)
            # every source's queries against the local keys in one block (large products run faster)
            theirs = torch.cat(list(got.values()), dim=2) if got else None
            q_pos = torch.cat([torch.arange(s * local + lo, s * local + hi) for s in got]) if got else None
            kept.append((theirs, q_pos))  # the backward needs these queries again: keep them rather than resend
            if got:
                out, lse = partial(theirs, k, v, q_pos, k_pos, causal, key_mask, scale)
                answers = torch.cat([out, lse[..., None]], dim=-1).split(hi - lo, dim=2)
                for source, answer in zip(got, answers, strict=True):
                    reply.send(answer.contiguous(), source)
            back = {peer: reply.recv((*q_parts[j].shape[:-1], width + 1), q.dtype, peer) for peer in to}
            reply.start()
            own = partial(q_parts[j], k, v, k_pos[lo:hi], k_pos, causal, key_mask, scale)
            reply.wait()
            parts = [own] + [(b[..., :-1], b[..., -1]) for b in back.values()]
            out, lse = merge([p[0] for p in parts], [p[1] for p in parts])
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.settings, ctx.kept = (group, causal, micro, scale), kept
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        group, causal, micro, scale = ctx.settings
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local, width = q.shape[2], q.shape[3]
        bounds = chunk_bounds(local, micro)
        to, froms = peers(rank, world, causal)
        k_pos = torch.arange(rank * local, (rank + 1) * local)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        packs = [torch.cat([dout[:, :, lo:hi], lse[:, :, lo:hi, None], delta[:, :, lo:hi, None]], dim=-1)
                 for lo, hi in bounds]
        kept, ctx.kept = ctx.kept, None
        for j, got in _rounds(packs, to, froms, group, _TAG + 4 * micro, width + 2):
            lo, hi = bounds[j]
            reply = _Exchange(group, _TAG + 4 * micro + 2 * j + 1)
            if got:
                queries, q_pos = kept[j]
                grads = torch.cat(list(got.values()), dim=2)
                dq_s, dk_s, dv_s = partial_backward(queries, k, v, grads[..., :width], grads[..., -2], grads[..., -1],
                                                    q_pos, k_pos, causal, key_mask, scale)
                dk += dk_s
                dv += dv_s
                for source, part in zip(got, dq_s.split(hi - lo, dim=2), strict=True):
                    reply.send(part.contiguous(), source)
            back = [reply.recv(tuple(packs[j].shape[:-1]) + (width,), q.dtype, peer) for peer in to]
            reply.start()
            dq_own, dk_own, dv_own = partial_backward(q[:, :, lo:hi], k, v, dout[:, :, lo:hi], lse[:, :, lo:hi],
                                                      delta[:, :, lo:hi], k_pos[lo:hi], k_pos, causal, key_mask,
                                                      scale)
            dk += dk_own
            dv += dv_own
            reply.wait()
            dq[:, :, lo:hi] = dq_own + sum(back) if back else dq_own
        return dq, dk, dv, None, None, None, None, None


def query_broadcast_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              group: dist.ProcessGroup | None = None, causal: bool = False,
                              key_mask: torch.Tensor | None = None, micro: int = 1,
                              scale: float | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence, by query broadcast.
    ``q`` is ``(B, H, l, D)``, ``k``/``v`` ``(B, Hkv, l, D)``, ``key_mask`` ``(B, l)``: this rank's part."""
    check_inputs(q, k, v, key_mask)
    if v.shape[3] != q.shape[3]:
        raise ConfigError(f"query broadcast returns outputs in the queries' messages, so v's head dim {v.shape[3]} "
                          f"must equal q's {q.shape[3]}")
    chunk_bounds(q.shape[2], micro)
    scale = default_scale(q, scale)
    return _QueryBroadcast.apply(q, k, v, key_mask, group, causal, micro, scale)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str = "query_broadcast",
                       group: dist.ProcessGroup | None = None, causal: bool = False,
                       key_mask: torch.Tensor | None = None, micro: int = 1, scale: float | None = None,
                       check: bool = True) -> torch.Tensor:
    """Sequence-parallel attention with any of ``SCHEMES`` (all exact). ``check`` first compares
    shapes and settings across ranks (one small all-gather) so a mismatch fails every rank."""
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown sequence-parallel scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    check_inputs(q, k, v, key_mask)
    if check:
        check_across_ranks(group, shape=tuple(q.shape), kv=tuple(k.shape), causal=causal, scheme=scheme,
                           micro=micro, masked=key_mask is not None)
    if scheme == "query_broadcast":
        return query_broadcast_attention(q, k, v, group, causal, key_mask, micro, scale)
    from convoy.parallel import sequence_baselines

    fn = {"allgather_kv": sequence_baselines.allgather_kv_attention, "ring": sequence_baselines.ring_attention,
          "ulysses": sequence_baselines.ulysses_attention}[scheme]
    return fn(q, k, v, group=group, causal=causal, key_mask=key_mask, scale=scale)


class SequenceParallelAttention(nn.Module):
    """Multi-head attention over a sequence split across the ranks of ``group``; drop-in for a
    transformer block whose input ``x`` is this rank's ``(B, l, d_model)`` part of the sequence."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, causal: bool = True,
                 scheme: str = "query_broadcast", micro: int = 1, group: dist.ProcessGroup | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ConfigError(f"d_model {d_model} must split into {n_heads} heads, and {n_heads} query heads into "
                              f"groups over {n_kv_heads} K/V heads")
        if scheme not in SCHEMES:
            raise ConfigError(f"unknown sequence-parallel scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
        self.heads, self.kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.causal, self.scheme, self.micro, self.group = causal, scheme, micro, group
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)
        self._checked: tuple | None = None

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, local, d_model = x.shape
        q = self.q_proj(x).view(b, local, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, local, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        key = (tuple(x.shape), key_mask is not None)
        out = sequence_attention(q, k, v, self.scheme, self.group, self.causal, key_mask, self.micro,
                                 check=self._checked != key)
        self._checked = key
        return self.o_proj(out.transpose(1, 2).reshape(b, local, d_model))
