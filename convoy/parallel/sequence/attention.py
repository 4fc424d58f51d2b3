"""Blockwise attention math shared by every sequence-parallel scheme (no communication here).

Shapes: queries ``(B, H, lq, D)``, keys and values ``(B, Hkv, lk, D)`` with ``H % Hkv == 0``
(grouped K/V: query head h reads K/V head ``h // (H / Hkv)``, no copies). Positions are global
token indices, so a block of queries from one device and a block of keys from another get the
right causal mask. A key padding mask is ``(B, lk)``, True where the key is real.

``partial`` attends a query block to a key block and returns the block's output and its
log-sum-exp (the softmax normaliser); ``merge`` combines partials exactly; ``partial_backward``
is the flash-attention backward of one block given the merged log-sum-exp, so any scheme can
split the backward the way it split the forward. A query that sees no key at all (fully
masked) gets output 0 and gradient 0. Both run torch's fused CPU flash-attention kernels (float32
and float64, one head dim for q, k and v), which tile the block and never hold its scores, and are
much faster than the einsum form they fall back to otherwise; ``reference`` stays plain autograd.
"""

from __future__ import annotations

import math

import torch

from convoy.errors import ConfigError

NEG_INF = float("-inf")


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """``scale``, or 1 / sqrt(head_dim) when it is None."""
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> None:
    """``ConfigError`` for shards no scheme can attend (every rank with the same shapes fails alike)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ConfigError(f"q, k, v must be 4-d (B, H, l, D) shards; got shapes {tuple(q.shape)}, "
                          f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ConfigError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in (B, Hkv, l)")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ConfigError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same batch size and "
                          "local sequence length")
    if q.shape[3] != k.shape[3]:
        raise ConfigError(f"q's head dim {q.shape[3]} differs from k's {k.shape[3]}; project both to one head dim")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"{q.shape[1]} query heads can't share {k.shape[1]} K/V heads: the query head count must "
                          "be a multiple of the K/V head count; use a number of K/V heads that divides the number "
                          "of query heads")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ConfigError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if key_mask is not None and (key_mask.shape != (q.shape[0], q.shape[2]) or key_mask.dtype != torch.bool):
        raise ConfigError(f"key_mask must be a bool tensor of shape (B, l) = {(q.shape[0], q.shape[2])} for "
                          f"this shard; got {key_mask.dtype} {tuple(key_mask.shape)}")


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, lq, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, lq, d)


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
               key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Which (query, key) pairs may attend, broadcastable to ``(B, Hkv, g, lq, lk)``; None for all."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None, None]
    if key_mask is not None:
        keys = key_mask[:, None, None, None, :]
        mask = keys if mask is None else mask & keys
    return mask


def fully_masked(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> bool:
    """True when causality hides the whole key block from the whole query block."""
    return causal and bool(k_pos.min() > q_pos.max())


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
            key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, k.shape[1]), k) * scale
    mask = block_mask(q_pos, k_pos, causal, key_mask)
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU flash kernels take these blocks (one head dim, a float dtype they know)."""
    return q.device.type == "cpu" and v.shape[-1] == q.shape[-1] and q.dtype in (torch.float32, torch.float64)


def _flash_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, key_mask: torch.Tensor | None,
                groups: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """What the fused kernels need to hide pairs, for their grouped query rows (``g * lq``, group-major):
    an additive mask ``(B or 1, 1, g lq, lk)`` (-inf where a pair may not attend) or None; whether the
    kernel's own causal mask does it (a diagonal block: the same positions on both sides); and which
    rows see no key at all ``(B or 1, 1, g lq)``, or None. Key positions ascend."""
    causal = causal and bool(k_pos.max() > q_pos.min())  # else every query comes after every key
    aligned = causal and groups == 1 and q_pos.shape == k_pos.shape and bool((q_pos == k_pos).all())
    padded = key_mask is not None and not bool(key_mask.all())
    mask = None
    if causal and not aligned:
        hidden = k_pos[None, :] > q_pos[:, None]
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, NEG_INF).repeat(groups, 1)[None, None]
    if padded:
        keys = torch.zeros(key_mask.shape, dtype=dtype).masked_fill_(~key_mask, NEG_INF)[:, None, None, :]
        mask = keys if mask is None else mask + keys
    if not (causal or padded):
        return mask, aligned, None
    # how many keys each query sees, in O(lq + lk): keys before it (causal), and of those the real ones
    before = torch.searchsorted(k_pos, q_pos, right=True) if causal else None
    if padded:
        real = key_mask.cumsum(-1)
        seen = real[:, (before - 1).clamp(min=0)] * (before > 0) if causal else real[:, -1:].expand(-1, len(q_pos))
    else:
        seen = before[None]
    dead = seen == 0
    return mask, aligned, dead.repeat(1, groups)[:, None] if bool(dead.any()) else None


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            causal: bool = False, key_mask: torch.Tensor | None = None, scale: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query block ``q`` to key block ``k, v``: (output ``(B, H, lq, D)``, lse ``(B, H, lq)``).
    Runs torch's fused CPU flash kernel (tiled: no ``lq x lk`` scores in memory) where it applies."""
    scale = default_scale(q, scale)
    b, h, lq, d = q.shape
    kv_heads = k.shape[1]
    if not _fused(q, v):
        s = _scores(q, k, q_pos, k_pos, causal, key_mask, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        out = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
        return out.reshape(b, h, lq, v.shape[-1]), lse.reshape(b, h, lq)
    # a K/V head's g query heads attend the same keys: one head of g * lq query rows, no K/V copies
    mask, aligned, dead = _flash_mask(q_pos, k_pos, causal, key_mask, h // kv_heads, q.dtype)
    out, lse = _FLASH(q.reshape(b, kv_heads, -1, d), k, v, is_causal=aligned, attn_mask=mask, scale=scale)
    if dead is not None:  # the kernel leaves lse 0 for a row that sees no key: it must weigh nothing
        lse = lse.masked_fill(dead, NEG_INF)
        out = out.masked_fill(dead[..., None], 0.0)
    return out.reshape(b, h, lq, d), lse.reshape(b, h, lq)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the partials of one query block over several key blocks, exactly (each weighed by
    ``exp(its lse - merged lse)``, accumulated in place: no stack of all outputs)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    finite = torch.where(torch.isinf(lse), 0.0, lse)
    out = outs[0] * torch.exp(lses[0] - finite)[..., None]
    for part, part_lse in zip(outs[1:], lses[1:], strict=True):
        out.addcmul_(part, torch.exp(part_lse - finite)[..., None])
    return out, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one more partial of the same query rows into ``out`` and ``lse`` in place (exact: a running
    log-sum-exp). Rows that see no key on either side stay 0 with lse -inf."""
    merged = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isinf(merged), 0.0, merged)
    out.mul_(torch.exp(lse - finite)[..., None]).addcmul_(part, torch.exp(part_lse - finite)[..., None])
    lse.copy_(merged)


def partial_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                     delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = False,
                     key_mask: torch.Tensor | None = None, scale: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients from one (query block, key block) pair: (dq, dk, dv). ``lse`` is the query
    block's merged log-sum-exp over all keys, ``delta = (dout * out).sum(-1)`` with the merged output."""
    scale = default_scale(q, scale)
    b, h, lq, d = q.shape
    kv_heads = k.shape[1]
    lse = torch.where(torch.isinf(lse), 0.0, lse)  # a query that sees no key: all its scores are -inf, p = 0
    if not _fused(q, v):
        s = _scores(q, k, q_pos, k_pos, causal, key_mask, scale)
        p = torch.exp(s - _grouped(lse[..., None], kv_heads))
        dout_g = _grouped(dout, kv_heads)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout_g)
        dp = torch.einsum("bhgqd,bhkd->bhgqk", dout_g, v)
        ds = p * (dp - _grouped(delta[..., None], kv_heads))
        dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k) * scale
        dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q, kv_heads)) * scale
        return dq.reshape(q.shape), dk, dv
    mask, aligned, _ = _flash_mask(q_pos, k_pos, causal, key_mask, h // kv_heads, q.dtype)
    dout_g, delta_g = dout.reshape(b, kv_heads, -1, d), delta.reshape(b, kv_heads, -1)
    # The kernel reads the output only to form delta = rowsum(dout * out), and the merged output is
    # not here: hand it dout * delta / |dout|^2, whose row sums with dout are delta (terms of one sign,
    # so no cancellation: exact to rounding). A zero row of dout has delta 0 and contributes nothing.
    norm = dout_g.square().sum(-1)
    stand_in = dout_g * torch.where(norm > 0, delta_g / norm, 0.0)[..., None]
    dq, dk, dv = _FLASH_BACKWARD(dout_g, q.reshape(b, kv_heads, -1, d), k, v, stand_in, lse.reshape(b, kv_heads, -1),
                                 0.0, aligned, attn_mask=mask, scale=scale)
    return dq.reshape(b, h, lq, d), dk, dv


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              key_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Single-device attention with plain autograd (the ground truth for tests and benchmarks)."""
    scale = default_scale(q, scale)
    pos_q = torch.arange(q.shape[2])
    pos_k = torch.arange(k.shape[2])
    s = _scores(q, k, pos_q, pos_k, causal, key_mask, scale)
    dead = torch.isinf(s).all(dim=-1, keepdim=True)  # queries that see no key
    p = torch.softmax(torch.where(dead, 0.0, s), dim=-1).masked_fill(dead, 0.0)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return out.reshape(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


class Traffic:
    """Bytes this process hands to torch.distributed, counted at each send site (payload only)."""

    def __init__(self) -> None:
        self.sent = 0

    def add(self, tensor: torch.Tensor, copies: int = 1) -> None:
        """Count ``tensor`` sent to ``copies`` peers."""
        self.sent += tensor.numel() * tensor.element_size() * copies

    def reset(self) -> int:
        sent, self.sent = self.sent, 0
        return sent


TRAFFIC = Traffic()
"""What every sequence-parallel scheme in this process sent; benchmarks read and reset it."""
