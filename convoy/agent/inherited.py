"""A forked process takes over the memory it inherited: its own copy of every page it shares with its parent.

After ``fork`` a child shares its parent's anonymous pages copy-on-write, and the kernel charges a page to the
memory cgroup of whoever faulted it first: the parent. A role process forked from the agent's fork server (its
``import torch`` done there) would so be charged only for what it writes later, and a memory limit on its
cgroup would not count its imports. Once the child is in its own cgroup, ``own_inherited_pages`` faults a
private copy of each present anonymous page it still shares (``MADV_POPULATE_WRITE``, one call per run of
such pages; touching each page where the kernel predates it, Linux < 5.14), so its cgroup, its USS and its
RSS count the imports as a process that imported them itself would. Pages never present are left alone (no
reserved address space is filled), and so are file pages (the shared libraries' code). Torch-free.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Iterator

MADV_POPULATE_WRITE = 23
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CHUNK_PAGES = 1 << 16
"""Pagemap entries read at a time (8 bytes each)."""
_WANTED = bytes(1 if byte & 0xA1 == 0x80 else 0 for byte in range(256))
"""The top byte of a pagemap entry: bit 63 present, bit 61 a file page or shared anonymous, bit 56 mapped by
this process only. A page to copy is present, anonymous and not exclusive."""
_RUNS = re.compile(b"\x01+")


def writable_private_ranges(maps: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each private writable mapping in a ``/proc/PID/maps`` text, but the kernel's own."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[1][1] != "w" or fields[1][3] != "p":
            continue
        name = fields[5].strip() if len(fields) == 6 else ""
        if name in ("[vvar]", "[vdso]", "[vsyscall]", "[vvar_vclock]"):
            continue
        start, end = (int(part, 16) for part in fields[0].split("-"))
        yield start, end


def shared_runs(top_bytes: bytes) -> Iterator[tuple[int, int]]:
    """``(first page, pages)`` of each run of pages to copy, from the pagemap entries' top bytes."""
    for match in _RUNS.finditer(top_bytes.translate(_WANTED)):
        yield match.start(), match.end() - match.start()


def own_inherited_pages(pid: str = "self") -> int:
    """Copy the pages this process shares with its parent (see the module's docstring); returns their bytes.
    OSError where ``/proc`` cannot tell (the process then stays charged as it was)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    with open(f"/proc/{pid}/maps") as maps_file:
        maps = maps_file.read()
    populate = libc.madvise(0, 0, MADV_POPULATE_WRITE) == 0  # an empty range: only the advice is checked
    copied = 0
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        for start, end in writable_private_ranges(maps):
            for chunk in range(start, end, CHUNK_PAGES * PAGE_BYTES):
                pages = min(CHUNK_PAGES, (end - chunk) // PAGE_BYTES)
                entries = os.pread(pagemap.fileno(), pages * 8, chunk // PAGE_BYTES * 8)
                for first, count in shared_runs(entries[7::8]):
                    address, length = chunk + first * PAGE_BYTES, count * PAGE_BYTES
                    if not populate:
                        _touch(address, length)
                    elif libc.madvise(address, length, MADV_POPULATE_WRITE) != 0:
                        if ctypes.get_errno() != errno.ENOMEM:
                            continue  # a range the kernel will not populate stays shared
                        _touch(address, length)  # over the cgroup's limit: the OOM killer acts as on any fault
                    copied += length
    return copied


def _touch(address: int, length: int) -> None:
    """Write each page's first byte back to it: the write fault gives this process its own copy."""
    for page in range(address, address + length, PAGE_BYTES):
        byte = ctypes.c_ubyte.from_address(page)
        byte.value = byte.value
