"""The in-process side of benchmarks/checkpoint.py: the model's training loop with its pre-step hooks timed
(``Trainer``), the sizes, and the peers that save from inside it: a plain ``torch.save``, a copy into
``share_memory_()`` buffers, and ``dcp.async_save`` in its three set-ups."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed.checkpoint as dcp
from ckpt_worker import build, forward_backward
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import convoy

@dataclass(frozen=True)
class Sizes:
    """How big and how long: the model, the timed blocks, the saves and the restores."""

    name: str
    layers: int
    width: int = 1024
    batch: int = 32
    reps: int = 5  # blocks without and with snapshots, each followed by one peer save
    block: int = 6  # steps per block; the first of each is not timed
    persist_every: int = 8
    persist_saves: int = 4  # the first is a warm-up, reported on its own
    restores: int = 5  # fresh restore processes, and as many torch.load processes


FULL = Sizes("full", layers=24)
QUICK = Sizes("quick", layers=6, reps=3, block=4, persist_every=4, persist_saves=3, restores=2)


class Step(NamedTuple):
    total: float  # the whole step, checkpointer included
    in_ckpt: float  # inside ckpt.step()
    in_ckpt_cpu: float  # CPU time of this thread inside ckpt.step() (the rest: waiting, e.g. for a core)
    wait: float  # inside optimizer.step(), in the pre-step hooks (waiting for copies)
    ckpt_start: float  # perf_counter() when ckpt.step() was called


class Saver(Protocol):
    """What a training step calls after optimizer.step(): a Checkpointer, or one of the peers below."""

    def step(self, step: int) -> Any: ...


class Trainer:
    """The model and its optimizer; what optimizer.step() waits for in pre-step hooks is timed:
    the Checkpointers' hooks, and ``staging`` (futures a peer's save must finish before the state changes)."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        self.model, self.optimizer = build(sizes.layers, sizes.width)
        self.generator = torch.Generator().manual_seed(1)
        self.staging: list[Future[Any]] = []
        self._mark = 0.0
        self._wait = 0.0
        self.optimizer.register_step_pre_hook(self._before)  # runs before every other hook ...
        self.optimizer.register_step_pre_hook(self._await_staging)
        self.optimizer.register_step_pre_hook(self._after)  # (until a Checkpointer's hook comes after it)

    def attach(self, job_id: str | None, **options: Any) -> convoy.Checkpointer:
        """A Checkpointer on this model (``job_id``: with in-memory snapshots in that job's segment)."""
        if job_id:
            os.environ["CONVOY_JOB_ID"] = job_id
        try:
            ckpt = convoy.Checkpointer(self.model, self.optimizer, **options)
        finally:
            os.environ.pop("CONVOY_JOB_ID", None)
        self.optimizer.register_step_pre_hook(self._after)  # ... and this one after all of them
        return ckpt

    def _before(self, *args: Any) -> None:
        self._mark = time.perf_counter()

    def _after(self, *args: Any) -> None:
        self._wait = time.perf_counter() - self._mark

    def _await_staging(self, *args: Any) -> None:
        while self.staging:
            self.staging.pop().result()

    def step(self, ckpt: Saver | None, step: int) -> Step:
        started = time.perf_counter()
        forward_backward(self.model, self.optimizer, self.sizes.batch, self.generator)
        self.optimizer.step()
        stepped, cpu = time.perf_counter(), time.thread_time()
        if ckpt is not None:
            ckpt.step(step)
        done = time.perf_counter()
        return Step(done - started, done - stepped, time.thread_time() - cpu, self._wait, stepped)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def peer_save(trainer: Trainer, path: Path, fsync: bool) -> float:
    """Seconds for a plain synchronous torch.save of the same state (optionally fsynced)."""
    started = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(trainer.state(), handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    return time.perf_counter() - started


def tensors_of(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples, in a fixed order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_of(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors_of(value)


class SharedCopy:
    """The plain in-memory peer: each save copies the state's tensors into buffers that were made once
    with ``share_memory_()`` (another process could map them, as a snapshot in shared memory)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.buffers = [tensor.detach().clone().share_memory_() for tensor in tensors_of(trainer.state())]

    def step(self, step: int) -> None:
        with torch.no_grad():
            for buffer, tensor in zip(self.buffers, tensors_of(self.trainer.state()), strict=True):
                buffer.copy_(tensor)


# async_save's set-ups: (label, the stager kept across saves; None: async_save makes one per call)
ASYNC_SAVE: dict[str, tuple[str, Any]] = {
    "as_new": ("dcp.async_save, as it comes", None),
    "as_cached": ("dcp.async_save, DefaultStager kept (reused buffers)",
                  lambda: DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=False))),
    "as_thread": ("dcp.async_save, kept DefaultStager, async staging",
                  lambda: DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=False))),
}


class AsyncSavePeer:
    """The persistent peer: ``dcp.async_save`` of the state every ``every`` steps into ``directory/step-N``
    (the default FileSystemWriter; the default process group, here convoy.init's 1-rank gloo group).
    With async staging the next ``optimizer.step()`` waits for ``staging_completion`` (Trainer.staging)."""

    def __init__(self, trainer: Trainer, directory: Path, every: int, stager: DefaultStager | None) -> None:
        self.trainer, self.directory, self.every, self.stager = trainer, directory, every, stager
        self.upload: Future[Any] | None = None
        self.done: list[float] = []  # per save: seconds from the call until its future was done
        self._finished = threading.Event()

    def step(self, step: int) -> None:
        if (step + 1) % self.every:
            return
        self._finished.clear()
        started = time.perf_counter()
        result = dcp.async_save(self.trainer.state(), checkpoint_id=str(self.directory / f"step-{step}"),
                                async_stager=self.stager)
        if isinstance(result, AsyncSaveResponse):  # staging runs on: the state must not change before it ends
            self.trainer.staging.append(result.staging_completion)
            result = result.upload_completion
        self.upload = result
        result.add_done_callback(lambda _: (self.done.append(time.perf_counter() - started), self._finished.set()))

    def wait(self) -> None:
        """Until the save in flight is written (its future done, its completion time recorded)."""
        if self.upload is not None:
            self.upload.result(timeout=300)
            self._finished.wait(timeout=300)


def measure_async_save(trainer: Trainer, root: Path, samples: dict[str, list[float]]) -> None:
    """Each async_save set-up in turn, timed as convoy's persistent saves: the call and the next
    optimizer.step()'s wait at each save, the ``persist_every`` steps from it, and until its future is done."""
    sizes, every = trainer.sizes, trainer.sizes.persist_every
    for key, (_, make_stager) in ASYNC_SAVE.items():
        stager = make_stager() if make_stager else None
        peer, timed = AsyncSavePeer(trainer, root / key, every, stager), []
        for step in range(every * (sizes.persist_saves + 1) - 1):
            if (step + 1) % every == 0 and peer.upload is not None:  # untimed, as for convoy's saves
                idle = time.perf_counter()
                peer.wait()
                samples[key + "_idle"].append(time.perf_counter() - idle)
            timed.append(trainer.step(peer, step))
        peer.wait()
        if stager is not None:
            stager.close()
        for save in range(every - 1, len(timed), every):
            prefix = key + ("_first_" if save == every - 1 else "_")  # the first save is a warm-up
            samples[prefix + "blocking"].append(timed[save].in_ckpt + timed[save + 1].wait)
            samples[prefix + "in_call"].append(timed[save].in_ckpt)
            samples[prefix + "in_call_cpu"].append(timed[save].in_ckpt_cpu)
            samples[prefix + "wait"].append(timed[save + 1].wait)
            samples[prefix + "period"].append(sum(t.total for t in timed[save : save + every]))
        samples[key + "_first_done"], samples[key + "_done"] = peer.done[:1], peer.done[1:]
        shutil.rmtree(root / key, ignore_errors=True)
