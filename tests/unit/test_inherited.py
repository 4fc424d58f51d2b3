"""Which pages a forked process copies to own them: its private writable mappings, and within them the pages
that are present, anonymous and still shared (pagemap's flags); the fork server's preload default."""

from __future__ import annotations

import subprocess
import sys

from convoy.agent.inherited import shared_runs, writable_private_ranges
from convoy.config import ROLE_PRELOAD, WorkerConfig

MAPS = """\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000004000 r--p 00000000 fd:01 1234                       /usr/lib/libc.so.6
7f0000004000-7f0000006000 rw-p 00004000 fd:01 1234                       /usr/lib/libc.so.6
7f0000006000-7f0000008000 rw-s 00000000 00:05 99                         /dev/shm/segment
7f0000008000-7f000000a000 ---p 00000000 00:00 0
7ffd00000000-7ffd00002000 r--p 00000000 00:00 0                          [vvar]
7ffd00002000-7ffd00003000 rw-p 00000000 00:00 0                          [vvar_vclock]
7ffd00010000-7ffd00031000 rw-p 00000000 00:00 0                          [stack]
7ffd00040000-7ffd00041000 rw-p 00000000 00:00 0
"""

PRESENT, FILE, EXCLUSIVE = 0x80, 0x20, 0x01
"""Bits 63, 61 and 56 of a pagemap entry, as they sit in its top byte."""


def test_only_private_writable_mappings_but_the_kernels_own_are_walked() -> None:
    ranges = list(writable_private_ranges(MAPS))
    assert ranges == [(0x55D0C0000000, 0x55D0C0021000), (0x7F0000004000, 0x7F0000006000),
                      (0x7FFD00010000, 0x7FFD00031000), (0x7FFD00040000, 0x7FFD00041000)]


def test_runs_are_present_anonymous_pages_not_yet_exclusive() -> None:
    shared = PRESENT
    tops = bytes([shared, shared, 0, PRESENT | EXCLUSIVE, shared, PRESENT | FILE, shared, shared, shared, 0])
    assert list(shared_runs(tops)) == [(0, 2), (4, 1), (6, 3)]
    assert list(shared_runs(bytes([0, PRESENT | EXCLUSIVE, PRESENT | FILE | EXCLUSIVE]))) == []


def test_the_fork_server_preloads_torch_and_convoys_role_modules_for_the_default_list_and_any_list_given() -> None:
    assert WorkerConfig().role_preload() == ROLE_PRELOAD and ROLE_PRELOAD[0] == "torch"
    assert WorkerConfig(preload=("torch", "numpy")).role_preload() == ("torch", "numpy")
    assert WorkerConfig(preload=()).role_preload() == ()


def test_the_role_preload_starts_no_thread_and_no_dynamo() -> None:
    """The server forks after it: a thread would not survive into the children, and torch._dynamo is what the
    default list of standbys adds and roles leave out."""
    code = ("import sys, threading; from convoy.agent.standby import preload; from convoy.config import ROLE_PRELOAD; "
            "preload(','.join(ROLE_PRELOAD)); missing = [m for m in ROLE_PRELOAD if m not in sys.modules]; "
            "print(threading.active_count(), 'torch._dynamo' in sys.modules, missing)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "False", "[]"], out.stdout + out.stderr
