"""Sequence-parallel attention by query broadcast: keys and values stay put, queries travel.

n ranks hold consecutive parts of the sequence (rank r: global positions ``[r l, (r + 1) l)``)
and map them to their own Q, K, V. Each rank cuts its queries into ``micro`` micro-sequences.
In round j every rank sends its j-th query micro-sequence to the ranks whose keys it needs
(all others; with a causal mask only the earlier ranks), each rank attends the queries it got
to its own K and V (keeping the log-sum-exp), the partial outputs go back to their owner, and
the owner merges them exactly with its own partial. Every round's messages are posted at the
start, so later rounds' queries are in flight while a round computes, and a round waits only for
the queries it attends (answers are collected after the last round). A rank attends its own
queries and every source's of a round in one block, one call of torch's fused CPU flash kernel.
The backward goes the same way: a rank sends its output gradient, log-sum-exp and
``rowsum(dout * out)`` (the holders of keys kept its queries from the forward), each holder adds
its K and V gradients locally and returns the query gradient. Per rank a forward sends about
``2 L d (n - 1) / n`` bytes and so does a backward (half that with a causal mask, on average),
independent of the K/V width, which is why it pays when K and V are larger than Q (long cached
context, many K/V heads) and never limits the degree by the head count.

Baselines with the same signature live in ``baselines.py`` (all-gather K/V, ring
pass-K/V, Ulysses all-to-all); ``attention.py`` has the block math all of them share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError
from convoy.parallel import even_bounds
from convoy.parallel.sequence.attention import TRAFFIC, check_inputs, default_scale, merge, partial, partial_backward

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


def auto_micro(local_len: int, world: int, rows: int = 2048, most: int = 4) -> int:
    """The micro count ``micro=None`` picks: the most micro-sequences, up to ``most``, that keep a
    round's block (a micro-sequence of every rank, ``world * local_len / micro`` query rows) at least
    ``rows`` long. Shorter blocks run the fused kernel less efficiently, and on a fast link a round's
    messages cost more than the overlap gains; long sequences get the overlap for free."""
    return max(1, min(most, local_len, world * local_len // rows))


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


class _Rounds:
    """Every round's messages, posted at once so that only the data a round computes on is ever
    waited for: round j's block goes out to ``to``, the sources' j-th blocks come in from ``froms``
    (``inbox[j]``), and their answers to this rank's block come back (``answers[j]``)."""

    def __init__(self, blocks: list[torch.Tensor], to: list[int], froms: list[int], answer_width: int,
                 group: dist.ProcessGroup | None, tag: int) -> None:
        self.group, self.tag, self.inbox, self.answers, self.arrivals, self.pending = group, tag, [], [], [], []
        for j, block in enumerate(blocks):
            rows = block.shape[:-1]
            self.inbox.append({source: block.new_empty(block.shape) for source in froms})
            self.answers.append({peer: block.new_empty((*rows, answer_width)) for peer in to})
            self.arrivals.append(_post(group, [], [(b, source, tag + 2 * j) for source, b in self.inbox[j].items()]))
            self.pending += _post(group, [(block, peer, tag + 2 * j) for peer in to],
                                  [(b, peer, tag + 2 * j + 1) for peer, b in self.answers[j].items()])

    def arrived(self, j: int) -> dict[int, torch.Tensor]:
        """Round j's blocks from the sources, once they are here."""
        _wait(self.arrivals[j])
        return self.inbox[j]

    def answer(self, j: int, result: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        """Send source i (in ``inbox[j]`` order) its rows ``[(i + 1) r, (i + 2) r)`` of ``result``, where
        ``r`` is a block's length (the rows before are this rank's own), with their ``lse`` as one more
        column when given (one copy either way)."""
        size = result.shape[2] // (len(self.inbox[j]) + 1)
        messages = []
        for i, source in enumerate(self.inbox[j], start=1):
            rows = slice(i * size, (i + 1) * size)
            message = result[:, :, rows].contiguous() if lse is None else torch.cat([result[:, :, rows],
                                                                                   lse[:, :, rows, None]], dim=-1)
            messages.append((message, source, self.tag + 2 * j + 1))
        self.pending += _post(self.group, messages, [])

    def finish(self) -> list[list[torch.Tensor]]:
        """Wait for every send and answer; each round's answers."""
        _wait(self.pending)
        self.pending = []
        return [list(answers.values()) for answers in self.answers]


class _QueryBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, group, causal, micro, scale):  # noqa: ANN001, ANN205
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local, width = q.shape[2], q.shape[3]
        bounds = chunk_bounds(local, micro)
        to, froms = peers(rank, world, causal)
        k_pos = torch.arange(rank * local, (rank + 1) * local)
        rounds = _Rounds([q[:, :, lo:hi].contiguous() for lo, hi in bounds], to, froms, width + 1, group, _TAG)
        own, kept = [], []
        for j, (lo, hi) in enumerate(bounds):
            got = rounds.arrived(j)
            # its own queries and every source's against the local keys: one block, one large kernel call
            queries = torch.cat([q[:, :, lo:hi], *got.values()], dim=2)
            q_pos = torch.cat([k_pos[lo:hi], *(torch.arange(s * local + lo, s * local + hi) for s in got)])
            kept.append((queries, q_pos))  # the backward needs these queries again: keep them rather than resend
            out, lse = partial(queries, k, v, q_pos, k_pos, causal, key_mask, scale)
            rounds.answer(j, out, lse)
            own.append((out[:, :, :hi - lo], lse[:, :, :hi - lo]))
        merged = [merge([out] + [a[..., :-1] for a in answers], [lse] + [a[..., -1] for a in answers])
                  for (out, lse), answers in zip(own, rounds.finish(), strict=True)]
        out, lse = torch.cat([o for o, _ in merged], dim=2), torch.cat([s for _, s in merged], dim=2)
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
        delta = (dout * out).sum(-1)
        packs = [torch.cat([dout[:, :, lo:hi], lse[:, :, lo:hi, None], delta[:, :, lo:hi, None]], dim=-1)
                 for lo, hi in bounds]
        rounds = _Rounds(packs, to, froms, width, group, _TAG + 4 * micro)
        kept, ctx.kept = ctx.kept, None
        dq, dk, dv = torch.empty_like(q), None, None
        for j, (lo, hi) in enumerate(bounds):
            queries, q_pos = kept[j]
            grads = torch.cat([packs[j], *rounds.arrived(j).values()], dim=2)
            dq_j, dk_j, dv_j = partial_backward(queries, k, v, grads[..., :width], grads[..., -2], grads[..., -1],
                                                q_pos, k_pos, causal, key_mask, scale)
            rounds.answer(j, dq_j)
            dq[:, :, lo:hi] = dq_j[:, :, :hi - lo]
            dk, dv = (dk_j, dv_j) if dk is None else (dk.add_(dk_j), dv.add_(dv_j))
        for (lo, hi), answers in zip(bounds, rounds.finish(), strict=True):
            for answer in answers:
                dq[:, :, lo:hi] += answer
        return dq, dk, dv, None, None, None, None, None


def query_broadcast_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              group: dist.ProcessGroup | None = None, causal: bool = False,
                              key_mask: torch.Tensor | None = None, micro: int | None = 1,
                              scale: float | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence, by query broadcast.
    ``q`` is ``(B, H, l, D)``, ``k``/``v`` ``(B, Hkv, l, D)``, ``key_mask`` ``(B, l)``: this rank's part.
    ``micro`` is the number of query micro-sequences (rounds); None picks it (``auto_micro``)."""
    check_inputs(q, k, v, key_mask)
    if v.shape[3] != q.shape[3]:
        raise ConfigError(f"query broadcast returns outputs in the queries' messages, so v's head dim {v.shape[3]} "
                          f"must equal q's {q.shape[3]}")
    if micro is None:
        micro = auto_micro(q.shape[2], dist.get_world_size(group))
    chunk_bounds(q.shape[2], micro)
    scale = default_scale(q, scale)
    return _QueryBroadcast.apply(q, k, v, key_mask, group, causal, micro, scale)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str = "query_broadcast",
                       group: dist.ProcessGroup | None = None, causal: bool = False,
                       key_mask: torch.Tensor | None = None, micro: int | None = 1, scale: float | None = None,
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
                 scheme: str = "query_broadcast", micro: int | None = 1, group: dist.ProcessGroup | None = None,
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
