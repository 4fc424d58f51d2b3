"""The ways of saving ``benchmarks/gpu.py`` times per step: none, convoy's snapshot (every step, and under a 5%
budget), and ``dcp.async_save`` as its users run it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import convoy

GOAL_OVERHEAD = 0.05


class Peers:
    """The three ways of saving timed per step: none, convoy's snapshot, and ``dcp.async_save`` at its best
    (pinned, asynchronous staging; each save waits for the one before, as its documentation asks)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.model, self.optimizer, self.directory = model, optimizer, directory
        self.checkpointer = convoy.Checkpointer(model, optimizer, persist_every=0)
        self.budgeted: convoy.Checkpointer | None = None
        """``max_overhead=GOAL_OVERHEAD``: made at its first block (its measuring runs there)."""
        self.new_stager = lambda: DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=torch.cuda.is_available()))
        self.stager = self.new_stager()
        self.pending = None
        self.saves = 0
        self.fresh_stagers = 0

    def save(self, how: str, step: int) -> None:
        if how == "convoy":
            self.checkpointer.step(step)
        elif how == "budget":
            if self.budgeted is None:
                self.checkpointer.wait()
                self.budgeted = convoy.Checkpointer(self.model, self.optimizer, persist_every=0,
                                                    max_overhead=GOAL_OVERHEAD)
            self.budgeted.step(step)
        elif how == "dcp":
            if self.pending is not None:
                self.pending.upload_completion.result()
                self._stager_usable()
            target = self.directory / f"step{self.saves % 2}"
            shutil.rmtree(target, ignore_errors=True)
            state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
            self.pending = dcp.async_save(state, checkpoint_id=str(target), async_stager=self.stager)
            self.saves += 1

    def settle_dcp(self) -> None:
        if self.pending is not None:
            self.pending.upload_completion.result()
            self.pending = None
            self._stager_usable()

    def _stager_usable(self) -> None:
        """Some torch versions (2.11) close the stager given to ``async_save`` once its upload ends, which
        empties its copy table (the next staging fails with ``KeyError``): then each save gets a new stager, as
        users of that version must, and the count is reported."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager = self.new_stager()
            self.fresh_stagers += 1

    def close(self) -> None:
        self.settle_dcp()
        self.checkpointer.close()
        if self.budgeted is not None:
            self.budgeted.close()
            decision = self.budgeted.budget.decision if self.budgeted.budget else None
            print(f"  budget {GOAL_OVERHEAD:.0%}: {decision.describe() if decision else 'no interval chosen yet'}",
                  flush=True)
