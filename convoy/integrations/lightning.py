"""``ConvoyCallback``: a PyTorch Lightning ``Trainer`` under convoy loses no finished optimizer step.

    trainer = pl.Trainer(..., callbacks=[ConvoyCallback()])

After every optimizer step (in ``on_train_batch_end``, where Lightning's own ``ModelCheckpoint`` saves, and only
when ``trainer.global_step`` advanced, so gradient accumulation is respected) it snapshots (``convoy.Checkpointer``)
the LightningModule, the optimizers, LR schedulers, precision plugin, the other callbacks' and the datamodule's
state, RNG streams, the fit loop's progress and the data position. When convoy starts the worker again in a new
round, ``on_fit_start`` loads the newest snapshot every rank has and hands the loop progress to Lightning's own
restart logic (``fit_loop.load_state_dict``, what ``ckpt_path=`` resumes do), and leaves the RNG streams as the
seed made them: Lightning calls ``train_dataloader()`` after ``on_fit_start`` (``setup()`` before it), so data drawn
there is drawn as in the first fit. ``on_train_start`` then moves the fresh dataloader past the batches already
trained in the current epoch, with the sampler's epoch and the RNG streams the uninterrupted run had at that point
of the loop, so the weights end bit-identical (no random collator).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint import Checkpointer
from convoy.runtime.snapshot_budget import SnapshotBudget, checked_budget
from convoy.runtime.checkpoint_state import rng_state, set_rng_state

logger = logging.getLogger(__name__)


class StateOf:
    """Something read and written through two functions, as an object the Checkpointer can save and load."""

    def __init__(self, read: Any, write: Any) -> None:
        self.read, self.write = read, write

    def state_dict(self) -> Any:
        return self.read()

    def load_state_dict(self, saved: Any) -> None:
        self.write(saved)


def loaders(trainer: pl.Trainer) -> list[Any]:
    """The training dataloaders Lightning iterates (after it set up its data: DistributedSampler put in)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def samplers(loader: Any) -> list[Any]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = [getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)]
    return [sampler for sampler in found if sampler is not None]


def generators(trainer: pl.Trainer) -> list[torch.Generator]:
    """The generators that order the batches: a sampler's own or a loader's (none: the global torch stream)."""
    found: list[torch.Generator] = []
    for loader in loaders(trainer):
        for owner in (loader, *samplers(loader)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not seen for seen in found):
                found.append(generator)
    return found


class DataPosition:
    """Where the training data stands: the epoch, the batches of it already trained, and the RNG streams and
    batch-order generators as the epoch's first batch found them (what makes its order reproducible)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.epoch, self.batches, self.last_batch = 0, 0, False
        self.epoch_start = self.streams()
        self.saved: dict[str, Any] | None = None

    def streams(self) -> dict[str, Any]:
        """The RNG streams and the batch-order generators as they stand now."""
        return {"rng": rng_state(), "generators": [generator.get_state() for generator in generators(self.trainer)]}

    def begin_epoch(self, epoch: int, start: dict[str, Any] | None = None) -> None:
        self.epoch, self.batches, self.last_batch = epoch, 0, False
        self.epoch_start = start if start is not None else self.streams()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self.batches, "last_batch": self.last_batch,
                "epoch_start": self.epoch_start, "generators_now": self.streams()["generators"]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.saved = saved


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed ``fit()`` picks the data up: ``batches`` into ``epoch``, whose iterator is made from the
    streams of ``epoch_start``; then ``rng_now`` (the streams right after the saved step) when that was mid-epoch."""

    epoch: int
    batches: int
    epoch_start: dict[str, Any]
    rng_now: dict[str, Any] | None


def check_strategy(trainer: pl.Trainer) -> None:
    """Every rank must hold the whole model and optimizer (DDP or one device): the snapshots are replicated."""
    strategy = trainer.strategy
    if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        raise CheckpointError(f"ConvoyCallback supports strategy='ddp' or one device, got {type(strategy).__name__} "
                              "(a sharded strategy holds a different part of the state on each rank); use "
                              "strategy='ddp', or convoy.Checkpointer in a loop of your own")


class ConvoyCallback(pl.Callback):
    """Snapshots after every optimizer step; resumes a restarted ``fit()`` at the step after the newest snapshot
    every rank has. Outside a convoy job (no ``CONVOY_JOB_ID``) it warns once and does nothing.

    ``persist_every`` (0: never) also writes a persistent checkpoint every that many steps to
    ``$CONVOY_RUN_DIR/checkpoints``; ``async_snapshot`` copies while the next step computes (turned off when
    the module has several optimizers: the copy is awaited before the first one's step only); ``max_overhead``
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
        """The global step this ``fit()`` started from (0: from the beginning)."""
        self._own_group = False
        self._last_step = 0
        self._resume_point: ResumePoint | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not os.environ.get("CONVOY_JOB_ID"):
            logger.warning("ConvoyCallback: not under `convoy run` (no CONVOY_JOB_ID), so no snapshots are taken "
                           "and nothing resumes; launch with `convoy run ...` to protect finished steps")
            return
        check_strategy(trainer)
        if not trainer.optimizers:
            raise CheckpointError("ConvoyCallback found no optimizer: configure_optimizers() must return one")
        if not dist.is_initialized():  # one device: Lightning made no process group, the Checkpointer needs one
            dist.init_process_group("gloo")
            self._own_group = True
        first, *others = trainer.optimizers
        shared: dict[str, Any] = {f"optimizer{index + 1}": opt for index, opt in enumerate(others)}
        for index, config in enumerate(trainer.lr_scheduler_configs):
            shared[f"lr_scheduler{index}"] = config.scheduler
        self.position = DataPosition(trainer)
        own = {"loops": StateOf(trainer.fit_loop.state_dict, trainer.fit_loop.load_state_dict),
               "data": self.position, "callbacks": self._callback_states(trainer),
               "precision": StateOf(trainer.precision_plugin.state_dict, trainer.precision_plugin.load_state_dict)}
        if trainer.datamodule is not None:
            own["datamodule"] = StateOf(trainer.datamodule.state_dict, trainer.datamodule.load_state_dict)
        self.checkpointer = Checkpointer(
            pl_module, first, state=own, model_state=shared, persist_every=self.persist_every,
            async_snapshot=self.async_snapshot and not others, replicated=dist.get_world_size() > 1,
            max_overhead=self.max_overhead)
        seeded = rng_state()  # the streams a first fit() builds its dataloaders from, after setup() drew its own
        self.resumed_at = self.checkpointer.restore()
        self._last_step = trainer.global_step
        if self.resumed_at:
            self._resume(trainer)
            set_rng_state(seeded)  # the snapshot's streams come back in on_train_start, once the data is built

    def _callback_states(self, trainer: pl.Trainer) -> StateOf:
        """The other callbacks' ``state_dict()`` (ModelCheckpoint's best scores, EarlyStopping's patience...)."""
        others = [callback for callback in trainer.callbacks if callback is not self]

        def write(saved: dict[str, Any]) -> None:
            for callback in others:
                if callback.state_key in saved:
                    callback.load_state_dict(saved[callback.state_key])

        return StateOf(lambda: {callback.state_key: callback.state_dict() for callback in others}, write)

    def _resume(self, trainer: pl.Trainer) -> None:
        saved = self.position.saved
        assert saved is not None and trainer.global_step == self.resumed_at, (trainer.global_step, self.resumed_at)
        pending = getattr(trainer, "_checkpoint_connector", None)
        if trainer.ckpt_path and pending is not None and getattr(pending, "_loaded_checkpoint", None):
            # Lightning would load its older file's loops and optimizers over the snapshot's after this hook
            logger.warning(f"ConvoyCallback: convoy's snapshot of step {self.resumed_at} is newer than "
                           f"ckpt_path={trainer.ckpt_path}; resuming from the snapshot")
            pending._loaded_checkpoint = {}
        rng_now = rng_state()  # what the Checkpointer restored: the streams right after the saved step
        if saved["last_batch"]:  # the saved step ended its epoch: the next one starts on the streams it left
            # (Lightning calls no on_train_epoch_start for it)
            self.position.begin_epoch(saved["epoch"] + 1, {"rng": rng_now, "generators": saved["generators_now"]})
            point = ResumePoint(self.position.epoch, 0, self.position.epoch_start, None)
        else:
            self.position.epoch, self.position.batches = saved["epoch"], saved["batches"]
            self.position.epoch_start = saved["epoch_start"]
            point = ResumePoint(saved["epoch"], saved["batches"], saved["epoch_start"], rng_now)
            # Lightning warns that a plain dataloader cannot resume mid-epoch: on_train_start moves it on instead
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        self._resume_point = point
        logger.warning(f"ConvoyCallback: resuming at global step {self.resumed_at} (epoch "
                       f"{point.epoch}, {point.batches} batches of it already trained)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """In a resumed fit, with its dataloaders built from the seed's streams as the first fit built them, put the
        snapshot's streams back where the loop took them: make the epoch's iterator from the streams of its start,
        draw past the batches already trained, and go on with the streams right after the saved step."""
        point, self._resume_point = self._resume_point, None
        if point is None:
            return
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        iterator = getattr(fetcher, "iterator", None)
        if iterator is None:
            raise CheckpointError("ConvoyCallback could not find the training data iterator of this Lightning "
                                  f"version ({pl.__version__}) to resume epoch {point.epoch} at batch {point.batches}")
        for loader in loaders(trainer):
            for sampler in samplers(loader):
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(point.epoch)
        set_rng_state(point.epoch_start["rng"])
        for generator, state in zip(generators(trainer), point.epoch_start["generators"]):
            generator.set_state(state)
        if point.epoch > 0:  # Lightning makes a later epoch's iterator after its start hooks (drawing a seed)
            iter(fetcher)
            iterator = fetcher.iterator
        for _ in range(point.batches):  # the iterator below Lightning's counters, so they stay the restored ones
            next(iterator)
        if point.rng_now is not None:
            set_rng_state(point.rng_now)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None:
            self.position.begin_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.checkpointer is None:
            return
        self.position.batches = batch_idx + 1
        if trainer.global_step == self._last_step:  # accumulating gradients: no optimizer step yet
            return
        self._last_step = trainer.global_step
        self.position.last_batch = self.position.batches >= trainer.num_training_batches
        self.checkpointer.step(trainer.global_step - 1)

    def _close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.budget = self.checkpointer.budget
            self.checkpointer = None
        if self._own_group:
            dist.destroy_process_group()
            self._own_group = False

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()
