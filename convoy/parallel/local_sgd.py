"""Group-wise local SGD: model groups train apart for ``H`` steps, then each parameter shard syncs
among the ranks that hold it.

The world is ``n`` model groups of ``m`` ranks (consecutive ranks, so a node's workers form one
group when it runs ``m`` of them). Each model group holds the whole model split into ``m``
shards (pipeline stages, or layer-wise), one per rank; the ``n`` ranks holding shard ``k`` form
shard group ``k``. A group trains its replica with its own (inner) optimizer; every ``H`` steps
each shard group averages its shard and either sets it to the average, or treats
``anchor - average`` as an outer gradient for Nesterov momentum (DiLoCo). With ``stagger`` the
shard groups take turns (shard ``k`` syncs ``k H / m`` steps after shard 0), spreading the
traffic over the interval. Only shard groups cross between model groups, so the bytes between
groups are one allreduce of the shard every ``H`` steps instead of one per step.

Elastic: a group that drops out is not in the next rendezvous round, so the next sync is among
the others; a group that joins takes its shards, inner optimizer state and outer state from a
peer of each shard group (``Checkpointer(replicated=layout.shard_groups(), model_state=...)``).

``Layout`` and ``due`` are pure; ``make_groups`` and ``LocalSGD`` need torch.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError, ScheduleError


@dataclass(frozen=True)
class Nesterov:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on ``anchor - average``."""

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ConfigError(f"Nesterov outer optimizer needs lr > 0 and 0 <= momentum < 1 "
                              f"(got lr={self.lr}, momentum={self.momentum})")


Outer = str | Nesterov
OUTERS = ("average", "nesterov")


def outer_from_name(name: str, lr: float = 0.7, momentum: float = 0.9) -> Outer:
    """``"average"`` or ``"nesterov"`` (with ``lr`` and ``momentum``), as a command line gives it."""
    if name == "average":
        return "average"
    if name == "nesterov":
        return Nesterov(lr, momentum)
    raise ConfigError(f"unknown outer optimizer {name!r}; choose from {', '.join(OUTERS)}")


def check_every(every: int) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"local SGD needs every >= 1 inner steps between syncs (got {every!r}); "
                          "every=1 syncs each step, like synchronous data parallelism")


@dataclass(frozen=True)
class Layout:
    """``n_groups`` model groups of ``n_shards`` ranks: rank ``g * n_shards + k`` holds shard ``k``
    of group ``g``'s replica."""

    n_groups: int
    n_shards: int

    def __post_init__(self) -> None:
        for name in ("n_groups", "n_shards"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"local SGD layout needs {name} >= 1 (got {value!r})")

    @classmethod
    def from_world(cls, world_size: int, shards: int) -> Layout:
        """As many groups as ``world_size`` holds; it must be a multiple of ``shards``."""
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ConfigError(f"local SGD needs shards >= 1 per model group (got {shards!r})")
        if world_size < 1 or world_size % shards:
            raise ConfigError(f"world size {world_size} is not n groups x {shards} shards; run a multiple of "
                              f"{shards} workers (e.g. --nproc-per-node {shards}, so a node is a group)")
        return cls(world_size // shards, shards)

    @classmethod
    def from_env(cls, shards: int, env: Mapping[str, str] | None = None) -> Layout:
        """From ``WORLD_SIZE`` (set by convoy and torchrun)."""
        env = os.environ if env is None else env
        try:
            world = int(env["WORLD_SIZE"])
        except (KeyError, ValueError) as exc:
            raise ConfigError("WORLD_SIZE is not set; run under convoy or torchrun, or use Layout.from_world"
                              ) from exc
        return cls.from_world(world, shards)

    @property
    def world_size(self) -> int:
        return self.n_groups * self.n_shards

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a {self.n_groups} x {self.n_shards} layout "
                              f"(ranks 0..{self.world_size - 1})")

    def group_of(self, rank: int) -> int:
        self.check_rank(rank)
        return rank // self.n_shards

    def shard_of(self, rank: int) -> int:
        self.check_rank(rank)
        return rank % self.n_shards

    def rank(self, group: int, shard: int) -> int:
        if not (0 <= group < self.n_groups and 0 <= shard < self.n_shards):
            raise ConfigError(f"no group {group} / shard {shard} in a {self.n_groups} x {self.n_shards} layout")
        return group * self.n_shards + shard

    def model_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each replica, in shard order (a pipeline's stages)."""
        return tuple(tuple(self.rank(g, k) for k in range(self.n_shards)) for g in range(self.n_groups))

    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks holding each shard, in group order: the only traffic between groups."""
        return tuple(tuple(self.rank(g, k) for g in range(self.n_groups)) for k in range(self.n_shards))

    def offset(self, shard: int, every: int, stagger: bool) -> int:
        """Steps by which shard ``shard``'s syncs trail shard 0's."""
        check_every(every)
        return shard * every // self.n_shards if stagger else 0

    def due(self, step: int, shard: int, every: int, stagger: bool = False) -> bool:
        """Whether shard ``shard`` syncs after finished step ``step`` (steps count from 0)."""
        if step < 0:
            raise ConfigError(f"steps count from 0 (got {step})")
        return (step + 1 - self.offset(shard, every, stagger)) % every == 0

    def cross_bytes(self, shard_bytes: float) -> float:
        """Bytes one rank sends to other groups for one ring allreduce of its shard: ``2 (n-1)/n S``."""
        return 2 * (self.n_groups - 1) / self.n_groups * shard_bytes


@dataclass
class Groups:
    """This rank's place in the layout and the process groups it communicates in."""

    layout: Layout
    rank: int
    model: dist.ProcessGroup
    shard: dist.ProcessGroup

    @property
    def group_index(self) -> int:
        return self.layout.group_of(self.rank)

    @property
    def shard_index(self) -> int:
        return self.layout.shard_of(self.rank)


def make_groups(layout: Layout) -> Groups:
    """Create every model and shard group (all ranks must call this, in the same order)."""
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized; call convoy.init() before make_groups")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ConfigError(f"the layout is {layout.n_groups} groups x {layout.n_shards} shards = "
                          f"{layout.world_size} ranks but the world has {world}; use Layout.from_world")
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, sets in (("model", layout.model_groups()), ("shard", layout.shard_groups())):
        for ranks in sets:
            group = dist.new_group(list(ranks), backend="gloo")
            if rank in ranks:
                mine[kind] = group
    return Groups(layout, rank, mine["model"], mine["shard"])


def shard_model(model: nn.Module, layout: Layout, shard: int) -> nn.Sequential:
    """Layer-wise sharding: shard ``shard`` of an ``nn.Sequential``-like model cut into
    ``layout.n_shards`` contiguous pieces of as equal a layer count as possible."""
    from convoy.parallel.pipeline.runtime import split_sequential

    try:
        return split_sequential(model, layout.n_shards)[shard]
    except ScheduleError as exc:
        raise ConfigError(f"cannot split the model into {layout.n_shards} shards: {exc}") from exc


def outer_step(anchor: torch.Tensor, average: torch.Tensor, buffer: torch.Tensor, outer: Nesterov) -> None:
    """One Nesterov step in place: ``g = anchor - average``, ``buffer = mu buffer + g``,
    ``anchor -= lr (g + mu buffer)`` (torch's SGD with ``nesterov=True``)."""
    gradient = anchor - average
    buffer.mul_(outer.momentum).add_(gradient)
    anchor.sub_(gradient.add_(buffer, alpha=outer.momentum), alpha=outer.lr)


class LocalSGD:
    """Syncs this rank's shard (``params``) over its shard group every ``every`` steps.

    Call ``step(step)`` after each inner ``optimizer.step()`` and ``finish()`` after the last;
    ``bytes_sent`` counts what this rank sent to other groups (payload, ring allreduce). Pass
    the object in ``Checkpointer(model_state=...)`` so a restart or a joining group resumes it."""

    def __init__(self, params: Iterable[torch.Tensor], groups: Groups, every: int, outer: Outer = "average",
                 stagger: bool = False) -> None:
        check_every(every)
        if isinstance(outer, str):
            outer = outer_from_name(outer)
        self.params = list(params)
        if not self.params:
            raise ConfigError("local SGD got no parameters for this shard; every rank must hold part of the model")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ConfigError(f"a shard's parameters must share one dtype to sync in one allreduce (got {dtypes})")
        self.groups, self.every, self.outer, self.stagger = groups, every, outer, stagger
        self.layout = groups.layout
        self.shard = groups.shard_index
        self.numel = sum(p.numel() for p in self.params)
        self.nbytes = self.numel * self.params[0].element_size()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.anchor = flat.clone() if isinstance(outer, Nesterov) else None
        self.buffer = torch.zeros_like(flat) if isinstance(outer, Nesterov) else None
        self.syncs = 0
        self.bytes_sent = 0.0
        self._checked = False
        self._fresh = True  # nothing trained since the replicas were made or synced

    def due(self, step: int) -> bool:
        return self.layout.due(step, self.shard, self.every, self.stagger)

    def step(self, step: int) -> bool:
        """After inner step ``step`` (from 0): sync if due; return whether it did."""
        if not self.due(step):
            self._fresh = False
            return False
        self.sync()
        return True

    def finish(self) -> None:
        """After the last step: sync every shard not synced by it, so the replicas end identical."""
        if not self._fresh:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the shard over its group, then set it (and the anchor) to the outer result."""
        group = self.groups.shard
        if not self._checked:
            self._check_agreement()
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        dist.all_reduce(flat, group=group)
        flat.div_(self.layout.n_groups)
        self.bytes_sent += self.layout.cross_bytes(self.nbytes)
        if isinstance(self.outer, Nesterov):
            assert self.anchor is not None and self.buffer is not None
            outer_step(self.anchor, flat, self.buffer, self.outer)
            flat = self.anchor
        at = 0
        for p in self.params:
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        self.syncs += 1
        self._fresh = True

    def _check_agreement(self) -> None:
        """Once per start: every rank of the shard group must have done as many syncs (else their
        anchors differ, e.g. ranks restored from different checkpoints)."""
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.layout.n_groups)]
        dist.all_gather(counts, torch.tensor([self.syncs]), group=self.groups.shard)
        seen = [int(c.item()) for c in counts]
        if len(set(seen)) != 1:
            raise ConfigError(f"shard group {self.shard} (ranks {list(self.layout.shard_groups()[self.shard])}) "
                              f"resumed from different syncs {seen}; restore every rank with one Checkpointer "
                              "given model_state={'local_sgd': ...} and replicated=layout.shard_groups()")
        self._checked = True

    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "bytes_sent": self.bytes_sent, "fresh": self._fresh, "anchor": self.anchor,
                "buffer": self.buffer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in ("anchor", "buffer"):
            live, saved = getattr(self, name), state[name]
            if (live is None) != (saved is None) or (live is not None and live.shape != saved.shape):
                raise ConfigError(f"saved local SGD {name} does not fit this shard (saved "
                                  f"{None if saved is None else tuple(saved.shape)}, live "
                                  f"{None if live is None else tuple(live.shape)}); same outer optimizer and model?")
            if live is not None:
                live.copy_(saved)
        self.syncs, self.bytes_sent = int(state["syncs"]), float(state["bytes_sent"])
        self._checked, self._fresh = False, bool(state.get("fresh", False))
