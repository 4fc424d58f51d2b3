"""A SIGTERM that arrives while a snapshot's background copy is in flight lets the copy land, then exits.

The agent stops a round's workers with SIGTERM (SIGKILL after the stop grace). Killed at once, a worker
whose newest step was committed partial (its parameters still being copied) leaves that step incomplete,
and a rank whose state no peer shares must then redo it. Where the script left SIGTERM at its default,
the Checkpointer installs ``ExitAfterCopy``: the signal wakes a watcher thread through
``signal.set_wakeup_fd`` (so a main thread blocked in a collective does not hold it up), which waits for
the copy (bounded) and exits with 128 + SIGTERM, the status a shell gives the default action. A script's
own SIGTERM handler, or another user of the wakeup fd (an asyncio loop), is left alone.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from convoy.runtime.checkpoint_state import BackgroundCopy

COPY_BOUND_S = 5.0
"""The longest a stopping worker waits for its copy; the agent's SIGKILL after the stop grace bounds it too."""


def _python_handler(signum: int, frame: Any) -> None:
    """Nothing: the watcher thread acts (the main thread may be blocked in C for long)."""


class ExitAfterCopy:
    """Installed by ``install`` in the main thread; ``uninstall`` puts SIGTERM's default back."""

    def __init__(self, copies: BackgroundCopy, read_fd: int, write_fd: int, bound_s: float) -> None:
        self.copies, self.bound_s = copies, bound_s
        self._read_fd, self._write_fd = read_fd, write_fd
        self._watcher = threading.Thread(target=self._watch, name="convoy-stop-copy", daemon=True)
        self._watcher.start()

    @classmethod
    def install(cls, copies: BackgroundCopy, bound_s: float = COPY_BOUND_S) -> ExitAfterCopy | None:
        """Take over SIGTERM if the script left it at its default (None where it did not, or off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:  # someone else listens there: leave them be
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return None
        signal.signal(signal.SIGTERM, _python_handler)
        return cls(copies, read_fd, write_fd, bound_s)

    def uninstall(self) -> None:
        """SIGTERM kills at once again (call from the main thread, once no copy is in flight)."""
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.close(self._write_fd)  # the watcher reads end-of-file and returns

    def _watch(self) -> None:
        while True:
            try:
                got = os.read(self._read_fd, 64)
            except OSError:
                return
            if not got:
                os.close(self._read_fd)
                return
            if signal.SIGTERM in got:
                self.copies.settle(self.bound_s)
                os._exit(128 + signal.SIGTERM)
