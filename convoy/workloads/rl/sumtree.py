"""A sum tree over a fixed number of slots: prioritized replay's index (set priorities, draw slots in proportion
to them, both in O(log n) per slot and vectorized over a batch). Its nodes are a numpy array (numpy's indexing of a
batch costs a few microseconds where torch's costs tens, and a batch walks the tree's 18 levels a few times per
call); it takes and gives torch tensors."""

from __future__ import annotations

import numpy as np
import torch


class SumTree:
    """Leaves hold each slot's priority, every inner node the sum below it (``nodes[1]`` is the total)."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a sum tree needs at least one slot, got {slots}")
        self.slots = slots
        self.depth = max(0, (slots - 1).bit_length())
        self.leaves = 1 << self.depth
        self.nodes = np.zeros(2 * self.leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.nodes[1])

    def get(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.nodes[slots.to(torch.int64).numpy() + self.leaves])

    def set(self, slots: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give ``slots`` their ``priorities`` (>= 0); a slot named twice keeps its last."""
        if slots.numel() == 0:
            return
        values = priorities.detach().to(torch.float64).numpy()
        if bool((values < 0).any()) or not bool(np.isfinite(values).all()):
            raise ValueError("priorities must be finite and >= 0")
        at = slots.to(torch.int64).numpy() + self.leaves
        self.nodes[at] = values
        for _ in range(self.depth):  # a parent named twice is written twice with one sum: no need to deduplicate
            at = at // 2
            self.nodes[at] = self.nodes[2 * at] + self.nodes[2 * at + 1]

    def find(self, masses: torch.Tensor) -> torch.Tensor:
        """The slot under each of ``masses`` (each in [0, total)): the first slot whose running sum passes it."""
        left_over = masses.to(torch.float64).numpy().copy()
        at = np.ones(left_over.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = 2 * at
            below = self.nodes[left]
            go_right = left_over >= below
            left_over = np.where(go_right, left_over - below, left_over)
            at = left + go_right
        return torch.from_numpy(np.minimum(at - self.leaves, self.slots - 1))

    def draw(self, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``count`` slots drawn in proportion to their priorities, stratified (one per equal part of the total)."""
        total = self.total
        if total <= 0:
            raise ValueError("no slot has a priority above 0")
        parts = (torch.arange(count, dtype=torch.float64) + torch.rand(count, generator=generator,
                                                                        dtype=torch.float64)) * (total / count)
        slots = self.find(parts.clamp_(max=total * (1 - 1e-12)))
        empty = self.get(slots) <= 0  # float rounding can land on a zero leaf beside the right one
        if bool(empty.any()):
            slots[empty] = self.find(torch.rand(int(empty.sum()), generator=generator, dtype=torch.float64) * total)
        return slots
