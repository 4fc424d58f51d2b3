"""A sum tree over a fixed number of slots: prioritized replay's index (set priorities, draw slots in proportion
to them, both in O(log n) per slot and vectorized over a batch with torch)."""

from __future__ import annotations

import torch


class SumTree:
    """Leaves hold each slot's priority, every inner node the sum below it (``nodes[1]`` is the total)."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a sum tree needs at least one slot, got {slots}")
        self.slots = slots
        self.leaves = 1 << max(0, (slots - 1).bit_length())
        self.nodes = torch.zeros(2 * self.leaves, dtype=torch.float64)

    @property
    def total(self) -> float:
        return float(self.nodes[1])

    def get(self, slots: torch.Tensor) -> torch.Tensor:
        return self.nodes[slots + self.leaves]

    def set(self, slots: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give ``slots`` their ``priorities`` (>= 0); a slot named twice keeps its last."""
        if slots.numel() == 0:
            return
        if bool((priorities < 0).any()) or not bool(torch.isfinite(priorities).all()):
            raise ValueError("priorities must be finite and >= 0")
        at = slots.to(torch.int64) + self.leaves
        self.nodes[at] = priorities.to(torch.float64)
        at = torch.unique(at // 2)
        while at.numel() and int(at[0]) >= 1:
            self.nodes[at] = self.nodes[2 * at] + self.nodes[2 * at + 1]
            if int(at[0]) == 1:
                break
            at = torch.unique(at // 2)

    def find(self, masses: torch.Tensor) -> torch.Tensor:
        """The slot under each of ``masses`` (each in [0, total)): the first slot whose running sum passes it."""
        at = torch.ones_like(masses, dtype=torch.int64)
        left_over = masses.to(torch.float64).clone()
        while int(at[0]) < self.leaves:
            left = 2 * at
            go_right = left_over >= self.nodes[left]
            left_over = torch.where(go_right, left_over - self.nodes[left], left_over)
            at = torch.where(go_right, left + 1, left)
        return (at - self.leaves).clamp_(max=self.slots - 1)

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
