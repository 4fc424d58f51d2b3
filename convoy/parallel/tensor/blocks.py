"""Execute bubble fills: split an MLP stage's forward between its owner and an idle helper.

Tensor parallelism of the Megatron kind: the helper takes the last columns of each block's
first linear (and the matching rows of the second), computes its pre-activations and partial
output, and sends both back. The owner computes the rest and joins the helper's part into its
autograd graph through ``_Injected``, whose backward is the linear layer's own, so the
backward (run by the owner alone, later) gives the same gradients as the unsplit block.

The parameter shard goes to the helper once per (stage, helper) and step, before the first
split forward that needs it (a header and one flat tensor); afterwards each block costs two
messages: the input out, the pre-activations and partial output back together.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from convoy.errors import ScheduleError
from convoy.parallel.pipeline.schedule import Action, Kind

FILL_SHARE = 0.5
"""Part of each block's hidden columns the helper computes."""
_FILL_TAG = 1 << 24
_PARAM_TAG = 1 << 28
_MAX_BLOCKS = 16
_LEAD = 10
"""Header layout: block count, input rank - 1, up to 8 leading input dims, then 5 ints per block."""
_HEADER = _LEAD + 5 * _MAX_BLOCKS


class _Delay(torch.autograd.Function):
    """Identity that sleeps: ``forward_ms`` in forward, ``backward_ms`` in backward (cost emulation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_ms: float, backward_ms: float) -> torch.Tensor:
        ctx.backward_ms = backward_ms
        time.sleep(forward_ms / 1e3)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_ms / 1e3)
        return grad, None, None


class MLPBlock(nn.Module):
    """``fc2(gelu(fc1(x)))``: the block bubble filling can split. ``forward_ms`` and
    ``backward_ms`` add fixed sleeps so benchmarks can measure schedules, not CPU noise."""

    def __init__(self, width: int, hidden: int | None = None, forward_ms: float = 0.0, backward_ms: float = 0.0
                 ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden or 4 * width)
        self.fc2 = nn.Linear(hidden or 4 * width, width)
        self.forward_ms, self.backward_ms = forward_ms, backward_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_ms or self.backward_ms:
            x = _Delay.apply(x, self.forward_ms, self.backward_ms)
        return self.fc2(F.gelu(self.fc1(x)))


def split_blocks(module: nn.Module, stage: int) -> list[MLPBlock]:
    """The MLP blocks of a stage, or ``ScheduleError`` if the stage can't be split."""
    blocks = [module] if isinstance(module, MLPBlock) else list(module.children())
    if not blocks or not all(isinstance(b, MLPBlock) for b in blocks) or len(blocks) > _MAX_BLOCKS:
        raise ScheduleError(f"stage {stage} can't be split for bubble filling: a fillable stage is an MLPBlock or a "
                            f"sequence of up to {_MAX_BLOCKS} of them; leave it out of plan_fills(fillable=...)")
    return blocks  # type: ignore[return-value]


class _Injected(torch.autograd.Function):
    """Returns ``value`` (computed elsewhere as ``linear(inp, weight, bias)``) with that linear's backward."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        ctx.has_bias = bias is not None
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        inp, weight = ctx.saved_tensors
        flat_grad, flat_inp = grad.reshape(-1, grad.shape[-1]), inp.reshape(-1, inp.shape[-1])
        bias_grad = flat_grad.sum(0) if ctx.has_bias else None
        return grad @ weight, flat_grad.t() @ flat_inp, bias_grad, None


def _cut(hidden: int) -> int:
    return hidden - max(1, round(hidden * FILL_SHARE))


class Filler:
    """The fill side of one rank's pipeline runtime: owner and helper halves of split forwards."""

    def __init__(self, rank: int, n_microbatches: int, global_rank, group: dist.ProcessGroup | None) -> None:
        self.rank, self.m, self._global, self.group = rank, n_microbatches, global_rank, group
        self._shipped: set[tuple[int, int]] = set()
        self._shards: dict[tuple[int, int], list[tuple]] = {}
        self._sends: list[dist.Work] = []
        self._keep: list[torch.Tensor] = []

    def begin(self) -> None:
        self._shipped.clear()
        self._shards.clear()

    def finish(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends, self._keep = [], []

    def _tag(self, stage: int, mb: int, block: int, which: int) -> int:
        return _FILL_TAG + (((stage * self.m + mb) * _MAX_BLOCKS + block) * 2 + which)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        data = tensor.detach().contiguous()
        self._keep.append(data)
        self._sends.append(dist.isend(data, self._global(peer), self.group, tag))

    # -- owner -----------------------------------------------------------------------------
    def _ship(self, blocks: list[MLPBlock], stage: int, helper: int, x: torch.Tensor) -> None:
        """Two messages: a fixed-size header (block shapes, input shape, emulated costs) and
        every block's parameter shard, flattened into one tensor."""
        if x.dim() - 1 > _LEAD - 2:
            raise ScheduleError(f"a split forward's input has {x.dim()} dims; bubble filling takes at most "
                                f"{_LEAD - 1}: flatten the leading dims or leave stage {stage} unfilled")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = len(blocks), x.dim() - 1
        header[2:1 + x.dim()] = torch.tensor(x.shape[:-1])
        shards = []
        for j, b in enumerate(blocks):
            cut = _cut(b.fc1.out_features)
            header[_LEAD + 5 * j:_LEAD + 5 * j + 5] = torch.tensor([
                b.fc1.in_features, b.fc1.out_features, cut, b.fc2.out_features, round(b.forward_ms * 1e3)])
            shards += [b.fc1.weight[cut:].reshape(-1), b.fc1.bias[cut:], b.fc2.weight[:, cut:].reshape(-1)]
        self._send(header, helper, _PARAM_TAG + 2 * stage)
        self._send(torch.cat(shards), helper, _PARAM_TAG + 2 * stage + 1)

    def forward(self, act: Action, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The owner's side of split forward ``act``: returns the stage output, in the graph.
        Per block: the input goes out, the helper's pre-activations and partial output come
        back in one message while the owner computes its own columns."""
        blocks, helper = split_blocks(module, act.stage), act.peer
        assert helper is not None
        if (act.stage, helper) not in self._shipped:
            self._shipped.add((act.stage, helper))
            self._ship(blocks, act.stage, helper, x)
        for j, b in enumerate(blocks):
            cut, hidden, width = _cut(b.fc1.out_features), b.fc1.out_features, b.fc2.out_features
            self._send(x, helper, self._tag(act.stage, act.mb, j, 0))
            reply = torch.empty(*x.shape[:-1], hidden - cut + width)
            work = dist.irecv(reply, self._global(helper), self.group, self._tag(act.stage, act.mb, j, 1))
            if b.forward_ms or b.backward_ms:
                x = _Delay.apply(x, b.forward_ms * (1 - FILL_SHARE), b.backward_ms)
            w1, b1, w2 = b.fc1.weight, b.fc1.bias, b.fc2.weight
            y_own = F.linear(F.gelu(F.linear(x, w1[:cut], b1[:cut])), w2[:, :cut])
            work.wait()
            pre_h, y_h = reply.split([hidden - cut, width], dim=-1)
            pre = _Injected.apply(x, w1[cut:], b1[cut:], pre_h)
            y = _Injected.apply(F.gelu(pre), w2[:, cut:], None, y_h)
            x = y_own + y + b.fc2.bias
        return x

    # -- helper ----------------------------------------------------------------------------
    def _receive_shards(self, stage: int, owner: int) -> list[tuple]:
        src = self._global(owner)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.recv(header, src, self.group, _PARAM_TAG + 2 * stage)
        k, lead_dims = int(header[0]), int(header[1])
        lead = header[2:2 + lead_dims].tolist()
        dims = [header[_LEAD + 5 * j:_LEAD + 5 * j + 5].tolist() for j in range(k)]
        flat = torch.empty(sum((hidden - cut) * (d_in + 1 + d_out) for d_in, hidden, cut, d_out, _ in dims))
        dist.recv(flat, src, self.group, _PARAM_TAG + 2 * stage + 1)
        shards, at = [], 0
        for d_in, hidden, cut, d_out, forward_us in dims:
            part = hidden - cut
            w1, b1, w2 = flat[at:at + part * (d_in + 1 + d_out)].split([part * d_in, part, d_out * part])
            at += part * (d_in + 1 + d_out)
            shards.append((w1.view(part, d_in), b1, w2.view(d_out, part), lead + [d_in], forward_us / 1e3))
        return shards

    def help(self, act: Action) -> None:
        """The helper's side of the split forward ``act`` (an ``H`` naming the owner)."""
        assert act.kind is Kind.H and act.peer is not None
        owner = act.peer
        if (act.stage, owner) not in self._shards:
            self._shards[act.stage, owner] = self._receive_shards(act.stage, owner)
        with torch.no_grad():
            for j, (w1, b1, w2, in_shape, forward_ms) in enumerate(self._shards[act.stage, owner]):
                x = torch.empty(in_shape)
                dist.recv(x, self._global(owner), self.group, self._tag(act.stage, act.mb, j, 0))
                pre = F.linear(x, w1, b1)
                y = F.linear(F.gelu(pre), w2)
                if forward_ms:
                    time.sleep(forward_ms * FILL_SHARE / 1e3)
                self._send(torch.cat([pre, y], dim=-1), owner, self._tag(act.stage, act.mb, j, 1))
