"""The replay buffer's storage: a ring of transitions kept as columns of tensors, sampled uniformly or by
priority, bounded in transitions and in bytes, and snapshotted whole (``saved_form`` / ``from_saved``).

A transition is one row of every column the ``Layout`` names (for DQN: obs, action, reward, next_obs, discount,
where ``discount`` is gamma^n for an n-step return, 0 past the episode's end). An insert that does not match the
layout is refused whole and counted, so nothing half-written enters the ring. Each slot remembers which insert
wrote it (``written``): a priority update for a slot rewritten since it was sampled is dropped, not misapplied.
The columns may live in a shared ring (``ring.py``, ``share``), where learners on the host gather rows themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from convoy.errors import ConfigError
from convoy.workloads.rl.sumtree import SumTree


class BadTransitions(ConfigError):
    """An insert whose tensors do not match the buffer's layout (refused whole, counted)."""


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier for a ring other processes read: taking a lock is a locked instruction, which orders
    every earlier store (streaming ones too) before every later one."""
    with _FENCE:
        pass


@dataclass(frozen=True)
class Column:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Layout:
    """The columns of a transition, by name."""

    columns: Mapping[str, Column]

    @staticmethod
    def for_dqn(obs_shape: tuple[int, ...], obs_dtype: torch.dtype = torch.float32) -> Layout:
        """``obs_dtype``: uint8 for frames (a quarter of float32's bytes)."""
        return Layout({"obs": Column(obs_shape, obs_dtype), "action": Column((), torch.int64),
                       "reward": Column((), torch.float32), "next_obs": Column(obs_shape, obs_dtype),
                       "discount": Column((), torch.float32)})

    @property
    def row_bytes(self) -> int:
        return sum(torch.Size(c.shape).numel() * c.dtype.itemsize for c in self.columns.values())

    def describe(self) -> dict[str, Any]:
        return {name: [list(c.shape), str(c.dtype).removeprefix("torch.")] for name, c in self.columns.items()}

    @staticmethod
    def from_description(described: Mapping[str, Any]) -> Layout:
        try:
            return Layout({name: Column(tuple(int(d) for d in shape), getattr(torch, dtype))
                           for name, (shape, dtype) in described.items()})
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"not a transition layout: {described!r} ({exc})") from exc

    def rows_of(self, batch: Mapping[str, torch.Tensor]) -> int:
        """How many transitions ``batch`` holds; ``BadTransitions`` naming the first column that does not fit."""
        missing, extra = set(self.columns) - set(batch), set(batch) - set(self.columns)
        if missing or extra:
            raise BadTransitions(f"transitions need exactly the columns {sorted(self.columns)}; missing "
                                 f"{sorted(missing)}, unknown {sorted(extra)}")
        rows = None
        for name, column in self.columns.items():
            tensor = batch[name]
            if tensor.dtype != column.dtype or tuple(tensor.shape[1:]) != column.shape or tensor.dim() < 1:
                raise BadTransitions(f"column {name!r} must be {column.dtype} of shape [n, {list(column.shape)}], got "
                                     f"{tensor.dtype} {list(tensor.shape)}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise BadTransitions(f"column {name!r} holds NaN or infinite values")
            if rows is not None and tensor.shape[0] != rows:
                raise BadTransitions(f"column {name!r} has {tensor.shape[0]} rows where the others have {rows}")
            rows = tensor.shape[0]
        return int(rows or 0)


@dataclass
class Sampled:
    slots: torch.Tensor
    written: torch.Tensor
    """Which insert wrote each slot (give it back with the new priorities)."""
    batch: dict[str, torch.Tensor]
    weights: torch.Tensor
    """Importance weights (all 1 for uniform sampling), normalized to at most 1."""


@dataclass
class Counters:
    inserted: int = 0
    """Transitions accepted since the buffer was created (a snapshot keeps the count)."""
    sampled: int = 0
    refused: int = 0
    """Inserts refused (a malformed transition), counted in batches."""
    stale_priorities: int = 0
    """Priority updates dropped because their slot was rewritten since it was sampled."""
    by_source: dict[str, int] = field(default_factory=dict)
    """Transitions accepted per source (an actor), the count a snapshot keeps for each."""


class ReplayBuffer:
    """``capacity`` transitions at most, fewer where ``max_bytes`` allows fewer rows; ``alpha`` > 0 samples by
    priority (``priority ** alpha``), 0 uniformly."""

    def __init__(self, layout: Layout, capacity: int, max_bytes: int = 0, alpha: float = 0.0, beta: float = 0.4,
                 seed: int = 0) -> None:
        if capacity < 1:
            raise ConfigError(f"a replay buffer's capacity must be >= 1 transition, got {capacity}")
        if max_bytes < 0 or alpha < 0 or not 0 <= beta <= 1:
            raise ConfigError("max_bytes must be >= 0, alpha >= 0 and 0 <= beta <= 1")
        rows = min(capacity, max_bytes // layout.row_bytes) if max_bytes else capacity
        if rows < 1:
            raise ConfigError(f"max_bytes {max_bytes} holds no transition of {layout.row_bytes} bytes")
        self.layout, self.capacity, self.alpha, self.beta = layout, rows, alpha, beta
        self.columns = {name: torch.zeros((rows, *c.shape), dtype=c.dtype) for name, c in layout.columns.items()}
        self.written = torch.full((rows,), -1, dtype=torch.int64)
        self.size = 0
        self.counters = Counters()
        self.tree = SumTree(rows) if alpha > 0 else None
        self.max_priority = 1.0
        self.generator = torch.Generator().manual_seed(seed)

    def insert(self, batch: Mapping[str, torch.Tensor], source: str = "", rows: int | None = None) -> int:
        """Append ``batch`` (overwriting the oldest once full); returns the rows taken. ``rows``: the batch was
        checked against the layout already (``Layout.rows_of``) and holds that many."""
        if rows is None:
            try:
                rows = self.layout.rows_of(batch)
            except BadTransitions:
                self.counters.refused += 1
                raise
        if rows == 0:
            return 0
        take = min(rows, self.capacity)  # a batch larger than the ring keeps its newest rows
        first = self.counters.inserted + rows - take
        slots = torch.arange(first, first + take) % self.capacity
        start = first % self.capacity
        ahead = min(take, self.capacity - start)  # the rows before the ring wraps, then the rest from slot 0
        self.written[slots] = -1  # a reader of a shared ring (ring.py) that copied one of these rows drops it
        fence()
        for name, column in self.columns.items():  # slice copies: indexed writes are ~20x slower on large rows
            fresh = batch[name][rows - take:]
            column[start:start + ahead].copy_(fresh[:ahead])
            column[:take - ahead].copy_(fresh[ahead:])
        fence()
        self.written[slots] = torch.arange(first, first + take)
        if self.tree is not None:
            self.tree.set(slots, torch.full((take,), self.max_priority ** self.alpha))
        self.counters.inserted += rows
        self.counters.by_source[source] = self.counters.by_source.get(source, 0) + rows
        self.size = min(self.capacity, self.size + rows)
        return rows

    def sample(self, count: int, gather: bool = True) -> Sampled:
        """``count`` slots drawn, their insert numbers and weights, and (``gather``) their rows: a learner that
        gathers them itself from a shared ring does not need them copied here."""
        if self.size == 0:
            raise ConfigError("the replay buffer is empty: insert transitions before sampling")
        if count < 1:
            raise ConfigError(f"sample at least one transition, got {count}")
        if self.tree is None:
            slots = torch.randint(self.size, (count,), generator=self.generator)
            weights = torch.ones(count)
        else:
            slots = self.tree.draw(count, self.generator)
            chance = self.tree.get(slots) / self.tree.total
            weights = (self.size * chance).pow(-self.beta)
            weights = (weights / weights.max()).to(torch.float32)
        self.counters.sampled += count
        # index_select, not c[slots]: indexed reads are ~20x slower on large rows
        gathered = {n: torch.index_select(c, 0, slots) for n, c in self.columns.items()} if gather else {}
        return Sampled(slots, self.written[slots].clone(), gathered, weights)

    def update_priorities(self, slots: torch.Tensor, written: torch.Tensor, priorities: torch.Tensor) -> int:
        """New priorities (e.g. |TD error|) for sampled slots; those rewritten since are dropped. Returns how many
        were applied."""
        if self.tree is None:
            raise ConfigError("this replay buffer samples uniformly (alpha 0): it keeps no priorities")
        if not (slots.shape == written.shape == priorities.shape) or slots.dim() != 1:
            raise BadTransitions("slots, written and priorities must be 1-d and of one length")
        if bool(((slots < 0) | (slots >= self.capacity)).any()):
            raise BadTransitions(f"slots must be in [0, {self.capacity})")
        current = self.written[slots] == written
        self.counters.stale_priorities += int((~current).sum())
        fresh = priorities[current].to(torch.float64).abs() + 1e-6
        if fresh.numel():
            self.max_priority = max(self.max_priority, float(fresh.max()))
            self.tree.set(slots[current], fresh.pow(self.alpha))
        return int(current.sum())

    def share(self, columns: dict[str, torch.Tensor], written: torch.Tensor) -> None:
        """Keep the ring in these tensors from now on (a shared ring's views, ``ring.SharedRing``), its rows copied
        there first."""
        if set(columns) != set(self.columns) or written.shape != self.written.shape:
            raise ConfigError("a shared ring must have this buffer's columns and capacity")
        for name, column in columns.items():
            column.copy_(self.columns[name])
        written.copy_(self.written)
        self.columns, self.written = dict(columns), written

    def saved_form(self) -> dict[str, Any]:
        """Everything a restored buffer needs (views of the live tensors: copy them before the next insert)."""
        counters = self.counters
        return {"layout": self.layout.describe(), "capacity": self.capacity, "alpha": self.alpha, "beta": self.beta,
                "size": self.size, "columns": {n: c[:self.size] for n, c in self.columns.items()},
                "written": self.written[:self.size], "max_priority": self.max_priority,
                "priorities": self.tree.get(torch.arange(self.size)) if self.tree is not None else None,
                "inserted": counters.inserted, "sampled": counters.sampled, "refused": counters.refused,
                "by_source": dict(counters.by_source)}

    @staticmethod
    def from_saved(saved: Mapping[str, Any], seed: int = 0) -> ReplayBuffer:
        buffer = ReplayBuffer(Layout.from_description(saved["layout"]), int(saved["capacity"]),
                              alpha=float(saved["alpha"]), beta=float(saved["beta"]), seed=seed)
        size = int(saved["size"])
        for name, column in buffer.columns.items():
            column[:size] = saved["columns"][name]
        buffer.written[:size] = saved["written"]
        buffer.size, buffer.max_priority = size, float(saved["max_priority"])
        if buffer.tree is not None and size:
            buffer.tree.set(torch.arange(size), saved["priorities"])
        buffer.counters = Counters(inserted=int(saved["inserted"]), sampled=int(saved["sampled"]),
                                   refused=int(saved["refused"]), by_source=dict(saved["by_source"]))
        return buffer
