"""``ConvoyCallback``: a Hugging Face ``Trainer`` under convoy loses no finished optimizer step.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ConvoyCallback()])

After every optimizer step it snapshots (``convoy.Checkpointer``) the model, optimizer, LR scheduler, RNG
streams, the ``TrainerState`` counters and the data position. When convoy starts the worker again in a new
round, ``on_train_begin`` loads the newest snapshot every rank has and makes the running ``train()`` go on
from the step after it: epochs already done and the batches already trained in the current epoch are
skipped by the dataloader (``skip_batches``), and the sampler and RNG streams are put back where the
uninterrupted run had them, so the weights end bit-identical (fixed data order, no random collator). Only a
model every rank holds whole (DDP or one process): FSDP, DeepSpeed and DTensor-sharded models are refused.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint import Checkpointer
from convoy.runtime.snapshot_budget import SnapshotBudget, checked_budget
from convoy.runtime.checkpoint_state import rng_state, set_rng_state

logger = logging.getLogger(__name__)
PROGRESS_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "best_metric",
                   "best_global_step", "best_model_checkpoint")
"""The ``TrainerState`` counters a resume restores (log history stays with the round that wrote it)."""
SHARDING_BACKENDS = {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed",
                     DistributedType.MEGATRON_LM: "Megatron-LM"}
"""Accelerate's modes that split the model or optimizer state over the ranks."""


def sharding(model: torch.nn.Module, optimizer: Any) -> str | None:
    """What splits the model or optimizer state over the ranks (accelerate's FSDP or DeepSpeed, a module that FSDP
    wrapped, parameters sharded as DTensors when the model loaded), in words; None when every rank holds it whole."""
    backend = getattr(getattr(optimizer, "accelerator_state", None), "distributed_type", None)
    if backend in SHARDING_BACKENDS:
        return SHARDING_BACKENDS[backend]
    if any(isinstance(module, (FSDPModule, FullyShardedDataParallel)) for module in model.modules()):
        return "FSDP"
    if any(isinstance(param, DTensor) for param in model.parameters()):
        return "DTensor parameters (a model sharded as it loaded)"
    return None


def check_replicated(model: torch.nn.Module, optimizer: Any) -> None:
    """Every rank must hold the whole model and optimizer: the snapshots are replicated, a peer's copy stands in."""
    found = sharding(model, optimizer)
    if found is not None:
        raise CheckpointError(f"ConvoyCallback supports DDP or one process, got {found} (each rank holds a different "
                              "shard, so a restarted rank could load a peer's); train with DDP, or leave out "
                              "ConvoyCallback and resume from the Trainer's own checkpoints (save_steps)")


class TrainerProgress:
    """The Trainer's counters as an object the Checkpointer can save and load."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.state, name, None) for name in PROGRESS_FIELDS}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name, value in saved.items():
            setattr(self.state, name, value)


class DataPosition:
    """Where the dataloader stands: the epoch, the batches of it already trained, and the RNG streams and
    sampler generator as they were when the epoch began (what makes its batch order reproducible)."""

    def __init__(self) -> None:
        self.epoch = -1
        self.batches = 0
        self.epoch_start: dict[str, Any] = {}
        self.generator: torch.Generator | None = None

    def begin_epoch(self, generator: torch.Generator | None) -> None:
        self.epoch += 1
        self.batches = 0
        self.generator = generator
        self.epoch_start = {"rng": rng_state(), "generator": generator.get_state() if generator is not None else None}

    def state_dict(self) -> dict[str, Any]:
        now = self.generator.get_state() if self.generator is not None else None
        return {"epoch": self.epoch, "batches": self.batches, "epoch_start": self.epoch_start, "generator_now": now}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.saved = saved


def sampler_generator(loader: Any) -> torch.Generator | None:
    """The generator that orders the batches: accelerate's synchronized one, else the sampler's own."""
    found = getattr(loader, "synchronized_generator", None)
    if isinstance(found, torch.Generator):
        return found
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None),
                  getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None))
    for sampler in candidates:
        found = getattr(sampler, "generator", None)
        if isinstance(found, torch.Generator):
            return found
    return None


class ResumePlan:
    """What the first epochs of a resumed ``train()`` do: skip epochs before ``epoch`` whole, skip ``skip``
    batches of it, and start it with the RNG streams of ``epoch_start``; then ``rng_now`` at its first step."""

    def __init__(self, saved: dict[str, Any], batches_per_epoch: int) -> None:
        rng_now = rng_state()  # what the Checkpointer just restored: the streams right after the saved step
        if saved["batches"] >= batches_per_epoch:  # the saved step ended its epoch: the next one starts fresh
            self.epoch, self.skip = saved["epoch"] + 1, 0
            self.epoch_start = {"rng": rng_now, "generator": saved["generator_now"]}
            self.rng_now: dict[str, Any] | None = None
        else:
            self.epoch, self.skip = saved["epoch"], saved["batches"]
            self.epoch_start, self.rng_now = saved["epoch_start"], rng_now


class ConvoyCallback(TrainerCallback):
    """Snapshots after every optimizer step; resumes a restarted ``train()`` at the step after the newest
    snapshot every rank has. Outside a convoy job (no ``CONVOY_JOB_ID``), or in a ``train()`` the Trainer resumed
    from its own checkpoint, it warns once and does nothing.

    ``persist_every`` (0: never) also writes a persistent checkpoint every that many steps to
    ``$CONVOY_RUN_DIR/checkpoints``; ``async_snapshot`` copies while the next step computes; ``max_overhead``
    (e.g. 0.02) snapshots every k-th step instead, the smallest k whose measured cost stays within that share of
    the training's time, and says k and the steps a failure may cost (``Checkpointer``)."""

    def __init__(self, persist_every: int = 0, async_snapshot: bool = True,
                 max_overhead: float | None = None) -> None:
        self.persist_every, self.async_snapshot = persist_every, async_snapshot
        self.max_overhead = checked_budget(max_overhead)
        self.checkpointer: Checkpointer | None = None
        self.budget: SnapshotBudget | None = None
        """With ``max_overhead``: its budget once training ended (``budget.decision``: the last k chosen)."""
        self.resumed_at = 0
        """The global step this ``train()`` started from (0: from the beginning)."""
        self._own_group = False
        self._plan: ResumePlan | None = None
        self._skipping_epoch = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if not os.environ.get("CONVOY_JOB_ID"):
            logger.warning("ConvoyCallback: not under `convoy run` (no CONVOY_JOB_ID), so no snapshots are taken "
                           "and nothing resumes; launch with `convoy run ...` to protect finished steps")
            return
        if state.global_step > 0:  # its skip plan is already fixed and no snapshot could be put under it safely
            logger.warning(f"ConvoyCallback: the Trainer resumed from its own checkpoint at step {state.global_step}, "
                           "so this train() takes no snapshots; call train() without resume_from_checkpoint to let "
                           "convoy resume from its newer in-memory snapshots")
            return
        model, optimizer = kwargs["model"], kwargs["optimizer"]
        check_replicated(model, optimizer)
        scheduler, loader = kwargs.get("lr_scheduler"), kwargs["train_dataloader"]
        if not hasattr(loader, "skip_batches"):
            raise CheckpointError(f"ConvoyCallback needs the Trainer's accelerate dataloader (one with "
                                  f"`skip_batches`), got {type(loader).__name__}; leave get_train_dataloader() "
                                  "to the Trainer or return a loader prepared by its accelerator")
        if not dist.is_initialized():  # one process: the Trainer made no process group, the Checkpointer needs one
            dist.init_process_group("gloo")
            self._own_group = True
        self.loader = loader
        self.accumulation = max(1, args.gradient_accumulation_steps)
        self.position = DataPosition()
        self.progress = TrainerProgress(state)
        shared = {"lr_scheduler": scheduler} if scheduler is not None and hasattr(scheduler, "state_dict") else {}
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper steps the real one
        self.checkpointer = Checkpointer(
            model, inner, state={"trainer_state": self.progress, "data": self.position}, model_state=shared,
            persist_every=self.persist_every, async_snapshot=self.async_snapshot,
            replicated=dist.get_world_size() > 1, max_overhead=self.max_overhead)
        self.resumed_at = self.checkpointer.restore()
        if self.resumed_at:
            self._plan = ResumePlan(self.position.saved, len(loader))
            self.position.epoch = -1
            logger.warning(f"ConvoyCallback: resuming at global step {state.global_step} (epoch "
                           f"{self._plan.epoch}, {self._plan.skip} batches of it already trained)")

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        generator = sampler_generator(self.loader)
        plan = self._plan
        if plan is not None and self.position.epoch + 1 == plan.epoch:
            set_rng_state(plan.epoch_start["rng"])
            if generator is not None and plan.epoch_start["generator"] is not None:
                generator.set_state(plan.epoch_start["generator"])
            self.loader.skip_batches = plan.skip
        self.position.begin_epoch(generator)
        self._skipping_epoch = plan is not None and self.position.epoch < plan.epoch
        if self._skipping_epoch:
            self.loader.skip_batches = len(self.loader)
        elif plan is not None and self.position.epoch == plan.epoch:
            self.position.batches = plan.skip
            if plan.rng_now is None:
                self._plan = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        plan = self._plan
        if plan is not None and self.position.epoch == plan.epoch:
            # the dataloader drew from the RNG streams while it found the first batch; put the saved step's back
            if plan.rng_now is not None:
                set_rng_state(plan.rng_now)
            self.loader.skip_batches = 0
            self._plan = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        total = len(self.loader)
        self.position.batches = min(self.position.batches + self.accumulation, total)
        state.epoch = self.position.epoch + self.position.batches / total  # the Trainer counts from the skip
        self.checkpointer.step(state.global_step - 1)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        if self._skipping_epoch:  # an epoch with no batch makes the Trainer stop; this one was done before
            self.loader.skip_batches = 0
            self._skipping_epoch = False
            control.should_training_stop = state.global_step >= state.max_steps > 0

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        self.checkpointer.close()
        self.budget = self.checkpointer.budget
        self.checkpointer = None
        if self._own_group:
            dist.destroy_process_group()
            self._own_group = False
