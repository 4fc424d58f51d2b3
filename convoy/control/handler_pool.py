"""The master's handler threads: at most a bounded number serve the requests the front door admits, in priority
order when all are busy; a thread with nothing to do waits a while for more before it ends."""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable

THREAD_IDLE_S = 5.0


class HandlerPool:
    """Runs ``serve`` on at most ``size`` threads; what comes when all are busy waits in priority order. A thread
    with nothing to do waits ``THREAD_IDLE_S`` for more before it ends (a steady stream of requests starts none)."""

    def __init__(self, size: int, serve: Callable[[object], None]) -> None:
        self.size, self._serve = size, serve
        self._work = threading.Condition(threading.Lock())
        self._waiting: list[tuple[int, int, object]] = []
        self._order = itertools.count()
        self.threads = 0
        """Threads alive, busy or not."""
        self.busy = 0
        """Threads serving an item now."""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, priority: int, item: object) -> None:
        with self._work:
            heapq.heappush(self._waiting, (priority, next(self._order), item))
            if self.threads > self.busy + len(self._waiting) - 1:  # one is free to take it
                self._work.notify()
                return
            if self.threads >= self.size:
                return
            self.threads += 1
        threading.Thread(target=self._run, name="convoy-api-handler", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._work:
                if not self._waiting:
                    self._work.wait(THREAD_IDLE_S)
                if not self._waiting:
                    self.threads -= 1
                    return
                item = heapq.heappop(self._waiting)[2]
                self.busy += 1
            try:
                self._serve(item)
            finally:
                with self._work:
                    self.busy -= 1
