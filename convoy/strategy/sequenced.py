"""The sequence strategy: every sample's sequence cut over groups of consecutive ranks, attention by query broadcast.

A model takes part when it computes attention with ``convoy.attention`` and position indices with
``convoy.positions`` (``parallel/sequence/shard.py``). Every rank holds the whole model under DDP. A group of
``sequence`` ranks trains on its ranks' batches together: each rank passes ``train_step`` its own batch, as under
DDP, the group gathers them, cuts them into micro-batches, and each rank runs its part of every sample's positions
(inputs and targets cut along dimension 1). Each rank's loss is the mean over its positions, so with parts of equal
length the group's mean is the micro-batch's, and DDP's average over all ranks is DDP's gradient over the same
samples.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError
from convoy.parallel.sequence.shard import Record, recording, sharded
from convoy.strategy.pipelined import gather_batch
from convoy.strategy.plan import Strategy

_GROUPS: dict[tuple[int, int], Any] = {}
"""(the world group, ranks a sample) -> this rank's sequence group, made once: every rank makes the same groups in
the same order. Always a group of its own, even over all ranks, so its messages never queue behind DDP's."""


def sequence_group(ranks: int) -> Any:
    """This rank's group of ``ranks`` consecutive ranks; made on first use, the same on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ranks:
        raise ConfigError(f"a sequence cut over {ranks} ranks needs a world size that is a multiple of it (WORLD_SIZE "
                          f"is {world})")
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUPS:
        groups = [dist.new_group(list(range(start, start + ranks)), backend="gloo") for start in range(0, world, ranks)]
        _GROUPS[key] = groups[rank // ranks]
    return _GROUPS[key]


def check_batch(inputs: Any, targets: Any, ranks: int) -> int:
    """The sequence length of a batch the strategy can cut, or a ``ConfigError`` saying what is wrong."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ConfigError(f"the sequence strategy takes one tensor of inputs and one of targets (got "
                          f"{type(inputs).__name__} and {type(targets).__name__})")
    if inputs.dim() < 2 or targets.dim() < 2 or inputs.shape[1] != targets.shape[1]:
        raise ConfigError(f"the sequence strategy cuts inputs and targets along dimension 1, the positions: they "
                          f"must be (batch, positions, ...) of one length (got {tuple(inputs.shape)} and "
                          f"{tuple(targets.shape)})")
    if inputs.shape[1] % ranks:
        raise ConfigError(f"sequence length {inputs.shape[1]} is not a multiple of the {ranks} ranks a sample is cut "
                          "over; pad the batches or plan again")
    return inputs.shape[1]


class SequenceParallel(nn.Module):
    """A model under DDP whose samples' positions are cut over a group of ranks; ``train_step`` runs one step.
    Its ``forward`` runs whole sequences on this rank (for evaluation); training goes through ``convoy.train_step``."""

    def __init__(self, model: nn.Module, strategy: Strategy) -> None:
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel

        self.strategy = strategy
        self.group = sequence_group(strategy.sequence)
        self.rank = dist.get_rank(self.group)
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=strategy.bucket_mb, gradient_as_bucket_view=True)
        self._checked = False

    def _check_hooks(self, record: Record) -> None:
        """Refuse a model whose forward did not go through both hooks: its parts would attend and be placed as
        if each were a whole sequence, and train on that without a word."""
        missing = [name for name, seen in (("convoy.attention", record.attention), ("convoy.positions",
                                                                                    record.positions)) if not seen]
        if missing:
            raise ConfigError(f"the sequence strategy cuts each sample's positions over {self.strategy.sequence} "
                              f"ranks, but {type(self.ddp.module).__name__}'s forward never called "
                              f"{' or '.join(missing)}: compute attention with convoy.attention(q, k, v, causal=...) "
                              "and position indices with convoy.positions(length), or plan without it")
        self._checked = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp.module(*args, **kwargs)

    def train_step(self, optimizer: torch.optim.Optimizer, loss_fn: Any, inputs: Any, targets: torch.Tensor
                   ) -> float:
        ranks = self.strategy.sequence
        length = check_batch(inputs, targets, ranks) // ranks
        parts = ranks * self.strategy.accumulation
        micro_in = gather_batch(inputs, self.group).narrow(1, self.rank * length, length).chunk(parts)
        micro_targets = gather_batch(targets, self.group).narrow(1, self.rank * length, length).chunk(parts)
        total = torch.zeros((), dtype=torch.float64)
        for index, (x, y) in enumerate(zip(micro_in, micro_targets, strict=True)):
            sync = self.ddp.no_sync() if index < parts - 1 else contextlib.nullcontext()
            autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if self.strategy.bf16
                        else contextlib.nullcontext())
            with sync, sharded(self.group):
                with autocast, recording() if not self._checked else contextlib.nullcontext() as record:
                    loss = loss_fn(self.ddp(x), y)
                if not self._checked:
                    self._check_hooks(record)
                (loss / parts).backward()
            total += loss.detach().double()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(total, group=self.group)
        return float(total) / parts / ranks
