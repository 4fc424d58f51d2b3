"""How glibc's malloc treats a process's large blocks (``mallopt``), where the process's work asks for it.

By default a block over glibc's mmap threshold (128 KiB, rising to 32 MiB as blocks are freed) is mapped afresh
and handed back when freed: each training step's logits and activations of tens of MiB are faulted in and zeroed
by the kernel again (a GRPO step on SmolLM2 spent 38% of its time in the kernel's ``clear_page_erms``).
:func:`keep_freed_memory` serves every block from the heap and keeps what is freed, so the next step reuses the
same pages: its resident memory stays at its peak, which is what a long-running trainer holds anyway. A process
whose memory the agent measures or limits is left alone: the agent started it with a low threshold
(``MALLOC_MMAP_THRESHOLD_``) so that its resident memory follows what it holds.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
KEPT_BYTES = 1 << 30
"""The heap's free top kept (not trimmed) and the padding it grows by: larger than a step's biggest tensor."""


def _mallopt(option: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL(None).mallopt(option, value))
    except (OSError, AttributeError):  # not glibc: nothing to tell
        return False


def set_mmap_threshold(nbytes: int) -> bool:
    """Blocks of ``nbytes`` and more are mapped afresh and handed back when freed (what ``MALLOC_MMAP_THRESHOLD_``
    sets at a process's start); whether glibc took it."""
    return _mallopt(M_MMAP_THRESHOLD, nbytes)


def keep_freed_memory() -> bool:
    """Every block from the heap, freed memory kept for the next; whether it applied (not to a process the agent
    measures or limits, nor where malloc is not glibc's)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    return (_mallopt(M_MMAP_MAX, 0) and _mallopt(M_TRIM_THRESHOLD, KEPT_BYTES)
            and _mallopt(M_TOP_PAD, KEPT_BYTES))
