"""glibc's malloc told to keep what a process frees (``keep_freed_memory``): a large block freed and asked for again
reuses the same pages (no page faulted in and zeroed afresh), where glibc's default maps a block over 32 MiB anew
each time; a process whose memory the agent measures or limits (``MALLOC_MMAP_THRESHOLD_`` set) is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BLOCK_PAGES = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
STEP = '''
import resource, sys
from convoy.worker.allocator import keep_freed_memory

kept = keep_freed_memory() if sys.argv[1] == "keep" else None

def faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = b"\\x01" * (64 << 20)  # as a step's logits: written, then freed
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_a_step()
print(kept, faults_of_a_step())
'''


def second_step(mode: str, **env: str) -> tuple[str, int]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", STEP, mode], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_a_page_fault_only_where_kept() -> None:
    kept, faults = second_step("keep")
    assert kept == "True" and faults < BLOCK_PAGES // 20, f"{faults} page faults for a block of {BLOCK_PAGES} pages"
    _, faults = second_step("default")
    assert faults > BLOCK_PAGES // 2, "glibc's default maps the block afresh: its pages are faulted in again"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_process_the_agent_measures_keeps_its_threshold() -> None:
    kept, faults = second_step("keep", MALLOC_MMAP_THRESHOLD_="131072")
    assert kept == "False" and faults > BLOCK_PAGES // 2
