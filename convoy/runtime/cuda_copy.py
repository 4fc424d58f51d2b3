"""Snapshots of CUDA tensors: copied into the shared-memory segment on a side stream, overlapped with compute.

The segment (an mmap of ``/dev/shm``) is page-locked once with ``cudaHostRegister``, so device-to-host copies land
in it directly by DMA without holding up the host. Where registration is refused (a driver that will not pin a
shared mapping, a locked-memory limit), a pinned staging buffer laid out as the slot (each tensor at its slot
offset) takes the copies and the background thread moves them into the segment (said once). Each batch of copies
ends in an event: the compute stream waits on it (``guard``) before it may change what the copies read, and the host
waits on it only off the training thread, to mark a slot complete. Which tensor goes which way (``split_by_device``)
is pure and apart from the CUDA calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

def split_by_device(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> tuple[list[int], list[int]]:
    """``indices`` of tensors in host memory and of tensors on a CUDA device, in their order."""
    host = [i for i in indices if tensors[i].device.type != "cuda"]
    cuda = [i for i in indices if tensors[i].device.type == "cuda"]
    return host, cuda


def staging_extent(sources: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
    """Bytes a staging buffer needs to hold ``sources`` at their slot ``offsets``. Staged where they will land in
    the slot, the batches of one snapshot (buffers now, parameters later) never overwrite each other."""
    return max((offset + source.numel() * source.element_size() for source, offset in zip(sources, offsets,
                                                                                         strict=True)), default=0)


class CudaCopies:
    """One rank's copies between CUDA tensors and its snapshot segment, on one side stream.

    ``say`` tells once why the segment could not be pinned. Use from the training thread; the callable
    ``landed`` returns is what a background thread runs."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.stream = torch.cuda.Stream()
        self._say = say
        self._registered: dict[int, int] = {}  # data pointer -> bytes, page-locked by us
        self._refused: set[int] = set()
        self._staging: torch.Tensor | None = None

    def pin(self, segment: torch.Tensor) -> bool:
        """Page-lock the mapped segment (once per mapping); False where CUDA refuses."""
        pointer, size = segment.data_ptr(), segment.numel()
        if pointer in self._registered:
            return True
        if pointer in self._refused:
            return False
        error = torch.cuda.cudart().cudaHostRegister(pointer, size, 0)
        if int(getattr(error, "value", error)) != 0:
            self._refused.add(pointer)
            self._say(f"the snapshot segment could not be page-locked for CUDA (cudaHostRegister: {error}); "
                      "CUDA tensors are staged through a pinned buffer instead")
            return False
        self._registered[pointer] = size
        return True

    def pinned(self, segment: torch.Tensor) -> bool:
        return segment.data_ptr() in self._registered

    def unpin(self, pointer: int, size: int) -> None:
        """Before the segment is unmapped: page-locked memory must be unregistered while it is still mapped."""
        self._refused.discard(pointer)
        if self._registered.pop(pointer, None) is not None:
            torch.cuda.synchronize()  # no copy in flight may still target it
            torch.cuda.cudart().cudaHostUnregister(pointer)

    def to_host(self, sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                staged_at: Sequence[int] | None) -> tuple[torch.cuda.Event, Callable[[], None]]:
        """Start copying CUDA ``sources`` into the host ``targets`` (views into the segment) after the work queued
        so far; returns the event that ends the copies and ``landed``, which waits for it (off the training
        thread). ``staged_at`` (the targets' slot offsets; None where the segment is page-locked): the copies go
        to a pinned buffer at those offsets first, and ``landed`` moves them into the segment."""
        pinned = staged_at is None
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        if pinned:
            with torch.cuda.stream(stream):
                for source, target in zip(sources, targets, strict=True):
                    source.record_stream(stream)  # not reused by the allocator before the copy is done
                    target.copy_(source.detach(), non_blocking=True)
            event = stream.record_event()
            return event, event.synchronize
        assert staged_at is not None
        staged = self._stage(sources, staged_at)
        with torch.cuda.stream(stream):
            for source, buffer in zip(sources, staged, strict=True):
                source.record_stream(stream)
                buffer.copy_(source.detach(), non_blocking=True)
        event = stream.record_event()

        def landed() -> None:
            event.synchronize()
            for buffer, target in zip(staged, targets, strict=True):
                target.copy_(buffer)

        return event, landed

    def to_device(self, sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.cuda.Event:
        """Start copying host ``sources`` (views into the segment) into CUDA ``targets``; returns the ending event.
        From a page-locked segment the copies run by DMA while the host goes on."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for source, target in zip(sources, targets, strict=True):
                target.copy_(source, non_blocking=True)
        return stream.record_event()

    @staticmethod
    def guard(event: torch.cuda.Event) -> Callable[[], None]:
        """What runs before ``optimizer.step()``: the compute stream waits for the copies; the host does not."""
        return lambda: torch.cuda.current_stream().wait_event(event)

    def _stage(self, sources: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
        """Views of the pinned staging buffer shaped like ``sources`` at ``offsets`` (kept, grown as needed: views
        handed out before still hold the buffer they point into)."""
        extent = staging_extent(sources, offsets)
        if self._staging is None or self._staging.numel() < extent:
            self._staging = torch.empty(extent, dtype=torch.uint8, pin_memory=True)
        return [self._staging[offset:offset + source.numel() * source.element_size()]
                .view(source.dtype).view(source.shape) for source, offset in zip(sources, offsets, strict=True)]


def has_cuda(state: Any) -> bool:
    """Whether a nested state holds any CUDA tensor (the copier is made only then)."""
    if isinstance(state, torch.Tensor):
        return state.device.type == "cuda"
    if isinstance(state, dict):
        return any(has_cuda(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_cuda(value) for value in state)
    return False
