"""Sequence-parallel attention by query broadcast: keys and values stay put, queries travel.

n ranks hold consecutive parts of the sequence (rank r: global positions ``[r l, (r + 1) l)``) and
map them to their own Q, K, V. Each rank cuts its queries into chunks: groups of K/V heads (with
their query heads) and, where asked (``micro``) or where there are few K/V heads, ranges of
positions. For chunk j every rank sends its rows to the ranks whose keys they need (all others; with
a causal mask only the earlier ranks), each rank attends the queries it got to its own K and V
(keeping the log-sum-exp), the partial outputs go back to their owner, and the owner folds them
exactly into its output. Two chunks are in flight at a time (the next one travels while this one
computes), so a rank holds its own part plus those two chunks (``query_stream.py`` runs it): with
the default chunks (8 per rank for a part of many MB) nothing of the whole sequence is held on any
rank; a single chunk (``micro=1``, or a part of a few MB) holds every rank's queries for a moment.
The backward goes the same way: a rank sends a chunk's queries, output gradient, log-sum-exp and
``rowsum(dout * out)``, each holder adds its K and V gradients in place and returns the query
gradient. Per rank a forward sends about ``2 L d (n - 1) / n`` bytes and a backward
``3 L d (n - 1) / n`` (half that with a causal mask, on average), independent of the K/V width, which is why it pays
when K and V are larger than Q (long cached context, many K/V heads) and never limits the degree by
the head count.

Baselines with the same signature live in ``baselines.py`` (all-gather K/V, ring
pass-K/V, Ulysses all-to-all); ``attention.py`` has the block math all of them share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError
from convoy.parallel import even_bounds
from convoy.parallel.sequence.attention import check_inputs, default_scale
from convoy.parallel.sequence.query_stream import Chunks, QueryBroadcast

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


def auto_chunks(local_len: int, heads: int, kv_heads: int, world: int, head_bytes: int = 256, per_rank: int = 8,
                rows: int = 768, least: int = 2 << 20) -> Chunks:
    """The chunks ``micro=None`` picks: ``per_rank`` for every rank of the group, so that the two chunks in flight
    from every peer (queries in, partial outputs out and back) stay a fraction of this rank's own part, but none
    under ``least`` bytes of queries (``head_bytes`` a row of one head): where a rank's part is a few MB, its
    buffers weigh as little and more kernel calls and messages would only cost time. Heads
    first, every kernel call then spanning the whole local part: groups of K/V heads, or where there are fewer K/V
    heads than that, parts of each K/V head's query heads; where there are fewer query heads too, the positions
    are cut into pieces of at least ``rows`` (shorter calls run torch's fused CPU kernels on smaller tiles,
    markedly slower)."""
    wanted = max(1, min(per_rank * world, local_len * heads * head_bytes // least))
    group = heads // kv_heads
    if kv_heads >= wanted:
        spans = [(h0 * group, h1 * group) for h0, h1 in even_bounds(kv_heads, wanted)]
    else:
        per_kv = min(group, -(-wanted // kv_heads))
        spans = [(h * group + a, h * group + b) for h in range(kv_heads) for a, b in even_bounds(group, per_kv)]
    pieces = max(1, min(-(-wanted // len(spans)), local_len // rows))
    return [(h0, h1, lo, hi) for h0, h1 in spans for lo, hi in even_bounds(local_len, pieces)]


def plan_chunks(q: torch.Tensor, kv_heads: int, world: int, micro: int | None) -> Chunks:
    """For this rank's queries ``q`` ``(B, H, l, D)``: ``micro`` micro-sequences of every head, or with None the
    chunks ``auto_chunks`` picks."""
    b, heads, local_len, width = q.shape
    if micro is None:
        return auto_chunks(local_len, heads, kv_heads, world, b * width * q.element_size())
    return [(0, heads, lo, hi) for lo, hi in chunk_bounds(local_len, micro)]


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


def query_broadcast_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              group: dist.ProcessGroup | None = None, causal: bool = False,
                              key_mask: torch.Tensor | None = None, micro: int | None = None,
                              scale: float | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence, by query broadcast.
    ``q`` is ``(B, H, l, D)``, ``k``/``v`` ``(B, Hkv, l, D)``, ``key_mask`` ``(B, l)``: this rank's part.
    ``micro`` cuts the positions into that many chunks, every head in each; None picks chunks that keep a
    rank's memory near its own part (``auto_chunks``)."""
    check_inputs(q, k, v, key_mask)
    if v.shape[3] != q.shape[3]:
        raise ConfigError(f"query broadcast returns outputs in the queries' messages, so v's head dim {v.shape[3]} "
                          f"must equal q's {q.shape[3]}")
    chunks = plan_chunks(q, k.shape[1], dist.get_world_size(group), micro)
    plan = peers(dist.get_rank(group), dist.get_world_size(group), causal)
    return QueryBroadcast.apply(q, k, v, key_mask, group, causal, chunks, plan, default_scale(q, scale), _TAG)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str = "query_broadcast",
                       group: dist.ProcessGroup | None = None, causal: bool = False,
                       key_mask: torch.Tensor | None = None, micro: int | None = None, scale: float | None = None,
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
    from convoy.parallel.sequence import baselines as sequence_baselines

    fn = {"allgather_kv": sequence_baselines.allgather_kv_attention, "ring": sequence_baselines.ring_attention,
          "ulysses": sequence_baselines.ulysses_attention}[scheme]
    return fn(q, k, v, group=group, causal=causal, key_mask=key_mask, scale=scale)


class SequenceParallelAttention(nn.Module):
    """Multi-head attention over a sequence split across the ranks of ``group``; drop-in for a
    transformer block whose input ``x`` is this rank's ``(B, l, d_model)`` part of the sequence."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, causal: bool = True,
                 scheme: str = "query_broadcast", micro: int | None = None, group: dist.ProcessGroup | None = None,
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
